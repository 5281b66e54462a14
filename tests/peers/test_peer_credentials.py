"""The pool's secret and TLS files change under running agents, as a projected volume's do
when the kubelet updates them from their Secrets: a renewed certificate (a new CA too) is
taken for the next connections without a restart, a file that does not load changes
nothing, and an agent that took a rotated secret still reads from agents not updated yet
for its grace, then cuts off whoever only knows the old one (docs/cross-node.md,
"Rotating the secret and renewing certificates")."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
from contextlib import ExitStack
from pathlib import Path

import pytest
from cryptography import x509

from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import ConfigError, Peers, PeerTls
from kvpool.agent.peers import auth, wire
from kvpool.agent.peers.credentials import Credentials
from kvpool.bench.certs import make_ca
from kvpool.bench.local import LocalAgent

from .conftest import metric, wait_until
from .nodes import PEER_PORT, Network, peer_agent
from .test_peer_reads import peer_of, seen_as, start

GRACE = 8.0
"""Node 0's `peers.secretGrace` in the rotation test: the previous secret accepted for 8 s
(long enough for another agent's start and a read from it on a loaded machine)."""


def projected(directory: Path, version: str, files: dict[str, Path]) -> None:
    """Write `files` (name -> source) into `directory` as the kubelet writes a projected
    volume: each name a link into `..data`, itself a link to this version's directory,
    switched in one rename."""
    directory.mkdir(exist_ok=True)
    target = directory / f"..{version}"
    target.mkdir()
    for name, source in files.items():
        shutil.copyfile(source, target / name)
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(Path("..data") / name)
    (directory / "..data.new").symlink_to(target.name)
    os.replace(directory / "..data.new", directory / "..data")


def tls_files(made: dict[str, str]) -> dict[str, Path]:
    return {Path(made[k]).name: Path(made[k]) for k in ("certFile", "keyFile", "caFile")}


def peer_tls(directory: Path) -> dict[str, str]:
    return {"certFile": str(directory / "tls.crt"), "keyFile": str(directory / "tls.key"),
            "caFile": str(directory / "ca.crt")}


def not_after(made: dict[str, str]) -> float:
    """When the certificate of these files expires, as Unix time."""
    cert = x509.load_pem_x509_certificate(Path(made["certFile"]).read_bytes())
    return cert.not_valid_after_utc.timestamp()


def expiry(agent: LocalAgent) -> float:
    """When the agent says the certificate it uses expires."""
    return metric(agent, "kvpool_peer_tls_certificate_expiry_timestamp_seconds")


def served_over_tls(host: str, made: dict[str, str]) -> bool:
    """Whether the agent at `host` takes a TLS connection made with these files (its
    certificate signed by the CA they trust, theirs by the CA it trusts): it answers a
    peer HELLO over it."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=made["caFile"])
    ctx.load_cert_chain(made["certFile"], made["keyFile"])
    ctx.check_hostname = False
    try:
        with socket.create_connection((host, PEER_PORT), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(auth.hello(os.urandom(16), auth.nonce()))
            return len(s.recv(wire.HELLO.size)) > 0
    except (OSError, ssl.SSLError):
        return False


def test_renewed_tls_files_are_taken_by_running_agents_and_a_bad_renewal_changes_nothing(
        net: Network, tmp_path: Path, secret: Path) -> None:
    one = make_ca(tmp_path / "ca-one", "pool CA one")
    two = make_ca(tmp_path / "ca-two", "pool CA two", days=2)  # (a later expiry)
    pool = tmp_path / "pool-tls"  # nodes 0 and 1 mount it
    projected(pool, "v1", tls_files(one))
    with ExitStack() as stack:
        (a, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False,
                                 prefetch=False, extra={"tls": peer_tls(pool)})
        # Node 2 already has the certificate of the pool's next CA.
        c = stack.enter_context(peer_agent(net, 2, tmp_path / "node2", secret, nvme=False,
                                           prefetch=False, extra={"tls": two}))
        cc = stack.enter_context(KVPoolClient(c.socket_path))
        key, data = os.urandom(16), os.urandom(2 << 20)
        assert ca.put(key, data, b"meta")
        seen_as(cb, [key], ["peer"])
        assert cb.get_with_meta(key) == (data, b"meta")
        assert expiry(a) == not_after(one)
        wait_until(lambda: "CERTIFICATE" in c.log(), "node 2 to refuse node 0's certificate")
        assert cc.lookup_tiers([key]) == []

        # The pool's Secret renewed with the next CA: nodes 0 and 1 take it running.
        projected(pool, "v2", tls_files(two))
        for agent in (a, b):
            wait_until(lambda agent=agent: metric(
                agent, "kvpool_peer_credential_reloads_total", what="tls", result="ok") == 1,
                "nodes 0 and 1 to take the renewed files")
        seen_as(cc, [key], ["peer"])
        assert cc.get_with_meta(key) == (data, b"meta")
        assert expiry(a) == expiry(b) == not_after(two) != not_after(one)
        key2, data2 = os.urandom(16), os.urandom(1 << 20)
        assert ca.put(key2, data2)
        seen_as(cb, [key2], ["peer"])
        assert cb.get(key2) == data2
        assert not served_over_tls(net.nodes[0].addr, one)

        # A renewal whose key is not its certificate's: refused, the certificate in use
        # stays, and new connections still take it.
        wrong = tls_files(two) | {"tls.key": Path(one["keyFile"])}
        projected(pool, "v3", wrong)
        wait_until(lambda: metric(a, "kvpool_peer_credential_reloads_total", what="tls",
                                  result="error") == 1, "node 0 to refuse the files")
        assert "do not load, the certificate in use stays" in a.log()
        assert expiry(a) == not_after(two)
        assert served_over_tls(net.nodes[0].addr, two)
        key3, data3 = os.urandom(16), os.urandom(1 << 20)
        assert ca.put(key3, data3)
        seen_as(cc, [key3], ["peer"])
        assert cc.get(key3) == data3


def server_proves(host: str, secrets: tuple[bytes, ...], answer: bool = True) -> bytes | None:
    """Which of `secrets` the agent at `host` proves to a new connection (None: none of
    them); with `answer`, the connection then answers with that secret and must be
    accepted."""
    with socket.create_connection((host, PEER_PORT), timeout=10) as s:
        mine, my_id = auth.nonce(), os.urandom(16)
        s.sendall(auth.hello(my_id, mine))
        theirs = b""
        while len(theirs) < wire.HELLO.size + wire.PROOF_BYTES:
            got = s.recv(wire.HELLO.size + wire.PROOF_BYTES - len(theirs))
            assert got, "the agent closed the connection before its proof"
            theirs += got
        server_id, server_nonce = auth.parse_hello(theirs[: wire.HELLO.size])
        try:
            secret = auth.proved(secrets, b"server", mine, server_nonce, my_id, server_id,
                                 theirs[wire.HELLO.size :])
        except auth.AuthError:
            return None
        if answer:
            s.sendall(auth.proof(secret, b"client", mine, server_nonce, my_id, server_id))
            assert s.recv(1) == wire.ACCEPTED
        return secret


def test_a_rotated_secret_still_lets_an_agent_read_from_those_not_updated_for_its_grace(
        net: Network, tmp_path: Path) -> None:
    old, new = os.urandom(32).hex().encode(), os.urandom(32).hex().encode()
    files = [tmp_path / f"secret{i}" for i in range(2)]  # each node's copy of the Secret
    for f in files:
        f.write_bytes(old)
    host0 = net.nodes[0].addr
    with ExitStack() as stack:
        a = stack.enter_context(peer_agent(net, 0, tmp_path / "node0", files[0], nvme=False,
                                           prefetch=False,
                                           extra={"secretGrace": f"{GRACE:g}s"}))
        ca = stack.enter_context(KVPoolClient(a.socket_path))
        b = peer_agent(net, 1, tmp_path / "node1", files[1], nvme=False, prefetch=False)
        stack.callback(b.stop)
        key, data = os.urandom(16), os.urandom(1 << 20)
        assert ca.put(key, data)

        # A secret too short to be one: refused, the one in use stays.
        files[0].write_bytes(b"short")
        wait_until(lambda: metric(a, "kvpool_peer_credential_reloads_total", what="secret",
                                  result="error") == 1, "node 0 to refuse the file")
        assert "cannot be used, the pool secret in use stays" in a.log()
        assert server_proves(host0, (old, new)) == old

        # Rotated on node 0's node first: node 0 proves the new secret at once, and reads
        # from node 1, started now with the old one only (a node the kubelet has not
        # updated yet); node 1 cannot check node 0's proof, so it reads nothing from it.
        files[0].write_bytes(new)
        wait_until(lambda: metric(a, "kvpool_peer_credential_reloads_total", what="secret",
                                  result="ok") == 1, "node 0 to take the new secret")
        assert server_proves(host0, (old, new)) == new
        b.start()
        cb = stack.enter_context(KVPoolClient(b.socket_path))
        key1, data1 = os.urandom(16), os.urandom(1 << 20)
        assert cb.put(key1, data1)
        seen_as(ca, [key1], ["peer"])
        assert ca.get(key1) == data1
        wait_until(lambda: metric(b, "kvpool_peer_auth_failures_total") > 0,
                   "node 1 to refuse node 0's proof")
        assert cb.lookup_tiers([key]) == []
        assert peer_of(cb, net.nodes[0])["state"] == "refused"  # (kvpool stats says so)

        # Once its grace is over, node 0 accepts the new secret only: its connections to
        # node 1 (proven with the old one) end, and node 1 is cut off.
        wait_until(lambda: "connections proven with a secret no longer accepted ended"
                   in a.log(), "node 0 to end the connections", timeout=4 * GRACE)
        wait_until(lambda: metric(a, "kvpool_peer_up") == 0, "node 0 to lose node 1")
        assert metric(a, "kvpool_peer_directory_entries") == 0
        wait_until(lambda: metric(a, "kvpool_peer_auth_failures_total") > 0,
                   "node 0 to refuse node 1's proof")
        wait_until(lambda: peer_of(ca, net.nodes[1])["state"] == "refused",
                   "node 0's STATS to say node 1 refused")
        assert a.log().count(f"peer {net.nodes[1].addr}:{PEER_PORT} refused") == 1  # once

        # Node 1's copy updated at last: they are a pool again, both ways.
        files[1].write_bytes(new)
        seen_as(cb, [key], ["peer"])
        assert cb.get(key) == data
        key2, data2 = os.urandom(16), os.urandom(1 << 20)
        assert cb.put(key2, data2)
        seen_as(ca, [key2], ["peer"])
        assert ca.get(key2) == data2
        assert peer_of(ca, net.nodes[1])["state"] == peer_of(cb, net.nodes[0])["state"] == "ok"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_previous_secret_is_accepted_for_the_grace_then_its_connections_end(
        tmp_path: Path) -> None:
    path, clock = tmp_path / "secret", Clock()
    s1, s2, s3 = (os.urandom(32).hex().encode() for _ in range(3))
    path.write_bytes(s1)
    creds = Credentials(Peers(enabled=True, secret_file=path, secret_grace=10), clock=clock)
    assert (creds.secret, creds.accepted(), creds.refresh()) == (s1, (s1,), False)
    path.write_bytes(s2)
    assert creds.refresh() is False  # nothing stops being accepted at a rotation
    assert (creds.secret, creds.accepted()) == (s2, (s2, s1))
    clock.now += 9
    assert creds.refresh() is False and not creds.stale(s1)
    clock.now += 1
    assert creds.refresh() is True  # the grace is over: connections proven with s1 end
    assert (creds.secret, creds.accepted()) == (s2, (s2,))
    assert creds.stale(s1) and not creds.stale(s2)
    assert creds.refresh() is False

    # Rotated again within a grace: the secret before the last stops being accepted.
    path.write_bytes(s3)
    creds.refresh()
    clock.now += 1
    path.write_bytes(s1)
    assert creds.refresh() is True
    assert (creds.secret, creds.accepted()) == (s1, (s1, s3))
    assert creds.stale(s2)


def test_a_secret_file_that_goes_or_only_gains_whitespace_changes_nothing(
        tmp_path: Path) -> None:
    path = tmp_path / "secret"
    s1 = os.urandom(32).hex().encode()
    path.write_bytes(s1)
    creds = Credentials(Peers(enabled=True, secret_file=path))
    path.write_bytes(s1 + b"\n")  # surrounding whitespace is not part of it
    assert creds.refresh() is False and creds.accepted() == (s1,)
    path.unlink()  # a file gone meanwhile: the secret in use stays
    assert creds.refresh() is False and creds.accepted() == (s1,)


def test_files_that_do_not_load_at_the_start_are_a_config_error_naming_them(
        tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"too short")
    with pytest.raises(ConfigError, match=r"peers.secretFile: .*short: a pool secret needs "
                       r"at least 16 bytes, it holds 9"):
        Credentials(Peers(enabled=True, secret_file=short))
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    made = make_ca(tmp_path / "ca", "pool CA")
    tls = PeerTls(cert_file=tmp_path / "missing.crt", key_file=Path(made["keyFile"]),
                  ca_file=Path(made["caFile"]))
    with pytest.raises(ConfigError, match=r"peers.tls: .*missing.crt: No such file"):
        Credentials(Peers(enabled=True, secret_file=secret, tls=tls))
    wrong = make_ca(tmp_path / "other", "another CA")
    tls = PeerTls(cert_file=Path(made["certFile"]), key_file=Path(wrong["keyFile"]),
                  ca_file=Path(made["caFile"]))
    with pytest.raises(ConfigError, match=r"peers.tls: .*KEY_VALUES_MISMATCH"):
        Credentials(Peers(enabled=True, secret_file=secret, tls=tls))
