"""TLS on the ext_proc port: gateways built for endpoint pickers connect with TLS by default.

A certificate and key from files (a mounted Secret, cert-manager), or a self-signed pair made at
start, as the reference picker does: traffic is encrypted, and the gateway's Envoy does not verify
the picker's identity (it authenticates itself to kvroute with the stream token).
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SELF_SIGNED_DAYS = 365


def self_signed(host: str) -> tuple[bytes, bytes]:
    """A P-256 key and a certificate for `host` (and localhost), PEM-encoded: (key, certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvroute-extproc")])
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return pem_key, certificate.public_bytes(serialization.Encoding.PEM)


def server_credentials(cert_file: str, key_file: str, self_signed_for: str) -> grpc.ServerCredentials | None:
    """Credentials for the ext_proc port: from the files, or self-signed for the listen host when
    `self_signed_for` is set; None: plaintext."""
    if cert_file:
        pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    elif self_signed_for:
        pair = self_signed(self_signed_for)
    else:
        return None
    return grpc.ssl_server_credentials([pair])
