"""Peer part of `kvpool bench`: the peer tier between two nodes (network namespaces joined
by veth pairs on a bridge, `netns`; root only), every figure against its baseline in the
same run.

- reads: chunks of 1 MiB and 16 MiB stored on node 0 and read on node 1 through both
  agents, as an engine reads a prefix: a LOOKUP of the round's keys, then
  `KVPoolClient.get_into` of each in turn on node 1 (its agent fetches the chunk from node
  0's into its arena, with the peer chunks that follow it in the LOOKUP in the same
  pipelined batch, verifies each, and the client copies it out); and the same with one
  `get_many_into` of the round's keys (one window, as an engine's connector loads a
  prefix); against a raw TCP stream of the same bytes from node 0's namespace to node
  1's (`rawtcp`). Node 1's client reads as the vLLM connector does (`clients`):
  without a lease, the peer chunks waited for with WAIT as they land; `KVPOOL_LEASE_FREE=0`
  reads them through ACQUIREs instead. Every chunk read is compared with what was stored:
  a wrong byte stops the bench.
- lookup: a 128-key LOOKUP on node 1 whose keys are all remote, with 10^6 remote entries
  in its directory (10^5 with --quick), over the socket and from shared memory (a client
  with `local_lookup`: the agent's peer table, no round trip), against the same LOOKUP of
  128 keys in node 1's DRAM over the socket and a LOOKUP of one remote key over it (what
  any LOOKUP over the socket pays: the round trip and the agent's loop), the four taking
  turns. The entries come over the wire from a peer that only announces
  (`InventoryPeer`, in this process, on the bridge: an agent holding 10^6 chunks would
  need 10^6 arena pages); a FETCH from it is answered "absent".
- Both nodes' TCP congestion control is `reno` for the whole part (`CONGESTION_CONTROL`:
  the machine's `bbr` paced the veth links far below what they carry), reported as
  `congestion_control` (the suite moves it to `meta.peer_congestion_control`).
- tls: the 16 MiB reads in one window between two more agents, with TLS between them
  (`peers.tls`, a CA made for the run), against the plain ones of the same run.
- propagation: seconds from a PUT on node 0 returning to node 1's LOOKUP counting the
  chunk (the announcement's way through node 0's subscription to node 1's directory).
- directory: node 1's resident memory grown by the 10^6 announced entries, per entry: its
  heap (resident less shared) and, apart, the shared-memory peer table its clients read.

- handoff: seconds from a put of a 16 MiB chunk on node 0 naming node 1 (`to`) to node
  1's LOOKUP counting it in its own DRAM (pushed after the COMMIT, read by node 1's agent
  from node 0's, verified, pinned), against the same put without the hint until node 1's
  client has the bytes by key (the announcement, then a read through the peer tier).
  Every chunk is read back on node 1 and compared.
- handoff window: seconds from one `put_many` on node 0 of a window of chunks naming node 1
  (what a prefill engine's connector saves of one request) to node 1's LOOKUP counting
  every one of them in its own DRAM (`handoff_window`: 16 chunks of 1 to 4 MiB;
  `handoff_small_window`: 64 of 64 KiB, where per-chunk round trips weigh most); each is
  read back and compared.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import psutil

from kvpool.agent import lookupkernel
from kvpool.agent.client import KVPoolClient, env_flag
from kvpool.agent.constants import ENV_LEASE_FREE
from kvpool.agent.peers import wire

from .certs import make_ca
from .control import sample
from .local import LocalAgent
from .netns import PEER_PORT, Network, Node, peer_agent
from .scripted_peer import ScriptedPeer, next_request
from .stats import MiB, percentile

TLS_PORT = PEER_PORT + 1
"""The TLS pair's peer port (the plain pair keeps theirs)."""
LOOKUP_KEYS = 128
PROPAGATION_CHUNK = 4096
SMALL_READS = {False: 64, True: 16}
"""1 MiB chunks read per round (full, --quick)."""
LARGE_READS = {False: 16, True: 4}
"""16 MiB chunks read per round."""
REMOTE_ENTRIES = {False: 10**6, True: 10**5}
PROPAGATIONS = {False: 200, True: 20}
LOOKUPS = {False: 10000, True: 1000}
LOOKUP_ROUNDS = 10
"""The LOOKUP samples of each column come in this many rounds, the columns taking turns."""
HANDOFF_CHUNK = 16 * MiB
HANDOFFS = {False: 20, True: 4}
WINDOW_SIZES = [1 * MiB, 2 * MiB, 3 * MiB, 4 * MiB] * 4
"""The hand-off window's chunks: 16, 40 MiB in all."""
SMALL_WINDOW_SIZES = [64 << 10] * 64
"""The small hand-off window's chunks: 64, 4 MiB in all."""
WINDOWS = {False: 10, True: 2}
HANDOFF_SHARE = 0.5
"""The agents' `peers.handoffShare`: a whole window pinned unread fits their quota."""
POLL = 0.0005
"""Seconds between a hand-off sample's questions to node 1 (both columns alike)."""
CONGESTION_CONTROL = "reno"
"""TCP congestion control in the nodes' namespaces, for the agents and the raw baseline
alike. A namespace inherits the machine's, and `bbr` (a common default) paces each socket
by its estimate of the link's bandwidth, which the veth pairs' reordering (spurious
retransmissions, every one DSACKed) knocks down to a few Mbit/s at times: raw TCP then ran
at ~1.7 GB/s where the same veths carry ~6 GB/s without pacing, and a hand-off stalled
40-70 ms at random (docs/benchmarks.md). `reno` is built into every kernel and allowed in
a namespace; a bench that compares against the link measures the link, not the pacing."""


def size_name(size: int) -> str:
    return f"{size // MiB}MiB"


class InventoryPeer(ScriptedPeer):
    """A peer of the pool that holds nothing but announces `count` keys of `size` bytes:
    it proves the pool's secret like an agent, and on SUBSCRIBE sends an empty inventory,
    then, on `announce`, the keys as changes (ADD messages of `wire.MAX_RECORDS`), then
    heartbeats. A FETCH is answered "absent"."""

    def __init__(self, host: str, secret: bytes, keys: bytes, size: int) -> None:
        self.keys, self.size = keys, size
        self.go = threading.Event()
        super().__init__(host, secret)

    def announce(self) -> None:
        self.go.set()

    def speak(self, conn: socket.socket) -> None:
        while not self.closed:
            op, rid, _ = next_request(conn)
            if op == wire.OP_SUBSCRIBE:
                self._stream(conn)
                return
            conn.sendall(wire.encode_reply(wire.ABSENT, rid))

    def _stream(self, conn: socket.socket) -> None:
        conn.sendall(wire.encode_stream(wire.BEGIN, "", sent_at=time.time())
                     + wire.encode_stream(wire.SYNCED, sent_at=time.time()))
        while not self.go.wait(0.25):
            conn.sendall(wire.encode_stream(wire.HEARTBEAT, sent_at=time.time()))
        step = 16 * wire.MAX_RECORDS
        for start in range(0, len(self.keys), step):
            block = self.keys[start : start + step]
            conn.sendall(wire.encode_stream(wire.ADD, "", [
                (block[i : i + 16], self.size) for i in range(0, len(block), 16)], time.time()))
        while not self.closed:
            time.sleep(0.25)
            conn.sendall(wire.encode_stream(wire.HEARTBEAT, sent_at=time.time()))


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"peer bench: no {what} within {timeout:.0f} s")
        time.sleep(0.005)


def in_node(node: Node, *cmd: str) -> list[str]:
    """The command line that runs `cmd` in the node's namespace."""
    return ["ip", "netns", "exec", node.ns, *cmd]


def congestion_control(net: Network, name: str) -> str:
    """Set the nodes' TCP congestion control (before any of their sockets is made); what
    their namespaces say it is now."""
    said = set()
    for node in net.nodes:
        subprocess.run(in_node(node, "sysctl", "-qw",
                               f"net.ipv4.tcp_congestion_control={name}"),
                       check=True, capture_output=True)
        said.add(subprocess.run(in_node(node, "sysctl", "-n",
                                        "net.ipv4.tcp_congestion_control"),
                                check=True, capture_output=True, text=True).stdout.strip())
    return ",".join(sorted(said))


def raw_sender(node: Node, stack: contextlib.ExitStack) -> tuple[str, int]:
    """Start the raw TCP baseline's sender in `node`'s namespace, ended with `stack`; the
    address it listens on."""
    sender = subprocess.Popen(in_node(node, sys.executable, "-m", "kvpool.bench.rawtcp",
                                      "send", node.addr),
                              stdout=subprocess.PIPE, text=True)
    stack.callback(sender.wait, 30)
    stack.callback(sender.kill)
    assert sender.stdout is not None
    return node.addr, int(sender.stdout.readline())


def raw_tcp(sender: tuple[str, int], node: Node, size: int, count: int) -> float:
    """Seconds node's namespace takes to receive `count` chunks of `size` bytes from the
    raw sender."""
    return raw_tcp_cpu(sender, node, size, count)[0]


def raw_tcp_cpu(sender: tuple[str, int], node: Node, size: int, count: int,
                sendfile: bool = False) -> tuple[float, float]:
    """`raw_tcp`'s seconds, and the CPU seconds the receiving thread spent meanwhile;
    `sendfile`: the sender sends by `sendfile` from a shared-memory file, as a holding
    agent does (`rawtcp`)."""
    out = subprocess.run(in_node(node, sys.executable, "-m", "kvpool.bench.rawtcp", "recv",
                                 sender[0], str(sender[1]), str(size), str(count),
                                 *(["sendfile"] if sendfile else [])),
                         capture_output=True, text=True, timeout=300, check=True)
    seconds, cpu = out.stdout.split()[-2:]
    return float(seconds), float(cpu)


class RoundWatch(Protocol):
    """What a driver of `peer_reads` sees of each round (the warm-up round too): `begin`
    just before the round's clock starts, `copy(i)` when the client has chunk i's reply in
    a window and asks for its buffer (it copies the chunk next), `end` once the round's
    reads are done, before any check."""

    def begin(self) -> None: ...

    def copy(self, i: int) -> None: ...

    def end(self) -> None: ...


def clients(stack: contextlib.ExitStack, agents: list[LocalAgent]
            ) -> tuple[KVPoolClient, KVPoolClient]:
    """Clients of node 0's agent (the holder's) and node 1's (the reader's). The reader's
    reads DRAM chunks without a lease, as the vLLM connector does (and so waits for peer
    chunks with WAIT, docs/protocol.md), unless `$KVPOOL_LEASE_FREE` says no."""
    holder, reader = agents
    return (stack.enter_context(KVPoolClient(holder.socket_path)),
            stack.enter_context(KVPoolClient(
                reader.socket_path, lease_free=env_flag(ENV_LEASE_FREE, True))))


def peer_reads(holder: KVPoolClient, reader: KVPoolClient, size: int, count: int,
               reps: int, many: bool = False,
               watch: RoundWatch | None = None) -> tuple[list[float], int]:
    """Seconds per round of reading `count` chunks of `size` bytes stored on the holder
    through the reader's agent (each round reads them from the peer again: the reader
    deletes its copies between rounds), and the bytes read and found equal to what was
    stored (every read is compared; a wrong byte stops the bench). `watch`: told of each
    round (`benchmarks/peer_window.py`)."""
    rng = random.Random(size * 2 + many)
    keys = [rng.randbytes(16) for _ in range(count)]
    data = [rng.randbytes(size) for _ in range(count)]
    for k, d in zip(keys, data, strict=True):
        if not holder.put(k, d):
            raise RuntimeError("peer bench: the holder refused a chunk")
    bufs = [bytearray(size) for _ in range(count)]
    _wait(lambda: reader.lookup_tiers(keys) == ["peer"] * count, "announcement of the chunks")
    times, verified = [], 0

    def target(i: int, n: int, meta: bytes) -> bytearray:
        if watch is not None:
            watch.copy(i)
        return bufs[i]

    for _ in range(reps + 1):  # the first round warms the connections up
        if watch is not None:
            watch.begin()
        start = time.perf_counter()
        found = reader.lookup_tiers(keys)  # as an engine asks before it reads
        if many:  # one window of ACQUIREs, as an engine's connector loads a prefix
            got = reader.get_many_into(keys, target)
        else:
            got = [reader.get_into(k, b) for k, b in zip(keys, bufs, strict=True)]
        times.append(time.perf_counter() - start)
        if watch is not None:
            watch.end()
        if found != ["peer"] * count:
            raise RuntimeError(f"peer bench: LOOKUP found {found}")
        if got != [size] * count:
            raise RuntimeError(f"peer bench: reads of {size} B chunks from the peer gave "
                               f"{got}")
        if any(b != d for b, d in zip(bufs, data, strict=True)):
            raise RuntimeError(f"peer bench: a {size} B chunk read from the peer differs "
                               "from what was stored")
        verified += size * count
        for k in keys:
            reader.delete(k, local=True)  # node 1's copies only: node 0 keeps its own
        _wait(lambda: reader.lookup_tiers(keys) == ["peer"] * count, "the reader's delete")
    for k in keys:
        holder.delete(k)
    return times[1:], verified


def propagation(holder: KVPoolClient, reader: KVPoolClient, n: int) -> list[float]:
    """Seconds from a PUT on the holder returning to the reader's LOOKUP counting it."""
    out = []
    data = os.urandom(PROPAGATION_CHUNK)
    for _ in range(n):
        key = os.urandom(16)
        holder.put(key, data)
        start = time.perf_counter()
        deadline = start + 30
        while reader.lookup_tiers([key]) != ["peer"]:
            if time.perf_counter() > deadline:
                raise RuntimeError("peer bench: a chunk's announcement took over 30 s")
        out.append(time.perf_counter() - start)
        holder.delete(key)
    return out


def handoff(holder: KVPoolClient, reader: KVPoolClient, to: str,
            n: int) -> tuple[list[float], list[float], int]:
    """(pushed, pulled, bytes verified): seconds from a put of a `HANDOFF_CHUNK` chunk on
    the holder naming the reader's node `to` to the reader's LOOKUP counting it in its DRAM;
    and from the same put without the hint to the reader's client holding its bytes, read
    by key through the peer tier. Each chunk is read back on the reader and compared."""
    data = os.urandom(HANDOFF_CHUNK)
    buf = bytearray(HANDOFF_CHUNK)
    pushed: list[float] = []
    pulled: list[float] = []
    verified = 0

    def check(key: bytes) -> int:
        if reader.get_into(key, buf) != HANDOFF_CHUNK or buf != data:
            raise RuntimeError("peer bench: a handed-off chunk read on node 1 differs from "
                               "what was put on node 0")
        reader.delete(key)
        holder.delete(key)
        return HANDOFF_CHUNK

    for _ in range(n):
        key = os.urandom(16)
        start = time.perf_counter()
        holder.put(key, data, to=to)
        deadline = start + 30
        while reader.lookup_tiers([key]) != ["dram"]:
            if time.perf_counter() > deadline:
                raise RuntimeError("peer bench: a hand-off took over 30 s")
            time.sleep(POLL)  # asking without a pause would take the receiving agent's CPU
        pushed.append(time.perf_counter() - start)
        verified += check(key)
        key = os.urandom(16)
        start = time.perf_counter()
        holder.put(key, data)
        deadline = start + 30
        while reader.get_into(key, buf) != HANDOFF_CHUNK:
            if time.perf_counter() > deadline:
                raise RuntimeError("peer bench: a chunk put on node 0 was not readable on "
                                   "node 1 within 30 s")
            time.sleep(POLL)
        pulled.append(time.perf_counter() - start)
        verified += check(key)
    return pushed, pulled, verified


def handoff_window(holder: KVPoolClient, reader: KVPoolClient, to: str, n: int,
                   sizes: list[int]) -> tuple[list[float], int]:
    """(seconds, bytes verified): from one `put_many` on the holder of chunks of `sizes`
    naming the reader's node `to` to the reader's LOOKUP counting them all in its DRAM, `n`
    times; each chunk is then read on the reader and compared."""
    rng = random.Random(29)
    data = [rng.randbytes(size) for size in sizes]
    times: list[float] = []
    verified = 0
    for _ in range(n):
        keys = [os.urandom(16) for _ in data]
        start = time.perf_counter()
        holder.put_many(keys, data, to=to)
        deadline = start + 60
        while reader.lookup_tiers(keys) != ["dram"] * len(keys):
            if time.perf_counter() > deadline:
                raise RuntimeError("peer bench: a hand-off window took over 60 s")
            time.sleep(POLL)
        times.append(time.perf_counter() - start)
        for k, d in zip(keys, data, strict=True):
            if reader.get(k) != d:
                raise RuntimeError("peer bench: a chunk of a hand-off window read on node 1 "
                                   "differs from what was put on node 0")
            verified += len(d)
            reader.delete(k)
            holder.delete(k)
    return times, verified


def run_peer(quick: bool, reps: int) -> dict[str, Any]:
    sizes = {1 * MiB: SMALL_READS[quick], 16 * MiB: LARGE_READS[quick]}
    entries = REMOTE_ENTRIES[quick]
    dram = max(s * n for s, n in sizes.items()) * 2 + 16 * MiB
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-peer-bench-") as tmpdir, \
            Network(2) as net, contextlib.ExitStack() as stack:
        result["congestion_control"] = congestion_control(net, CONGESTION_CONTROL)  # a word
        tmp = Path(tmpdir)
        secret = tmp / "secret"
        secret.write_bytes(os.urandom(32).hex().encode())
        keys = random.Random(7).randbytes(16 * entries)
        fake = InventoryPeer(net.host, secret.read_bytes(), keys, 1 * MiB)
        stack.callback(fake.close)
        agents = [stack.enter_context(peer_agent(
            net, i, tmp / f"node{i}", secret, nvme=False, dram=str(dram), prefetch=False,
            named=True, extra={"addresses": [f"{net.nodes[1 - i].addr}:{PEER_PORT}",
                                             f"{net.host}:{fake.port}"],
                               "handoffShare": HANDOFF_SHARE})) for i in range(2)]
        holder, reader = clients(stack, agents)
        raw_at = raw_sender(net.nodes[0], stack)

        result["sizes"] = {}
        for size, count in sizes.items():
            raw = [raw_tcp(raw_at, net.nodes[1], size, count) for _ in range(reps)]
            peer, verified = peer_reads(holder, reader, size, count, reps)
            batch, verified_many = peer_reads(holder, reader, size, count, reps, many=True)
            total = size * count
            peer_gbps = total / percentile(peer, 50) / 1e9
            many_gbps = total / percentile(batch, 50) / 1e9
            raw_gbps = total / percentile(raw, 50) / 1e9
            result["sizes"][size_name(size)] = {
                "chunks": count, "peer_read_gbps": round(peer_gbps, 3),
                "peer_read_many_gbps": round(many_gbps, 3),
                "raw_tcp_gbps": round(raw_gbps, 3),
                "peer_vs_raw": round(peer_gbps / raw_gbps, 3),
                "peer_many_vs_raw": round(many_gbps / raw_gbps, 3),
                "bytes_verified": verified + verified_many}

        # The same 16 MiB reads between two agents with TLS on (their own peer port), as
        # one window each round: what encryption costs the best path.
        tls = make_ca(tmp / "pool-ca", "kvpool bench pool CA")
        secured = [stack.enter_context(peer_agent(
            net, i, tmp / f"tls{i}", secret, nvme=False, dram=str(dram), prefetch=False,
            extra={"port": TLS_PORT, "addresses": [f"{net.nodes[1 - i].addr}:{TLS_PORT}"],
                   "tls": tls})) for i in range(2)]
        tls_holder, tls_reader = clients(stack, secured)
        size, count = 16 * MiB, sizes[16 * MiB]
        over_tls, verified = peer_reads(tls_holder, tls_reader, size, count, reps, many=True)
        tls_gbps = size * count / percentile(over_tls, 50) / 1e9
        plain = result["sizes"][size_name(size)]["peer_read_many_gbps"]
        result["tls"] = {"chunk_bytes": size, "chunks": count,
                         "peer_read_many_gbps": round(tls_gbps, 3),
                         "vs_plain": round(tls_gbps / plain, 3), "bytes_verified": verified}
        for a in secured:
            a.stop()

        pushed, pulled, verified = handoff(holder, reader, "node1", HANDOFFS[quick])
        result["handoff"] = {"chunk_bytes": HANDOFF_CHUNK, "samples": len(pushed),
                             "p50_ms": round(percentile(pushed, 50) * 1e3, 2),
                             "p99_ms": round(percentile(pushed, 99) * 1e3, 2),
                             "pull_p50_ms": round(percentile(pulled, 50) * 1e3, 2),
                             "pull_p99_ms": round(percentile(pulled, 99) * 1e3, 2),
                             "bytes_verified": verified}
        for name, chunks in (("handoff_window", WINDOW_SIZES),
                             ("handoff_small_window", SMALL_WINDOW_SIZES)):
            window, verified = handoff_window(holder, reader, "node1", WINDOWS[quick], chunks)
            result[name] = {"chunks": len(chunks), "bytes": sum(chunks),
                            "samples": len(window),
                            "p50_ms": round(percentile(window, 50) * 1e3, 2),
                            "p99_ms": round(percentile(window, 99) * 1e3, 2),
                            "bytes_verified": verified}

        prop = propagation(holder, reader, PROPAGATIONS[quick])
        result["propagation"] = {"samples": len(prop),
                                 "p50_ms": round(percentile(prop, 50) * 1e3, 2),
                                 "p99_ms": round(percentile(prop, 99) * 1e3, 2)}

        proc = psutil.Process(agents[1].proc.pid if agents[1].proc else 0)
        before = proc.memory_info()
        fake.announce()
        _wait(lambda: reader.stats()["tiers"]["peer"]["chunks"] >= entries,
              f"{entries} remote entries in the directory", timeout=300)
        after = proc.memory_info()
        heap = (after.rss - after.shared) - (before.rss - before.shared)
        result["directory"] = {"remote_entries": entries,
                               "agent_rss_bytes_per_entry": round(heap / entries, 1),
                               "shared_bytes_per_entry": round(
                                   (after.shared - before.shared) / entries, 1)}
        remote = [keys[16 * i : 16 * i + 16] for i in range(LOOKUP_KEYS)]
        local = [os.urandom(16) for _ in range(LOOKUP_KEYS)]
        for k in local:
            reader.put(k, b"x" * PROPAGATION_CHUNK)
        path = str(agents[1].socket_path)
        # Interleaved in rounds, so that the machine's load weighs on each column alike.
        lookups: list[float] = []
        shm: list[float] = []
        baseline: list[float] = []
        one: list[float] = []
        if lookupkernel.kernels() is None:  # (compiled now, not during the samples)
            raise RuntimeError("peer bench: the local LOOKUP's compiled walk is missing")
        load = os.getloadavg()[0]
        each = LOOKUPS[quick] // LOOKUP_ROUNDS
        for _ in range(LOOKUP_ROUNDS):
            lookups += sample(path, "lookup", remote, each)
            shm += sample(path, "lookup_local", remote, each)
            baseline += sample(path, "lookup", local, each)
            one += sample(path, "lookup", remote[:1], each)
        result["lookup"] = {"keys": LOOKUP_KEYS, "remote_entries": entries,
                            "p50_us": round(percentile(lookups, 50) * 1e6, 1),
                            "p99_us": round(percentile(lookups, 99) * 1e6, 1),
                            "local_p50_us": round(percentile(shm, 50) * 1e6, 1),
                            "local_p99_us": round(percentile(shm, 99) * 1e6, 1),
                            "dram_p50_us": round(percentile(baseline, 50) * 1e6, 1),
                            "dram_p99_us": round(percentile(baseline, 99) * 1e6, 1),
                            "one_key_p50_us": round(percentile(one, 50) * 1e6, 1),
                            "one_key_p99_us": round(percentile(one, 99) * 1e6, 1),
                            "load_average": [round(load, 2), round(os.getloadavg()[0], 2)]}
    return result
