"""A real Kubernetes node for the tests: the control plane of tests/controlplane.py plus
containerd with runc, the kubelet, kube-scheduler, kube-proxy (iptables) and CoreDNS, all inside
one network namespace the test creates (`NodeNetwork`).

- Addresses: the node has 10.251.N.2 on a veth pair whose host end is 10.251.N.1; pods get
  10.252.N.0/24 from the CNI bridge plugin (host-local) inside the namespace; Services are
  10.96.0.0/16, DNAT'ed by kube-proxy inside the namespace. The host routes only the pod range to
  the node, so the tests reach the API server and the pods, and nothing in the namespace has a
  route anywhere else.
- Images: tests/node_images.py builds them (no registry) and `ctr images import` loads them.
- What differs from a production node, and why: cgroup v1 (this machine's hybrid hierarchy;
  `failCgroupV1: false`), containerd 1.6 from Debian (no RuntimeConfig RPC: the kubelet's cgroup
  driver is set, cgroupfs), `restrict_oom_score_adj` (root here lacks CAP_SYS_RESOURCE, so a
  sandbox's oom_score_adj of -998 cannot be set), the kubelet's programs and pods' cgroups under a
  root of their own (`/kvroute-node-N`) so that stopping leaves nothing behind, and no
  NetworkPolicy enforcement (the bridge plugin has none).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.harness.processes import stop
from tests.controlplane import ControlPlane, binaries
from tests.node_images import CACHE, IMAGE_NAMES, build_images, node_programs

NODE_NAME = "kvroute-node"
DNS_IP = "10.96.0.10"
CGROUP_ROOT = Path("/sys/fs/cgroup")
RUNS = CACHE / "node-runs"  # one record per live run, for `Node.sweep`
# What the kubelet sets host-wide (its kernel defaults); a run puts them back when it stops.
KUBELET_SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
                   "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes")  # fmt: skip


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


@dataclass(frozen=True)
class NodeNetwork:
    """The node's network namespace and the veth pair that joins it to the host."""

    index: int

    @property
    def name(self) -> str:
        return f"kvroute-node-{self.index}"

    @property
    def host_ip(self) -> str:
        return f"10.251.{self.index}.1"

    @property
    def node_ip(self) -> str:
        return f"10.251.{self.index}.2"

    @property
    def pod_cidr(self) -> str:
        return f"10.252.{self.index}.0/24"

    @property
    def host_link(self) -> str:
        return f"kvrn{self.index}h"

    def enter(self) -> list[str]:
        """The prefix that runs a program in the namespace's network only (`ip netns exec` would
        also remount /sys, hiding the cgroup hierarchies the kubelet needs)."""
        return ["nsenter", f"--net=/var/run/netns/{self.name}"]

    @classmethod
    def pick(cls) -> NodeNetwork:
        """A network whose addresses nothing on the host uses yet (not created)."""
        taken = _run("ip", "-o", "addr").stdout + _run("ip", "route").stdout
        return cls(
            random.choice([i for i in range(1, 255) if f"10.251.{i}." not in taken and f"10.252.{i}." not in taken])
        )

    def create(self) -> None:
        network, inside = self, f"kvrn{self.index}n"
        try:
            _run("ip", "netns", "add", network.name)
            _run("ip", "link", "add", network.host_link, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", network.name)
            _run("ip", "addr", "add", f"{network.host_ip}/30", "dev", network.host_link)
            _run("ip", "link", "set", network.host_link, "up")
            _run("ip", "-n", network.name, "addr", "add", f"{network.node_ip}/30", "dev", inside)
            _run("ip", "-n", network.name, "link", "set", inside, "up")
            _run("ip", "-n", network.name, "link", "set", "lo", "up")
            _run(*network.enter(), "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run("ip", "route", "add", network.pod_cidr, "via", network.node_ip, "dev", network.host_link)
        except BaseException:
            network.delete()
            raise

    def delete(self) -> None:
        _run("ip", "link", "del", self.host_link, check=False)  # its route goes with it
        _run("ip", "netns", "del", self.name, check=False)


class Node:
    """Start with `start()`, stop with `stop()` (idempotent, also after a failed start). `cp` is the
    control plane (kubectl, helm, kubeconfigs); pods' addresses are reachable from the tests."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.programs = node_programs()
        self.bin = self.programs / "bin"
        self.network: NodeNetwork | None = None
        self.cp: ControlPlane | None = None
        self.processes: dict[str, subprocess.Popen] = {}
        self.socket = workdir / "containerd" / "containerd.sock"
        self.cgroup = ""
        self.sysctls: dict[str, str] = {}
        self.record = RUNS / f"{os.getpid()}.json"

    # --- start ---------------------------------------------------------------------------------

    def start(self) -> Node:
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            raise RuntimeError("this node runs on cgroup v1 (or hybrid) hierarchies only; /sys/fs/cgroup is cgroup v2")
        archives = build_images(self.programs)
        self.workdir.mkdir(parents=True, exist_ok=True)
        Node.sweep()
        self.network = NodeNetwork.pick()
        self.cgroup = f"/{self.network.name}"
        self.sysctls = {key: _sysctl(key) for key in KUBELET_SYSCTLS}  # the kubelet sets these host-wide
        record = {"workdir": str(self.workdir.resolve()), "index": self.network.index, "sysctls": self.sysctls}
        RUNS.mkdir(parents=True, exist_ok=True)
        self.record.write_text(json.dumps({**record, "started": _started(os.getpid())}))
        try:
            self.network.create()
            self.cp = ControlPlane(self.workdir / "controlplane", self.network).start()
            self._start_containerd()
            for archive in archives.values():
                self._ctr("images", "import", str(archive))
            self._start_kubelet()
            self._start("kube-scheduler", [str(self.bin / "kube-scheduler"), "--kubeconfig",
                        str(self.cp.component_kubeconfig("kube-scheduler")), "--leader-elect=false",
                        "--bind-address", "127.0.0.1"])  # fmt: skip
            self._start_kube_proxy()
            self._wait_node_ready()
            self._start_dns()
        except BaseException:
            self.stop()
            raise
        return self

    def _env(self) -> dict[str, str]:
        lib = self.programs / "root" / "usr" / "lib" / "x86_64-linux-gnu"
        return {
            **os.environ,
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "LD_LIBRARY_PATH": str(lib),
            "XTABLES_LIBDIR": str(lib / "xtables"),
        }

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        assert self.cp is not None
        self.processes[name] = self.cp.spawn(name, argv, env=self._env())
        return self.processes[name]

    def _ctr(self, *args: str) -> str:
        result = subprocess.run(
            [str(self.bin / "ctr"), "--address", str(self.socket), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            env=self._env(),
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed: {result.stderr}")
        return result.stdout

    def _start_containerd(self) -> None:
        assert self.network is not None
        state = self.workdir / "containerd"
        cni = self.workdir / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        bridge = {
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": True,
            "ipMasq": False,
            "hairpinMode": True,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": self.network.pod_cidr}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(cni / "ipam"),
            },
        }
        conflist = {"cniVersion": "1.0.0", "name": "kvroute-node", "plugins": [bridge]}
        (cni / "net.d" / "10-kvroute.conflist").write_text(json.dumps(conflist))
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = f"""version = 2
root = "{state / "root"}"
state = "{state / "state"}"
[grpc]
  address = "{self.socket}"
[{cri}]
  sandbox_image = "{IMAGE_NAMES["pause"]}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
[{cri}.cni]
  bin_dir = "{self.programs / "root" / "usr" / "lib" / "cni"}"
  conf_dir = "{cni / "net.d"}"
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{self.bin / "runc"}"
  Root = "{state / "runc"}"
  SystemdCgroup = false
[plugins."io.containerd.internal.v1.opt"]
  path = "{state / "opt"}"
"""
        (self.workdir / "containerd.toml").write_text(config)
        process = self._start(
            "containerd", [str(self.bin / "containerd"), "--config", str(self.workdir / "containerd.toml")]
        )
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start; see {self.workdir}/controlplane/containerd.log")
            time.sleep(0.1)

    def _start_kubelet(self) -> None:
        assert self.network is not None and self.cp is not None
        for hierarchy in self._cgroup_hierarchies():
            (hierarchy / self.cgroup.lstrip("/")).mkdir(exist_ok=True)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "failSwapOn": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.cp.workdir / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            "clusterDomain": "cluster.local",
            "clusterDNS": [DNS_IP],
            "resolvConf": "",  # pods resolve through CoreDNS only: nothing upstream is reachable
            "podLogsDir": str(self.workdir / "pod-logs"),
            "address": self.network.node_ip,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "enforceNodeAllocatable": [],
            "localStorageCapacityIsolation": False,
            # this machine's disk is shared and often fuller than a node would allow
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
        }
        (self.workdir / "kubelet.yaml").write_text(yaml.safe_dump(config))
        kubelet = self.workdir / "kubelet"
        self._start("kubelet", [str(self.bin / "kubelet"), "--config", str(self.workdir / "kubelet.yaml"),
                    "--kubeconfig", str(self.cp.component_kubeconfig("kubelet")), "--hostname-override", NODE_NAME,
                    "--root-dir", str(kubelet), "--cert-dir", str(kubelet / "pki"),
                    "--node-ip", self.network.node_ip])  # fmt: skip

    def _start_kube_proxy(self) -> None:
        assert self.network is not None and self.cp is not None
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.cp.component_kubeconfig("kube-proxy"))},
            "mode": "iptables",
            "clusterCIDR": self.network.pod_cidr,
            "hostnameOverride": NODE_NAME,
            "bindAddress": self.network.node_ip,
            "nodePortAddresses": ["primary"],
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # pods on one bridge reach each other's Services without br_netfilter's help
            "iptables": {"masqueradeAll": True},
            "conntrack": {"maxPerCore": 0},
        }
        (self.workdir / "kube-proxy.yaml").write_text(yaml.safe_dump(config))
        self._start("kube-proxy", [str(self.bin / "kube-proxy"), "--config", str(self.workdir / "kube-proxy.yaml")])

    def _wait_node_ready(self, timeout_s: float = 120.0) -> None:
        self.wait(self._node_ready, timeout_s, "the node to register Ready")

    def _node_ready(self) -> bool:
        assert self.cp is not None
        result = self.cp.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
        if result.returncode != 0:
            return False
        conditions = json.loads(result.stdout)["status"].get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _start_dns(self) -> None:
        assert self.cp is not None
        self.cp.apply(coredns_objects())
        self.cp.kubectl("rollout", "status", "deployment/coredns", "-n", "kube-system", "--timeout=120s")

    def wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll `ready()` until true; fail naming `what`, and which node process died, if any."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [name for name, process in self.processes.items() if process.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}; see {self.workdir}")
            if ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}; see {self.workdir}")

    # --- stop ----------------------------------------------------------------------------------

    def _cgroup_hierarchies(self) -> list[Path]:
        """Each mounted cgroup v1 hierarchy (not the v2 'unified' one, which the kubelet does not use)."""
        return [p for p in CGROUP_ROOT.iterdir() if p.is_dir() and p.name != "unified" and not p.is_symlink()]

    def _kill_pods(self) -> int:
        """SIGKILL every process in the node's cgroups (the containers and their sandboxes); how many
        were still there."""
        found = 0
        for hierarchy in self._cgroup_hierarchies():
            top = hierarchy / self.cgroup.lstrip("/")
            with contextlib.suppress(OSError):  # runc removes cgroups while we walk them
                for procs in list(top.rglob("cgroup.procs")):
                    with contextlib.suppress(OSError):
                        for pid in procs.read_text().split():
                            found += 1
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(int(pid), signal.SIGKILL)
        return found

    def _kill_leftovers(self) -> None:
        """This run's node programs still alive: containerd's shims (which outlive it by design), and
        all of them after a run killed before its stop. Only programs of the node's and the control
        plane's builds that name the work folder on their command line."""
        needle = str(self.workdir.resolve()).encode()
        builds = (str(self.programs), str(binaries()))
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    if needle in (proc / "cmdline").read_bytes() and os.readlink(proc / "exe").startswith(builds):
                        os.kill(int(proc.name), signal.SIGKILL)

    def _unmount(self) -> None:
        """Everything the kubelet and containerd mounted under the work folder, deepest first."""
        prefix = str(self.workdir.resolve()) + "/"
        with open("/proc/self/mounts") as mounts:
            points = [line.split()[1].encode().decode("unicode_escape") for line in mounts]
        for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
            _run("umount", "-l", point, check=False)

    def _remove_cgroups(self) -> None:
        for hierarchy in self._cgroup_hierarchies():
            top = hierarchy / self.cgroup.lstrip("/")
            with contextlib.suppress(OSError):
                for directory in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                    with contextlib.suppress(OSError):
                        directory.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()

    def _remove_host_files(self) -> None:
        """What the kubelet, containerd and CNI keep in fixed host folders for this run's pods:
        log links into the work folder, CNI results and shim sockets of this run's sandboxes and
        containers (sockets no process listens on any more), the device-plugin socket."""
        for link in Path("/var/log/containers").glob("*.log"):
            with contextlib.suppress(OSError):
                if os.readlink(link).startswith(str(self.workdir.resolve())):
                    link.unlink()
        state = self.workdir / "containerd"
        ids = {p.name for p in state.glob("*/io.containerd.grpc.v1.cri/sandboxes/*")}
        for result in Path("/var/lib/cni/results").glob("*"):
            if any(f"-{i}-" in result.name for i in ids):
                result.unlink(missing_ok=True)
        with open("/proc/net/unix") as table:
            listening = {line.split()[-1] for line in table if line.split()[-1].startswith("/")}
        for sock in Path("/run/containerd/s").glob("*"):
            if str(sock) not in listening:
                sock.unlink(missing_ok=True)
        Path("/var/lib/kubelet/device-plugins/kubelet.sock").unlink(missing_ok=True)
        for folder in ("/var/log/containers", "/var/lib/cni/results", "/var/lib/cni", "/run/containerd/s",
                       "/run/containerd", "/var/lib/kubelet/device-plugins", "/var/lib/kubelet"):  # fmt: skip
            with contextlib.suppress(OSError):
                Path(folder).rmdir()  # only where nothing else is left

    def _restore_sysctls(self) -> None:
        for key, value in self.sysctls.items():
            _run("sysctl", "-qw", f"{key}={value}", check=False)

    def stop(self) -> None:
        """Every step runs even when one before it failed; the first failure is raised at the end."""
        steps: list[Callable[[], object]] = [
            *(
                lambda name=name: stop(self.processes.pop(name, None))
                for name in ("kube-proxy", "kube-scheduler", "kubelet")
            ),
            self._kill_pods,
            lambda: stop(self.processes.pop("containerd", None)),
            lambda: self.cp.stop() if self.cp is not None else None,
            self._kill_leftovers,
            self._reap,
            self._unmount,
            self._remove_cgroups,
            self._remove_host_files,
            self._restore_sysctls,
            lambda: self.network.delete() if self.network is not None else None,
            lambda: self.record.unlink(missing_ok=True),
        ]
        failures = []
        for step in steps:
            try:
                step()
            except Exception as error:  # cleanup goes on; the first failure is raised below
                failures.append(error)
        self.network = None
        if failures:
            raise failures[0]

    def _reap(self) -> None:
        """The killed processes leave their cgroups once reaped; kill what is still there meanwhile
        (for up to 2 s)."""
        for _ in range(20):
            if not self._kill_pods():
                return
            time.sleep(0.1)

    @classmethod
    def sweep(cls) -> None:
        """Stop what a run killed before its own stop left: each run records its work folder,
        network and the host settings it changed while it lives; a record whose process is gone
        (or whose PID now names another process) is swept."""
        for path in RUNS.glob("*.json") if RUNS.exists() else ():
            left = json.loads(path.read_text())
            if _started(int(path.stem)) == left.get("started"):
                continue
            node = cls(Path(left["workdir"]))
            node.network, node.cgroup = NodeNetwork(left["index"]), f"/kvroute-node-{left['index']}"
            node.sysctls, node.record = left.get("sysctls", {}), path
            node.stop()


def _sysctl(key: str) -> str:
    return _run("sysctl", "-n", key).stdout.strip()


def _started(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat), which tells a reused PID apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def coredns_objects() -> list[dict[str, Any]]:
    """CoreDNS as a Deployment behind the kube-dns Service at DNS_IP, with kubeadm's TTL and cache
    (30 s: how long a pod that left a Service may still be in its answers, which the chart's
    preStop waits must cover): cluster.local only (nothing upstream), as a non-root user on port
    1053 (the Service maps 53 to it)."""
    ns, name = "kube-system", "coredns"
    labels = {"k8s-app": "kube-dns"}
    corefile = (
        ".:1053 {\n    errors\n    health :8080\n    ready :8181\n"
        "    kubernetes cluster.local in-addr.arpa ip6.arpa {\n        pods insecure\n"
        "        fallthrough in-addr.arpa ip6.arpa\n        ttl 30\n    }\n    cache 30\n}\n"
    )
    rules = [
        {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"], "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    ]
    container = {
        "name": "coredns",
        "image": IMAGE_NAMES["coredns"],
        "imagePullPolicy": "Never",
        "args": ["-conf", "/etc/coredns/Corefile"],
        "ports": [{"containerPort": 1053, "protocol": "UDP"}, {"containerPort": 1053, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": ns}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns},
            "data": {"Corefile": corefile},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": name,
                        "dnsPolicy": "Default",
                        "containers": [container],
                        "volumes": [{"name": "config", "configMap": {"name": name}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": ns, "labels": labels},
            "spec": {
                "clusterIP": DNS_IP,
                "selector": labels,
                "ports": [
                    {"name": "dns", "port": 53, "targetPort": 1053, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "targetPort": 1053, "protocol": "TCP"},
                ],
            },
        },
    ]
