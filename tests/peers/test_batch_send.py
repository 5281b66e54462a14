"""FETCH replies sent a batch at a time by a worker in one compiled call (`peers.batchsend`,
`peers.sendkernel`), on a real TCP connection served by asyncio with small socket buffers: a
batch (a reply past the buffers in two file ranges, an ABSENT head, a small reply) arrives
whole and in order while the reader takes it slowly, the transport reading again and writing
after it; each head leaves in the segment of its chunk's first bytes; a reader that takes no
bytes ends the batch with a timeout, saying how far it went, and one that resets the
connection with the call's errno; a reset of the connection (`Unacked.reset`) stops a batch
waiting for room and aborts the transport only once the worker's call is over, and so does a
cancellation; a file that ends before its range ends the batch. Memory ranges (what a reader
on the holder's kernel is sent: copies out of the arena's mapping) go in the same call, and
a mapped page past a file a client shrank ends the batch with EFAULT, never a SIGBUS."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import mmap
import os
import socket
import struct
from pathlib import Path

import pytest

from kvpool.agent.peers import sendkernel
from kvpool.agent.peers.batchsend import BatchSender
from kvpool.agent.peers.unacked import Unacked

from .served import segments_out, served, take

CHUNK = 4 << 20
"""Far more than the sockets' buffers (`served` makes them small): most of it waits for room."""


@pytest.fixture(autouse=True)
def _compiled() -> None:
    if sendkernel.kernel() is None:
        pytest.fail("the send kernel did not compile (llvmlite is a dependency)")


def _sender(writer: asyncio.StreamWriter) -> BatchSender:
    sender = BatchSender.make(writer.transport)
    assert sender is not None and sender.free()
    return sender


def test_a_batch_arrives_whole_and_in_order_and_the_transport_reads_and_writes_after_it(
        tmp_path: Path) -> None:
    data = os.urandom(CHUNK)
    path = tmp_path / "chunk"
    path.write_bytes(b"x" * 4096 + data)  # the chunk at an offset, in two ranges

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with served(path) as (writer, reader, fd):
            taking = loop.run_in_executor(None, take, reader, 5 + CHUNK + 6 + 3 + 100 + 5, 64 << 10)
            sender = _sender(writer)
            batch = sendkernel.Batch()
            half = 4096 + CHUNK // 2
            batch.add(b"HEAD1", fd, [(4096, CHUNK // 2), (half, CHUNK - CHUNK // 2)])
            batch.add(b"ABSENT", -1, [])
            batch.add(b"H3!", fd, [(4096, 100)])
            started = loop.time()
            assert await sender.send(batch, 30.0) == sendkernel.DONE
            assert (batch.done, batch.partial) == (3, False)
            assert started <= batch.end(0) <= batch.end(1) <= batch.end(2) <= loop.time()
            assert writer.transport.is_reading()  # paused while the worker sent
            writer.write(b"after")  # through the transport, after the batch
            await writer.drain()
            received = await taking
            sender.close()
        assert received == b"HEAD1" + data + b"ABSENT" + b"H3!" + data[:100] + b"after"

    asyncio.run(main())


def test_each_head_leaves_with_its_chunks_first_bytes_in_one_segment(tmp_path: Path) -> None:
    # asyncio's transports set TCP_NODELAY: a head sent on its own is a segment of its own.
    data = os.urandom(100)
    path = tmp_path / "chunk"
    path.write_bytes(data)

    async def main() -> None:
        async with served(path) as (writer, reader, fd):
            sock = writer.get_extra_info("socket")
            sender = _sender(writer)
            batch = sendkernel.Batch()
            batch.add(b"HEAD" * 7, fd, [(0, len(data))])
            before = segments_out(sock)
            assert await sender.send(batch, 5.0) == sendkernel.DONE
            assert take(reader, 28 + len(data)) == b"HEAD" * 7 + data
            assert segments_out(sock) - before == 1
            sender.close()

    asyncio.run(main())


def _sent_unread(tmp_path: Path, replies: int, timeout: float,
                 reset: bool = False) -> tuple[int, sendkernel.Batch]:
    """What a batch of `replies` replies of CHUNK bytes each ends with, sent to a reader
    that never reads (`reset`: that has closed the connection with a reset), and the batch."""
    path = tmp_path / "chunk"
    path.write_bytes(os.urandom(CHUNK))

    async def main() -> tuple[int, sendkernel.Batch]:
        async with served(path) as (writer, reader, fd):
            sender = _sender(writer)
            batch = sendkernel.Batch()
            for _ in range(replies):
                batch.add(b"HEAD", fd, [(0, CHUNK)])
            if reset:  # a zero linger: the close sends a reset, not a FIN
                reader.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                reader.close()
            code = await sender.send(batch, timeout)
            sender.close()
            return code, batch

    return asyncio.run(main())


def test_a_reader_that_stops_taking_bytes_ends_the_batch_with_a_timeout(
        tmp_path: Path) -> None:
    code, batch = _sent_unread(tmp_path, 3, 0.2)
    assert code == sendkernel.TIMEOUT
    assert (batch.done, batch.partial) == (0, True)  # the first reply stopped part way


def test_a_reader_that_resets_the_connection_ends_the_batch_with_its_errno(
        tmp_path: Path) -> None:
    code, batch = _sent_unread(tmp_path, 1, 5.0, reset=True)
    assert code == sendkernel.ERRNO
    assert batch.errno in (errno.ECONNRESET, errno.EPIPE)
    assert batch.done == 0


def test_a_reset_stops_a_batch_waiting_for_room_and_aborts_the_transport_after_it(
        tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(os.urandom(CHUNK))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with served(path) as (writer, _reader, fd):
            released: list[int] = []
            sender = _sender(writer)
            unacked = Unacked(writer.transport, writer.get_extra_info("socket"), 30.0,
                              sender.stop)
            batch = sendkernel.Batch()
            batch.add(b"HEAD", fd, [(0, CHUNK)])
            sending = loop.create_task(sender.send(batch, 30.0))
            while sender.running is None or not batch.partial:
                await asyncio.sleep(0.01)  # the worker waits for room (nobody reads)
            unacked.reset()
            # The socket stays open while the worker may still use it; a lease held
            # meanwhile waits for the close.
            assert not writer.transport.is_closing()
            unacked.hold(lambda: released.append(1))
            assert await sending == sendkernel.STOPPED
            await asyncio.sleep(0.01)
            assert writer.transport.is_closing()
            await unacked.settle(wait=True)
            assert released == [1]
            assert not sender.free()  # the connection is ending: no other batch
            sender.close()

    asyncio.run(main())


def test_a_cancelled_batch_returns_only_once_the_workers_call_is_over(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(os.urandom(CHUNK))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with served(path) as (writer, _reader, fd):
            sender = _sender(writer)
            batch = sendkernel.Batch()
            batch.add(b"HEAD", fd, [(0, CHUNK)])
            sending = loop.create_task(sender.send(batch, 30.0))
            while sender.running is None or not batch.partial:
                await asyncio.sleep(0.01)
            running = sender.running
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending
            assert running.done() and running.result() == sendkernel.STOPPED
            assert sender.running is None
            sender.close()

    asyncio.run(main())


def test_a_file_that_ends_before_its_range_ends_the_batch(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(os.urandom(1000))

    async def main() -> None:
        async with served(path) as (writer, _reader, fd):
            sender = _sender(writer)
            batch = sendkernel.Batch()
            batch.add(b"OK", fd, [(0, 1000)])
            batch.add(b"CUT", fd, [(0, 4000)])
            assert await sender.send(batch, 5.0) == sendkernel.ENDED
            assert (batch.done, batch.partial) == (1, True)
            sender.close()

    asyncio.run(main())


def test_memory_ranges_arrive_in_order_among_file_ranges(tmp_path: Path) -> None:
    data = os.urandom(CHUNK)
    path = tmp_path / "chunk"
    path.write_bytes(data)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with served(path) as (writer, reader, fd):
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), CHUNK) as mm:
                base = _address(mm)
                taking = loop.run_in_executor(None, take, reader, 2 + CHUNK + 2 + 100 + 2 + 50,
                                              64 << 10)
                sender = _sender(writer)
                batch = sendkernel.Batch()
                half = CHUNK // 2
                batch.add(b"M1", -1, [(base, half), (base + half, CHUNK - half)])
                batch.add(b"F2", fd, [(0, 100)])
                batch.add(b"M3", -1, [(base + 1000, 50)])
                assert await sender.send(batch, 30.0) == sendkernel.DONE
                assert (batch.done, batch.partial) == (3, False)
                received = await taking
                sender.close()
        assert received == b"M1" + data + b"F2" + data[:100] + b"M3" + data[1000:1050]

    asyncio.run(main())


def test_a_mapped_page_past_a_shrunk_file_ends_the_batch_with_efault(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    path.write_bytes(os.urandom(4 * 4096))

    async def main() -> None:
        async with served(path) as (writer, _reader, _fd):
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4 * 4096) as mm:
                base = _address(mm)
                os.truncate(path, 4096)  # as a client's fd of the arena can
                sender = _sender(writer)
                batch = sendkernel.Batch()
                batch.add(b"OK", -1, [(base, 100)])
                batch.add(b"PAST", -1, [(base + 2 * 4096, 4096)])
                assert await sender.send(batch, 5.0) == sendkernel.ERRNO
                assert batch.errno == errno.EFAULT
                assert (batch.done, batch.partial) == (1, True)
                sender.close()

    asyncio.run(main())


def _address(mm: mmap.mmap) -> int:
    """The mapping's address (the anchor goes at once: the mapping may close after)."""
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor
