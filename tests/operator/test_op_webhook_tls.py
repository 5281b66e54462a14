"""The webhook as the API server reaches it: HTTPS with the certificate from --webhook-cert-dir."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import ipaddress
import json
import ssl
from pathlib import Path
from typing import Any

import pytest
from op_cluster import (
    Cluster,
    Emulator,
    admission_review,
    client_for_tests,
    declare_resources,
    free_port,
    options_for_tests,
)
from op_support import example

from kvpool.operator import api

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
    declare_resources(kmock)
    port = free_port()
    options = dataclasses.replace(
        options_for_tests(port), webhook_insecure=False, webhook_cert_dir=tmp_path
    )
    cluster = Cluster(
        emulator=kmock,
        kube=client_for_tests(str(kmock.url)),
        webhook_url=f"https://127.0.0.1:{port}",
    )
    cluster.start(options)
    try:
        await cluster.wait_ready()
        await cluster.create(
            example("pool-minimal.yaml", api.POOL_KIND)
            | {"metadata": {"name": "small", "namespace": "inference"}}
        )
        context = ssl.create_default_context(cafile=str(ca))
        pod = example("pod.yaml", "Pod")
        pod["metadata"]["annotations"] = {"kvpool.io/pool": "small"}
        # The pool reaches the webhook's index through the watch: wait for it.
        response = await cluster.admit("kvpool-inject", admission_review(pod, "inference"),
                                       ssl_context=context, until=lambda r: r["allowed"])
        ops = json.loads(base64.b64decode(response["patch"]))
        env_ops = [op for op in ops if op["path"].startswith("/spec/containers/0/env")]
        assert env_ops, ops
    finally:
        await cluster.shutdown()
