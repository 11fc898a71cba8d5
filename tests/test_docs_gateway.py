"""docs/envoy-gateway.md against the real CRDs: every YAML object in it, and what its `helm
install` commands render, pass `kubectl apply --dry-run=server` on a live API server that has the
Gateway API, InferencePool, Envoy Gateway and kvroute CRDs (schemas and CEL rules as published)."""

from __future__ import annotations

import copy
import re
import shlex
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.controlplane import ROOT, ControlPlane

pytestmark = pytest.mark.k8s

GUIDE = ROOT / "docs" / "envoy-gateway.md"
README = ROOT / "README.md"


def blocks(language: str, path: Path = GUIDE) -> list[str]:
    """A page's fenced blocks of one language, dedented (some sit inside list items)."""
    pattern = rf"^([ \t]*)```{language}\n(.*?)^\1```"
    return [textwrap.dedent(m.group(2)) for m in re.finditer(pattern, path.read_text(), re.M | re.S)]


def documented_objects() -> list[dict[str, Any]]:
    return [d for block in blocks("yaml") for d in yaml.safe_load_all(block) if d]


def helm_installs(path: Path = GUIDE) -> list[list[str]]:
    """Each `helm install` command of a page's shell blocks and prose, as argv."""
    text = " ".join(blocks("sh", path)) + " " + path.read_text().replace("\n", " ")
    commands = re.findall(r"helm install [^`\n]*?(?=`|$)", text.replace("\\ ", " ").replace("\\\n", " "))
    return [shlex.split(c) for c in dict.fromkeys(c.strip() for c in commands)]


@pytest.fixture(scope="module")
def gateway_cluster(control_plane: ControlPlane):
    cp = control_plane
    cp.install_crds("gateway-api", "inference-extension", "envoy-gateway")
    cp.kubectl(
        "apply", "-f", str(ROOT / "manifests" / "crd.yaml"), "-f", str(ROOT / "manifests" / "kopf-peering-crd.yaml")
    )
    cp.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    cp.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in ("llm", "kvroute")])
    return cp


def dry_run(cp: ControlPlane, objects: list[dict[str, Any]] | str):
    text = objects if isinstance(objects, str) else yaml.safe_dump_all(objects)
    return cp.kubectl("apply", "--dry-run=server", "-f", "-", stdin=text, check=False)


def test_the_guide_shows_both_ways():
    kinds = {d["kind"] for d in documented_objects()}
    assert {"InferencePool", "KVRoutingPolicy", "HTTPRoute", "Gateway"} <= kinds  # A: the picker
    assert {"EnvoyExtensionPolicy", "BackendTrafficPolicy", "ReferenceGrant"} <= kinds  # B: the policies
    assert len(helm_installs()) == 2


@pytest.mark.parametrize("index", range(len(documented_objects())), ids=lambda i: documented_objects()[i]["kind"])
def test_every_object_in_the_guide_is_accepted_by_the_server(gateway_cluster: ControlPlane, index: int):
    result = dry_run(gateway_cluster, [documented_objects()[index]])
    assert result.returncode == 0, result.stderr


def test_the_helm_commands_render_objects_the_server_accepts(gateway_cluster: ControlPlane):
    """The guide's and the README's."""
    commands = helm_installs() + helm_installs(README)
    assert any("inferencePool.enabled=true" in argv for argv in helm_installs(README))
    for argv in commands:
        assert argv[:2] == ["helm", "install"]
        release, chart, *flags = argv[2:]
        rendered = gateway_cluster.helm("template", release, str(ROOT / chart), *flags).stdout
        assert "kind: Deployment" in rendered
        result = dry_run(gateway_cluster, rendered)
        assert result.returncode == 0, result.stderr


def test_envoy_gateway_refuses_full_duplex_bodies_with_fail_open(gateway_cluster: ControlPlane):
    """As the guide says: streaming both ways needs failOpen false."""
    policy = copy.deepcopy(next(d for d in documented_objects() if d["kind"] == "EnvoyExtensionPolicy"))
    mode = policy["spec"]["extProc"][0]["processingMode"]
    mode["request"]["body"] = mode["response"]["body"] = "FullDuplexStreamed"
    refused = dry_run(gateway_cluster, [policy])
    assert refused.returncode != 0 and "FailOpen must be false" in refused.stderr
    policy["spec"]["extProc"][0]["failOpen"] = False
    accepted = dry_run(gateway_cluster, [policy])
    assert accepted.returncode == 0, accepted.stderr
