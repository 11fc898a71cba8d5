"""TLS on the ext_proc port: gateways built for endpoint pickers connect with TLS by default.

A certificate and key from files (a mounted Secret, cert-manager), or a self-signed pair made at
start, as the reference picker does: traffic is encrypted, and the gateway's Envoy does not verify
the picker's identity (it authenticates itself to kvroute with the stream token). With a client CA
the TLS is mutual: kvroute's own Envoy verifies kvroute's certificate against that private CA and
presents one of its own, so only a holder of a certificate from it opens a stream at all
(`issue_mutual` makes such a set; the Helm chart makes its own with Helm's genCA).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from extproc.envoy.bootstrap import MUTUAL_FILES

SELF_SIGNED_DAYS = 365


def mutual_paths(directory: Path) -> dict[str, Path]:
    return {role: directory / name for role, name in MUTUAL_FILES.items()}


def _names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _certificate(
    common_name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None = None,
    hosts: list[str] | None = None,
    ca: bool = False,
) -> x509.Certificate:
    """Signed by `issuer` (name, key), or by itself."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_name, signer = issuer or (name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if hosts is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _pem(key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate) -> tuple[bytes, bytes]:
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return pem_key, certificate.public_bytes(serialization.Encoding.PEM)


def self_signed(host: str) -> tuple[bytes, bytes]:
    """A P-256 key and a certificate for `host` (and localhost), PEM-encoded: (key, certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return _pem(key, _certificate("kvroute-extproc", key, hosts=[host]))


def issue_mutual(directory: Path, hosts: list[str]) -> dict[str, Path]:
    """A private CA, a server certificate for the ext_proc (`hosts` and localhost) and a client
    certificate for Envoy, written as PEM files; their paths by role (ca, server_cert, server_key,
    client_cert, client_key). Keys are written owner-readable only."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("kvroute-extproc-ca", ca_key, ca=True)
    issuer = (ca.subject, ca_key)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    pems = {
        "server": _pem(server_key, _certificate("kvroute-extproc", server_key, issuer, hosts)),
        "client": _pem(client_key, _certificate("envoy", client_key, issuer)),
    }
    paths = mutual_paths(directory)
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for role, (pem_key, pem_cert) in pems.items():
        paths[f"{role}_cert"].write_bytes(pem_cert)
        paths[f"{role}_key"].write_bytes(pem_key)
        paths[f"{role}_key"].chmod(0o600)
    return paths


def server_credentials(
    cert_file: str, key_file: str, self_signed_for: str, client_ca_file: str = ""
) -> grpc.ServerCredentials | None:
    """Credentials for the ext_proc port: from the files, or self-signed for the listen host when
    `self_signed_for` is set; with `client_ca_file`, clients must present a certificate it signed.
    None: plaintext."""
    if cert_file:
        pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    elif self_signed_for:
        pair = self_signed(self_signed_for)
    else:
        return None
    if client_ca_file:
        return grpc.ssl_server_credentials(
            [pair], root_certificates=Path(client_ca_file).read_bytes(), require_client_auth=True
        )
    return grpc.ssl_server_credentials([pair])


def server_ssl_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext | None:
    """The same TLS for the ext_authz HTTP port (the ext_proc's faster transport) as
    `server_credentials` gives the gRPC port, from the files; mutual with `client_ca_file`.
    None: plaintext."""
    if not cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
