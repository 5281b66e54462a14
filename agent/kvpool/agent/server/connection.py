"""One client connection: whole frames in, replies out, in order.

A connection is closed when it sends garbage, stalls inside a frame, or stops
reading its replies; its leases end with it. What each op does is the
dispatcher's (dispatch.py); nothing a client sends can stop the loop.
"""

from __future__ import annotations

import array
import asyncio
import functools
import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from .. import __version__
from .. import protocol as p
from ..store import MAX_LEASES_PER_CLIENT, OpError
from ..store.peerreads import PeerRead
from .dispatch import commit_many

if TYPE_CHECKING:
    from .dispatch import Dispatcher
    from .space import Space

log = logging.getLogger("kvpool.agent")

RECEIVE_BUFFER = 64 * 1024
"""What a connection's receive buffer holds between frames. It grows for a large frame
and goes back to this once the frame is handled, so an idle connection holds no more."""
COALESCE_BYTES = 256 * 1024
"""Reply bytes held back for one send while more requests of a pipelined batch are
already buffered; past this they go out (a batch of inline GETs must not pile up)."""


MAX_COMMIT_BATCH = 1024
"""COMMITs handled as one batch at most (`Connection._commits`)."""
_COMMIT = int(p.Op.COMMIT)
_OPS = {int(op): op for op in p.Op}
"""An op byte's `Op` (a dict's look-up: `Op(byte)` runs the enum's constructor, twice a
chunk read)."""
_REQUEST_OPS: dict[type, p.Op] = {}
"""A decoded request's type's `Op`, filled as types come."""


def _op_of_request(req: object) -> p.Op:
    kind = type(req)
    op = _REQUEST_OPS.get(kind)
    if op is None:
        op = _REQUEST_OPS[kind] = p.Op(kind.__struct_config__.tag)  # type: ignore[attr-defined]
    return op


def _op_of(body: bytes | bytearray) -> int:
    """A request's op from its first bytes (a msgpack array led by its op: a fixarray and a
    positive fixint), or -1."""
    return body[1] if len(body) >= 2 and 0x90 <= body[0] <= 0x9F and body[1] < 0x80 else -1


class Closed(Exception):
    """The connection must close (EOF, timeout, or a frame we cannot recover from)."""


class _Held:
    """A request a peer read under way keeps from an answer now (an ACQUIRE of the chunk
    it brings, a WAIT with no key landed yet), held until the read settles
    (`Connection._hold`); `left` once no read it waits for is left and still it could not
    be answered (an ACQUIRE's read failed, or the chunk went again at once): the task
    answers it then, the slow way."""

    __slots__ = ("code", "left", "req", "started")

    def __init__(self, code: int, req: Any, started: float) -> None:
        self.code, self.req, self.started = code, req, started
        self.left = False


class Connection:
    def __init__(self, dispatcher: Dispatcher, space: Space, sock: socket.socket,
                 cid: int) -> None:
        self.dispatcher = dispatcher
        self.space = space
        self.store = space.store
        self.sock = sock
        self.id = cid
        self.tenant = space.tenant
        self.hello = False
        self.pod = ""
        self.model = ""
        """The engine pod and model its HELLO named (KV events' topic)."""
        self.block_size = 0
        self.chunk_tokens = 0
        """Tokens per chunk key, when HELLO said: LOOKUP then counts prefill tokens."""
        self.buf = bytearray(RECEIVE_BUFFER)
        self.start = 0
        self.end = 0
        self.task: asyncio.Task[None] | None = None
        self.out: list[bytes] = []
        """Replies of the requests handled since the last send (see `serve`)."""
        self.out_bytes = 0
        self.spares: set[int] = set()
        """Spare write leases (put-ahead) granted to this connection and still open."""
        self.loop = asyncio.get_running_loop()
        self.fd = sock.fileno()
        """Kept: a closed socket's fileno() is -1, and the loop knows the fd by number."""
        self.reading = False
        """Whether the fd is registered with the loop (`_readable` reads into the buffer)."""
        self.eof = False
        self.error: OSError | None = None
        self.need = 0
        """Bytes from self.start that `_fill` waits for (0: nobody waits)."""
        self.held: _Held | None = None
        """A request waiting for a landing from a peer (an ACQUIRE, a WAIT), the frames
        after it left in the buffer until it is answered (`_hold`)."""
        self.waiter: asyncio.Future[None] | None = None

    def ended(self) -> None:
        """The connection is gone: its pod's topic ends with its pod's last connection."""
        if self.hello and self.space.events is not None:
            self.space.events.disconnected(self.pod, self.model)

    # -- receiving. The socket stays registered with the loop while the connection is
    # served, and `_readable` reads whatever arrives into the buffer: a wait for a frame
    # costs a future, not two epoll_ctl system calls as well (loop.sock_recv_into
    # registered the fd and unregistered it at each wait that found nothing to read: a
    # third of the loop's time on a client's ACQUIRE and RELEASE frames in a profile).

    def _resume(self) -> None:
        if not self.reading and not self.eof:
            self.loop.add_reader(self.fd, self._readable)
            self.reading = True

    def _pause(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.fd)
            self.reading = False

    def _make_room(self, need: int) -> None:
        """Room to read into, for `need` bytes from self.start."""
        if self.start + need > len(self.buf) and self.start:
            pending = self.end - self.start
            self.buf[:pending] = self.buf[self.start : self.end]
            self.start, self.end = 0, pending
        if self.end == len(self.buf):
            # Grow by doubling as bytes arrive: a length prefix alone must not make
            # the agent allocate a whole frame for a client that never sends it.
            grown = bytearray(min(self.start + need, 2 * len(self.buf)))
            grown[: self.end] = self.buf[: self.end]
            self.buf = grown

    def _readable(self) -> None:
        """The loop's callback: the socket has bytes, or its end."""
        if self.end == len(self.buf):
            if self.end - self.start >= self.need:
                # Full, and nobody waits for more: stop reading until `_fill` asks (the
                # client's further bytes wait in its socket, as they would unread).
                self._pause()
                return
            self._make_room(self.need)
        view = memoryview(self.buf)[self.end :]
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.error = e
            n = 0
        finally:
            view.release()
        if n == 0:  # its end (or an error): read no more, the level-triggered fd stays ready
            self.eof = True
            self._pause()
        self.end += n
        if self.waiter is not None and not self.waiter.done():
            if n and self.held is not None:
                return  # behind the held request: its landing answers them (`_landed_held`)
            if n and self.need == 1 and self._quick():
                return  # every frame that came is answered: the task waits on
            self.waiter.set_result(None)

    def _quick(self) -> bool:
        """With the task waiting for a frame (`read_frame`, nothing held to send), answer
        the frames that came whose op answers at once (`Dispatcher.quick`: a RELEASE, an
        ACQUIRE of a chunk in DRAM), here in the loop's callback, and send their replies:
        the task is not woken for them (a turn of the loop, the coroutines' resumption and
        a future per frame: two frames per chunk an engine reads). True when every byte
        that came was so answered; False at the first frame that is not whole, not such an
        op or not answerable now (a chunk to read from below): it is left in the buffer,
        with the replies before it held in order, for the task to answer. An ACQUIRE of a
        chunk a peer read is bringing, or a WAIT none of whose keys has landed yet, is
        held for the landing instead (`_hold`), the replies before it sent: True, the task
        not woken."""
        if not self.hello or self.out:
            return False
        quick = self.dispatcher.quick
        limit = self.dispatcher.max_frame_bytes
        buf = self.buf
        while (pending := self.end - self.start) > 0:
            if pending < p.HEADER.size:
                return False
            (length,) = p.HEADER.unpack_from(buf, self.start)
            begin = self.start + p.HEADER.size
            if length > limit or pending < p.HEADER.size + length or length < 2:
                return False
            # A request is a msgpack array led by its op: a fixarray and a positive fixint.
            handler = quick.get(buf[begin + 1]) if 0x90 <= buf[begin] <= 0x9F else None
            if handler is None:
                return False
            started = time.perf_counter()
            try:
                with memoryview(buf) as view:
                    req = p.request_decoder.decode(view[begin : begin + length])
            except msgspec.MsgspecError:
                return False  # (the task answers it: BAD_FRAME)
            code = buf[begin + 1]
            answered = self._answer_now(handler, code, req, started)
            if isinstance(answered, PeerRead):
                if not self._send_now():
                    return False  # the task answers it (the reads it started go on)
                self.start = begin + length
                self._hold(answered, code, req, started)
                return True
            if not answered:
                return False  # not now: the task answers it (nothing was done)
            self.start = begin + length
            if self.out_bytes >= COALESCE_BYTES and not self._send_now():
                return False
        self.start = self.end = 0
        return self._send_now()

    def _answer_now(self, handler: Callable[[Connection, Any], Any], op_code: int, req: Any,
                    started: float) -> bool | PeerRead:
        """Answer a request of an op `Dispatcher.quick` names with its reply queued, counted
        as the task counts one: True. Where its handler says not now: False (nothing done:
        the task answers it), or the peer read under way whose settling may let it answer
        (the caller holds the request until then, `_hold`)."""
        metrics = self.dispatcher.metrics
        op = _OPS[op_code]
        try:
            reply = handler(self, req)
            if reply is None:
                return False
            if isinstance(reply, PeerRead):
                return reply
            self.reply(p.encode(reply))
            metrics.ops_ok[op].inc()
        except Exception as e:
            self._reply_error(op, req.rid, e)
        metrics.latency[op].observe(time.perf_counter() - started)
        return True

    def _hold(self, read: PeerRead, code: int, req: Any, started: float) -> None:
        """Hold a request a peer read keeps from an answer now (`_answer_now`) until the read
        settles, then answer it and the frames that came after it from the loop's callback
        (`_landed_held`), as `_quick` answers frames: a window of peer chunks is answered
        without the task waking for each (a future, the task's step and five coroutines
        resumed a chunk, the reading agent's loop's dearest callback at 1 MiB chunks)."""
        held = self.held = _Held(code, req, started)
        read.call_when_settled(functools.partial(self._landed_held, held))

    def _landed_held(self, held: _Held) -> None:
        """A read the held request waits for settled: its reply queued, and, with the task
        waiting for a frame, sent with the replies of the frames that came meanwhile
        (`_quick`, which may hold the next); the task is woken only for what it must
        answer. Still not answerable (a WAIT whose landed read failed), it waits for the
        next read it names."""
        if self.held is not held or held.left:
            return
        if self.eof:  # gone: no lease for it (the task ends the connection, `_fill`)
            self._wake()
            return
        answered = self._answer_now(self.dispatcher.quick[held.code], held.code, held.req,
                                    held.started)
        if isinstance(answered, PeerRead):
            answered.call_when_settled(functools.partial(self._landed_held, held))
            return
        if not answered:
            held.left = True  # the read failed, or the chunk went: a read from below, a miss
            self._wake()
            return
        self.held = None
        if self.waiter is None or self.waiter.done() or self.need != 1:
            return  # the task is on its way: it sends the reply with those after it
        if not self._send_now() or (self.end > self.start and not self._quick()):
            self._wake()
        elif not self.reading:  # (paused when the buffer filled behind the held request)
            self._resume()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _send_now(self) -> bool:
        """Send the held replies from the loop's callback; False where the socket did not
        take them all (the rest stays held: the task sends it, under the send timeout) or
        the send failed (the task finds the connection ended)."""
        frames = self.out[0] if len(self.out) == 1 else b"".join(self.out)
        self.out.clear()
        self.out_bytes = 0
        try:
            sent = self.sock.send(frames)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self.error = e
            self.eof = True
            self._pause()
            return False
        if sent == len(frames):
            return True
        self.reply(frames[sent:])
        return False

    async def _fill(self, need: int, timeout: float | None) -> None:
        """Wait until `need` bytes are buffered from self.start, each wait for more bytes
        at most `timeout`; and, between frames, while a request is held (`_hold`):
        returns with it held once the task must answer it (`_Held.left`). A client gone
        meanwhile ends the connection at once, its leases with it, not once the held
        chunk's read settles (up to `peers.timeout` later)."""
        while self.end - self.start < need or self.held is not None:
            if self.held is not None:
                if self.eof:
                    raise Closed("peer closed while a request waited for a peer's chunk")
                if self.held.left:
                    return
            if self.eof:
                if self.error is not None:
                    raise Closed(f"receive failed: {self.error}")
                raise Closed("peer closed" if self.end == self.start else "truncated frame")
            self._make_room(need)
            self.need = need
            # Bytes that came while this connection was busy are read now (as
            # sock_recv_into tried first), not at the loop's next poll: behind 8 clients'
            # work a turn of the loop is long (their ACQUIREs' p50 took 7x longer).
            self._readable()
            if (self.end - self.start >= need and self.held is None) or self.eof:
                self.need = 0
                continue
            if self.out:  # replies `_quick` answered and the socket did not take
                await self.flush()
                continue  # (bytes may have come meanwhile)
            self._resume()
            self.waiter = self.loop.create_future()
            try:
                if timeout is None:
                    await self.waiter
                else:
                    await asyncio.wait_for(self.waiter, timeout)
            except TimeoutError as e:
                raise Closed("frame not completed in time") from e
            finally:
                self.waiter = None
                self.need = 0

    async def read_frame(self) -> bytes | None:
        """The next frame's body; None where a request held for a landing (`_hold`) is
        the task's to answer (`_Held.left`)."""
        if self.end == self.start:
            self.start = self.end = 0
            if len(self.buf) > RECEIVE_BUFFER:  # a large frame is done with: give it back
                self.buf = bytearray(RECEIVE_BUFFER)
                self.dispatcher.memory_released = True
        await self._fill(1, None)  # idle between frames: no limit
        if self.held is not None:
            return None
        # inside a frame: the frame timeout
        await self._fill(p.HEADER.size, self.dispatcher.frame_timeout)
        (length,) = p.HEADER.unpack_from(self.buf, self.start)
        limit = self.dispatcher.max_frame_bytes
        if length > limit:
            await self.send_error(0, p.ErrorCode.FRAME_TOO_LARGE,
                                  f"frame of {length} bytes exceeds the limit of {limit}")
            raise Closed("frame too large")
        self.start += p.HEADER.size
        await self._fill(length, self.dispatcher.frame_timeout)
        with memoryview(self.buf) as view:  # one copy of the body, not two
            body = bytes(view[self.start : self.start + length])
        self.start += length
        return body

    def buffered_frame(self, op: int = -1) -> bytes | None:
        """The next frame's body when it is already whole in the buffer (and, given `op`,
        a request of that op), else None (a frame still arriving, or one too large, is
        left to `read_frame`)."""
        pending = self.end - self.start
        if pending < p.HEADER.size:
            return None
        (length,) = p.HEADER.unpack_from(self.buf, self.start)
        if length > self.dispatcher.max_frame_bytes or pending < p.HEADER.size + length:
            return None
        begin = self.start + p.HEADER.size
        if op >= 0 and (length < 2 or _op_of(self.buf[begin : begin + 2]) != op):
            return None
        with memoryview(self.buf) as view:
            body = bytes(view[begin : begin + length])
        self.start = begin + length
        return body

    def reply(self, frame: bytes) -> None:
        """Queue a reply; `flush` sends the queue in one write."""
        self.out.append(frame)
        self.out_bytes += len(frame)

    async def flush(self) -> None:
        if not self.out:
            return
        frames = self.out[0] if len(self.out) == 1 else b"".join(self.out)
        self.out.clear()
        self.out_bytes = 0
        await self.send(frames)

    async def send(self, frame: bytes) -> None:
        # Most replies fit the socket's buffer: one non-blocking send, no task. Only the
        # rest of a reply the client is slow to read waits, under the send timeout (in
        # Python 3.11 `wait_for` wraps its awaitable in a task: too dear for every reply).
        try:
            sent = self.sock.send(frame)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            raise Closed(f"send failed: {e}") from e
        if sent == len(frame):
            return
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_sendall(self.sock, memoryview(frame)[sent:]),
                                   self.dispatcher.send_timeout)
        except TimeoutError as e:
            raise Closed("client does not read its replies") from e
        except OSError as e:
            raise Closed(f"send failed: {e}") from e

    async def send_error(self, rid: int, code: p.ErrorCode, message: str) -> None:
        """Send an error reply now, after the replies queued before it (the connection
        is about to close)."""
        self.reply(p.encode(p.ErrorReply(rid=rid, code=int(code), message=message)))
        await self.flush()

    def close(self) -> None:
        # Marked ended first: a connection closed by the agent's stop before its task
        # first ran must not register its fd with the loop then (a closed fd: EBADF, or
        # its number already reused by another socket), and a read waiting on it ends.
        self._pause()
        self.eof = True
        self.sock.close()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def serve(self) -> None:
        self._resume()  # registered for the connection's life (paused only when full)
        try:
            await self._serve()
        finally:
            self._pause()

    async def _serve(self) -> None:
        while True:
            # No frame outlives its handling: an idle connection holds none of its bytes.
            body = await self.read_frame()
            if body is None:  # a held request its landing did not answer
                held, self.held = self.held, None
                assert held is not None
                await self._handle(b"", held.req)
            else:
                await self._handle_next(body)
            # A pipelined batch (a window of ACQUIREs, RELEASEs cast ahead of a call) is
            # often already whole in the buffer: its replies go out in one send, not one
            # each (a send per reply was ~18% of the loop's time under batches).
            while self.held is None and self.out_bytes < COALESCE_BYTES:
                body = self.buffered_frame()
                if body is None:  # (an empty body is a frame too: a malformed one)
                    break
                await self._handle_next(body)
            await self.flush()

    async def _handle_next(self, body: bytes) -> None:
        """Handle a frame; a COMMIT followed by more COMMITs already whole in the buffer (a
        put window's, which the client sends in one write) is handled with them, as one
        batch (`_commits`)."""
        if not self.hello:
            await self._handle(body)
            return
        code = _op_of(body)
        if code == _COMMIT:
            bodies = [body]
            while len(bodies) < MAX_COMMIT_BATCH \
                    and (more := self.buffered_frame(_COMMIT)) is not None:
                bodies.append(more)
            if len(bodies) > 1:
                await self._commits(bodies)
                return
        elif (handler := self.dispatcher.quick.get(code)) is not None:
            # A RELEASE, or an ACQUIRE of a chunk in DRAM, that came while the task was
            # busy (a window's, behind an ACQUIRE that waited for its chunk to land):
            # answered as `_quick` answers one, without the two coroutines and the checks
            # of `_handle`'s way; one it does not answer now takes that way.
            started = time.perf_counter()
            try:
                req = p.request_decoder.decode(body)
            except msgspec.MsgspecError:
                req = None  # (`_handle` answers it: BAD_FRAME)
            answered = req is not None and self._answer_now(handler, code, req, started)
            if isinstance(answered, PeerRead):  # answered as it lands, the frames after it
                self._hold(answered, code, req, started)  # left buffered
                return
            if answered:
                return
            await self._handle(body, req)
            return
        await self._handle(body)

    async def _commits(self, bodies: list[bytes]) -> None:
        """COMMITs that came together: their chunks journaled in one write and made visible
        (`dispatch.commit_many`), a reply each, in order; one that fails fails alone. Each
        request's latency is its share of the batch's time. A frame that does not decode
        ends the batch before it, and is answered as alone (the connection closes)."""
        metrics = self.dispatcher.metrics
        started = time.perf_counter()
        reqs: list[p.Commit] = []
        for body in bodies:
            try:
                req = p.request_decoder.decode(body)
            except msgspec.MsgspecError:
                break
            assert isinstance(req, p.Commit)  # (its op byte said so)
            reqs.append(req)
        replies: list[p.CommitReply | Exception]
        try:
            replies = commit_many(self, reqs)
        except Exception as e:  # a bug: every COMMIT of the batch says it
            replies = [e] * len(reqs)
        each = (time.perf_counter() - started) / max(1, len(reqs))
        op, ok, latency = p.Op.COMMIT, metrics.ops_ok[p.Op.COMMIT], metrics.latency[p.Op.COMMIT]
        for req, reply in zip(reqs, replies, strict=True):
            if isinstance(reply, Exception):
                self._reply_error(op, req.rid, reply)
            else:
                self.reply(p.encode(reply))
                ok.inc()
            latency.observe(each)
        if len(reqs) < len(bodies):
            await self._handle(bodies[len(reqs)])  # its error reply, and Closed

    async def _handle(self, body: bytes, decoded: Any = None) -> None:
        """Answer a request (`decoded`: its body decoded already)."""
        metrics = self.dispatcher.metrics
        started = time.perf_counter()
        try:
            req = p.request_decoder.decode(body) if decoded is None else decoded
        except msgspec.ValidationError as e:
            tag = p.peek_tag(body)
            if tag is not None and tag not in p.Op._value2member_map_:
                metrics.op_error(0, p.ErrorCode.UNKNOWN_OP)
                await self.send_error(0, p.ErrorCode.UNKNOWN_OP, f"unknown op {tag}")
                raise Closed("unknown op") from e
            metrics.op_error(tag or 0, p.ErrorCode.BAD_FRAME)
            await self.send_error(0, p.ErrorCode.BAD_FRAME, f"malformed request: {e}")
            raise Closed("malformed frame") from e
        except msgspec.DecodeError as e:
            metrics.op_error(0, p.ErrorCode.BAD_FRAME)
            await self.send_error(0, p.ErrorCode.BAD_FRAME, f"undecodable frame: {e}")
            raise Closed("undecodable frame") from e
        op = _op_of_request(req)
        try:
            if not self.hello and op is not p.Op.HELLO:
                raise OpError(p.ErrorCode.HELLO_REQUIRED, "send HELLO first")
            if op is p.Op.HELLO:
                assert isinstance(req, p.Hello)
                await self._hello(req)
            else:
                self.reply(p.encode(await self.dispatcher.dispatch(self, op, req)))
            metrics.ops_ok[op].inc()
        except Closed:
            raise
        except Exception as e:
            self._reply_error(op, req.rid, e)
        metrics.latency[op].observe(time.perf_counter() - started)

    def _reply_error(self, op: p.Op, rid: int, e: Exception) -> None:
        """The reply of a request that failed, counted: an OpError's code and message, or
        INTERNAL with the exception, logged with its traceback (called in its `except`): a
        bug must cost one request, not the agent."""
        if isinstance(e, OpError):
            code, message = e.code, e.message
        else:
            log.error("internal error serving %s", op.name, exc_info=e)
            code, message = p.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"
        self.dispatcher.metrics.op_error(op, code)
        self.reply(p.encode(p.ErrorReply(rid=rid, code=int(code), message=message)))

    def _mismatch(self, claimed: str) -> str:
        """Why a HELLO claiming another tenant than the socket's is refused: a tenant this
        agent has no space of (a name the pool does not have, or mistyped) is said to be
        missing, not just another tenant's."""
        served = f"this socket serves tenant {self.space.tenant!r}"
        tenants = self.dispatcher.tenants
        if claimed not in tenants:
            return (f"no tenant space {claimed!r} on this agent (its tenants: "
                    f"{', '.join(tenants)}); {served}")
        return f"{served}, the client claims {claimed!r}"

    async def _hello(self, req: p.Hello) -> None:
        if req.version != p.PROTOCOL_VERSION:
            raise OpError(p.ErrorCode.VERSION_MISMATCH,
                          f"agent speaks protocol {p.PROTOCOL_VERSION}, client asked {req.version}")
        if len(req.tenant.encode()) > p.MAX_TENANT_BYTES:
            raise OpError(p.ErrorCode.BAD_ARGUMENT,
                          f"tenant name of {len(req.tenant.encode())} bytes: at most "
                          f"{p.MAX_TENANT_BYTES}")
        space = self.space
        if space.isolated:
            # The socket, not the client, says whose connection this is.
            if req.tenant and req.tenant != space.tenant:
                raise OpError(p.ErrorCode.TENANT_MISMATCH, self._mismatch(req.tenant))
        else:
            self.tenant = req.tenant  # one space: the claim only picks quotas and priority
        if req.block_size < 0 or req.chunk_tokens < 0:
            raise OpError(p.ErrorCode.BAD_ARGUMENT, "block_size and chunk_tokens must be >= 0")
        self.hello = True
        self.pod, self.model = req.pod, req.model
        self.block_size, self.chunk_tokens = req.block_size, req.chunk_tokens
        if space.events is not None:
            space.events.connected(self.pod, self.model)
        cfg = space.config
        frame = p.encode(p.HelloReply(
            rid=req.rid, version=p.PROTOCOL_VERSION, agent_version=__version__, pool=cfg.pool,
            arena_bytes=space.arena.size, max_chunk_bytes=cfg.max_chunk_bytes,
            max_meta_bytes=cfg.max_meta_bytes, max_frame_bytes=self.dispatcher.max_frame_bytes,
            max_leases=MAX_LEASES_PER_CLIENT, tenant=self.tenant,
            peers=self.store.peer is not None,
        ))
        # The arena fd rides on the reply (SCM_RIGHTS); the reply is small and
        # the connection fresh, so one sendmsg carries it whole.
        await self.flush()  # replies before it keep their order
        # The lookup index's fd follows it (lookupindex.py); a client that asks for one
        # fd gets the arena's alone.
        fds = array.array("i", [space.arena.client_fd(), space.index.fd])
        try:
            sent = self.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except BlockingIOError as e:
            raise Closed("client does not read its replies") from e
        if sent < len(frame):
            await self.send(frame[sent:])
