"""Whether the standard OTEL_* environment asks for traces kvroute can export: apart from
tracing.py, so that a process without tracing never imports the OpenTelemetry SDK and its OTLP
exporter (some 60 ms at every ext_proc start)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

# W3C trace context: a client's is continued by kvroute's route span, whose own goes on to the
# backend (here, not in tracing.py: the Envoy bootstrap names them without importing the SDK).
TRACE_HEADERS = ("traceparent", "tracestate")

log = logging.getLogger(__name__)

ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def wanted(environ: Mapping[str, str]) -> bool:
    """Tracing is on when an OTLP endpoint is named, the SDK is not disabled and the traces
    exporter is OTLP (the SDK's default; `none` turns it off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if exporter != "otlp":
        if exporter != "none":
            log.warning("OTEL_TRACES_EXPORTER=%s: kvroute exports traces over OTLP only; tracing off", exporter)
        return False
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    if protocol.strip().lower() != "grpc":
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: kvroute exports traces over OTLP/gRPC only; tracing off", protocol)
        return False
    return any(environ.get(name) for name in ENDPOINTS)
