"""TLS between agents (`peers.tls`): chunks move encrypted between agents whose certificates
the pool's CA signed; a plain connection, or an agent of another CA, gets nothing."""

from __future__ import annotations

import os
import socket
from contextlib import ExitStack
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.agent.peers import auth
from kvpool.bench.certs import make_ca

from .conftest import metric, wait_until
from .nodes import PEER_PORT, Network, peer_agent
from .test_peer_reads import peer_of, seen_as, start


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
        wait_until(lambda: f"peer {peer0} refused: TLS:" in c.log() and "CERTIFICATE" in c.log(),
                   "node 2 to refuse node 0's certificate")
        assert peer_of(cc, net.nodes[0])["state"] == "refused"
        assert cc.lookup_tiers([key]) == []
        assert metric(c, "kvpool_peer_directory_entries") == 0
        assert metric(c, "kvpool_peer_up") == 0

