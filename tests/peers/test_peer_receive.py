"""A reader's receive of one FETCH reply (`links.receive`), on each of its paths: the
compiled call that never takes the GIL (`peers.recvkernel`), straight into an arena
guarded against SIGBUS (`busguard`) or through the worker's buffer (an arena the guard
does not cover), and the Python one it falls back to (no llvmlite, TLS, an arena written
by pwrite). Over a real TCP connection on the
loopback into a real arena file: the bytes land in their extents and nowhere else, a bad
checksum is CORRUPT with the connection still in step, a head to refuse is a protocol
error, a cut or stalled reply an error or a timeout, a shrunk arena is put back, and any
fuzzed reply ends the same way on both paths."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent import busguard, checksums
from kvpool.agent.arena import Arena
from kvpool.agent.peers import links, recvkernel, wire
from kvpool.agent.peers.settle import Settler

KiB, MiB = 1 << 10, 1 << 20
ARENA = 8 * MiB
EXTENTS = [(0, MiB + 4 * KiB), (4 * MiB, MiB), (6 * MiB, 2 * MiB)]
"""Room for 4 MiB + 4 KiB; a chunk of 2.5 MiB spans all three, the third in part."""
GUARD = 0x5A


_WAY = {"straight": False}
"""Whether `target` offers the arena's SIGBUS guard (the `compiled` fixture's way)."""


@pytest.fixture(params=["straight", "buffer", "python"])
def compiled(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The compiled receive, straight into the guarded mapping or through the buffer; or
    the Python one."""
    if request.param != "python":  # the agent's install has llvmlite and the xxhash wheel's
        assert recvkernel.kernel() is not None  # symbols (and compiling it installs the guard)
        assert busguard.ready() is not None
    _WAY["straight"] = request.param == "straight"
    yield request.param != "python"
    _WAY["straight"] = False


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    a = Arena(tmp_path / "arena", ARENA, lock=False)
    os.pwrite(a.fd, bytes([GUARD]) * ARENA, 0)
    try:
        assert a.mapped_writes
        yield a
    finally:
        a.close()


def target(arena: Arena, extents: list[tuple[int, int]] = EXTENTS) -> links.ArenaTarget:
    if _WAY["straight"]:
        guard = arena.guard_counts()
        assert guard
        return links.ArenaTarget(arena.fd, extents, arena.write_run, arena.mapped_base, guard,
                                 arena.repair)
    return links.ArenaTarget(arena.fd, extents, arena.write_run, arena.mapped_base)


def reply(rid: int, data: bytes, meta: bytes = b"", tenant: str = "",
          kind: int = checksums.XXH3, checksum: int | None = None) -> bytes:
    if checksum is None:
        checksum = checksums.compute(kind, [data], meta)
    return wire.encode_reply(wire.OK, rid, kind=kind, size=len(data), checksum=checksum,
                             meta=meta, tenant=tenant) + data


def connection(stream: bytes, *, close: bool = True, seed: int = 0) -> socket.socket:
    """The reader's end of a TCP connection on the loopback whose other end sends `stream`
    in bursts of random sizes, then closes (or stays open, sending nothing more)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        reader = socket.create_connection(server.getsockname())
        sender, _ = server.accept()
    rng = random.Random(seed)

    def send() -> None:
        with sender, contextlib.suppress(OSError):  # the reader may close first
            at = 0
            while at < len(stream):
                n = rng.choice([7, 28, 1000, 64 * KiB, MiB])
                sender.sendall(stream[at : at + n])
                at += n
            if not close:
                sender.recv(1)  # until the reader's end closes
    threading.Thread(target=send, daemon=True).start()
    reader.settimeout(30)  # as the agent's sockets are, between receives
    return reader


def landed(arena: Arena, data: bytes, extents: list[tuple[int, int]] = EXTENTS) -> None:
    """`data` is in the extents' first bytes, and every other byte of the arena is as it
    was."""
    want = bytearray([GUARD]) * ARENA
    at = 0
    for offset, n in extents:
        part = data[at : at + n]
        want[offset : offset + len(part)] = part
        at += len(part)
    assert os.pread(arena.fd, ARENA, 0) == want


def receive(sock: socket.socket, rid: int, t: links.ArenaTarget, compiled: bool,
            seconds: float = 30.0,
            wake: Settler[links.Fetched | str] | None = None) -> links.Fetched | str:
    return links.receive(sock, rid, t, time.monotonic() + seconds, compiled=compiled,
                         wake=wake)


def by_kernel() -> int:
    rx = recvkernel.receiver(links._buffer())
    return rx.replies if rx is not None else 0


def test_a_reply_lands_in_its_extents_verified_and_the_next_one_follows(
        arena: Arena, compiled: bool) -> None:
    data = random.Random(1).randbytes(5 * MiB // 2 + 7)
    small = os.urandom(3000)
    before = by_kernel()
    with connection(reply(7, data, b"meta", "team-a") + reply(8, small)) as s:
        assert receive(s, 7, target(arena), compiled) == links.Fetched(
            len(data), checksums.compute(checksums.XXH3, [data], b"meta"), checksums.XXH3,
            b"meta", "team-a")
        landed(arena, data)
        assert receive(s, 8, target(arena, [(2 * MiB, 8 * KiB)]), compiled) == links.Fetched(
            len(small), checksums.compute(checksums.XXH3, [small]), checksums.XXH3, b"", "")
    assert by_kernel() == before + (2 if compiled else 0)


def test_a_reply_failing_its_checksum_is_corrupt_and_the_connection_stays_in_step(
        arena: Arena, compiled: bool) -> None:
    data, good = os.urandom(MiB + 5), os.urandom(MiB)
    bad = reply(1, data, checksum=checksums.compute(checksums.XXH3, [data]) ^ 1)
    with connection(bad + reply(2, good)) as s:
        assert receive(s, 1, target(arena), compiled) == links.CORRUPT
        assert receive(s, 2, target(arena), compiled) == links.Fetched(
            len(good), checksums.compute(checksums.XXH3, [good]), checksums.XXH3, b"", "")
        landed(arena, good + data[MiB:])  # the corrupt one's bytes stay where it put them


def test_absent_wsum_and_unknown_kinds_are_taken_after_the_head_as_in_python(
        arena: Arena, compiled: bool) -> None:
    """The kernel takes XXH3 replies only: it hands any other head back and the receive
    goes on in Python from there."""
    wsum, odd, last = os.urandom(300 * KiB + 3), os.urandom(64 * KiB), os.urandom(KiB)
    stream = (wire.encode_reply(wire.ABSENT, 1) + reply(2, wsum, b"m", kind=checksums.WSUM)
              + reply(3, odd, kind=9, checksum=0) + reply(4, last))
    with connection(stream) as s:
        assert receive(s, 1, target(arena), compiled) == links.ABSENT
        got = receive(s, 2, target(arena), compiled)
        assert isinstance(got, links.Fetched) and got.kind == checksums.WSUM
        landed(arena, wsum)
        assert receive(s, 3, target(arena), compiled) == links.CORRUPT
        assert isinstance(receive(s, 4, target(arena), compiled), links.Fetched)
        landed(arena, last + odd[KiB:] + wsum[64 * KiB:])


@pytest.mark.parametrize("head", [
    wire.encode_reply(wire.OK, 6, size=10),  # another request's reply
    wire.encode_reply(wire.OK, 5, size=4 * MiB + 4 * KiB + 1),  # more than reserved
    bytes([2]) + wire.encode_reply(wire.OK, 5)[1:],  # no such status
    wire.REPLY.pack(wire.OK, 0, 0, 5, 10, 0, wire.MAX_META_BYTES + 1),
    wire.REPLY.pack(wire.OK, 0, wire.MAX_TENANT_BYTES + 1, 5, 10, 0, 0),
], ids=["rid", "size", "status", "meta", "tenant"])
def test_a_head_the_reader_must_refuse_is_a_protocol_error_and_nothing_lands(
        arena: Arena, compiled: bool, head: bytes) -> None:
    with connection(head + os.urandom(64 * KiB)) as s, pytest.raises(wire.WireError):
        receive(s, 5, target(arena), compiled)
    landed(arena, b"")


def test_a_reply_cut_short_is_an_error_and_one_that_stalls_a_timeout(
        arena: Arena, compiled: bool) -> None:
    data = os.urandom(2 * MiB)
    cut = reply(1, data)[: -MiB // 2]
    with connection(cut) as s, pytest.raises(ConnectionError):
        receive(s, 1, target(arena), compiled)
    with connection(cut, close=False) as s, pytest.raises(TimeoutError):
        receive(s, 1, target(arena), compiled, seconds=0.3)
    with connection(reply(1, data)[:10], close=False) as s, pytest.raises(TimeoutError):
        receive(s, 1, target(arena), compiled, seconds=0.3)  # within the head


def test_an_arena_a_client_shrank_is_put_back_and_the_reply_lands_whole(
        arena: Arena, compiled: bool) -> None:
    """A page past a shrunk file is EFAULT to the kernel's copy, never SIGBUS: the compiled
    receive hands the piece back, `Arena.write_run` puts the file back and writes it, and
    the receive goes on from the next piece."""
    data = os.urandom(5 * MiB // 2)
    os.ftruncate(arena.fd, 4 * MiB)  # as a client's fd can: the last two extents are past it
    with connection(reply(1, data, b"m")) as s:
        assert isinstance(receive(s, 1, target(arena), compiled), links.Fetched)
    assert arena.resizes == 1 and os.fstat(arena.fd).st_size == ARENA
    got = b"".join(os.pread(arena.fd, n, o) for o, n in EXTENTS)
    assert got[: len(data)] == data


def test_fuzzed_replies_end_alike_on_both_paths_and_write_only_into_their_extents(
        tmp_path: Path) -> None:
    """The same fuzzed byte streams into every path: the same result or the same error,
    the same bytes in the extents of a read that ended (the rest are freed unread), and
    nothing outside the extents ever written."""
    assert recvkernel.kernel() is not None
    rng = random.Random(29)
    extents = [(64 * KiB, 16 * KiB), (256 * KiB, 8 * KiB)]
    arenas = [Arena(tmp_path / f"arena{i}", ARENA // 8, lock=False) for i in range(3)]
    try:
        for case in range(150):
            data = rng.randbytes(rng.choice([0, 1, 100, 16 * KiB, 24 * KiB]))
            meta = rng.randbytes(rng.choice([0, 5]))
            stream = bytearray(reply(3, data, meta, rng.choice(["", "t"]),
                                     kind=rng.choice([checksums.XXH3, checksums.WSUM])))
            for _ in range(rng.randint(0, 3)):  # flip bytes, mostly in the head
                at = rng.randrange(min(len(stream), wire.REPLY.size + 8))
                stream[at] = rng.getrandbits(8)
            if rng.random() < 0.3:
                del stream[rng.randrange(len(stream)) :]
            if rng.random() < 0.3:
                stream += rng.randbytes(rng.randint(1, 64))
            outcomes = []
            for arena, (way, straight) in zip(arenas, [(True, True), (True, False),
                                                       (False, False)], strict=True):
                _WAY["straight"] = straight
                os.pwrite(arena.fd, bytes([GUARD]) * (ARENA // 8), 0)
                with connection(bytes(stream), seed=case) as s:
                    try:
                        outcome: object = receive(s, 3, target(arena, extents), way, 5.0)
                    except (wire.WireError, OSError) as e:
                        outcome = type(e)
                outside = bytearray(os.pread(arena.fd, ARENA // 8, 0))
                inside = [bytes(outside[o : o + n]) for o, n in extents]
                for o, n in extents:
                    outside[o : o + n] = bytes([GUARD]) * n
                assert outside == bytes([GUARD]) * (ARENA // 8), case
                # A failed read's extents are freed unread: what a reply cut short left in
                # them differs by path (straight in, or held in the buffer).
                outcomes.append((outcome, None if isinstance(outcome, type) else inside))
            assert outcomes[0] == outcomes[1] == outcomes[2], case
    finally:
        _WAY["straight"] = False
        for a in arenas:
            a.close()


def test_a_receive_makes_the_wake_up_a_settled_read_owes_before_it_waits(
        arena: Arena, compiled: bool) -> None:
    """A worker settles a read with the loop's wake-up deferred to its next receive (made
    there without the GIL, by the compiled call): the next reply is sent only once the loop
    has the first result, so a receive that waited first would wait for ever."""
    data = os.urandom(MiB)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        settler: Settler[links.Fetched | str] = Settler(loop)
        first = loop.create_future()
        with socket.create_server(("127.0.0.1", 0)) as server:
            reader = socket.create_connection(server.getsockname())
            sender, _ = server.accept()
        with reader, sender:
            def worker() -> links.Fetched | str:
                assert settler.settle(first, links.ABSENT, defer=True)
                return receive(reader, 1, target(arena), compiled, seconds=30.0, wake=settler)
            second = loop.run_in_executor(None, worker)
            assert await asyncio.wait_for(first, 20) == links.ABSENT
            sender.sendall(reply(1, data))
            assert isinstance(await second, links.Fetched)
        settler.close()

    asyncio.run(main())
    landed(arena, data)


def test_a_guarded_arena_takes_the_bytes_straight_into_its_mapping(arena: Arena) -> None:
    """Into a guarded arena the compiled receive puts each piece straight where it goes
    (one copy): the worker's buffer never holds the chunk's bytes, where the buffer's way
    leaves the last piece in it."""
    assert recvkernel.kernel() is not None and busguard.ready() is not None
    data = os.urandom(5 * MiB // 2)
    buf = links._buffer()
    for straight in (True, False):
        _WAY["straight"] = straight
        try:
            buf[:] = bytes([GUARD]) * len(buf)
            with connection(reply(1, data, b"m")) as s:
                assert isinstance(receive(s, 1, target(arena), True), links.Fetched)
        finally:
            _WAY["straight"] = False
        landed(arena, data)
        assert (bytes(buf) == bytes([GUARD]) * len(buf)) is straight


def test_a_fault_the_guard_answered_is_repaired_before_a_receive_trusts_the_mapping(
        arena: Arena) -> None:
    """A load from a page past a shrunk file is a zero page, counted, never SIGBUS; the
    next receive into the arena first puts the file back and maps it over the zero page
    again (`Arena.repair`), so the bytes it receives land in the file and the mapping is
    the file's again."""
    assert recvkernel.kernel() is not None  # (compiling it installs the guard)
    guard = busguard.ready()
    assert guard is not None
    _WAY["straight"] = True
    try:
        t = target(arena)
        base = arena.mapped_base
        faults = guard.faults
        os.ftruncate(arena.fd, 4 * MiB)  # as a client's fd can
        assert ctypes.string_at(base + 6 * MiB, 4) == bytes(4)  # was SIGBUS: now zeros
        assert guard.faults == faults + 1 and not guard.clean()
        data = os.urandom(5 * MiB // 2)
        with connection(reply(1, data)) as s:
            assert isinstance(receive(s, 1, t, True), links.Fetched)
    finally:
        _WAY["straight"] = False
    assert guard.clean() and os.fstat(arena.fd).st_size == ARENA
    got = b"".join(os.pread(arena.fd, n, o) for o, n in EXTENTS)
    assert got[: len(data)] == data
    os.pwrite(arena.fd, b"file", 6 * MiB + 100)  # the zero page is gone: the file's again
    assert ctypes.string_at(base + 6 * MiB + 100, 4) == b"file"


def test_a_sigbus_outside_the_guarded_ranges_still_ends_the_process(tmp_path: Path) -> None:
    """The guard answers faults in guarded ranges only: anywhere else the action it
    replaced runs (here the default: the process ends by SIGBUS)."""
    script = f"""
import ctypes, mmap, os
from kvpool.agent import busguard
assert busguard.guard() is not None
fd = os.open({str(tmp_path / "other")!r}, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 8192)
m = mmap.mmap(fd, 8192, flags=mmap.MAP_SHARED)
os.ftruncate(fd, 0)
print("faulting", flush=True)
ctypes.string_at(ctypes.addressof(ctypes.c_char.from_buffer(m)), 4)
print("survived", flush=True)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout == "faulting\n" and out.returncode == -signal.SIGBUS, out
