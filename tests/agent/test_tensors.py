"""Tensors as chunk sources and destinations, through a real agent, on CPU tensors.

The GPU path and this one are the same code (`kvpool.agent.gpu`): on CUDA the copies are
DMAs on the caller's stream and the fences are CUDA events; here the copies complete as
issued, and stub streams stand in for CUDA's where a test is about ordering (when the
agent sees a RELEASE or a COMMIT relative to the fence). The registrar that pins the
arena mapping is the client's own seam: tests pass one that records its calls.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.agent import checksums
from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from .conftest import RawConn, scrape, wait_until

LAYERS, TOKENS, HEADS, DIM = 4, 64, 4, 16
DAMAGED_DRAM = 'kvpool_integrity_failures_total{pool="default",tier="dram"}'


def kv_cache(seed: int, layers: int = LAYERS, blocks: int = 4) -> list[torch.Tensor]:
    """One [K/V, tokens, heads, dim] bf16 buffer per layer, as an engine holds them."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, blocks * TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16)
            for _ in range(layers)]


def chunk_segments(cache: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    """The chunk of one token block: K of every layer, then V of every layer (views)."""
    rows = slice(block * TOKENS, (block + 1) * TOKENS)
    return [layer[0, rows] for layer in cache] + [layer[1, rows] for layer in cache]


def packed(segments: list[torch.Tensor]) -> bytes:
    return b"".join(s.contiguous().view(torch.uint8).numpy().tobytes() for s in segments)


class Recorder:
    """A registrar that records its calls (the client's injectable seam)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def register(self, address: int, nbytes: int) -> None:
        self.calls.append(("register", address))

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))


class StubStream:
    """A stream whose fence runs `on_wait` (a check against the agent) when waited on:
    what the client must not have done yet at that moment is asserted there."""

    def __init__(self, on_wait: Callable[[], None]) -> None:
        self.on_wait = on_wait
        self.issued = 0
        self.waited = 0

    def issue(self) -> AbstractContextManager[object]:
        self.issued += 1
        return contextlib.nullcontext()

    def record(self) -> StubStream:
        return self

    def wait(self) -> None:
        self.waited += 1
        self.on_wait()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def tclient(agent: LocalAgent, recorder: Recorder) -> Iterator[KVPoolClient]:
    with KVPoolClient(agent.socket_path, registrar=recorder) as c:
        yield c


def keys_for(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 8 for i in range(n)]


# --------------------------------------------------------------------------- round trips


def test_per_layer_segments_are_stored_as_one_chunk_and_read_back_into_segments(
        tclient: KVPoolClient) -> None:
    cache = kv_cache(1)
    keys = keys_for(4)
    chunks = [chunk_segments(cache, b) for b in range(4)]
    assert tclient.put_many(keys, chunks) == [True] * 4

    empty = kv_cache(2)
    for layer in empty:
        layer.zero_()
    dests = [chunk_segments(empty, b) for b in range(4)]
    sizes = tclient.get_many_into(keys, lambda i, size, meta: dests[i], verify=True)

    assert sizes == [len(packed(c)) for c in chunks]
    for src, dst in zip(cache, empty, strict=True):
        assert torch.equal(src, dst)  # every segment landed at its own place


def test_a_segmented_chunk_is_the_bytes_of_its_segments_in_order(
        tclient: KVPoolClient) -> None:
    segments = chunk_segments(kv_cache(3), 1)
    key = keys_for(1)[0]
    assert tclient.put_many([key], [segments]) == [True]

    assert tclient.get(key, verify=True) == packed(segments)  # the plain client sees them
    flat = torch.empty(len(packed(segments)), dtype=torch.uint8)
    assert tclient.get_many_into([key], lambda i, n, m: flat) == [flat.numel()]
    assert flat.numpy().tobytes() == packed(segments)


def test_buffers_and_tensors_read_alike_in_one_call(tclient: KVPoolClient) -> None:
    data = [os.urandom(10_000), os.urandom(4099)]
    keys = keys_for(2)
    assert tclient.put_many(keys, data) == [True, True]
    as_buffer = bytearray(10_000)
    as_tensor = torch.empty(4099, dtype=torch.uint8)
    outs: list[object] = [as_buffer, as_tensor]
    assert tclient.get_many_into(keys, lambda i, n, m: outs[i], verify=True) == [10_000, 4099]
    assert bytes(as_buffer) == data[0] and as_tensor.numpy().tobytes() == data[1]


def test_inline_mode_moves_tensors_through_the_frames(agent: LocalAgent) -> None:
    segments = chunk_segments(kv_cache(4), 2)
    key = keys_for(1)[0]
    with KVPoolClient(agent.socket_path, mode="inline") as c:
        assert c.put_many([key], [segments]) == [True]
        out = [torch.empty_like(s) for s in segments]
        assert c.get_many_into([key], lambda i, n, m: out, verify=True) == [len(packed(out))]
    assert all(torch.equal(a, b) for a, b in zip(segments, out, strict=True))


# --------------------------------------------------------------------------- checksum kind


def test_tensor_puts_carry_the_wsum_kind_and_its_checksum_matches_the_cpu_definition(
        agent: LocalAgent, tclient: KVPoolClient) -> None:
    segments = chunk_segments(kv_cache(5), 0)
    key = keys_for(1)[0]
    assert tclient.put_many([key], [segments], [b"meta"]) == [True]
    raw = RawConn(agent.socket_path)
    try:
        reply = raw.call(p.Acquire(1, key))
        assert isinstance(reply, p.AcquireReply)
        assert reply.checksum_kind == checksums.WSUM
        assert reply.checksum == checksums.compute(checksums.WSUM, [packed(segments)], b"meta")
    finally:
        raw.close()


def test_a_window_of_mixed_layouts_carries_each_chunks_wsum_and_reads_back_exactly(
        agent: LocalAgent, tclient: KVPoolClient) -> None:
    # one window: chunks of many equal segments (summed stacked), odd sizes, a tail of
    # 1-3 bytes, a view not aligned in its storage, other dtypes
    g = torch.Generator().manual_seed(21)

    def rand(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    storage = rand(4097)
    chunks = [chunk_segments(kv_cache(22, layers=32), 0), chunk_segments(kv_cache(23), 1),
              [rand(1000), rand(2000), rand(7)], [storage[1:]], [rand(5)],
              [rand(4096).view(torch.float64), rand(64).view(torch.int32)]]
    keys = keys_for(len(chunks))
    metas = [bytes([i]) * 3 for i in range(len(chunks))]
    assert tclient.put_many(keys, chunks, metas) == [True] * len(chunks)
    raw = RawConn(agent.socket_path)
    try:
        for key, chunk, meta in zip(keys, chunks, metas, strict=True):
            reply = raw.call(p.Acquire(1, key))
            assert isinstance(reply, p.AcquireReply)
            assert reply.checksum_kind == checksums.WSUM
            assert reply.checksum == checksums.compute(checksums.WSUM, [packed(chunk)], meta)
            raw.call(p.Release(2, reply.lease))
    finally:
        raw.close()
    out = [[torch.zeros_like(s) for s in c] for c in chunks]
    sizes = tclient.get_many_into(keys, lambda i, n, m: out[i], verify=True)
    assert sizes == [len(packed(c)) for c in chunks]
    assert [packed(o) for o in out] == [packed(c) for c in chunks]


def test_segments_cut_mid_word_fall_back_to_xxh3_over_the_arena_bytes(
        agent: LocalAgent, tclient: KVPoolClient) -> None:
    data = torch.randint(0, 256, (1001,), dtype=torch.uint8)
    segments = [data[:3], data[3:]]  # the second segment starts inside a 4-byte word
    key = keys_for(1)[0]
    assert tclient.put_many([key], [segments]) == [True]
    raw = RawConn(agent.socket_path)
    try:
        reply = raw.call(p.Acquire(1, key))
        assert isinstance(reply, p.AcquireReply)
        assert reply.checksum_kind == checksums.XXH3
        assert reply.checksum == p.checksum(data.numpy().tobytes())
    finally:
        raw.close()


def test_a_flipped_byte_in_a_wsum_chunk_is_dropped_by_the_restarted_agent_and_is_a_miss(
        tmp_path: Path) -> None:
    agent = LocalAgent("--no-lock", workdir=tmp_path, dram="32Mi")
    agent.start()
    try:
        cache = kv_cache(6)
        keys = keys_for(2)
        with KVPoolClient(agent.socket_path) as c:
            assert c.put_many(keys, [chunk_segments(cache, b) for b in range(2)]) == [True] * 2
            lease = c._live().conn.call(p.Acquire(c._live().conn.rid(), keys[0]))
            assert isinstance(lease, p.AcquireReply)
            offset = lease.extents[0][0] + 1234
            arena = c._arena
            assert arena is not None
            arena[offset] ^= 0x01  # one bit, in one word, behind the agent's back
        agent.kill()
        agent.start()  # warm restart: replays the journal and re-verifies every chunk

        with KVPoolClient(agent.socket_path) as c:
            assert c.lookup([keys[0]]) == 0
            assert c.get(keys[0]) is None
            assert c.get(keys[1], verify=True) == packed(chunk_segments(cache, 1))
        assert scrape(agent)[DAMAGED_DRAM] == 1
    finally:
        agent.stop()


def test_a_flipped_byte_is_never_read_into_a_tensor_with_verify(
        tclient: KVPoolClient) -> None:
    segments = chunk_segments(kv_cache(7), 0)
    key = keys_for(1)[0]
    assert tclient.put_many([key], [segments]) == [True]
    conn = tclient._live().conn
    lease = conn.call(p.Acquire(conn.rid(), key))
    assert isinstance(lease, p.AcquireReply)
    arena = tclient._arena
    assert arena is not None
    arena[lease.extents[0][0] + 77] ^= 0x80
    conn.cast(p.Release(conn.rid(), lease.lease))

    out = [torch.empty_like(s) for s in segments]
    assert tclient.get_many_into([key], lambda i, n, m: out, verify=True) == [0]


# --------------------------------------------------------------------------- ordering


def test_a_read_lease_is_released_only_after_the_copies_fence_completed(
        agent: LocalAgent, tclient: KVPoolClient) -> None:
    keys = keys_for(3)
    chunks = [chunk_segments(kv_cache(8), b) for b in range(3)]
    assert tclient.put_many(keys, chunks) == [True] * 3
    out = [[torch.empty_like(s) for s in c] for c in chunks]

    with KVPoolClient(agent.socket_path) as observer:
        def leases_still_held() -> None:
            assert observer.stats()["leases"]["read"] == 3

        stream = StubStream(leases_still_held)
        sizes = tclient.get_many_into(keys, lambda i, n, m: out[i], stream=stream)
        assert stream.waited == 1 and stream.issued >= 3
        assert sizes == [len(packed(c)) for c in chunks]
        wait_until(lambda: observer.stats()["leases"]["read"] == 0,
                   what="the RELEASEs sent after the fence")


def test_a_write_is_committed_only_after_its_copies_fence_completed(
        agent: LocalAgent, tclient: KVPoolClient) -> None:
    keys = keys_for(3)
    chunks = [chunk_segments(kv_cache(9), b) for b in range(3)]
    with KVPoolClient(agent.socket_path) as observer:
        def nothing_visible_yet() -> None:
            assert observer.lookup(keys) == 0
            assert observer.stats()["leases"]["write"] == 3

        stream = StubStream(nothing_visible_yet)
        assert tclient.put_many(keys, chunks, stream=stream) == [True] * 3
        assert stream.waited == 1
        assert observer.lookup(keys) == 3


def test_a_read_window_that_fails_midway_waits_for_its_issued_copies_before_releasing(
        agent: LocalAgent, tclient: KVPoolClient) -> None:
    keys = keys_for(2)
    chunks = [chunk_segments(kv_cache(13), b) for b in range(2)]
    assert tclient.put_many(keys, chunks) == [True] * 2
    dests = [[torch.empty_like(s) for s in chunks[0]],
             [torch.empty_like(s) for s in chunks[1][:-1]]]  # the second one too small

    with KVPoolClient(agent.socket_path) as observer:
        def leases_still_held() -> None:
            assert observer.stats()["leases"]["read"] == 2

        stream = StubStream(leases_still_held)
        with pytest.raises(ValueError, match="does not fit"):
            tclient.get_many_into(keys, lambda i, n, m: dests[i], stream=stream)
        assert stream.waited == 1  # the first chunk's copies, before any RELEASE
        wait_until(lambda: observer.stats()["leases"]["read"] == 0, what="the RELEASEs")


class FirstFenceFails(StubStream):
    """Recording the window's fence fails once (a CUDA error, say); the copies were issued."""

    def record(self) -> StubStream:
        if not self.issued or getattr(self, "failed", False):
            return self
        self.failed = True
        raise RuntimeError("the device could not record the event")


def test_a_write_window_that_fails_after_its_copies_waits_for_them_before_aborting(
        agent: LocalAgent, tclient: KVPoolClient) -> None:
    keys = keys_for(2)
    chunks = [chunk_segments(kv_cache(14), b) for b in range(2)]
    with KVPoolClient(agent.socket_path) as observer:
        def leases_still_open() -> None:
            assert observer.stats()["leases"]["write"] == 2

        stream = FirstFenceFails(leases_still_open)
        with pytest.raises(RuntimeError, match="could not record"):
            tclient.put_many(keys, chunks, stream=stream)
        assert stream.waited == 1  # the issued copies, before any ABORT
        wait_until(lambda: observer.stats()["leases"]["write"] == 0, what="the ABORTs")
        assert observer.lookup(keys) == 0  # nothing committed


# --------------------------------------------------------------------------- registration


def test_the_arena_is_registered_once_per_mapping_and_again_after_an_agent_restart(
        tmp_path: Path) -> None:
    agent = LocalAgent("--no-lock", workdir=tmp_path, dram="32Mi")
    agent.start()
    recorder = Recorder()
    try:
        c = KVPoolClient(agent.socket_path, registrar=recorder, reconnect_timeout=60)
        assert recorder.calls == []  # nothing pinned before a tensor uses the mapping
        cache = kv_cache(10)
        for b in range(3):
            assert c.put_many(keys_for(1, salt=b), [chunk_segments(cache, b)]) == [True]
        out = [torch.empty_like(s) for s in chunk_segments(cache, 0)]
        assert c.get_many_into(keys_for(1, salt=0), lambda i, n, m: out) != [0]
        assert [what for what, _ in recorder.calls] == ["register"]  # once, not per call
        first = recorder.calls[0][1]

        agent.kill()
        agent.start()
        assert c.put_many(keys_for(1, salt=9), [chunk_segments(cache, 3)]) == [True]
        assert [what for what, _ in recorder.calls] == ["register", "unregister", "register"]
        assert recorder.calls[1] == ("unregister", first)  # the old mapping, before unmapping

        c.close()
        assert recorder.calls[-1] == ("unregister", recorder.calls[2][1])
    finally:
        agent.stop()


class Refusing(Recorder):
    def register(self, address: int, nbytes: int) -> None:
        super().register(address, nbytes)
        raise RuntimeError("cudaHostRegister: out of locked memory")


def test_a_mapping_that_cannot_be_registered_still_moves_tensors_and_says_why(
        agent: LocalAgent, caplog: pytest.LogCaptureFixture) -> None:
    refusing = Refusing()
    segments = chunk_segments(kv_cache(15), 0)
    with KVPoolClient(agent.socket_path, registrar=refusing) as c:
        assert c.put_many(keys_for(1), [segments]) == [True]
        out = [torch.empty_like(s) for s in segments]
        assert c.get_many_into(keys_for(1), lambda i, n, m: out) != [0]
    assert all(torch.equal(a, b) for a, b in zip(segments, out, strict=True))
    assert [what for what, _ in refusing.calls] == ["register"]  # never unregistered
    assert "not registered for DMA" in caplog.text


# --------------------------------------------------------------------------- bad input


def test_a_non_contiguous_tensor_is_refused_with_a_clear_error_and_nothing_stored(
        tclient: KVPoolClient) -> None:
    key = keys_for(1)[0]
    transposed = torch.zeros(64, 32).t()
    with pytest.raises(ValueError, match="not contiguous"):
        tclient.put_many([key], [transposed])
    assert tclient.lookup([key]) == 0
    assert tclient.stats()["leases"] == {"read": 0, "write": 0}


def test_a_too_small_destination_is_refused_and_the_chunk_stays_stored(
        tclient: KVPoolClient) -> None:
    key = keys_for(1)[0]
    segments = chunk_segments(kv_cache(11), 0)
    assert tclient.put_many([key], [segments]) == [True]
    short = [torch.empty_like(s) for s in segments[:-1]]
    with pytest.raises(ValueError, match="does not fit"):
        tclient.get_many_into([key], lambda i, n, m: short)
    wait_until(lambda: tclient.stats()["leases"]["read"] == 0, what="the lease to go")
    assert tclient.get(key, verify=True) == packed(segments)


@pytest.mark.parametrize("device", ["meta"])
def test_a_tensor_on_another_device_is_refused_with_a_clear_error(
        tclient: KVPoolClient, device: str) -> None:
    key = keys_for(1)[0]
    with pytest.raises(ValueError, match=f"device {device}"):
        tclient.put_many([key], [torch.empty(1024, device=device)])
    assert tclient.lookup([key]) == 0


def test_segments_of_one_chunk_on_two_devices_are_refused(tclient: KVPoolClient) -> None:
    with pytest.raises(ValueError, match="device"):
        tclient.put_many(keys_for(1), [[torch.zeros(8), torch.empty(8, device="meta")]])


def test_buffers_and_tensors_in_one_put_are_refused(tclient: KVPoolClient) -> None:
    with pytest.raises(TypeError, match="buffers or tensors"):
        tclient.put_many(keys_for(2), [b"x" * 16, torch.zeros(4)])


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_round_trip_through_the_registered_arena(agent: LocalAgent) -> None:
    with KVPoolClient(agent.socket_path) as c:
        cache = [layer.cuda() for layer in kv_cache(12)]
        keys = keys_for(4)
        stream = torch.cuda.Stream()
        assert c.put_many(keys, [chunk_segments(cache, b) for b in range(4)],
                          stream=stream) == [True] * 4
        empty = [torch.zeros_like(layer) for layer in cache]
        dests = [chunk_segments(empty, b) for b in range(4)]
        assert 0 not in c.get_many_into(keys, lambda i, n, m: dests[i], verify=True,
                                        stream=stream)
        assert all(torch.equal(a, b) for a, b in zip(cache, empty, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("on", ["own stream", "default stream"])
def test_gpu_windows_go_in_batch_calls_and_land_byte_exact(agent: LocalAgent, on: str) -> None:
    from kvpool.agent import cudacopy

    before = cudacopy.uses["batched"]
    stream = torch.cuda.Stream() if on == "own stream" else None  # the legacy default one
    with KVPoolClient(agent.socket_path) as c:
        cache = [layer.cuda() for layer in kv_cache(16, layers=16)]
        keys = keys_for(4, salt=7)
        chunks = [chunk_segments(cache, b) for b in range(4)]
        assert c.put_many(keys, chunks, stream=stream) == [True] * 4
        empty = [torch.zeros_like(layer) for layer in cache]
        dests = [chunk_segments(empty, b) for b in range(4)]
        assert 0 not in c.get_many_into(keys, lambda i, n, m: dests[i], stream=stream)
    assert all(torch.equal(a, b) for a, b in zip(cache, empty, strict=True))
    assert cudacopy.loaded.why == "", cudacopy.loaded.why
    assert cudacopy.uses["batched"] >= before + 2  # the put's window and the get's
    raw = RawConn(agent.socket_path)
    try:  # the sums made on the GPU are the agent's definition of WSUM
        for key, chunk in zip(keys, chunks, strict=True):
            reply = raw.call(p.Acquire(1, key))
            assert isinstance(reply, p.AcquireReply)
            assert reply.checksum_kind == checksums.WSUM
            host = [s.cpu() for s in chunk]
            assert reply.checksum == checksums.compute(checksums.WSUM, [packed(host)])
            raw.call(p.Release(2, reply.lease))
    finally:
        raw.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_flipped_byte_is_never_read_into_a_gpu_tensor_with_verify(
        agent: LocalAgent) -> None:
    with KVPoolClient(agent.socket_path) as c:
        cache = [layer.cuda() for layer in kv_cache(17)]
        keys = keys_for(3, salt=9)
        chunks = [chunk_segments(cache, b) for b in range(3)]
        assert c.put_many(keys, chunks) == [True] * 3
        conn = c._live().conn
        lease = conn.call(p.Acquire(conn.rid(), keys[1]))
        assert isinstance(lease, p.AcquireReply)
        arena = c._arena
        assert arena is not None
        arena[lease.extents[0][0] + 4321] ^= 0x04
        conn.cast(p.Release(conn.rid(), lease.lease))

        out = [[torch.zeros_like(s) for s in chunk] for chunk in chunks]
        sizes = c.get_many_into(keys, lambda i, n, m: out[i], verify=True)
        size = len(packed([s.cpu() for s in chunks[0]]))
        assert sizes == [size, 0, size]  # each verified on the GPU, the window's together
        assert all(torch.equal(a, b) for i in (0, 2) for a, b in zip(out[i], chunks[i],
                                                                     strict=True))


def _device_window(tclient: KVPoolClient, stream: StubStream) -> Any:
    """The copy step of a GPU's read window (`dma`: its own loop), here on CPU tensors."""
    from kvpool.agent import gpu
    from kvpool.agent.transport import BufferCopies, ZeroCopyTransport

    t = tclient._live()
    assert isinstance(t, ZeroCopyTransport)
    return gpu._TensorCopies(tclient._device(t), stream,
                             buffers=BufferCopies(t.arena, base=t.base), dma=True)


def test_a_device_read_window_reads_every_group_and_is_fenced_once_with_its_leases_held(
        agent: LocalAgent, tclient: KVPoolClient) -> None:
    from kvpool.agent.transport import read_groups, read_window

    keys = keys_for(40, salt=3)
    chunks = [chunk_segments(kv_cache(30 + b % 4), b % 4) for b in range(40)]
    assert tclient.put_many(keys, chunks) == [True] * 40
    assert len(read_groups(40)) == 2  # its ACQUIREs go in two groups
    out = [[torch.empty_like(s) for s in c] for c in chunks]
    with KVPoolClient(agent.socket_path) as observer:
        def every_lease_held() -> None:
            assert observer.stats()["leases"]["read"] == 40

        stream = StubStream(every_lease_held)
        sizes = [0] * 40
        read_window(tclient._live().conn, _device_window(tclient, stream), keys, 0,
                    lambda i, n, m: out[i], sizes)
        assert stream.waited == 1
        assert sizes == [len(packed(c)) for c in chunks]
        assert [packed(o) for o in out] == [packed(c) for c in chunks]
        wait_until(lambda: observer.stats()["leases"]["read"] == 0, what="the RELEASEs")


def test_a_device_read_window_failing_in_its_second_group_settles_then_releases_all(
        agent: LocalAgent, tclient: KVPoolClient) -> None:
    from kvpool.agent.transport import read_window

    keys = keys_for(20, salt=4)
    chunks = [chunk_segments(kv_cache(40), 0) for _ in range(20)]
    assert tclient.put_many(keys, chunks) == [True] * 20
    out = [[torch.empty_like(s) for s in c] for c in chunks]
    out[10] = out[10][:-1]  # too small: refused in the second group (keys 4 to 19)
    with KVPoolClient(agent.socket_path) as observer:
        def leases_still_held() -> None:
            assert observer.stats()["leases"]["read"] == 20

        stream = StubStream(leases_still_held)
        with pytest.raises(ValueError, match="does not fit"):
            read_window(tclient._live().conn, _device_window(tclient, stream), keys, 0,
                        lambda i, n, m: out[i], [0] * 20)
        assert stream.waited == 1  # the copies made so far, before any RELEASE
        wait_until(lambda: observer.stats()["leases"]["read"] == 0, what="the RELEASEs")
    assert tclient.get(keys[10], verify=True) == packed(chunks[10])  # still stored
