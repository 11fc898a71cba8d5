"""TLS on the ext_proc port, as endpoint-picker gateways connect: a real Envoy reaching kvroute over
TLS (a certificate kvroute made at start), and plaintext clients refused."""

from __future__ import annotations

import asyncio
import http.client
import ssl

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.stack import Stack
from extproc.envoy.tls import issue_mutual, self_signed, server_credentials
from extproc.runtime import config
from tests.e2e import eventually, post
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


def _health(port: int, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """A health check on the ext_proc port with these channel credentials (None: plaintext)."""

    async def check() -> grpc.StatusCode:
        address = f"127.0.0.1:{port}"
        options = [("grpc.ssl_target_name_override", "localhost")]
        channel = (
            grpc.aio.insecure_channel(address)
            if credentials is None
            else grpc.aio.secure_channel(address, credentials, options=options)
        )
        async with channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

    return asyncio.run(check())


def test_mutual_tls_admits_only_a_client_certificate_from_the_private_ca(tmp_path):
    """Envoy routes over mutual TLS; a client without a certificate, or with one from another CA,
    cannot even open a stream (the handshake fails before any token is read); a client with the
    stack's own client certificate can."""
    with Stack(tmp_path / "stack", sims=2, extproc_mtls=True) as stack:
        status, headers, _ = post(stack.url, {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and headers["x-kvroute-decision"] == "least_loaded"
        own = stack.mtls_files()
        ca = own["ca"].read_bytes()
        stranger = issue_mutual(tmp_path / "stranger", ["127.0.0.1"])
        cases = {
            "no certificate": grpc.ssl_channel_credentials(root_certificates=ca),
            "another CA's": grpc.ssl_channel_credentials(
                ca, stranger["client_key"].read_bytes(), stranger["client_cert"].read_bytes()
            ),
        }
        for name, credentials in cases.items():
            assert _health(stack.grpc_port, credentials) == grpc.StatusCode.UNAVAILABLE, name
        mine = grpc.ssl_channel_credentials(ca, own["client_key"].read_bytes(), own["client_cert"].read_bytes())
        assert _health(stack.grpc_port, mine) == grpc.StatusCode.OK
        assert _health(stack.grpc_port, None) == grpc.StatusCode.UNAVAILABLE


def test_envoy_refuses_an_ext_proc_whose_certificate_is_not_from_its_ca(tmp_path):
    """An impostor on the ext_proc port (a certificate from another CA): Envoy will not talk to
    it, so with failure mode closed the request fails instead of being steered by it."""
    stack = Stack(tmp_path / "stack", sims=2, extproc_mtls=True, fail_open=False)
    impostor = issue_mutual(tmp_path / "impostor", ["127.0.0.1"])
    own = stack.mtls_files()
    certificate_flags = [
        "--grpc-tls-cert-file", str(impostor["server_cert"]), "--grpc-tls-key-file", str(impostor["server_key"]),
        "--grpc-tls-client-ca-file", str(own["ca"]),
    ]  # fmt: skip
    stack.extproc_mtls = False  # the replica below gets the impostor's certificate instead
    stack.extproc_args = certificate_flags
    with stack:
        stack.extproc_mtls = True
        stack.stop_process("envoy")
        stack.start_envoy()  # Envoy as it is meant to be: mutual TLS against its own CA
        status, headers, _ = post(stack.url, {"model": "sim-model", "messages": [{"role": "user", "content": "x"}]})
        assert status >= 500 and "x-kvroute-decision" not in headers


def test_mutual_tls_settings(tmp_path):
    with pytest.raises(ValueError, match="needs grpc_tls_cert_file"):
        config.load(parse(["--grpc-tls-client-ca-file", str(tmp_path / "ca.crt")]), {})
    files = issue_mutual(tmp_path, ["kvroute-extproc.kvroute.svc"])
    assert {p.name for p in files.values()} == {"ca.crt", "server.crt", "server.key", "client.crt", "client.key"}
    assert oct(files["server_key"].stat().st_mode & 0o777) == "0o600"
    assert server_credentials(str(files["server_cert"]), str(files["server_key"]), "", str(files["ca"])) is not None


def _authz_health(port: int, context: ssl.SSLContext | None) -> int | str:
    """GET /health on the ext_authz port: its status, or why there was none."""
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=context)
        if context is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    )
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except (OSError, http.client.HTTPException) as error:
        return type(error).__name__
    finally:
        conn.close()


def test_the_ext_authz_port_takes_the_same_mutual_tls(tmp_path):
    """The faster transport's HTTP port is as closed as the gRPC port: Envoy routes through it over
    mutual TLS; a plaintext client, one without a certificate and one with another CA's get no
    answer; the stack's own client certificate gets one. The request's end comes back over the
    same port, as Envoy's access log writes it there through the same mutual TLS."""
    with Stack(tmp_path / "stack", sims=2, extproc_mtls=True, transport="ext_authz") as stack:
        status, headers, _ = post(stack.url, {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and headers["x-kvroute-decision"] == "least_loaded"
        ended = lambda: stack.debug_state()["authz"]["open_exchanges"] == 0  # noqa: E731
        eventually(ended, message="the request's end, from the access log over mutual TLS")
        own = stack.mtls_files()
        stranger = issue_mutual(tmp_path / "stranger", ["127.0.0.1"])

        def client(certificates: dict | None) -> ssl.SSLContext:
            context = ssl.create_default_context(cafile=str(own["ca"]))
            if certificates is not None:
                context.load_cert_chain(str(certificates["client_cert"]), str(certificates["client_key"]))
            return context

        assert _authz_health(stack.authz_port, None) != 200  # plaintext
        assert _authz_health(stack.authz_port, client(None)) != 200  # no certificate
        assert _authz_health(stack.authz_port, client(stranger)) != 200  # another CA's
        assert _authz_health(stack.authz_port, client(own)) == 200
