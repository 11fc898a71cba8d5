"""ext_proc configuration: file < environment < flags, validated."""

from __future__ import annotations

import argparse

import pytest
import yaml

from extproc.core.backends import Backend, Role
from extproc.runtime import config


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return parser.parse_args(argv)


def test_layers_override_in_order(tmp_path):
    path = tmp_path / "kvroute.yaml"
    path.write_text(
        "grpc_port: 7000\nadmin_port: 7001\n"
        "backends: ['10.0.0.1:8000', {address: '10.0.0.2:8000', models: [llama]}]\n"
        "routing: {block_size: 256, session_ttl_s: 60}\n"
    )
    env = {"KVROUTE_ADMIN_PORT": "7101", "KVROUTE_BLOCK_SIZE": "1024", "KVROUTE_HASH_KEY": "ab" * 16}
    loaded = config.load(parse(["--config", str(path), "--block-size", "2048"]), env)
    assert (loaded.grpc_port, loaded.admin_port) == (7000, 7101)
    assert loaded.routing.block_size == 2048
    assert loaded.routing.session_ttl_s == 60
    assert loaded.routing.hash_key == bytes.fromhex("ab" * 16)
    assert loaded.backends == (Backend("10.0.0.1:8000"), Backend("10.0.0.2:8000", frozenset({"llama"})))


def test_backends_from_env_and_flags():
    assert config.load(parse([]), {"KVROUTE_BACKENDS": "127.0.0.1:1,127.0.0.1:2"}).backends == (
        Backend("127.0.0.1:1"),
        Backend("127.0.0.1:2"),
    )
    loaded = config.load(parse(["--backend", "[::1]:9"]), {"KVROUTE_BACKENDS": "127.0.0.1:1"})
    assert loaded.backends == (Backend("[::1]:9"),)


def test_a_backends_role_from_flags_and_yaml():
    loaded = config.load(parse(["--backend", "10.0.0.1:1@prefill", "--backend", "10.0.0.2:2@Decode"]), {})
    assert [b.role for b in loaded.backends] == [Role.PREFILL, Role.DECODE]
    assert config.parse_backend({"address": "10.0.0.3:3", "role": "both"}).role is Role.BOTH
    with pytest.raises(ValueError, match="role"):
        config.parse_backend("10.0.0.1:1@sidecar")


@pytest.mark.parametrize("bad", ["localhost:80", "10.0.0.1", "10.0.0.1:0", "10.0.0.1:http", "evil.example:443"])
def test_backend_addresses_must_be_literal_ip_port(bad):
    with pytest.raises(ValueError):
        config.parse_address(bad)


def test_unknown_keys_and_bad_settings_are_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("grpc_prot: 1\n")
    with pytest.raises(ValueError, match="unknown config keys"):
        config.load(parse(["--config", str(path)]), {})
    with pytest.raises(ValueError, match="block_size"):
        config.load(parse(["--block-size", "12"]), {})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("routing: {decision_headers: 'false'}\n", "decision_headers must be true or false"),  # was on
        ("kv_events: 'false'\n", "kv_events must be true or false"),
        ("routing: {block_size: 512.0}\n", "block_size must be a whole number"),  # each request failed later
        ("routing: {location_ttl_s: .nan}\n", "location_ttl_s must be a finite number"),
        ("health_interval_s: .nan\n", "health_interval_s must be a finite number"),  # the probes died
        ("max_stream_age_s: -1\n", "max_stream_age_s must be greater than 0"),  # every stream was cut
        ("lease_ttl_s: 0\n", "lease_ttl_s must be greater than 0"),
        ("unhealthy_after: 0\n", "unhealthy_after must be at least 1"),
        ("grpc_port: 70000\n", "grpc_port must be at most 65535"),
        ("admin_port: 9002\n", "ports must differ"),
        ("admin_host:\n", "admin_host must be text"),  # None: aiohttp listened on every interface
        ("control_host: ' '\n", "control_host must name an address"),
        ("policy:\n", "policy must be text"),
        ("log_level: 10\n", "log_level must be text"),
        ("log_level: loud\n", "log_level must be one of debug, info, warning, error"),
        ("control_token_file: 5\n", "control_token_file must be text"),
        ("routing:\n", "routing must be a mapping"),
        ("routing: [block_size]\n", "routing must be a mapping"),
        ("backends: 127.0.0.1:1\n", "backends must be a list"),  # was read character by character
        ("backends: [{models: [a]}]\n", "a backend is ip:port or"),
        ("backends: [{address: '127.0.0.1:1', models: a}]\n", "models are a list"),
        ("routing: {tenant_header: 5}\n", "tenant_header must be"),
        ("grpc_port: [1\n", "not YAML"),
    ],
)
def test_a_value_of_the_wrong_kind_or_past_its_bounds_is_refused_at_start(tmp_path, text, message):
    """A YAML file hands values over as written, past the text parsers: each is checked for its
    kind and bounds when the configuration is made, as flags and the environment are."""
    path = tmp_path / "kvroute.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        config.load(parse(["--config", str(path)]), {})


def test_a_bad_environment_value_names_its_variable_and_a_missing_token_file_is_refused_at_once(tmp_path):
    with pytest.raises(ValueError, match="KVROUTE_GRPC_PORT='abc'"):
        config.load(parse([]), {"KVROUTE_GRPC_PORT": "abc"})
    with pytest.raises(ValueError, match="KVROUTE_BLOCK_SIZE='x'"):
        config.load(parse([]), {"KVROUTE_BLOCK_SIZE": "x"})
    with pytest.raises(FileNotFoundError):  # read when loaded, not after the monitoring port opened
        config.load(parse(["--grpc-token-file", str(tmp_path / "absent")]), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="token file is empty"):
        config.load(parse(["--control-port", "9010", "--control-token-file", str(tmp_path / "empty")]), {})


def test_the_extproc_command_says_what_is_wrong_without_a_traceback(tmp_path, capsys):
    from extproc import cli

    for argv in (["extproc", "--control-port", "9010"], ["extproc", "--config", str(tmp_path / "absent.yaml")]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert str(exited.value.code).startswith("kvroute extproc: "), exited.value.code


def test_not_a_number_from_the_environment_is_refused():
    for name in ("KVROUTE_LOCATION_TTL_S", "KVROUTE_SATURATION_KV_USAGE", "KVROUTE_HEALTH_INTERVAL_S"):
        with pytest.raises(ValueError, match=r"finite number|must be a number"):
            config.load(parse([]), {name: "nan"})
    with pytest.raises(ValueError, match="finite number"):
        config.load(parse([]), {"KVROUTE_SESSION_TTL_S": "inf"})
    with pytest.raises(ValueError, match="hash_key must be 32 hex digits"):
        config.load(parse([]), {"KVROUTE_HASH_KEY": "not-hex-" * 4})


def test_a_replica_store_needs_a_hash_key_every_replica_shares():
    with pytest.raises(ValueError, match="explicit hash_key"):
        config.load(parse(["--replica-store", "redis://127.0.0.1:6379/0"]), {})
    loaded = config.load(parse(["--replica-store", "redis://127.0.0.1:6379/0"]), {"KVROUTE_HASH_KEY": "cd" * 16})
    assert (loaded.replica_store, loaded.routing.hash_key) == ("redis://127.0.0.1:6379/0", bytes.fromhex("cd" * 16))


def test_the_ext_authz_transport_takes_tls_from_files():
    """The check port takes the gRPC port's TLS from its files (tests/test_extproc_tls.py), never a
    self-signed certificate made at start; with a replica store it serves replicas
    (tests/test_replicas_envoy.py)."""
    store = ["--replica-store", "redis://127.0.0.1:6379/0"]
    assert config.load(parse(["--authz-port", "9004", *store]), {"KVROUTE_HASH_KEY": "cd" * 16}).authz_port == 9004
    with pytest.raises(ValueError, match="not from a self-signed certificate"):
        config.load(parse(["--authz-port", "9004", "--grpc-tls-self-signed", "true"]), {})
    assert config.load(parse(["--authz-port", "9004"]), {}).authz_port == 9004
    files = ["--grpc-tls-cert-file", "c", "--grpc-tls-key-file", "k", "--grpc-tls-client-ca-file", "ca"]
    assert config.load(parse(["--authz-port", "9004", *files]), {}).grpc_tls_client_ca_file == "ca"


def test_several_policies_followed_or_listed_each_become_a_unit(tmp_path):
    followed = config.load(parse(["--policy", "llm/chat,llm/code", "--block-size", "1024"]), {})
    assert [(u.name, u.follow, u.routing.block_size) for u in followed.units()] == [
        ("llm/chat", "llm/chat", 1024),
        ("llm/code", "llm/code", 1024),
    ]
    one = config.load(parse(["--policy", "llm/chat", "--backend", "10.0.0.1:8000"]), {})
    assert [(u.name, u.follow, len(u.backends)) for u in one.units()] == [("llm/chat", "llm/chat", 1)]
    assert [u.name for u in config.load(parse([]), {}).units()] == ["default"]
    path = tmp_path / "policies.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "routing": {"block_size": 1024, "session_ttl_s": 60.0},
                "policies": [
                    {"name": "chat", "backends": [{"address": "10.0.0.1:8000", "models": ["a"]}]},
                    {"name": "code", "backends": ["10.0.0.2:8000"], "routing": {"block_size": 256}},
                ],
            }
        )
    )
    listed = config.load(parse(["--config", str(path)]), {}).units()
    assert [(u.name, u.follow, u.routing.block_size, u.routing.session_ttl_s) for u in listed] == [
        ("chat", "", 1024, 60.0),
        ("code", "", 256, 60.0),  # its own setting over the shared ones
    ]
    keyed = {"policies": [{"name": "a", "routing": {"hash_key": "ab" * 16}}], "replica_store": "redis://127.0.0.1:1/0"}
    path.write_text(yaml.safe_dump(keyed))  # each policy's own key will do
    assert config.load(parse(["--config", str(path)]), {}).units()[0].routing.hash_key == bytes.fromhex("ab" * 16)
    assert listed[0].backends[0].models == frozenset({"a"})


@pytest.mark.parametrize(
    ("document", "flags", "message"),
    [
        ({"policies": [{"name": "a"}, {"name": "a"}]}, [], "distinct names"),
        ({"policies": [{"backends": []}]}, [], "needs a name"),
        ({"policies": [{"name": "a", "selector": {}}]}, [], "needs a name"),
        ({"policies": [{"name": "a", "routing": {"block_size": 12}}]}, [], "block_size"),
        ({"policies": [{"name": "a"}]}, ["--backend", "10.0.0.1:1"], "replace policy and backends"),
        ({"policies": "a"}, [], "must be a list"),
        ({}, ["--policy", "llm/a,llm/a"], "NAMESPACE/NAME"),
        ({}, ["--policy", "llm/a,b"], "NAMESPACE/NAME"),
        ({}, ["--policy", "llm/a, llm/b"], "NAMESPACE/NAME"),
        ({}, ["--policy", "llm/a,llm/b", "--backend", "10.0.0.1:1"], "give policy or backends"),
        ({"policies": [{"name": "a"}]}, ["--replica-store", "redis://127.0.0.1:1/0"], "policy 'a': replica_store"),
    ],
)
def test_bad_policy_lists_are_refused(tmp_path, document, flags, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ValueError, match=message):
        config.load(parse(["--config", str(path), *flags]), {})
