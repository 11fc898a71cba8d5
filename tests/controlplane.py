"""A Kubernetes control plane on loopback for the tests: etcd, kube-apiserver (RBAC on) and
kube-controller-manager, built by tests/k8s/controlplane/build and cached outside the clone.

By default no kubelet runs: pods stay Pending unless a test patches their status, and the API
server listens on loopback. Given a `NodeNetwork` (tests/node.py), it runs inside that network
namespace on the node's address instead, ready for a real kubelet. An admin kubeconfig is written
for kubectl, helm and the Python clients; `kubeconfig_for` mints a ServiceAccount token
(TokenRequest) so a process runs with exactly that account's rights.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from bench.harness.processes import free_port, spawn, stop, wait_http

if TYPE_CHECKING:
    from tests.node import NodeNetwork

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "tests" / "k8s" / "controlplane" / "build"
FETCH_CRDS = ROOT / "tests" / "k8s" / "crds" / "fetch"
ADMIN_TOKEN = "kvroute-test-admin-token"
# The node's components, each with the identity its default RBAC binding names.
COMPONENT_TOKENS = {
    "kubelet": ("kvroute-test-kubelet-token", "system:node:kvroute-node", "system:nodes"),
    "kube-proxy": ("kvroute-test-proxy-token", "system:kube-proxy", ""),
    "kube-scheduler": ("kvroute-test-scheduler-token", "system:kube-scheduler", ""),
}


def binaries() -> Path:
    """The pinned control-plane binaries, built on first use (several minutes on 2 cores)."""
    out = subprocess.run([str(BUILD)], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def crds() -> Path:
    """The pinned Gateway API, InferencePool and Envoy Gateway CRDs, fetched on first use."""
    out = subprocess.run([str(FETCH_CRDS)], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


class ControlPlane:
    """Start with `start()`, stop with `stop()` (idempotent); `stop_apiserver`/`start_apiserver`
    take the API server away and bring it back on the same port, keeping etcd's state."""

    def __init__(self, workdir: Path, network: NodeNetwork | None = None) -> None:
        self.workdir = workdir
        self.network = network
        self.bin = binaries()
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()
        self.port = free_port()
        self.processes: dict[str, subprocess.Popen] = {}
        self.address = network.node_ip if network else "127.0.0.1"
        self.url = f"https://{self.address}:{self.port}"
        self.kubeconfig = workdir / "admin.kubeconfig"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """A control-plane or node process, inside the node's network namespace if there is one."""
        prefix = self.network.enter() if self.network else []
        self.processes[name] = spawn([*prefix, *argv], self.workdir / f"{name}.log", env=env)
        return self.processes[name]

    def _keys(self) -> None:
        """The ServiceAccount signing key pair and the static admin token."""
        key = self.workdir / "sa.key"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(self.workdir / "sa.pub")],
            check=True,
            capture_output=True,
        )
        tokens = [(ADMIN_TOKEN, "kvroute-admin", "system:masters"), *COMPONENT_TOKENS.values()]
        (self.workdir / "tokens.csv").write_text("".join(f"{t},{user},{user},{group}\n" for t, user, group in tokens))
        self.kubeconfig.write_text(yaml.safe_dump(self._kubeconfig("admin", ADMIN_TOKEN)))
        if self.network:
            self._kubelet_client_certificate()

    def _kubelet_client_certificate(self) -> None:
        """A CA the kubelet trusts and the API server's client certificate from it (for logs, exec)."""

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=self.workdir)

        new_key = ("req", "-newkey", "rsa:2048", "-nodes")
        openssl(*new_key, "-x509", "-days", "2", "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=kvroute-test-ca")
        subject = "/O=system:masters/CN=kube-apiserver-kubelet-client"
        openssl(*new_key, "-keyout", "kubelet-client.key", "-out", "kubelet-client.csr", "-subj", subject)
        signing = ("-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2")
        openssl("x509", "-req", "-in", "kubelet-client.csr", *signing, "-out", "kubelet-client.crt")

    def component_kubeconfig(self, component: str) -> Path:
        """A kubeconfig with that node component's token (COMPONENT_TOKENS)."""
        token, user, _ = COMPONENT_TOKENS[component]
        path = self.workdir / f"{component}.kubeconfig"
        path.write_text(yaml.safe_dump(self._kubeconfig(user, token)))
        return path

    def _kubeconfig(self, user: str, token: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "insecure-skip-tls-verify": True}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
            "current-context": "test",
        }

    def start(self) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._keys()
            self._start_etcd()
            self.start_apiserver()
            self._start_controller_manager()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self) -> None:
        client, peer = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{self.etcd_peer_port}"
        argv = [str(self.bin / "etcd"), "--data-dir", str(self.workdir / "etcd"), "--unsafe-no-fsync"]
        argv += ["--listen-client-urls", client, "--advertise-client-urls", client]
        argv += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
        argv += ["--initial-cluster", f"default={peer}", "--log-level", "warn"]
        process = self.spawn("etcd", argv)
        if not self.network:  # else it is inside the namespace; the API server's start waits for it
            wait_http(f"{client}/health", timeout_s=60, process=process)

    def start_apiserver(self) -> None:
        argv = [str(self.bin / "kube-apiserver"), "--etcd-servers", f"http://127.0.0.1:{self.etcd_port}"]
        argv += ["--bind-address", self.address, "--advertise-address", self.address, "--secure-port", str(self.port)]
        argv += [
            "--cert-dir",
            str(self.workdir / "certs"),
            "--authorization-mode",
            "Node,RBAC" if self.network else "RBAC",
        ]
        argv += ["--token-auth-file", str(self.workdir / "tokens.csv")]
        argv += ["--service-account-issuer", "https://kubernetes.default.svc.cluster.local"]
        argv += ["--service-account-key-file", str(self.workdir / "sa.pub")]
        argv += ["--service-account-signing-key-file", str(self.workdir / "sa.key")]
        argv += ["--service-cluster-ip-range", "10.96.0.0/16", "--allow-privileged=false"]
        if self.network:  # a kubelet, reached by its address with a client certificate
            argv += ["--enable-admission-plugins", "NodeRestriction"]
            argv += ["--kubelet-preferred-address-types", "InternalIP"]
            argv += ["--kubelet-client-certificate", str(self.workdir / "kubelet-client.crt")]
            argv += ["--kubelet-client-key", str(self.workdir / "kubelet-client.key")]
        else:
            argv += ["--endpoint-reconciler-type", "none"]  # the kubernetes Service cannot point at loopback
        self.spawn("kube-apiserver", argv)
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            process = self.processes["kube-apiserver"]
            if process.poll() is not None:
                raise RuntimeError(f"kube-apiserver exited {process.returncode}; see {self.workdir}/kube-apiserver.log")
            if self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError(f"kube-apiserver not ready within {timeout_s}s")

    def stop_apiserver(self) -> None:
        stop(self.processes.pop("kube-apiserver", None))

    def _start_controller_manager(self) -> None:
        argv = [str(self.bin / "kube-controller-manager"), "--kubeconfig", str(self.kubeconfig)]
        argv += ["--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", str(free_port())]
        argv += ["--service-account-private-key-file", str(self.workdir / "sa.key")]
        argv += ["--use-service-account-credentials=false", "--controllers", "*"]
        # what pods get as kube-root-ca.crt, to check the API server's own certificate with
        argv += ["--root-ca-file", str(self.workdir / "certs" / "apiserver.crt")]
        self.spawn("kube-controller-manager", argv)

    def stop(self) -> None:
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            stop(self.processes.pop(name, None))

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """Environment for a client process: its kubeconfig, the control plane's tools first on PATH."""
        return {
            **os.environ,
            "KUBECONFIG": str(kubeconfig or self.kubeconfig),
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "HELM_CACHE_HOME": str(self.workdir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.workdir / "helm" / "config"),
            "HELM_DATA_HOME": str(self.workdir / "helm" / "data"),
        }

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, kubeconfig: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bin / "kubectl"), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env(kubeconfig),
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bin / "helm"), *args], capture_output=True, text=True, env=self.env(), timeout=300
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed: {result.stderr}")
        return result

    def get(self, *args: str) -> Any:
        """`kubectl get ... -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, objects: Sequence[dict[str, Any]] | str, *flags: str) -> subprocess.CompletedProcess[str]:
        text = objects if isinstance(objects, str) else yaml.safe_dump_all(objects)
        return self.kubectl("apply", *flags, "-f", "-", stdin=text)

    def install_crds(self, *folders: str) -> None:
        """Creates the CRDs of these folders of `crds()` (server-side: some are too large for the
        last-applied annotation) and waits until the API server serves them."""
        for folder in folders:
            self.kubectl("apply", "--server-side", "-f", str(crds() / folder))
        self.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")

    def kubeconfig_for(self, namespace: str, service_account: str, hours: int = 2) -> Path:
        """A kubeconfig holding a fresh token of that ServiceAccount (TokenRequest)."""
        token = self.kubectl("create", "token", service_account, "-n", namespace, f"--duration={hours}h").stdout
        path = self.workdir / f"{namespace}-{service_account}.kubeconfig"
        path.write_text(yaml.safe_dump(self._kubeconfig(f"{namespace}-{service_account}", token.strip())))
        return path

    def can_i(self, namespace: str, service_account: str, verb: str, resource: str, where: str = "") -> bool:
        """`kubectl auth can-i` as that ServiceAccount (impersonated by the admin); `resource` may
        name a subresource (`kind/status`) and an object (`kind#name`)."""
        resource, _, name = resource.partition("#")
        resource, _, subresource = resource.partition("/")
        target = f"{resource}/{name}" if name else resource
        args = ["auth", "can-i", verb, target, "--as", f"system:serviceaccount:{namespace}:{service_account}"]
        args += [f"--subresource={subresource}"] if subresource else []
        args += ["-n", where] if where else ["--all-namespaces"]
        return self.kubectl(*args, check=False).stdout.strip() == "yes"

    def granted(self, namespace: str, user: str = "", token: str = "") -> set[tuple[str, str]]:
        """(resource, verb) pairs the server grants in a namespace to `user` (impersonated by the
        admin) or to the holder of `token`, from `kubectl auth can-i --list`."""
        who = ["--token", token] if token else ["--as", user]
        text = self.kubectl("auth", "can-i", "--list", "-n", namespace, *who).stdout
        granted = set()
        for line in text.splitlines()[1:]:
            resource, *_urls, verbs = line.split(None, 3) if "[" in line else (line, "")
            for verb in verbs.strip("[]").split():
                granted.add((resource, verb))
        return {g for g in granted if not g[0].startswith(("selfsubject", "[/"))}
