"""FETCH replies sent straight from the event loop (`peers.direct`): on a real TCP
connection served by asyncio, a reply larger than the socket's buffer arrives whole and in
order, head first, while the reader takes it slowly; a reply's head leaves with its
chunk's first bytes, in one TCP segment; the transport writes after it once the sender is
quiet; a reader that stops taking bytes ends the reply with a timeout, and
no writer callback is left on the socket."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from kvpool.agent.peers.direct import DirectSender

from .served import segments_out, served, take

CHUNK = 4 << 20
"""Far more than the sockets' buffers (`served` makes them small): most of it waits for room."""


def _registered_writer(loop: asyncio.AbstractEventLoop, fd: int) -> bool:
    selector = loop._selector  # type: ignore[attr-defined]
    try:
        key = selector.get_key(fd)
    except KeyError:
        return False
    return bool(key.data[1] is not None)


def test_a_reply_past_the_socket_buffer_arrives_whole_and_the_transport_writes_after_it(
        tmp_path: Path) -> None:
    data = os.urandom(CHUNK)
    path = tmp_path / "chunk"
    path.write_bytes(b"x" * 4096 + data)  # the chunk at an offset, in two ranges
    head = b"HEAD" * 16

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with served(path) as (writer, reader, fd):
            taking = loop.run_in_executor(None, take, reader, len(head) + CHUNK + 5, 64 << 10)
            direct = DirectSender.make(writer.transport)
            assert direct is not None and direct.ready()
            half = 4096 + CHUNK // 2
            # The socket takes a part; the rest goes from the writer callback.
            assert not direct.send(head, fd, [(4096, CHUNK // 2),
                                              (half, CHUNK - CHUNK // 2)])
            await direct.rest(30.0)
            direct.quiet()
            assert not _registered_writer(loop, direct.fd)
            writer.write(b"after")  # through the transport, after the reply
            await writer.drain()
            received = await taking
            direct.close()
        assert received == head + data + b"after"

    asyncio.run(main())


def test_a_reader_that_stops_taking_bytes_ends_the_reply_with_a_timeout(
        tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(os.urandom(CHUNK))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with served(path) as (writer, _reader, fd):
            direct = DirectSender.make(writer.transport)
            assert direct is not None
            assert not direct.send(b"HEAD", fd, [(0, CHUNK)])  # the reader never reads
            try:
                await direct.rest(0.2)
            except TimeoutError:
                pass
            else:
                raise AssertionError("a reply nobody reads went out whole")
            assert not _registered_writer(loop, direct.fd)
            direct.close()

    asyncio.run(main())


def test_a_replys_head_leaves_with_its_first_bytes_in_one_segment(tmp_path: Path) -> None:
    # asyncio's transports set TCP_NODELAY: a head written on its own was a segment of its
    # own (one more packet per chunk for both ends), before its bytes.
    data = os.urandom(100)
    path = tmp_path / "chunk"
    path.write_bytes(data)
    head = b"HEAD" * 7

    async def main() -> None:
        async with served(path) as (writer, reader, fd):
            sock = writer.get_extra_info("socket")
            direct = DirectSender.make(writer.transport)
            assert direct is not None
            before = segments_out(sock)
            assert direct.send(head, fd, [(0, len(data))])  # small: out at once
            assert take(reader, len(head) + len(data)) == head + data
            assert segments_out(sock) - before == 1
            direct.close()

    asyncio.run(main())
