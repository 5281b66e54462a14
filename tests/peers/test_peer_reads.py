"""The peer tier across real nodes (network namespaces): a chunk stored on one node is read
on another, byte for byte, and every way a peer can fail ends in the shared tier or a
miss, never in wrong bytes or a wait past `peers.timeout`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from ..support import scrape
from .conftest import metric, wait_until
from .nodes import Network, in_ns, peer_agent

MiB = 1 << 20


def start(stack: ExitStack, net: Network, tmp: Path, secret: Path, n: int = 3,
          **kw: Any) -> list[tuple[LocalAgent, KVPoolClient]]:
    out = []
    for i in range(n):
        agent = stack.enter_context(peer_agent(net, i, tmp / f"node{i}", secret, **kw))
        out.append((agent, stack.enter_context(KVPoolClient(agent.socket_path))))
    return out


def seen_as(client: KVPoolClient, keys: list[bytes], tiers: list[str]) -> None:
    wait_until(lambda: client.lookup_tiers(keys) == tiers, f"LOOKUP to say {tiers}")


def nvme_file(agent: LocalAgent, key: bytes) -> Path:
    h = key.hex()
    return agent.workdir / "nvme" / h[:2] / f"{h}.kvc"


def test_a_chunk_stored_on_one_node_is_read_on_the_others_with_its_bytes(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        (a, ca), (b, cb), (c, cc) = start(stack, net, tmp_path, secret, dram="8Mi")
        # Six 1 MiB chunks and their metadata on node 0; with 8 MiB of DRAM and a 4 MiB
        # chunk after them, the first ones go down to node 0's NVMe.
        chunks = {os.urandom(16): (os.urandom(MiB - 1000 * i), f"m{i}".encode())
                  for i in range(6)}
        for key, (data, meta) in chunks.items():
            assert ca.put(key, data, meta)
        big = os.urandom(16)
        assert ca.put(big, os.urandom(4 * MiB))
        keys = list(chunks)
        wait_until(lambda: "nvme" in ca.lookup_tiers(keys), "a chunk demoted to NVMe")
        for client in (cb, cc):  # found whole: in the peer tier (or prefetched already)
            wait_until(lambda client=client: len(client.lookup_tiers(keys)) == len(keys),
                       "the chunks in the directory")
        # Node 2's LOOKUP loads the prefix's first chunks ahead (policy.prefetch): from
        # the peer, as reads would.
        wait_until(lambda: cc.lookup_tiers(keys)[:4] == ["dram"] * 4, "the prefetch")
        # Read on node 1 by GET (inline) and on node 2 by ACQUIRE (zero-copy)
        for key, (data, meta) in chunks.items():
            assert cb.get_with_meta(key) == (data, meta)
            out = bytearray(len(data))
            assert cc.get_into(key, out) == len(data) and out == data
        # Now local on the readers, and announced by them: node 0 sees them as theirs too.
        assert cb.lookup_tiers(keys) == ["dram"] * len(keys)
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="ok") == 6
        assert metric(b, "kvpool_peer_bytes_total", direction="read") == sum(
            len(d) for d, _ in chunks.values())
        # Each read one chunk once, from node 0 or from the other reader once that one
        # announced its copy.
        assert metric(c, "kvpool_peer_requests_total", direction="read", result="ok") == 6
        assert sum(metric(x, "kvpool_peer_requests_total", direction="served", result="ok")
                   for x in (a, b, c)) == 12
        assert metric(b, "kvpool_tier_hits_total", tier="peer") >= 6
        assert metric(b, "kvpool_peer_directory_entries") >= 7
        # No peers.maxEntries: no cap, and no gauge of one.
        assert not [s for s in scrape(b) if s.startswith("kvpool_peer_directory_capacity")]
        wait_until(lambda: metric(b, "kvpool_peer_up") == 2, "node 1 following both peers")
        assert cb.stats()["tiers"]["peer"]["chunks"] >= 7


def test_a_stale_entry_falls_back_to_the_shared_tier_then_to_a_miss(
        net: Network, tmp_path: Path, secret: Path) -> None:
    store = tmp_path / "g4"
    store.mkdir()
    with ExitStack() as stack:
        (a, ca), (b, cb), _ = start(stack, net, tmp_path, secret, dram="4Mi", shared=store,
                                    prefetch=False)
        on_g4, gone = os.urandom(16), os.urandom(16)
        data = {k: os.urandom(MiB) for k in (on_g4, gone)}
        for k in (on_g4, gone):
            assert ca.put(k, data[k])
        for _ in range(4):  # push both down to node 0's NVMe
            ca.put(os.urandom(16), os.urandom(MiB))
        wait_until(lambda: nvme_file(a, on_g4).exists() and nvme_file(a, gone).exists(),
                   "demotion")
        wait_until(lambda: len(list(store.rglob("*.kvc"))) >= 6, "write-through to G4")
        for path in store.rglob(f"{gone.hex()}*"):
            path.unlink()  # only node 0's NVMe file has it now
        seen_as(cb, [on_g4], ["peer"])
        seen_as(cb, [gone], ["peer"])
        # The holder loses both files behind its back: the directory is stale.
        nvme_file(a, on_g4).unlink()
        nvme_file(a, gone).unlink()
        assert cb.get(on_g4) == data[on_g4]  # from G4
        assert cb.get(gone) is None
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="absent") == 2
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="ok") == 0


def test_a_peer_killed_mid_transfer_is_a_miss_leaks_nothing_and_is_back_once_restarted(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        # A long timeout: the transfer is cut by the kill, not by the deadline.
        (a, ca), (b, cb), _ = start(stack, net, tmp_path, secret, timeout="120s", nvme=False,
                                    prefetch=False)
        key, data = os.urandom(16), os.urandom(4 * MiB)
        assert ca.put(key, data)
        seen_as(cb, [key], ["peer"])
        used = cb.stats()["tiers"]["dram"]["used_bytes"]
        # Node 0 sends at 8 Mbit/s: 4 MiB take seconds, and the kill lands in the middle.
        in_ns(net.nodes[0], "tc", "qdisc", "add", "dev", net.nodes[0].inner, "root", "tbf",
              "rate", "8mbit", "burst", "32kbit", "latency", "400ms")
        got: list[bytes | None] = []
        reader = threading.Thread(target=lambda: got.append(cb.get(key)))
        reader.start()

        def receiving() -> bool:
            out = in_ns(net.nodes[1], "ss", "-tin", "dst", f"{net.nodes[0].addr}:9410")
            return any(int(f.split(":")[1]) > 256 << 10 for f in out.split()
                       if f.startswith("bytes_received:"))
        wait_until(receiving, "the transfer under way")
        a.kill(signal.SIGKILL)
        reader.join(timeout=60)
        assert got == [None]
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="error") == 1
        assert cb.stats()["tiers"]["dram"]["used_bytes"] == used  # the extents came back
        assert cb.lookup_tiers([key]) == []  # node 0's entries went with it
        k2 = os.urandom(16)
        assert cb.put(k2, data) and cb.get(k2) == data
        # Node 0 restarts (warm: its arena kept the chunk): its inventory brings it back.
        in_ns(net.nodes[0], "tc", "qdisc", "del", "dev", net.nodes[0].inner, "root")
        a.start()
        seen_as(cb, [key], ["peer"])
        assert cb.get(key) == data


def test_a_peer_serving_corrupted_bytes_is_a_miss_counted_and_marked_suspect(
        net: Network, tmp_path: Path, secret: Path) -> None:
    with ExitStack() as stack:
        (a, ca), (b, cb), _ = start(stack, net, tmp_path, secret, nvme=False, prefetch=False)
        local = stack.enter_context(KVPoolClient(b.socket_path, local_lookup=True))
        key, other = os.urandom(16), os.urandom(16)
        data = os.urandom(256 << 10)
        assert ca.put(key, data) and ca.put(other, os.urandom(4096))
        seen_as(cb, [key, other], ["peer", "peer"])
        # A key node 1 holds itself, between two a peer holds, is its own DRAM's (and hit).
        mine = os.urandom(16)
        assert cb.put(mine, os.urandom(4096))
        hits = metric(b, "kvpool_tier_hits_total", tier="dram")
        assert cb.lookup_tiers([key, mine, other]) == ["peer", "dram", "peer"]
        assert metric(b, "kvpool_tier_hits_total", tier="dram") == hits + 1
        # (from shared memory alike: the hit told to the agent with the next call)
        assert local.lookup_tiers([key, mine, other]) == ["peer", "dram", "peer"]
        assert local.lookup_nowait([key, mine, other]) == 3
        local.stats()
        wait_until(lambda: metric(b, "kvpool_tier_hits_total", tier="dram") == hits + 3,
                   "the local LOOKUPs told to the agent")
        # Flip a byte of the chunk in node 0's arena: it sends what is there, unverified.
        arena = a.arena_path.read_bytes()
        at = arena.find(data[:4096])
        assert at >= 0
        fd = os.open(a.arena_path, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes([data[100] ^ 0xFF]), at + 100)
        finally:
            os.close(fd)
        # (Its LOOKUP alone last: the read takes no chunk after it along, which would go
        # on a connection of its own at the same time and could land before this one is
        # found corrupt, docs/cross-node.md#reads-in-batches.)
        assert cb.lookup_tiers([key]) == ["peer"]
        assert cb.get(key) is None
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="corrupt") == 1
        assert metric(b, "kvpool_peer_suspect_total") == 1
        # A suspect peer is not read from (nor counted by LOOKUP) for a while.
        assert cb.lookup_tiers([other]) == []
        assert cb.lookup_tiers([mine, other]) == ["dram"]
        assert local.lookup_nowait([mine, other]) == 1  # its clients' tables say so too
        assert cb.get(other) is None
        assert cb.stats()["tiers"]["dram"]["chunks"] == 1  # its own chunk alone


def peer_of(client: KVPoolClient, node: Any) -> dict[str, Any]:
    """What STATS says of the peer on `node`."""
    (found,) = [p for p in client.stats()["peers"] if p["peer"] == f"{node.addr}:9410"]
    return dict(found)


def test_a_stopped_peer_costs_a_read_its_timeout_then_a_miss(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """...and STATS (and `kvpool stats`) say it is slow meanwhile, and for how long."""
    with ExitStack() as stack:
        (a, ca), (b, cb), _ = start(stack, net, tmp_path, secret, nvme=False,
                                    timeout="500ms", prefetch=False)
        key, data = os.urandom(16), os.urandom(MiB)
        assert ca.put(key, data)
        seen_as(cb, [key], ["peer"])
        before = peer_of(cb, net.nodes[0])
        assert before["state"] == "ok" and before["chunks"] == 1
        assert before["bytes_per_second"] is None  # no batch read from it yet
        assert {p["peer"] for p in cb.stats()["peers"]} == \
            {f"{n.addr}:9410" for n in (net.nodes[0], net.nodes[2])}
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            assert cb.get(key) is None
            slow = peer_of(cb, net.nodes[0])
            assert slow["state"] == "slow" and 0 < slow["for_seconds"] <= 5
            shown = subprocess.run(
                [sys.executable, "-m", "kvpool.agent", "stats", "--socket", str(b.socket_path)],
                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                env={**os.environ, "COLUMNS": "200"})
            assert shown.returncode == 0, shown.stderr
            row = next(line for line in shown.stdout.splitlines() if net.nodes[0].addr in line)
            assert "slow (" in row and " 1 " in row, shown.stdout
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        assert metric(b, "kvpool_peer_requests_total", direction="read", result="timeout") == 1
        # The peer answers again: a fresh connection reads it.
        wait_until(lambda: cb.get(key) == data, "a read from the resumed peer")
        after = peer_of(cb, net.nodes[0])
        assert after["state"] == "ok" and after["bytes_per_second"] > 0


@pytest.mark.parametrize("lease_free", [False, True])
def test_a_stopped_peer_costs_a_window_one_timeout_then_its_reads_are_misses_at_once(
        net: Network, tmp_path: Path, secret: Path, lease_free: bool) -> None:
    """A read that timed out marks its peer slow for `SLOW_SECONDS`: the window's other
    reads of it go on at once (the shared tier, then a miss) instead of each starting a
    batch of the rest that waits `peers.timeout` again (a window of 8 keys took 33
    timeouts). A lease-free client waits with WAIT first, an ACQUIREs client reads under
    leases: one batch's reads time out either way."""
    with ExitStack() as stack:
        (a, ca), (b, cb), _ = start(stack, net, tmp_path, secret, nvme=False,
                                    timeout="500ms", prefetch=False)
        reader = stack.enter_context(KVPoolClient(b.socket_path, lease_free=lease_free))
        keys = [os.urandom(16) for _ in range(8)]
        data = [os.urandom(MiB) for _ in keys]
        ca.put_many(keys, data)
        seen_as(cb, keys, ["peer"] * len(keys))
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            assert reader.get_many_into(keys, lambda i, n, meta: bytearray(n)) == [0] * 8
            assert cb.lookup_tiers(keys) == []  # slow: not counted meanwhile
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        timeouts = metric(b, "kvpool_peer_requests_total", direction="read", result="timeout")
        assert timeouts == len(keys)  # the one batch of the first read, nothing after it
        assert "not read from for" in b.log()
        # Once the slow period is over the peer is read again, with its bytes.
        out = [bytearray(MiB) for _ in keys]
        wait_until(lambda: reader.get_many_into(keys, lambda i, n, meta: out[i]) == [MiB] * 8,
                   "the resumed peer read again")
        assert out == data


def test_batches_on_a_slow_link_are_sized_to_land_in_time(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """A link slower than a batch: node 0 sends at 200 Mbit/s, so 32 chunks of 1 MiB (~1.3
    s) cannot land within `peers.timeout` (1 s) in one batch. Node 1, which never read from
    it, reads a window whole: its link unmeasured, its batches start at 8 MiB (`LinkRate`).
    Node 2 read a window at full speed first: its first batch after the throttle is sized
    for that, and its tail times out. The peer kept answering meanwhile: it is not marked
    slow (its chunks stay readable), and node 2's next window comes whole, no read timing
    out, every byte right."""
    with ExitStack() as stack:
        (_, ca), (b, cb), (c, cc) = start(stack, net, tmp_path, secret, timeout="1s",
                                          nvme=False, prefetch=False, dram="160Mi")
        windows = [[os.urandom(16) for _ in range(32)] for _ in range(4)]
        data = {k: os.urandom(MiB) for w in windows for k in w}
        for w in windows:
            ca.put_many(w, [data[k] for k in w])
        for client in (cb, cc):
            for w in windows:  # (a LOOKUP each: a window's reads do not run on into the next)
                seen_as(client, w, ["peer"] * len(w))

        def timeouts(agent: LocalAgent) -> float:
            return metric(agent, "kvpool_peer_requests_total", direction="read",
                          result="timeout")

        def read(agent: LocalAgent, w: list[bytes], whole: bool = True) -> None:
            with KVPoolClient(agent.socket_path, lease_free=True) as reader:
                out = [bytearray(MiB) for _ in w]
                got = reader.get_many_into(w, lambda i, n, meta: out[i])
            if whole:
                assert got == [MiB] * len(w)
            assert [bytes(o) for o, n in zip(out, got, strict=True) if n] == \
                [data[k] for k, n in zip(w, got, strict=True) if n]

        read(c, windows[0])  # at full speed: node 2's link measured fast
        in_ns(net.nodes[0], "tc", "qdisc", "add", "dev", net.nodes[0].inner, "root", "tbf",
              "rate", "200mbit", "burst", "256kb", "latency", "400ms")
        read(b, windows[1])
        assert timeouts(b) == 0
        assert 0 < metric(b, "kvpool_peer_link_bytes_per_second") <= 200e6 / 8 * 1.1
        read(c, windows[2], whole=False)
        assert timeouts(c) > 0  # (a 32 MiB batch: past the timeout)
        assert "reads timed out on a slow link" in c.log()
        missed = timeouts(c)
        assert cc.lookup_tiers(windows[3]) == ["peer"] * 32  # still readable
        read(c, windows[3])
        assert timeouts(c) == missed
        for agent in (b, c):
            assert "not read from for" not in agent.log()  # the peer never marked slow


def test_a_node_with_live_links_stops_without_an_error_in_its_log(
        net: Network, tmp_path: Path, secret: Path) -> None:
    """The stop waits for the peer tier's tasks to end before the tables they write close:
    a link's task, cancelled, dropped its peer's entries after, and the agent logged its
    failure (a released memory's ValueError, a callback's traceback) at every stop."""
    with ExitStack() as stack:
        (a, ca), (b, cb) = start(stack, net, tmp_path, secret, n=2, nvme=False)
        key, data = os.urandom(16), os.urandom(MiB)
        assert ca.put(key, data)
        wait_until(lambda: cb.lookup_tiers([key]) == ["peer"], "the chunk in node 1's directory")
        assert cb.get(key) == data
    for agent in (a, b):
        assert agent.proc is not None and agent.proc.returncode == 0, agent.log()
        log = agent.log()
        assert "kvpool agent stopped" in log
        for sign in ("Traceback", "Exception in callback", "never retrieved", '"ERROR"'):
            assert sign not in log, log
