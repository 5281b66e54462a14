"""A pool's TLS files for agents in tests and benchmarks: a CA and one agent certificate it
signs (`peers.tls`), made with the `cryptography` package (a kvpool dependency)."""

from __future__ import annotations

import datetime
from pathlib import Path


def make_ca(directory: Path, name: str, days: int = 1) -> dict[str, str]:
    """A CA and one agent certificate it signs (every agent of the test uses it), both
    valid for `days`: the `peers.tls` files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True)
    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str,
             signer: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                .sign(signer, hashes.SHA256()))
    ca_key, agent_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_cert = cert(name, ca_key, name, ca_key, True)
    agent_cert = cert("kvpool-agent", agent_key, name, ca_key, False)
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(pem))
    (directory / "tls.crt").write_bytes(agent_cert.public_bytes(pem))
    (directory / "tls.key").write_bytes(agent_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return {"certFile": str(directory / "tls.crt"), "keyFile": str(directory / "tls.key"),
            "caFile": str(directory / "ca.crt")}
