"""Settings: validated at construction, documented, loadable from a mapping."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from extproc.cli import parser
from extproc.core import policy
from extproc.core.settings import Settings
from extproc.runtime import config
from tools import crd
from tools.crd import CRD_FILES
from tools.settings_doc import settings_reference

ROOT = Path(__file__).resolve().parent.parent


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
        {"active_request_cost": 1e308},  # with new_session_load_weight 0: NaN costs, no candidate
        {"index_memory_mib": 1e303},  # its bytes overflowed as the router was built
        {"capacity_blocks": 1.5},
        {"capacity_blocks": True},
    ],
)
def test_bad_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        Settings(**bad)


def test_every_setting_is_documented():
    docs = Settings.help()
    assert docs and all(len(doc) > 10 for doc in docs.values())


def test_from_mapping_reads_hex_keys_and_rejects_unknown_names():
    settings = Settings.from_mapping({"block_size": 256, "hash_key": "00" * 16})
    assert settings.block_size == 256 and settings.hash_key == bytes(16)
    with pytest.raises(ValueError, match="unknown"):
        Settings.from_mapping({"blocksize": 256})


def test_default_key_is_random_per_process():
    assert Settings().hash_key != Settings().hash_key


def test_settings_reference_is_generated_from_the_declarations():
    committed = (ROOT / "docs" / "settings.md").read_text()
    assert committed == settings_reference(), "stale: python -m tools.settings_doc > docs/settings.md"


def test_every_setting_has_a_flag_and_an_environment_variable():
    flags = parser().parse_args(["extproc"])
    for f in fields(Settings):
        assert hasattr(flags, "routing_" + f.name)
    numbers = {f.name: _number(f) for f in fields(Settings) if f.type in ("int", "float")}
    environ = {"KVROUTE_" + name.upper(): str(value) for name, value in numbers.items()}
    loaded = config.load(None, environ).routing
    assert all(getattr(loaded, name) == value for name, value in numbers.items())


def _number(f: dataclasses.Field) -> float | bool:
    """A value other than the default that the setting's kind and bounds allow: a switch turned
    the other way; else 8, or half the maximum."""
    if f.metadata["kind"] is bool:
        return not f.default
    bounds = f.metadata["bounds"]
    return 8 if bounds is None or bounds.maximum is None or bounds.maximum >= 8 else bounds.maximum / 2


def test_crd_files_are_generated_and_identical():
    for path in CRD_FILES:
        assert path.read_text() == crd.render(), f"{path} is stale: python -m tools.crd"
    kopf = ROOT / "manifests" / "kopf-peering-crd.yaml"
    assert (ROOT / "charts" / "kvroute" / "crds" / "clusterkopfpeerings.yaml").read_text() == kopf.read_text()


def test_crd_routing_schema_matches_every_policy_setting():
    schema = yaml.safe_load(CRD_FILES[0].read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    routing = schema["properties"]["spec"]["properties"]["routing"]["properties"]
    declared = {f.metadata["policy"]: f for f in fields(Settings) if f.metadata["policy"]}
    assert set(routing) == set(declared)
    for key, f in declared.items():
        bounds = f.metadata["bounds"]
        prop = routing[key]
        if "x-kubernetes-int-or-string" in prop:  # capacityBlocks: bounds in its CEL rule
            rule = prop["x-kubernetes-validations"][0]["rule"]
            assert f">= {int(bounds.minimum)}" in rule and f"<= {int(bounds.maximum)}" in rule
            continue
        if f.metadata["choices"]:
            assert prop["enum"] == list(f.metadata["choices"]), key
        number = prop
        if bounds is not None:
            assert number["minimum"] == bounds.minimum, key
            assert number.get("exclusiveMinimum", False) == bounds.exclusive_minimum, key
            assert number.get("maximum") == bounds.maximum, key
            assert number.get("multipleOf") == bounds.multiple_of, key


@pytest.mark.parametrize("key", [f.metadata["policy"] for f in fields(Settings) if f.metadata["policy"]])
def test_every_policy_field_reaches_its_setting(key):
    values = {
        "sessionHeaders": ["X-Conversation"],
        "capacityBlocks": 77,
        "tenantHeader": "X-Tenant",
        "index": "precise",
        "sessionMoves": "gates",
        "tokenizerPath": "/models/tokenizer",
        "queueMetricFlows": ["team-a"],
        "flowWeights": {"team-a": 3},
        "objectivePriorities": {"batch": -2},
        "adapterSources": {"sql": "/adapters/sql"},
    }
    name = next(f.name for f in fields(Settings) if f.metadata["policy"] == key)
    number = _number(next(f for f in fields(Settings) if f.name == name))
    value = values.get(key, number)
    changes, unknown = policy.routing_changes({key: value})
    assert not unknown
    settings = dataclasses.replace(Settings(), **changes)
    expected = {
        "session_headers": ("x-conversation",),
        "capacity_blocks": 77,
        "tenant_header": "x-tenant",
        "index_mode": "precise",
        "session_moves": "gates",
        "tokenizer_path": "/models/tokenizer",
        "queue_metric_flows": ("team-a",),
        "flow_weights": (("team-a", 3.0),),
        "objective_priorities": (("batch", -2),),
        "adapter_sources": (("sql", "/adapters/sql"),),
    }
    assert getattr(settings, name) == expected.get(name, number)


def test_hash_key_is_never_read_from_a_policy():
    assert policy.routing_changes({"hashKey": "00" * 16}) == ({}, ["hashKey"])
    assert policy.routing_changes({"capacityBlocks": "auto"})[0] == {"capacity_auto": True}
    for count in (1.5, True):  # no block count, refused with the settings (int() made them 1)
        with pytest.raises(ValueError):
            Settings(hash_key=bytes(16), **policy.routing_changes({"capacityBlocks": count})[0])


def test_text_settings_refuse_other_types_and_unlisted_choices():
    with pytest.raises(ValueError, match="tokenizer_path must be text"):
        Settings(tokenizer_path=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="index_mode must be one of approximate, precise"):
        Settings(index_mode="exact")


def _sample(f: dataclasses.Field) -> tuple[object, str]:
    """A non-default value of the setting as YAML gives it, and as text (environment, flags)."""
    special = {
        "hash_key": ("ab" * 16, "ab" * 16),
        "session_headers": (["X-Conversation", "x-session-id"], "X-Conversation,x-session-id"),
        "tenant_header": ("X-Tenant", "X-Tenant"),
        "index_mode": ("precise", "precise"),
        "session_moves": ("gates", "gates"),
        "tokenizer_path": ("/models/tokenizer", "/models/tokenizer"),
        "queue_metric_flows": (["team-a", "team-b"], "team-a,team-b"),
        "flow_weights": ({"team-a": 2, "team-b": 0.5}, "team-a=2,team-b=0.5"),
        "objective_priorities": ({"critical": 10, "batch": -1}, "critical=10, batch=-1"),
        "adapter_sources": ({"sql": "/adapters/sql", "chat": "/a/chat"}, "sql=/adapters/sql,chat=/a/chat"),
    }
    if f.name in special:
        return special[f.name]
    kind = f.metadata["kind"]
    if kind is bool:
        return (not f.default, str(not f.default).lower())
    value = f.default + 8 if kind is int else f.default + 0.5
    maximum = f.metadata["bounds"].maximum if f.metadata["bounds"] else None
    if maximum is not None and value > maximum:
        value = (f.default + maximum) / 2
    return value, str(value)


@pytest.mark.parametrize("f", fields(Settings), ids=lambda f: f.name)
def test_every_setting_means_the_same_from_every_source(f, tmp_path):
    """YAML, environment, flags and (where it has a field) a policy give the same value, normalised
    by its declaration (header names lower-cased wherever they come from)."""
    value, text = _sample(f)
    expected = getattr(Settings(**{f.name: value}), f.name)
    assert expected != getattr(Settings(hash_key=bytes(16)), f.name) or f.name == "hash_key"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"routing": {f.name: value}}))
    from_yaml = config.load(parser().parse_args(["extproc", "--config", str(path)]), environ={}).routing
    from_env = config.load(None, environ={f"KVROUTE_{f.name.upper()}": text}).routing
    flag = "--" + f.name.replace("_", "-")
    from_flag = config.load(parser().parse_args(["extproc", flag, text]), environ={}).routing
    assert getattr(from_yaml, f.name) == getattr(from_env, f.name) == getattr(from_flag, f.name) == expected
    if f.metadata["policy"] and not f.metadata["secret"]:
        changes, unknown = policy.routing_changes({f.metadata["policy"]: value})
        assert not unknown and getattr(dataclasses.replace(Settings(), **changes), f.name) == expected
    else:
        # the secret key, what capacityBlocks "auto" sets, and the process's own memory budget
        assert f.name in ("hash_key", "capacity_auto", "index_memory_mib")


def test_header_settings_refuse_what_is_no_header_name():
    with pytest.raises(ValueError, match="tenant_header must be HTTP header names"):
        Settings(tenant_header="x tenant")
    with pytest.raises(ValueError, match="session_headers must be a list of header names"):
        Settings(session_headers="x-session-id")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="session_headers must be HTTP header names"):
        Settings(session_headers=(":authority",))
    assert Settings(session_headers=()).session_headers == ()  # only the body names conversations


def test_adapter_sources_take_only_names_vllm_can_serve():
    """Placement would load a name the servers' listing then drops, and wait for it on every request."""
    for bad in ("my sql", "../etc", "-x", "a\nb"):
        with pytest.raises(ValueError, match="adapter_sources"):
            Settings(adapter_sources={bad: "/adapters/x"})
    good = Settings(adapter_sources={"org/sql-v2.1": "/adapters/x"})
    assert good.adapter_sources == (("org/sql-v2.1", "/adapters/x"),)
