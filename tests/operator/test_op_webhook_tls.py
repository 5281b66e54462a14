"""The webhook as the API server reaches it: HTTPS with the certificate from --webhook-cert-dir."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import ssl
from pathlib import Path
from typing import Any

import pytest
from op_cluster import NAMESPACE, Emulator, admission_review, cluster_on, patched
from op_support import pod_body, pool_body

pytestmark = pytest.mark.kmock(cls=Emulator)


def _self_signed(directory: Path) -> Path:
    """tls.crt and tls.key for 127.0.0.1, as the chart's Secret provides them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvpool-webhook")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return directory / "tls.crt"


async def test_webhook_serves_https_with_the_given_certificate(kmock: Any, tmp_path: Path) -> None:
    ca = _self_signed(tmp_path)
    cluster = cluster_on(kmock, https=True)
    tls = dataclasses.replace(cluster.options, webhook_insecure=False, webhook_cert_dir=tmp_path)
    async with cluster.running(tls):
        await cluster.create(pool_body())
        context = ssl.create_default_context(cafile=str(ca))
        pod = pod_body()
        # The pool reaches the webhook's index through the watch: wait for it.
        response = await cluster.admit("kvpool-inject", admission_review(pod, NAMESPACE),
                                       ssl_context=context, until=lambda r: r["allowed"])
        env = patched(pod, response)["spec"]["containers"][0]["env"]
        assert "KVPOOL_SOCKET" in {e["name"] for e in env}, env
