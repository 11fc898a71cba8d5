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
# The SDK's samplers; it reads any other name, or a ratio it cannot, as sampling every request
SAMPLERS = ("always_on", "always_off", "parentbased_always_on", "parentbased_always_off")
RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")


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
    if not any(environ.get(name) for name in ENDPOINTS):
        return False
    return _sampler_read(environ)


def _sampler_read(environ: Mapping[str, str]) -> bool:
    """The sampler and its ratio are ones the SDK reads as meant: a mistyped name or a ratio such
    as `10%` would trace every request at some 200-300 us of CPU each, so tracing stays off."""
    sampler = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if sampler not in SAMPLERS + RATIO_SAMPLERS:
        log.warning(
            "OTEL_TRACES_SAMPLER=%s is not one of %s; tracing off", sampler, ", ".join(SAMPLERS + RATIO_SAMPLERS)
        )
        return False
    if sampler in RATIO_SAMPLERS:
        raw = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            ratio = float(raw)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            log.warning("OTEL_TRACES_SAMPLER_ARG=%s is not a ratio from 0 to 1; tracing off", raw)
            return False
    return True
