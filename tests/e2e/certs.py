"""A throwaway certificate authority and server certificates for TLS tests (the `cryptography` package)."""
from __future__ import annotations

import datetime as dt
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def make_ca(directory: str, name: str = "test-ca") -> tuple[str, ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA; returns (its PEM path, key, certificate)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    path = _write(os.path.join(directory, f"{name}.pem"), cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def make_server_cert(directory: str, ca: tuple[str, ec.EllipticCurvePrivateKey, x509.Certificate],
                     ip: str = "127.0.0.1") -> tuple[str, str]:
    """A certificate for `ip` signed by `ca`; returns (cert PEM path, key PEM path)."""
    _, ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(ip)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path = _write(os.path.join(directory, "server.pem"), cert.public_bytes(serialization.Encoding.PEM))
    key_path = _write(os.path.join(directory, "server-key.pem"), key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path
