"""Shared by the operations tests: a private PKI made per test session with
`cryptography` (a CA, a server certificate for localhost that also serves as the router's
internal client certificate, a client certificate, and a client certificate from another CA)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path      # a client certificate signed by a CA the servers do not trust
    rogue_key: Path

    def read(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def _make_pki(d: Path) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key, path):
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))

    def ca(cn, path):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn)).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False, decipher_only=False),
                               critical=True)
                .sign(key, hashes.SHA256()))
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return key, cert

    def leaf(cn, issuer_key, issuer_cert, usages, cert_path, key_path, sans=()):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer_cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        cert = b.sign(issuer_key, hashes.SHA256())
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key, key_path)

    ca_key, ca_cert = ca("spectandem test CA", d / "ca.pem")
    leaf("localhost", ca_key, ca_cert, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
         d / "server.pem", d / "server.key",
         sans=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    leaf("client", ca_key, ca_cert, [ExtendedKeyUsageOID.CLIENT_AUTH], d / "client.pem", d / "client.key")
    rogue_key, rogue_ca = ca("someone else's CA", d / "rogue-ca.pem")
    leaf("rogue", rogue_key, rogue_ca, [ExtendedKeyUsageOID.CLIENT_AUTH], d / "rogue.pem", d / "rogue.key")
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key",
               d / "rogue.pem", d / "rogue.key")


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return _make_pki(tmp_path_factory.mktemp("pki"))
