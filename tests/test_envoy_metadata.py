"""kvroute behind an Envoy configured the way endpoint-picker gateways read the picker: the
override_host policy follows only the `envoy.lb` dynamic metadata kvroute returns (no header
source), so requests land where kvroute chose only if Envoy honours that metadata."""

from __future__ import annotations

import random

import pytest

from bench.harness.stack import Stack, layout_for
from bench.workload import text
from tests.e2e import post

pytestmark = pytest.mark.envoy

RNG = random.Random(5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    with Stack(tmp_path_factory.mktemp("metadata"), sims=4, destination_from="metadata") as running:
        yield running


def test_requests_land_where_the_envoy_lb_metadata_says(stack: Stack):
    history = [{"role": "system", "content": text(RNG, 4000)}]
    served = []
    for turn in range(6):
        history.append({"role": "user", "content": f"turn {turn}: " + text(RNG, 300)})
        status, headers, body = post(
            stack.url, {"model": "sim-model", "messages": history, "max_tokens": 4}, {"x-session-id": "meta"}
        )
        assert status == 200
        assert headers["x-kvroute-backend"] == headers["x-sim-backend"]  # Envoy went where kvroute said
        served.append(headers["x-sim-backend"])
        history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert len(set(served)) == 1  # and stayed: round robin over 4 backends would not, 6 times in a row


def test_envoy_config_reads_metadata_only():
    from extproc.envoy.bootstrap import EnvoyLayout, bootstrap

    config = bootstrap(EnvoyLayout(backends=["127.0.0.1:1"], destination_from="metadata", transport="ext_proc"))
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "vllm")
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert policy["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]
    with pytest.raises(ValueError, match="header or metadata"):
        bootstrap(EnvoyLayout(backends=["127.0.0.1:1"], destination_from="body"))


def test_an_original_dst_cluster_goes_to_the_one_address_kvroute_names(tmp_path):
    """Gateways that connect to the destination header's address (ORIGINAL_DST) get one address;
    a client's own destination header never reaches that cluster."""
    with Stack(tmp_path, sims=3, backend_cluster="original_dst") as original:
        history = [{"role": "system", "content": text(RNG, 3000)}]
        served = set()
        for turn in range(4):
            history.append({"role": "user", "content": f"turn {turn}"})
            spoof = {"x-session-id": "odst", "x-gateway-destination-endpoint": f"127.0.0.1:{original.admin_port}"}
            status, headers, body = post(original.url, {"model": "sim-model", "messages": history}, spoof)
            assert status == 200 and headers["x-kvroute-backend"] == headers["x-sim-backend"]
            served.add(headers["x-sim-backend"])
            history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        assert len(served) == 1


def test_an_original_dst_cluster_refuses_the_two_address_list(tmp_path):
    """Why one address is the default: with `--destination-fallback true` (for kvroute's own
    override_host Envoy) an ORIGINAL_DST cluster cannot connect to `chosen,second`."""
    with Stack(
        tmp_path, sims=2, backend_cluster="original_dst", extproc_args=["--destination-fallback", "true"]
    ) as listed:
        status, _, _ = post(listed.url, {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 503


SUBSET_LUA = """
function envoy_on_request(handle)
  local subset = handle:headers():get("x-test-subset")
  if subset ~= nil then
    handle:streamInfo():dynamicMetadata():set("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset)
  end
end
"""


def with_subset_hints(config: dict) -> None:
    """What a gateway adds: a filter that puts a subset hint in `envoy.lb.subset_hint` (here from a
    test header, by Lua) ahead of the ext_proc filter, which forwards that namespace."""
    listener = config["static_resources"]["listeners"][0]
    filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    index = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.ext_proc")
    options = filters[index]["typed_config"].setdefault("metadata_options", {})
    options["forwarding_namespaces"] = {"untyped": ["envoy.lb.subset_hint"]}
    lua = {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": SUBSET_LUA},
        },
    }
    filters.insert(index, lua)


def test_a_gateways_subset_hint_limits_the_choice_and_an_empty_one_gives_503(tmp_path):
    """Full duplex, as the gateways that send hints run it (buffered mode reads the hint the
    same way: tests/test_processor.py)."""
    with Stack(tmp_path, sims=4, envoy_edit=with_subset_hints, **layout_for("full_duplex")) as s:
        allowed = s.backends[2]
        for i in range(8):
            body = {"model": "sim-model", "messages": [{"role": "user", "content": f"q{i} " + text(RNG, 200)}]}
            status, headers, _ = post(s.url, {**body, "max_tokens": 2}, {"x-test-subset": allowed})
            assert status == 200 and headers["x-sim-backend"] == allowed
        two = f"{s.backends[0]},{s.backends[1]}"
        served = {
            post(
                s.url,
                {"model": "sim-model", "messages": [{"role": "user", "content": f"r{i}"}]},
                {"x-test-subset": two},
            )[1]["x-sim-backend"]
            for i in range(8)
        }
        assert served <= {s.backends[0], s.backends[1]}
        status, _, _ = post(
            s.url,
            {"model": "sim-model", "messages": [{"role": "user", "content": "x"}]},
            {"x-test-subset": "10.9.9.9:8000"},
        )
        assert status == 503  # no candidate left: the picker protocol's answer, not a route elsewhere
        unhinted = {post(s.url, {"model": "sim-model", "messages": [{"role": "user", "content": text(RNG, 300)}]})[0]}
        assert unhinted == {200}
