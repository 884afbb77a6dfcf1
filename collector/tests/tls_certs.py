"""Test certificates made with ``cryptography``: a CA, a server certificate it signed, and
client certificates for mutual TLS."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def make_cert(directory: Path, *, expired: bool = False) -> tuple[Path, Path, Path]:
    """A test CA, and a server certificate it signed for localhost and 127.0.0.1 with its
    key; with ``expired``, a server certificate that expired an hour ago (the CA is valid)."""
    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    served = (now - datetime.timedelta(days=2), now - datetime.timedelta(hours=1)) if expired else validity
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "durable-sessions test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(served[0])
        .not_valid_after(served[1])
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
        )
        .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_pem(key))
    (directory / "ca-key.pem").write_bytes(_pem(ca_key))  # for make_client_cert
    return ca_path, cert_path, key_path


def make_client_cert(ca_directory: Path, directory: Path) -> tuple[Path, Path]:
    """A client certificate (and its key) signed by the CA that ``make_cert`` made in
    ``ca_directory``, for mutual TLS."""
    ca = x509.load_pem_x509_certificate((ca_directory / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_directory / "ca-key.pem").read_bytes(), password=None)
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "otel-collector")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "client.pem", directory / "client-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_pem(key))
    return cert_path, key_path


def mutual_tls_pki(directory: Path) -> dict[str, Path]:
    """Our CA with a server and a client certificate it signed, and a stranger's client
    certificate, signed by another CA: what a sidecar with tls.client_ca_file lets in and
    keeps out."""
    (directory / "ours").mkdir()
    (directory / "theirs").mkdir()
    ca, cert, key = make_cert(directory / "ours")
    client_cert, client_key = make_client_cert(directory / "ours", directory / "client")
    make_cert(directory / "theirs")
    stranger_cert, stranger_key = make_client_cert(directory / "theirs", directory / "stranger")
    return {
        "ca": ca, "cert": cert, "key": key, "client_cert": client_cert, "client_key": client_key,
        "stranger_cert": stranger_cert, "stranger_key": stranger_key,
    }  # fmt: skip


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
