"""TLS on the ext_proc port, as endpoint-picker gateways connect: a real Envoy reaching kvroute over
TLS (a certificate kvroute made at start), and plaintext clients refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.stack import Stack
from extproc.envoy.tls import self_signed, server_credentials
from extproc.runtime import config
from tests.e2e import post
from tests.test_config import parse

pytestmark = pytest.mark.envoy


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    with Stack(tmp_path_factory.mktemp("tls"), sims=2, extproc_tls=True) as running:
        yield running


def test_envoy_routes_through_a_tls_ext_proc_and_plaintext_is_refused(stack: Stack):
    status, headers, _ = post(stack.url, {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and headers["x-kvroute-decision"] == "least_loaded"  # kvroute decided, over TLS

    async def plaintext_health() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

    assert asyncio.run(plaintext_health()) == grpc.StatusCode.UNAVAILABLE


def test_tls_settings(tmp_path):
    key, certificate = self_signed("127.0.0.1")
    assert key.startswith(b"-----BEGIN PRIVATE KEY") and certificate.startswith(b"-----BEGIN CERTIFICATE")
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "tls.crt").write_bytes(certificate)
    assert server_credentials(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), "") is not None
    assert server_credentials("", "", "") is None  # plaintext
    with pytest.raises(ValueError, match="go together"):
        config.load(parse(["--grpc-tls-cert-file", str(tmp_path / "tls.crt")]), {})
    with pytest.raises(ValueError, match="not both"):
        flags = ["--grpc-tls-cert-file", "c", "--grpc-tls-key-file", "k", "--grpc-tls-self-signed", "true"]
        config.load(parse(flags), {})
