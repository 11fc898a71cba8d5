"""A product module as it was at a git revision, loaded beside the checkout's own: what results
scripts compare a change with, in one process (the same machine state for both)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType


def module_at(revision: str, path: str, name: str) -> ModuleType:
    """The file `path` (relative to the checkout) at `revision`, imported as module `name`."""
    source = subprocess.check_output(["git", "show", f"{revision}:{path}"], text=True)
    return _load(source, name)


def module_now(path: str, name: str) -> ModuleType:
    """The checkout's own `path`, imported as module `name` (beside the package's copy)."""
    return _load(Path(path).read_text(), name)


def _load(source: str, name: str) -> ModuleType:
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # (dataclasses look their module up while the class is made)
    spec.loader.exec_module(loaded)
    return loaded
