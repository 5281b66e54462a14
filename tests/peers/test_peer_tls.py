"""TLS between agents (`peers.tls`): chunks move encrypted between agents whose certificates
the pool's CA signed; a plain connection, or an agent of another CA, gets nothing."""

from __future__ import annotations

import datetime
import os
import socket
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.agent.peers import auth

from .conftest import metric, wait_until
from .nodes import PEER_PORT, Network, peer_agent
from .test_peer_reads import seen_as, start


def make_ca(directory: Path, name: str) -> dict[str, str]:
    """A CA and one agent certificate it signs (every agent of the test uses it): the
    `peers.tls` files."""
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
                .not_valid_after(now + datetime.timedelta(days=1))
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


def test_agents_of_one_ca_read_each_others_chunks_over_tls_and_no_one_else_does(
        net: Network, tmp_path: Path, secret: Path) -> None:
    tls = make_ca(tmp_path / "pool-ca", "kvpool pool CA")
    stranger = make_ca(tmp_path / "other-ca", "another CA")
    with ExitStack() as stack:
        (_, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False,
                                 prefetch=False, extra={"tls": tls})
        # Node 2 knows the secret but its certificate is of another CA.
        c = stack.enter_context(peer_agent(net, 2, tmp_path / "node2", secret, nvme=False,
                                           extra={"tls": stranger}))
        cc = stack.enter_context(KVPoolClient(c.socket_path))
        key, data = os.urandom(16), os.urandom(3 << 20)
        assert ca.put(key, data, b"meta")
        seen_as(cb, [key], ["peer"])
        assert cb.get_with_meta(key) == (data, b"meta")
        assert metric(b, "kvpool_peer_bytes_total", direction="read") == len(data)
        # A plain peer HELLO is not TLS: closed without a word.
        with socket.create_connection((net.nodes[0].addr, PEER_PORT), timeout=30) as s:
            s.sendall(auth.hello(os.urandom(16), auth.nonce()))
            assert s.recv(1024) == b""
        peer0 = f"{net.nodes[0].addr}:{PEER_PORT}"
        wait_until(lambda: f"peer {peer0} unreachable" in c.log() and "CERTIFICATE" in c.log(),
                   "node 2 to refuse node 0's certificate")
        assert cc.lookup_tiers([key]) == []
        assert metric(c, "kvpool_peer_directory_entries") == 0
        assert metric(c, "kvpool_peer_up") == 0
