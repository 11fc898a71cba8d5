"""The code's layers import only downwards, and each command loads only what it runs.

core <- runtime <- adapters (envoy, admin, kube, vllm, replicas) <- units <- service <- cli; the operator
(controller) beside the adapters, sharing the KVRoutingPolicy contract with the follower through
the core (extproc/core/policy.py), so dependencies between the two point one way: controller ->
extproc, never back (the CLI on top starts either). bench and the generators (tools) use the
product, never the other way round.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE_THIRD_PARTY = {"orjson", "siphash24"}  # pure libraries the routing core may use

# package or module -> what it may import from the project (itself always allowed)
ALLOWED = {
    "extproc": set(),  # the package's own __init__
    "extproc.core": set(),
    "extproc.runtime": {"extproc.core"},
    "extproc.envoy": {"extproc.core", "extproc.runtime"},
    "extproc.admin": {"extproc.core", "extproc.runtime"},
    "extproc.kube": {"extproc.core", "extproc.runtime"},
    "extproc.vllm": {"extproc.core", "extproc.runtime"},
    "extproc.replicas": {"extproc.core", "extproc.runtime"},
    # one policy's parts, assembled (several may run side by side)
    "extproc.units": {
        "extproc.core",
        "extproc.runtime",
        "extproc.envoy",
        "extproc.kube",
        "extproc.vllm",
        "extproc.replicas",
    },
    "extproc.service": {
        "extproc.core",
        "extproc.runtime",
        "extproc.envoy",
        "extproc.admin",
        "extproc.kube",
        "extproc.vllm",
        "extproc.replicas",
        "extproc.units",
    },
    "extproc.cli": {"extproc.core", "extproc.runtime", "extproc.envoy", "extproc.service", "controller.operator"},
    "controller": {"extproc.core"},
}
PROJECT = ("extproc", "controller", "bench", "protos", "tests", "tools")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module the file imports, anywhere in it (functions and TYPE_CHECKING blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module not in PROJECT:  # `from extproc import service` imports extproc.service
                found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _layer(module: str) -> str:
    return max((key for key in ALLOWED if module == key or module.startswith(key + ".")), key=len)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


PRODUCT_FILES = sorted(p for d in ("extproc", "controller") for p in (ROOT / d).rglob("*.py") if "proto" not in p.parts)


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_product_modules_import_only_downwards(path: Path):
    module = _module(path)
    layer = _layer(module)
    allowed = ALLOWED[layer] | {layer}
    for name in _imports(path):
        if not name.startswith(PROJECT):
            continue
        if name.startswith(("extproc.envoy.proto",)) and layer == "extproc.envoy":
            continue
        assert any(_within(name, a) for a in allowed), f"{module} ({layer}) imports {name}"


@pytest.mark.parametrize(
    "path", sorted((ROOT / "extproc" / "core").glob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_core_uses_only_the_standard_library_and_pure_libraries(path: Path):
    for name in _imports(path):
        top = name.split(".")[0]
        if top in ("extproc", "__future__"):
            continue
        assert top in sys.stdlib_module_names or top in CORE_THIRD_PARTY, f"{path.name} imports {name}"


def test_controller_and_extproc_depend_one_way():
    """The operator uses the ext_proc's core (the policy contract, settings); no ext_proc module
    but the CLI on top, which starts the operator, imports the operator's code."""
    for path in PRODUCT_FILES:
        module = _module(path)
        if module.startswith("extproc") and module != "extproc.cli":
            assert not any(_within(name, "controller") for name in _imports(path)), module


def test_the_layer_rule_catches_an_upward_import():
    assert not any(_within("extproc.envoy.processor", a) for a in ALLOWED["extproc.runtime"] | {"extproc.runtime"})
    assert _layer("extproc.core.router") == "extproc.core" and _layer("controller.logic") == "controller"


@pytest.mark.parametrize(
    ("argv", "absent"),
    [
        (["envoy-config"], {"grpc", "kubernetes_asyncio", "kopf", "tqdm", "bench", "aiohttp", "matplotlib"}),
        (["extproc", "--help"], {"kubernetes_asyncio", "kopf", "tqdm", "bench", "matplotlib"}),
    ],
)
def test_commands_load_only_what_they_run(argv: list[str], absent: set[str]):
    script = (
        "import sys, contextlib, io\n"
        "from extproc.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    loaded = set(
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    )
    assert not loaded & absent, loaded & absent


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_product_code_points_at_nothing_outside_the_repository(path: Path):
    assert "../shared" not in path.read_text(), f"{path} refers to a file outside the repository"
