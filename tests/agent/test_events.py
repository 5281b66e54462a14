"""KV events: what a real agent publishes, decoded by code kvpool did not write.

Two agents per module: one in `node` topic mode with the `map` payload, an NVMe tier
and a `file://` shared tier (decoded with SGLang's own event classes, and mirrored
under a random workload against STATS and the shared store's files), one in `pod`
mode with the `array` payload (fan-out per engine pod).
The mirror is a plain pyzmq SUB + msgspec consumer written from vLLM's format
(`vllm/distributed/kv_events.py`): structs of its own, no kvpool decoder.
"""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvpool.agent.client import EngineBlocks, KVPoolClient
from kvpool.bench.local import LocalAgent, free_port

from ..support import flip_last_byte
from .conftest import scrape, wait_until

KiB = 1024
CHUNK = 64 * KiB

# -- vLLM's format, written from its source: map events tagged by "type", or arrays led by it


class Stored(msgspec.Struct):
    """BlockStored's fields, in vLLM's order: the same in both shapes."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class Removed(msgspec.Struct):
    block_hashes: list[int]
    medium: str | None = None


class MapStored(Stored, tag="BlockStored", tag_field="type"):
    pass


class MapRemoved(Removed, tag="BlockRemoved", tag_field="type"):
    pass


class MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class ArrStored(Stored, array_like=True, tag="BlockStored"):
    pass


class ArrRemoved(Removed, array_like=True, tag="BlockRemoved"):
    pass


class ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[MapStored | MapRemoved | MapCleared]
    data_parallel_rank: int | None = None


class ArrBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[ArrStored | ArrRemoved | ArrCleared]
    data_parallel_rank: int | None = None


END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUBLISHED = 'kvpool_events_published_total{pool="default"}'


class Mirror:
    """A router's view of one topic: which block hashes each medium holds.

    Applies batches in sequence order; on a gap (or its first batch) it asks the
    replay socket for everything from the sequence it expected, and a replay that
    does not start there must start with AllBlocksCleared (a restarted topic)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, replay: str, topic: bytes,
                 batch: type[MapBatch] | type[ArrBatch]) -> None:
        self.ctx, self.endpoint, self.replay, self.topic = ctx, endpoint, replay, topic
        self.decoder = msgspec.msgpack.Decoder(batch)
        self.held: dict[str, set[int]] = {}
        self.expected: int | None = None
        self.gaps = 0
        self.sub = self._subscribe()

    def _subscribe(self) -> zmq.Socket[bytes]:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        return sub

    def disconnect(self) -> None:
        self.sub.close()

    def reconnect(self) -> None:
        self.sub = self._subscribe()

    def apply(self, payload: bytes) -> list[Any]:
        events: list[Any] = self.decoder.decode(payload).events
        for e in events:
            if isinstance(e, MapCleared | ArrCleared):
                self.held.clear()
            elif isinstance(e, Stored):
                self.held.setdefault(e.medium or "", set()).update(e.block_hashes)
            else:
                self.held.get(e.medium or "", set()).difference_update(e.block_hashes)
        return events

    def _replay(self) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        start = self.expected or 0
        dealer.send_multipart([b"", self.topic, start.to_bytes(8, "big")])
        first = True
        try:
            while dealer.poll(30_000):
                _, seq_b, payload = dealer.recv_multipart()
                if seq_b == END_SEQ:
                    return
                seq = int.from_bytes(seq_b, "big")
                events = self.apply(payload)
                if first and self.expected is not None and seq != self.expected:
                    assert isinstance(events[0], MapCleared | ArrCleared), \
                        "a replay past a gap must restart the topic"
                first = False
                self.expected = seq + 1
            raise AssertionError("replay did not end")
        finally:
            dealer.close()

    def pump(self) -> None:
        """Apply what has arrived, without waiting."""
        while self.sub.poll(0):
            _, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if self.expected is not None and seq < self.expected:
                continue  # already applied from a replay
            if seq != self.expected:
                if self.expected is not None:
                    self.gaps += 1
                self._replay()
                if seq < (self.expected or 0):
                    continue
            self.apply(payload)
            self.expected = seq + 1

    def count(self, medium: str) -> int:
        """Block hashes credited to `medium`."""
        return len(self.held.get(medium, ()))


def _config(tmp: Path, topic: str, payload: str, *, policy: Path | None = None,
            nvme: Path | None = None, shared: Path | None = None) -> tuple[Path, str, str]:
    port, replay = free_port(), free_port()
    lines = ["nodeName: n1", f"events: {{enabled: true, address: 127.0.0.1, port: {port}, "
             f"replayPort: {replay}, topic: {topic}, payload: {payload}}}"]
    if policy is not None:
        lines.append(f"policyFile: {policy}")
    tiers = []
    if nvme is not None:
        tiers.append(f"nvme: {{path: {nvme}, size: 1Mi}}")
    if shared is not None:
        shared.mkdir(exist_ok=True)  # the agent never makes a file:// store's directory
        tiers.append(f"shared: {{url: 'file://{shared}'}}")
    if tiers:
        lines.append(f"tiers: {{{', '.join(tiers)}}}")
    cfg = tmp / "config.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    return cfg, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


# The shared tier takes only what NVMe evicts (not every commit), but in the mirror test:
# the other tests' puts publish their DRAM events alone, whatever the uploads do.
POLICY = ("tiers: {dram: {eviction: lru}, nvme: {eviction: lru}, "
          "shared: {writeThrough: false}}\n")
POLICY_SHARED = "tiers: {dram: {eviction: lru}, nvme: {eviction: lru}}\n"
POLICY_TTL = "tiers: {dram: {eviction: lru}, nvme: {eviction: lru, ttl: 1s}}\n"


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


@contextlib.contextmanager
def events_agent(tmp: Path, topic: str, payload: str, dram: str, *, policy: Path | None = None,
                 nvme: Path | None = None, shared: Path | None = None
                 ) -> Iterator[tuple[LocalAgent, str, str]]:
    """An agent publishing KV events on 127.0.0.1 (its config and work dir in `tmp`), with
    its PUB and replay endpoints."""
    cfg, endpoint, replay = _config(tmp, topic, payload, policy=policy, nvme=nvme,
                                    shared=shared)
    with LocalAgent("--no-lock", "--config", str(cfg), workdir=_mkdir(tmp / "agent"),
                    dram=dram) as a:
        yield a, endpoint, replay


@pytest.fixture(scope="module")
def node_agent(tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[LocalAgent, str, str, Path]]:
    tmp = tmp_path_factory.mktemp("events-node")
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY)
    with events_agent(tmp, "node", "map", "2Mi", policy=policy, nvme=tmp / "nvme",
                      shared=tmp / "shared") as (
            a, endpoint, replay):
        yield a, endpoint, replay, policy


@pytest.fixture(scope="module")
def pod_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalAgent, str, str]]:
    with events_agent(tmp_path_factory.mktemp("events-pod"), "pod", "array", "2Mi") as agent:
        yield agent


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def own(k: bytes) -> int:
    """The block hash of a chunk named by kvpool's own key."""
    return int.from_bytes(k[:8], "big")


def blocks(i: int) -> EngineBlocks:
    """Two engine blocks of 16 tokens per chunk, hashes derived from the chunk's number."""
    return EngineBlocks([i * 1000 + 1, i * 1000 + 2], list(range(i, i + 32)), i * 1000)


def recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(30_000), "no event published"
    return sock.recv_multipart()


def test_sglang_decodes_what_a_put_and_a_delete_publish(
        node_agent: tuple[LocalAgent, str, str, Path], ctx: zmq.Context[Any]) -> None:
    from sglang.srt.disaggregation.kv_events import (
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    agent, endpoint, _, _ = node_agent
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@n1@")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    with KVPoolClient(agent.socket_path, pod="vllm-0", model="m", block_size=16) as c:
        # A subscriber's connection completes in the background: probe until events flow.
        wait_until(lambda: c.put(key(900_000 + int(time.monotonic_ns() % 10**6)), b"p")
                   and sub.poll(100), "the subscription to take effect")
        while sub.poll(200):
            sub.recv_multipart()
        c.put(key(1), b"x" * CHUNK, blocks=blocks(1))
        topic, seq, payload = recv(sub)
        stored = decoder.decode(payload).events
        c.delete(key(1))
        topic2, seq2, payload2 = recv(sub)
        removed = decoder.decode(payload2).events
    sub.close()
    assert topic == topic2 == b"kv@n1@default"
    assert int.from_bytes(seq2, "big") == int.from_bytes(seq, "big") + 1
    assert stored == [BlockStored(block_hashes=[1001, 1002], parent_block_hash=1000,
                                  token_ids=list(range(1, 33)), block_size=16, lora_id=None,
                                  medium="CPU_PINNED")]
    assert removed == [BlockRemoved(block_hashes=[1001, 1002], medium="CPU_PINNED")]


def test_kvpool_events_tails_decoded_events_one_line_each(
        node_agent: tuple[LocalAgent, str, str, Path]) -> None:
    agent = node_agent[0]
    cmd = [sys.executable, "-m", "kvpool.agent", "events", "--socket", str(agent.socket_path),
           "--count", "3"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc, \
            KVPoolClient(agent.socket_path, block_size=16) as c:
        # The command subscribes when it has started: store chunks until it has seen three.
        for i in range(3000, 5000):
            c.put(key(i), b"e")
            try:
                out, err = proc.communicate(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            proc.kill()
            raise AssertionError("kvpool events saw no three events")
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 3, out
    for line in lines:
        seq, topic, kind, medium, blocks, size = line.split(" ")
        assert (topic, kind, medium, size) == ("kv@n1@default", "BlockStored",
                                                "medium=CPU_PINNED", "block_size=16"), line
        assert blocks.startswith("blocks=") and seq.isdigit()


def test_pod_topics_fan_out_to_each_engine_pod_of_the_model_in_array_shape(
        pod_agent: tuple[LocalAgent, str, str], ctx: zmq.Context[Any]) -> None:
    agent, endpoint, replay = pod_agent
    p0 = Mirror(ctx, endpoint, replay, b"kv@p0@m", ArrBatch)
    p1 = Mirror(ctx, endpoint, replay, b"kv@p1@m", ArrBatch)
    other = Mirror(ctx, endpoint, replay, b"kv@p2@other", ArrBatch)
    with KVPoolClient(agent.socket_path, pod="p0", model="m", block_size=16) as c0, \
            KVPoolClient(agent.socket_path, pod="p1", model="m") as c1, \
            KVPoolClient(agent.socket_path, pod="p2", model="other") as c2:
        c0.put(key(1), b"x" * CHUNK, blocks=blocks(1))
        c2.put(key(2), b"y" * CHUNK)  # no blocks: kvpool's own key, model "other" only
        c1.stats()
        own = int.from_bytes(key(2)[:8], "big")

        nudges = iter(range(200, 2000))

        def seen() -> bool:
            # A subscriber hears only what is published once its connection is up: store
            # (one chunk per model) until each has heard something and replayed the rest.
            n = next(nudges)
            c0.put(key(n), b"m")
            c2.put(key(n + 10_000), b"o")
            for m in (p0, p1, other):
                m.pump()
            held = [m.held.get("CPU_PINNED", set()) for m in (p0, p1, other)]
            return {1001, 1002} <= held[0] and {1001, 1002} <= held[1] and own in held[2]
        wait_until(seen, "each pod's topic to hold its model's chunks")
        # A chunk goes to the pods of its storing client's model only.
        assert own not in p0.held["CPU_PINNED"] | p1.held["CPU_PINNED"]
        assert not {1001, 1002} & other.held["CPU_PINNED"]
        assert not {int.from_bytes(key(n + 10_000)[:8], "big") for n in range(200, 2000)} \
            & p0.held["CPU_PINNED"]
    for m in (p0, p1, other):
        m.disconnect()


def test_a_late_joiner_catches_up_through_replay(
        pod_agent: tuple[LocalAgent, str, str], ctx: zmq.Context[Any]) -> None:
    agent, endpoint, replay = pod_agent
    with KVPoolClient(agent.socket_path, pod="late", model="m") as c:
        for i in range(10, 15):
            c.put(key(i), b"z" * CHUNK, blocks=blocks(i))
        c.delete(key(10))
        joiner = Mirror(ctx, endpoint, replay, b"kv@late@m", ArrBatch)
        expect = {h for i in range(11, 15) for h in blocks(i).hashes}
        live = iter(range(100, 2000))

        def caught_up() -> bool:
            # A subscriber hears only what is published once its connection is up: store
            # until it hears something live, which makes it ask the replay for the rest.
            c.put(key(next(live)), b"z")
            joiner.pump()
            return expect <= joiner.held.get("CPU_PINNED", set())
        wait_until(caught_up, "the late joiner to hold every chunk stored before it joined")
        assert not {h for h in blocks(10).hashes} & joiner.held["CPU_PINNED"]
    joiner.disconnect()


def _quiet(s: dict[str, Any]) -> bool:
    """Nothing on its way between tiers: no demotion, NVMe removal or upload under way."""
    nvme, shared = s["tiers"].get("nvme", {}), s["tiers"].get("shared", {})
    queue = shared.get("queue", {})
    return not (nvme.get("inflight") or nvme.get("removing") or queue.get("pending")
                or queue.get("in_flight"))


def _stats(c: KVPoolClient) -> dict[str, int] | None:
    """Chunks per tier, once nothing is on its way between tiers: the local tiers' as they
    hold them, the shared tier's as this agent knows it (what it announced)."""
    s = c.stats()
    if not _quiet(s):
        return None
    tiers = {t: v["chunks"] for t, v in s["tiers"].items()}
    tiers["shared"] = s["events"]["announced"]["shared"]
    return tiers


def _agrees(mirror: Mirror, c: KVPoolClient, hashes: dict[int, bytes]) -> bool:
    """The mirror credits each tier with as many chunks as STATS counts (a chunk stored
    with engine blocks is two hashes; other tests' chunks are one hash, their key's)."""
    mirror.pump()
    tiers = _stats(c)
    return tiers is not None and all(
        len({hashes.get(h, h) for h in mirror.held.get(medium, ())}) == tiers[tier]
        for medium, tier in (("CPU_PINNED", "dram"), ("DISK", "nvme"), ("SHARED", "shared")))


def _shared_objects(agent: LocalAgent) -> set[bytes]:
    """The chunk keys the shared store holds (its `<key hex>.kvc` files)."""
    root = agent.workdir.parent / "shared"
    return {bytes.fromhex(f.name[:-4]) for f in root.glob("*/*.kvc")}


def _check_index(mirror: Mirror, agent: LocalAgent, hashes: dict[int, bytes], *,
                 whole_store: bool) -> None:
    """Every chunk the mirror credits to a tier is in that tier, asked without moving it:
    DRAM through the index the agent publishes in shared memory (a local LOOKUP, which
    promotes and prefetches nothing), NVMe and the shared tier by its chunk file. With
    `whole_store`, the mirror credits the shared tier with every object in the store
    (this agent wrote them all, and has not restarted since)."""
    nvme = agent.workdir.parent / "nvme"
    # (chunks other tests of the module stored are counted, not looked at here)
    in_dram = {hashes[h] for h in mirror.held.get("CPU_PINNED", ()) if h in hashes}
    on_nvme = {hashes[h] for h in mirror.held.get("DISK", ()) if h in hashes}
    with KVPoolClient(agent.socket_path, local_lookup=True) as local:
        for k in in_dram:
            assert local.lookup_tiers([k]) == ["dram"], k.hex()
    for k in on_nvme:
        assert (nvme / k.hex()[:2] / f"{k.hex()}.kvc").exists(), k.hex()
    stored = _shared_objects(agent)
    credited = {hashes.get(h, h) for h in mirror.held.get("SHARED", ())}
    assert {k for k in credited if isinstance(k, bytes)} <= stored
    if whole_store:
        assert len(credited) == len(stored)


def test_a_mirror_applying_every_event_ends_with_the_agents_index(
        node_agent: tuple[LocalAgent, str, str, Path], ctx: zmq.Context[Any]) -> None:
    """Random puts, reads, deletes, the evictions and demotions they cause (down to the
    shared tier), TTL expiries, a quarantined NVMe file, a corrupt shared object, a
    subscriber gap and an agent restart: the mirror's tiers match STATS after each
    phase, and its shared tier the store's files."""
    agent, endpoint, replay, policy = node_agent
    rng = random.Random(18)
    mirror = Mirror(ctx, endpoint, replay, b"kv@n1@default", MapBatch)
    hashes: dict[int, bytes] = {}
    with KVPoolClient(agent.socket_path) as c:
        def check(what: str) -> None:
            wait_until(lambda: _agrees(mirror, c, hashes), f"the mirror to match STATS {what}")

        def workload(n: int) -> None:
            for _ in range(n):
                i = rng.randrange(60)
                op = rng.random()
                if op < 0.55:
                    if i % 2:
                        c.put(key(i), bytes([i]) * CHUNK, blocks=blocks(i))
                        hashes.update({h: key(i) for h in blocks(i).hashes})
                    else:
                        c.put(key(i), bytes([i]) * CHUNK)
                        hashes[int.from_bytes(key(i)[:8], "big")] = key(i)
                elif op < 0.85:
                    c.get(key(i))  # a hit below DRAM promotes the chunk
                else:
                    # An upload of the key still under way may land after its delete and
                    # leave the object unannounced (docs/events.md): let it land first.
                    wait_until(lambda: _quiet(c.stats()), "uploads to land")
                    c.delete(key(i))

        def hashes_of(k: bytes) -> set[int]:
            return {h for h, hk in hashes.items() if hk == k} | {own(k)}

        def local_only(k: bytes) -> bool:
            """Held by no local tier, as the mirror (agreeing with STATS) has it."""
            held = mirror.held.get("CPU_PINNED", set()) | mirror.held.get("DISK", set())
            return not hashes_of(k) & held

        fresh = iter(range(1000, 2000))

        def put_fresh() -> Mirror:
            """Store a new small chunk; the mirror, having applied what has arrived."""
            k = key(next(fresh))
            c.put(k, b"n")
            hashes[own(k)] = k
            mirror.pump()
            return mirror

        policy.write_text(POLICY_SHARED)  # reloaded in place: every commit goes to G4 too
        wait_until(lambda: put_fresh().count("SHARED"), "uploads to be announced")
        workload(150)
        check("after puts, reads, deletes, evictions and demotions")
        assert mirror.count("DISK") > 0 and mirror.count("CPU_PINNED") > 0
        assert mirror.count("SHARED") > 0

        # Other tests' chunks (the module's agent keeps them) are demoted too: pick one of
        # this test's, whose hash `hashes` knows.
        nvme_key = next(hashes[h] for h in mirror.held["DISK"] if h in hashes)
        path = agent.workdir.parent / "nvme" / nvme_key.hex()[:2] / f"{nvme_key.hex()}.kvc"
        flip_last_byte(path)
        assert c.get(nvme_key) is None
        check("after a quarantine")

        # A shared copy found corrupt is deleted from the store: removed from the tier.
        bad = next(k for k in _shared_objects(agent) if k in hashes.values()
                   and local_only(k) and hashes_of(k) & mirror.held["SHARED"])
        obj = agent.workdir.parent / "shared" / bad.hex()[:2] / f"{bad.hex()}.kvc"
        flip_last_byte(obj)
        assert c.get(bad) is None
        check("after a corrupt shared copy")
        assert not obj.exists() and not hashes_of(bad) & mirror.held["SHARED"]

        def heard_since(gaps: int) -> bool:
            """Store a new chunk (a subscriber learns of what it missed only from a later
            batch) until the mirror has seen a gap more than `gaps`."""
            return put_fresh().gaps > gaps

        mirror.disconnect()  # a subscriber that drops out misses batches: a gap
        published = scrape(agent)[PUBLISHED]
        workload(40)
        wait_until(lambda: scrape(agent)[PUBLISHED] > published,
                   "events to be published while the mirror is away")
        mirror.reconnect()
        wait_until(lambda: heard_since(0), "the mirror to detect the gap")
        check("after a gap")

        policy.write_text(POLICY_TTL)  # reloaded in place: NVMe chunks now expire
        wait_until(lambda: (_stats(c) or {}).get("nvme") == 0, "NVMe chunks to expire")
        check("after TTL expiries")
        policy.write_text(POLICY_SHARED)
        workload(60)
        check("before the restart")
        _check_index(mirror, agent, hashes, whole_store=True)

        gaps = mirror.gaps
        agent.stop(remove_arena=False)
        agent.start()
        workload(30)
        # The restarted agent's topic counts on from its start time: a gap, whose replay
        # starts with AllBlocksCleared and the inventory of what the agent kept.
        wait_until(lambda: heard_since(gaps), "the mirror to detect the restart")
        check("after an agent restart")
        _check_index(mirror, agent, hashes, whole_store=False)
        # The restarted agent knows of the shared store only what it learns again: a read
        # of a chunk only the store holds announces it there (and in DRAM).
        again = next(k for k in _shared_objects(agent) if k in hashes.values()
                     and local_only(k) and own(k) not in mirror.held.get("SHARED", set()))
        assert c.get(again) is not None
        check("after a read from the shared tier")
        assert own(again) in mirror.held["SHARED"]
        _check_index(mirror, agent, hashes, whole_store=False)
    policy.write_text(POLICY)
    mirror.disconnect()
    metrics = scrape(agent)
    assert metrics[PUBLISHED] > 0
    assert metrics['kvpool_events_dropped_total{pool="default"}'] == 0


def test_lookup_counts_prefill_tokens_per_tier(
        node_agent: tuple[LocalAgent, str, str, Path]) -> None:
    agent, _, _, _ = node_agent
    series = 'kvpool_tokens_total{pool="default",result="%s",tier="%s"}'
    before = scrape(agent)
    with KVPoolClient(agent.socket_path, chunk_tokens=256) as c:
        c.put(key(500), b"t" * 100)
        c.put(key(501), b"t" * 100)
        assert c.lookup([key(500), key(501), key(502), key(503), key(504)]) == 2
    after = scrape(agent)
    assert after[series % ("hit", "dram")] - before[series % ("hit", "dram")] == 512
    assert after[series % ("miss", "none")] - before[series % ("miss", "none")] == 768


def test_an_agent_withdraws_its_oldest_shared_chunk_past_its_bound(
        ctx: zmq.Context[Any]) -> None:
    """The shared store has no size the agent manages: past `shared_announced` chunks the
    oldest announcement is withdrawn (the bound is a million; two here)."""
    from kvpool.agent.config import EventsPayload
    from kvpool.agent.events import Publisher, TierEvents

    pub = Publisher(host="127.0.0.1", port=0, replay_port=0, replay_depth=100, queue_depth=100,
                    shape=EventsPayload.MAP,
                    medium={"dram": "CPU_PINNED", "nvme": "DISK", "shared": "SHARED"},
                    published=lambda n: None, dropped=lambda n: None)
    try:
        tracker = TierEvents("", pub, node_topic="kv@n1@default", shared_announced=2)
        tracker.start([])  # no event loop runs here: each event is published at once
        for i in (1, 2, 3):
            tracker.stored("shared", key(i))
        tracker.stored("shared", key(2))  # announced already: nothing
        assert pub.replay_endpoint is not None
        mirror = Mirror(ctx, pub.endpoint, pub.replay_endpoint, b"kv@n1@default", MapBatch)
        mirror._replay()
        mirror.disconnect()
        assert mirror.held["SHARED"] == {own(key(2)), own(key(3))}
        assert tracker.announced() == {"dram": 0, "nvme": 0, "shared": 2}
    finally:
        pub.close()


def _replayed(ctx: zmq.Context[Any], replay: str, topic: bytes) -> list[ArrStored]:
    """The BlockStored events the replay socket keeps of `topic`, from its start."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay)
    decoder = msgspec.msgpack.Decoder(ArrBatch)
    stored: list[ArrStored] = []
    try:
        dealer.send_multipart([b"", topic, (0).to_bytes(8, "big")])
        while True:
            assert dealer.poll(30_000), "the replay did not end"
            _, seq_b, payload = dealer.recv_multipart()
            if seq_b == END_SEQ:
                return stored
            stored += [e for e in decoder.decode(payload).events if isinstance(e, ArrStored)]
    finally:
        dealer.close()


def test_a_restarted_agent_names_the_engines_blocks_as_before(
        tmp_path: Path, ctx: zmq.Context[Any]) -> None:
    """An engine stores chunks with its block hashes, some demoted to NVMe, one deleted;
    the agent is SIGKILLed and restarted warm. When the engine's pod says HELLO again, the
    inventory of its topic (read through the replay socket) names every chunk by the
    engine's blocks, tokens, parent and block size, in the tier that holds it. Before,
    the identities lived in the agent's memory only: the inventory named kvpool's keys,
    and a router keyed by the engine's hashes matched nothing the agent had kept."""
    chunks = range(1, 25)  # 24 chunks of 64 KiB through 1 MiB of DRAM into 1 MiB of NVMe
    with events_agent(tmp_path, "pod", "array", "1Mi", nvme=tmp_path / "nvme") as (
            agent, _, replay):
        with KVPoolClient(agent.socket_path, pod="p", model="m", block_size=16,
                          chunk_tokens=32) as c:
            for i in chunks:
                assert c.put(key(i), b"z" * CHUNK, blocks=blocks(i))
            c.delete(key(1))
            wait_until(lambda: (_stats(c) or {}).get("nvme", 0) > 0, "demotions to NVMe")
        agent.kill(signal.SIGKILL)
        agent.start()
        nvme = tmp_path / "nvme"
        on_nvme = {i for i in chunks if (nvme / key(i).hex()[:2] / f"{key(i).hex()}.kvc").exists()}
        with KVPoolClient(agent.socket_path, pod="p", model="m", block_size=16,
                          chunk_tokens=32) as c:
            c.stats()  # its HELLO starts the pod's topic; nothing is looked up or read
            in_dram = {i for i in chunks if i != 1 and i not in on_nvme}
            expect = {blocks(i).hashes[0]: (i, "DISK" if i in on_nvme else "CPU_PINNED")
                      for i in on_nvme | in_dram}
            assert on_nvme and 1 not in on_nvme and len(in_dram) > 8

            def inventory() -> dict[int, ArrStored]:
                return {e.block_hashes[0]: e for e in _replayed(ctx, replay, b"kv@p@m")}

            wait_until(lambda: len(inventory()) >= len(expect), "the pod's inventory")
            got = inventory()
            # Every chunk the agent kept (the deleted one is forgotten with it), and only
            # those, named as the engine named it, in the tier that holds it.
            assert set(got) == set(expect)
            for h, e in got.items():
                i, where = expect[h]
                b = blocks(i)
                assert (e.block_hashes, e.token_ids, e.parent_block_hash, e.block_size,
                        e.medium) == (b.hashes, b.token_ids, b.parent, 16, where)
            assert c.stats()["tiers"]["dram"]["chunks"] == len(in_dram)
    assert "warm restart" in agent.log()


def test_each_chunk_of_a_put_window_names_the_blocks_of_its_own_commit(
        node_agent: tuple[LocalAgent, str, str, Path], ctx: zmq.Context[Any]) -> None:
    """A put window's COMMITs reach the agent together and are stored as one batch (one
    journal write): each chunk's BlockStored still carries what its own COMMIT named."""
    agent, endpoint, _, _ = node_agent
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@n1@")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(MapBatch)
    numbers = range(3000, 3008)
    with KVPoolClient(agent.socket_path, pod="vllm-0", model="m", block_size=16) as c:
        wait_until(lambda: c.put(key(910_000 + int(time.monotonic_ns() % 10**6)), b"p")
                   and sub.poll(100), "the subscription to take effect")
        while sub.poll(200):
            sub.recv_multipart()
        assert c.put_many([key(i) for i in numbers], [b"w" * CHUNK for _ in numbers],
                          blocks=[blocks(i) for i in numbers]) == [True] * len(numbers)
        stored: dict[int, Stored] = {}
        while len(stored) < len(numbers):
            for e in decoder.decode(recv(sub)[2]).events:
                if isinstance(e, MapStored) and e.medium == "CPU_PINNED":
                    stored[e.block_hashes[0]] = e
    sub.close()
    for i in numbers:
        b = blocks(i)
        assert stored[b.hashes[0]] == MapStored(list(b.hashes), b.parent, list(b.token_ids),
                                                16, None, "CPU_PINNED")
