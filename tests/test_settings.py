"""Settings: validated at construction, documented, loadable from a mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.core.settings import Settings


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 12},
        {"block_size": 0},
        {"hash_key": b"short"},
        {"location_ttl_s": 0},
        {"capacity_blocks": -1},
        {"balance_rel_gate": 0},
        {"active_request_cost": -1},
    ],
)
def test_bad_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        Settings(**bad)


def test_every_setting_is_documented():
    docs = Settings.docs()
    assert docs and all(len(doc) > 10 for doc in docs.values())


def test_from_mapping_reads_hex_keys_and_rejects_unknown_names():
    settings = Settings.from_mapping({"block_size": 256, "hash_key": "00" * 16})
    assert settings.block_size == 256 and settings.hash_key == bytes(16)
    with pytest.raises(ValueError, match="unknown"):
        Settings.from_mapping({"blocksize": 256})


def test_default_key_is_random_per_process():
    assert Settings().hash_key != Settings().hash_key


def test_readme_documents_every_setting():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    missing = [name for name in Settings.docs() if f"| `{name}` |" not in readme]
    assert not missing
