"""LOOKUP answered by the client from the DRAM index the agent publishes in shared memory."""

from __future__ import annotations

import errno
import mmap
import os
import random
import signal
import socket
import threading
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.agent import lookupkernel
from kvpool.agent import protocol as p
from kvpool.agent.client import AgentUnavailable, KVPoolClient
from kvpool.agent.constants import PEER_TIER_CODE
from kvpool.agent.lookupindex import Entries, IndexReader, SharedIndex
from kvpool.agent.transport import ZeroCopyTransport
from kvpool.bench.local import LocalAgent

from .conftest import scrape

CHUNK = 4096
ARENA = "1Mi"
"""256 chunks of a page: the writer below evicts all the time."""


@pytest.fixture(scope="module")
def small_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    with LocalAgent("--no-lock", workdir=tmp_path_factory.mktemp("lookupidx"),
                    dram=ARENA, start_timeout=60) as a:
        yield a


def _hello_fds(path: Path) -> list[int]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(path))
        s.sendall(p.encode(p.Hello(1, p.PROTOCOL_VERSION)))
        _, fds, _, _ = socket.recv_fds(s, 65536, 4)
    return fds


def test_index_fd_is_read_only_and_cannot_be_resized(small_agent: LocalAgent) -> None:
    fds = _hello_fds(small_agent.socket_path)
    try:
        assert len(fds) == 2, "HELLO carries the arena's fd and the lookup index's"
        index = fds[1]
        size = os.fstat(index).st_size
        for attempt in (lambda: os.write(index, b"x"), lambda: os.pwrite(index, b"x", 64),
                        lambda: os.ftruncate(index, size * 2),
                        lambda: os.ftruncate(index, 0),
                        lambda: mmap.mmap(index, size, flags=mmap.MAP_SHARED,
                                          prot=mmap.PROT_READ | mmap.PROT_WRITE)):
            with pytest.raises(PermissionError):
                attempt()
        # Reopening it writable through /proc gets past no seal either.
        again = os.open(f"/proc/self/fd/{index}", os.O_RDWR)
        try:
            with pytest.raises(OSError) as e:
                os.write(again, b"x")
            assert e.value.errno == errno.EPERM
        finally:
            os.close(again)
        assert os.fstat(index).st_size == size
        mmap.mmap(index, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ).close()
    finally:
        for fd in fds:
            os.close(fd)


LOOKUPS = 'kvpool_lookups_total{pool="default"}'


def test_local_lookup_is_on_by_the_environment_and_answers_while_the_agent_cannot(
        small_agent: LocalAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """Answered from shared memory with the agent stopped (SIGSTOP): no round trip. The
    agent still hears of each lookup afterwards, so its counts are as if asked."""
    key = b"env-local-lookup"
    with KVPoolClient(small_agent.socket_path) as c:
        assert c.put(key, bytes(CHUNK)) or c.contains(key)
    before = scrape(small_agent)[LOOKUPS]
    monkeypatch.setenv("KVPOOL_LOCAL_LOOKUP", "1")
    assert small_agent.proc is not None
    with KVPoolClient(small_agent.socket_path) as local:
        small_agent.proc.send_signal(signal.SIGSTOP)
        try:
            assert local.lookup_tiers([key]) == ["dram"]
            assert local.lookup([key, b"never-stored-key"]) == 1
        finally:
            small_agent.proc.send_signal(signal.SIGCONT)
        local.stats()  # a call: the lookups' replies are read before its own
    assert scrape(small_agent)[LOOKUPS] == before + 2, "the agent heard of both lookups"
    monkeypatch.delenv("KVPOOL_LOCAL_LOOKUP")
    with KVPoolClient(small_agent.socket_path) as remote:
        assert remote.lookup([key]) == 1
    assert scrape(small_agent)[LOOKUPS] == before + 3


def test_a_local_lookup_is_not_answered_from_the_tables_of_an_agent_that_died(
        tmp_path: Path) -> None:
    """SIGKILL: the dead agent's tables stay mapped in the client, but its end of the socket
    is closed, so the next lookup goes to the socket (and finds no agent) instead of
    counting chunks nobody serves: an engine recomputes instead of planning a load."""
    key = b"dead-agent-local"
    agent = LocalAgent("--no-lock", workdir=tmp_path, dram=ARENA).start()
    try:
        with KVPoolClient(agent.socket_path, local_lookup=True, reconnect_timeout=0.2) as c:
            assert c.put(key, bytes(CHUNK))
            assert c.lookup([key]) == 1
            agent.kill()
            with pytest.raises(AgentUnavailable):
                c.lookup([key])
    finally:
        agent.stop()


def test_a_local_lookup_keeps_its_chunks_in_the_eviction_order_as_an_asked_one_does(
        tmp_path: Path) -> None:
    """LRU DRAM of 256 pages: the oldest chunk, looked up locally, is the youngest after
    it, so filling the arena evicts the second oldest first, not it."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("tiers:\n  dram: {eviction: lru}\n")
    keys = [_key(10**6 + i) for i in range(200)]
    with LocalAgent("--no-lock", "--policy", str(policy), workdir=tmp_path, dram=ARENA,
                    start_timeout=60) as agent, \
            KVPoolClient(agent.socket_path, local_lookup=True) as c:
        for key in keys:
            assert c.put(key, bytes(CHUNK))
        assert c.lookup(keys[:1]) == 1  # answered locally; the agent refreshes it later
        more = [_key(2 * 10**6 + i) for i in range(100)]  # past 256 pages: evicts
        c.put_many(more, [bytes(CHUNK)] * len(more))
        with KVPoolClient(agent.socket_path) as remote:
            assert remote.lookup(keys[:1]) == 1, "the looked-up chunk was evicted"
            assert remote.lookup(keys[1:2]) == 0, "the next oldest should have gone first"


def _key(i: int) -> bytes:
    return b"lookup-idx-" + i.to_bytes(5, "little")


class Writer(threading.Thread):
    """Puts fresh keys, never one twice, so the arena evicts the oldest all the time: a
    key's presence only ever goes from stored to evicted while the test reads."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.client = KVPoolClient(path)
        self.stored: list[bytes] = []
        self.next = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.error: BaseException | None = None

    def put_some(self, n: int) -> None:
        for _ in range(n):
            key = _key(self.next)
            self.next += 1
            self.client.put(key, bytes(CHUNK))
            with self.lock:
                self.stored.append(key)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.put_some(8)
        except BaseException as e:
            self.error = e

    def keys(self) -> list[bytes]:
        with self.lock:
            return list(self.stored)


@pytest.fixture(scope="module")
def writer(small_agent: LocalAgent) -> Iterator[Writer]:
    w = Writer(small_agent.socket_path)
    w.put_some(300)  # the arena is full: every later put evicts
    w.start()
    yield w
    w.stop.set()
    w.join(timeout=60)
    w.client.close()
    assert w.error is None, w.error


@pytest.fixture(scope="module")
def readers(small_agent: LocalAgent) -> Iterator[tuple[KVPoolClient, KVPoolClient]]:
    with KVPoolClient(small_agent.socket_path, local_lookup=True) as local, \
            KVPoolClient(small_agent.socket_path) as remote:
        assert isinstance(local._transport, ZeroCopyTransport)
        assert local._transport.index is not None, "the client mapped the agent's index"
        yield local, remote


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(picks=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), min_size=1,
                     max_size=64),
       stranger=st.none() | st.integers(0, 64))
def test_local_lookup_equals_the_agents_answer_under_concurrent_puts_and_evictions(
        writer: Writer, readers: tuple[KVPoolClient, KVPoolClient],
        picks: list[tuple[bool, int]], stranger: int | None) -> None:
    local, remote = readers
    stored = writer.keys()
    # Keys once stored, newest (likely still in DRAM) or oldest (evicted), in any order,
    # with a never-stored key somewhere or not at all.
    keys = [stored[-1 - i % 300] if newest else stored[i % len(stored)]
            for newest, i in picks]
    if stranger is not None:
        keys.insert(min(stranger, len(keys)), b"never-stored-key")
    before = local.lookup_tiers(keys)
    agent = remote.lookup_tiers(keys)
    after = local.lookup_tiers(keys)
    # Presence only goes from stored to evicted meanwhile, so the agent's answer lies
    # between the two local ones, and equals them when nothing changed in between.
    assert len(before) >= len(agent) >= len(after)
    assert set(before) <= {"dram"} and agent == ["dram"] * len(agent)
    if before == after:
        assert agent == before


def test_local_lookup_asks_the_agent_where_a_lower_tier_may_go_on(tmp_path: Path) -> None:
    with LocalAgent("--no-lock", "--nvme-dir", str(tmp_path / "nvme"), "--nvme", "16Mi",
                    workdir=tmp_path, dram=ARENA, start_timeout=60) as agent, \
            KVPoolClient(agent.socket_path, local_lookup=True) as local, \
            KVPoolClient(agent.socket_path) as remote:
        keys = [_key(i) for i in range(400)]  # more than DRAM holds: the oldest demote
        local.put_many(keys, [bytes(CHUNK)] * len(keys))
        # DRAM holds 256 of them at most: the rest are in NVMe, which only the agent knows
        # (its LOOKUPs promote and prefetch, so the exact split moves between calls).
        found = local.lookup_tiers(keys)
        assert len(found) == len(keys)
        assert found.count("nvme") >= len(keys) - 256
        assert len(remote.lookup_tiers(keys)) == len(keys)
        assert len(local.lookup_tiers(keys[-4:])) == 4


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 23)), max_size=120))
def test_the_table_answers_what_it_holds_through_tombstones_rebuilds_and_overflow(
        ops: list[tuple[bool, int]]) -> None:
    """The table alone, driven the way the DRAM tier drives it, against a set: 16 slots
    for up to 24 keys, so tombstones pile up, rebuilds run and the table overflows."""
    universe = [_key(i) for i in range(24)]
    index = SharedIndex(16, lower_tiers=False)
    reader = IndexReader(index.fd)
    held: dict[bytes, None] = {}
    try:
        for add, i in ops:
            key = universe[i]
            if add and key not in held:
                held[key] = None
                if not index.add(key):
                    index.rebuild(held)
            elif not add and key in held:
                del held[key]
                index.remove(key)
            if index.crowded:
                index.rebuild(held)
            for k in universe:
                got = reader.lookup([k])
                if index.overflowed:
                    assert got is None, "an overflowed table sends every LOOKUP to the socket"
                else:
                    assert got == (1 if k in held else 0)
            if not index.overflowed:
                # A whole prefix at once reads every home slot in one numpy pass: the keys
                # behind a tombstone or another key's slot still walk their probe.
                leading = next((j for j, k in enumerate(universe) if k not in held),
                               len(universe))
                assert reader.lookup(universe) == leading
                assert reader.lookup(list(held)) == len(held)
        if not index.overflowed:
            assert reader.lookup(list(held)) == len(held)
    finally:
        reader.close()
        index.close()


def _bulk(held: dict[bytes, int]) -> Entries:
    """The directory's entries as a peer table's rebuild takes them: a key table of them
    (a tombstone between each two, as a directory's table has some)."""
    cells = array("i", [c for i in range(len(held)) for c in (i + 1, -1)])
    return len(held), cells, bytearray(b"".join(held)), array("H", held.values())


def _answers(reader: IndexReader, keys: list[bytes],
             monkeypatch: pytest.MonkeyPatch) -> tuple[bytes | None, bytes | None]:
    """The reader's answer by the compiled walk and by the Python one."""
    kernels = lookupkernel.kernels()
    assert kernels is not None
    with monkeypatch.context() as m:
        m.setattr(lookupkernel, "ready", lambda: kernels)
        compiled = reader.answer(keys)
    with monkeypatch.context() as m:
        m.setattr(lookupkernel, "ready", lambda: None)
        walked = reader.answer(keys)
    return compiled, walked


@pytest.mark.parametrize("seed,max_slots,compiled_writes",
                         [(1, 1 << 12, True), (2, 1 << 12, False), (3, 1 << 10, True)])
def test_the_peer_table_answers_as_the_directory_and_the_peers_states_say(
        seed: int, max_slots: int, compiled_writes: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer table driven as the directory and the network drive it (entries added,
    moved to another holder, removed; a peer's entries dropped at once; peers turning
    unreadable and back), against a dict: up to 1,500 remote keys, so it grows from
    1,024 slots and is rebuilt (and with 1,024 slots at most, overflows: every LOOKUP
    then asks the socket). Both walks, compiled and Python, give the model's answer, of
    a table the agent wrote with its compiled writes or in Python."""
    assert lookupkernel.kernels() is not None
    if not compiled_writes:
        monkeypatch.setattr(lookupkernel, "ready", lambda: None)  # (`_answers` has its own)
    rnd = random.Random(seed)
    universe = [_key(i) for i in range(1500)]
    index = SharedIndex(64, lower_tiers=False, peer_slots=max_slots)
    peers = index.peers
    assert peers is not None
    reader = IndexReader(index.fd)
    held: dict[bytes, int] = {}  # the directory: key -> peer
    readable = [True, True, True, False]
    dram = set(universe[:40:3])
    assert all(index.add(k) for k in dram)
    peers.entries = lambda: _bulk(held)
    for peer, r in enumerate(readable):
        peers.set_readable(peer, r)
    grown = False
    try:
        for step in range(4000):
            op = rnd.random()
            key = rnd.choice(universe)
            if op < 0.6:
                held[key] = rnd.randrange(4)
                peers.add(key, held[key])
            elif op < 0.7:
                if key in held:
                    del held[key]
                    peers.remove(key)
            elif op < 0.702:
                peer = rnd.randrange(4)
                for k in [k for k, q in held.items() if q == peer]:
                    del held[k]
                if peers.drop(peer):
                    peers.rebuild()
            elif op < 0.72:
                peer = rnd.randrange(4)
                readable[peer] = not readable[peer]
                peers.set_readable(peer, readable[peer])
            grown = grown or peers.slots > 1024
            if step % 100:
                continue
            for _ in range(10):
                keys = rnd.sample(universe, rnd.randrange(1, 140))
                if rnd.random() < 0.5:  # mostly held, to get far into the prefix
                    keys = [k for k in keys if k in held or k in dram] + keys[:1]
                want = bytearray()
                for k in keys:
                    if k in dram:
                        want.append(2)
                    elif k in held and readable[held[k]]:
                        want.append(PEER_TIER_CODE)
                    else:
                        break
                compiled, walked = _answers(reader, keys, monkeypatch)
                if peers.overflowed:
                    assert compiled is walked is None, "overflowed: the socket answers"
                else:
                    assert compiled == walked == bytes(want)
        assert grown == (max_slots > 1 << 10)
        assert peers.overflowed == (max_slots == 1 << 10)
    finally:
        reader.close()
        index.close()


def test_a_torn_peer_slot_or_a_rebuild_under_way_sends_the_lookup_to_the_socket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    index = SharedIndex(16, lower_tiers=False, peer_slots=1 << 10)
    peers = index.peers
    assert peers is not None
    reader = IndexReader(index.fd)
    keys = [_key(i) for i in range(20)]
    try:
        peers.entries = lambda: _bulk(dict.fromkeys(keys, 1))
        peers.rebuild()
        peers.set_readable(1, True)
        assert _answers(reader, keys, monkeypatch) == (bytes([5]) * 20,) * 2
        at, _ = peers._find(keys[7])
        assert at is not None
        peers._words[3 * at] |= 1  # the agent in the middle of writing it
        assert _answers(reader, keys, monkeypatch) == (None, None)
        assert _answers(reader, keys[:7], monkeypatch) == (bytes([5]) * 7,) * 2
        peers._words[3 * at] += 1
        assert _answers(reader, keys, monkeypatch) == (bytes([5]) * 20,) * 2
        peers._set_epoch(peers.epoch + 1)  # a rebuild under way
        assert _answers(reader, keys, monkeypatch) == (None, None)
        peers._set_epoch(peers.epoch + 1)
        # A peer that is not readable, or whose entries went at once, counts for nothing.
        peers.set_readable(1, False)
        assert _answers(reader, keys, monkeypatch) == (b"", b"")
        peers.set_readable(1, True)
        peers.drop(1)
        assert _answers(reader, keys, monkeypatch) == (b"", b"")
    finally:
        reader.close()
        index.close()
