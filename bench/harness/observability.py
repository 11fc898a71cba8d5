"""Real observability back ends on loopback for the tests and benchmarks, each built from its Go
module on first use, pinned, outside the clone: Jaeger v1's all-in-one (OTLP/gRPC receiver,
in-memory storage, its query API; bench/harness/jaeger/build) and Prometheus with promtool
(bench/harness/prometheus/build)."""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from bench.harness.processes import free_port, spawn, stop, wait_http

HERE = Path(__file__).resolve().parent
JAEGER_BUILD = HERE / "jaeger" / "build"
PROMETHEUS_BUILD = HERE / "prometheus" / "build"


def _built(script: Path) -> Path:
    """What a build script prints last: the path of what it built (at once when built before)."""
    out = subprocess.run([str(script)], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def jaeger_binary() -> Path:
    """The pinned all-in-one binary, built on first use (minutes on 2 cores)."""
    return _built(JAEGER_BUILD)


def prometheus_binaries() -> Path:
    """The pinned prometheus and promtool, built on first use (minutes on 2 cores): their folder."""
    return _built(PROMETHEUS_BUILD)


class _Server:
    """One server process of a test or benchmark, started by `start`, stopped whatever happens."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.process: subprocess.Popen | None = None

    def _spawn(self, argv: list[str], ready_url: str, env: dict[str, str] | None = None) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = spawn(argv, self.workdir / "server.log", env=env)
        try:
            wait_http(ready_url, timeout_s=60, process=self.process)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)
            self.process = None

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class Jaeger(_Server):
    """One all-in-one process; `otlp_endpoint` receives spans, `trace` reads one back."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.otlp_port, self.query_port, self.admin_port = free_port(), free_port(), free_port()

    @property
    def otlp_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.otlp_port}"

    def exporter_env(self) -> dict[str, str]:
        """The standard OTEL_* variables that send a process's spans here, within a tenth of a second."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def start(self) -> Jaeger:
        argv = [str(jaeger_binary()), "--memory.max-traces", "10000"]
        argv += ["--collector.otlp.enabled=true", "--collector.otlp.grpc.host-port", f"127.0.0.1:{self.otlp_port}"]
        argv += ["--collector.otlp.http.host-port", f"127.0.0.1:{free_port()}"]
        argv += ["--collector.grpc-server.host-port", f"127.0.0.1:{free_port()}"]
        argv += ["--collector.http-server.host-port", f"127.0.0.1:{free_port()}"]
        argv += ["--query.http-server.host-port", f"127.0.0.1:{self.query_port}"]
        argv += ["--query.grpc-server.host-port", f"127.0.0.1:{free_port()}"]
        argv += ["--admin.http.host-port", f"127.0.0.1:{self.admin_port}"]
        # It traces itself over OTLP to a default port nobody serves, and its shutdown would wait out
        # the export: none of its own spans (and those to itself, should one be made)
        env = {"SPAN_STORAGE_TYPE": "memory", "OTEL_TRACES_SAMPLER": "always_off"}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.otlp_endpoint
        self._spawn(argv, f"http://127.0.0.1:{self.admin_port}/", env=env)
        return self

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """One trace as the collector holds it (`spans`, `processes`), or None while it has none."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.query_port}/api/traces/{trace_id}", timeout=10) as r:
                data = orjson.loads(r.read())["data"]
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise
        return data[0] if data else None

    def __enter__(self) -> Jaeger:
        return self.start()


class Prometheus(_Server):
    """One Prometheus server scraping `targets` (host:port, /metrics) every second as `job`, with
    `rules` (a rules file) evaluated every second; `query` and `alerts` read its HTTP API."""

    def __init__(self, workdir: Path, job: str, targets: list[str], rules: Path) -> None:
        super().__init__(workdir)
        self.port = free_port()
        self._config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
        }

    def start(self) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_bytes(orjson.dumps(self._config))  # JSON is YAML
        argv = [str(prometheus_binaries() / "prometheus"), "--config.file", str(config)]
        argv += ["--storage.tsdb.path", str(self.workdir / "data"), "--web.listen-address", f"127.0.0.1:{self.port}"]
        self._spawn(argv, f"http://127.0.0.1:{self.port}/-/ready")
        return self

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/PATH: its `data`; raises on an error answer (a query that does not parse)."""
        query = urllib.parse.urlencode(params)
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                answer = orjson.loads(response.read())
        except urllib.error.HTTPError as error:
            answer = orjson.loads(error.read())
        if answer.get("status") != "success":
            raise ValueError(f"{path} {params}: {answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series."""
        return self.api("query", query=expr)["result"]

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]

    def __enter__(self) -> Prometheus:
        return self.start()
