"""KV events stay per holder: a chunk read from a peer is announced by the node that now
holds it (in vLLM's event format, as routers read it)."""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvpool.agent.client import KVPoolClient
from kvpool.agent.events.identity import own_hash

from .nodes import Network, peer_agent
from .test_peer_reads import seen_as


def stored_hashes(sub: zmq.Socket[bytes], until: int, timeout: float = 30.0) -> set[int]:
    """Block hashes of the BlockStored events received until `until` is among them."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while until not in seen and time.monotonic() < deadline:
        if not sub.poll(100):
            continue
        parts = sub.recv_multipart()
        batch: Any = msgspec.msgpack.decode(parts[-1])
        for event in batch[1]:
            if isinstance(event, dict) and event.get("type") == "BlockStored":
                seen.update(event["block_hashes"])
    return seen


def test_a_chunk_read_from_a_peer_is_announced_by_the_node_that_now_holds_it(
        net: Network, tmp_path: Path, secret: Path) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    with ExitStack() as stack:
        stack.callback(ctx.term)
        a = stack.enter_context(peer_agent(net, 0, tmp_path / "node0", secret, nvme=False))
        b = stack.enter_context(peer_agent(net, 1, tmp_path / "node1", secret, nvme=False,
                                           prefetch=False,
                                           events={"enabled": True, "topic": "node",
                                                   "address": net.nodes[1].addr}))
        ca = stack.enter_context(KVPoolClient(a.socket_path))
        cb = stack.enter_context(KVPoolClient(b.socket_path))
        sub = ctx.socket(zmq.SUB)
        stack.callback(sub.close, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(f"tcp://{net.nodes[1].addr}:5557")
        # Node 1's own chunks reach the subscriber: it is listening.
        while True:
            mine = os.urandom(16)
            assert cb.put(mine, b"m" * 4096)
            if own_hash(mine) in stored_hashes(sub, own_hash(mine), timeout=2):
                break
        key, data = os.urandom(16), os.urandom(1 << 16)
        assert ca.put(key, data)
        seen_as(cb, [key], ["peer"])
        assert own_hash(key) not in stored_hashes(sub, own_hash(key), timeout=0.5)
        assert cb.get(key) == data
        assert own_hash(key) in stored_hashes(sub, own_hash(key))
