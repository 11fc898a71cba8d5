"""Shared test set-up: hypothesis without deadlines (this machine is shared and noisy), one
Kubernetes control plane for the whole session (started by the first `k8s` test that asks), one
real node likewise (the first `node` test), and a Redis server per replica test."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ci", parent=settings.get_profile("default"), max_examples=200)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory):
    """etcd + kube-apiserver (RBAC) + kube-controller-manager on loopback, for the `k8s` tests."""
    from tests.controlplane import ControlPlane

    plane = ControlPlane(tmp_path_factory.mktemp("controlplane")).start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory):
    """A real node (tests/node.py): the control plane, containerd, a kubelet, kube-scheduler,
    kube-proxy and CoreDNS in a network namespace of its own, with the locally built images."""
    from tests.node import Node

    node = Node(tmp_path_factory.mktemp("node")).start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def redis_server(tmp_path):
    """A real Redis server on loopback for one test (bench/harness/redis/install puts it in the cache)."""
    from bench.harness.store import RedisServer

    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()
