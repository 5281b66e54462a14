"""The client library inference processes import.

`KVPoolClient` talks to the node's agent over its Unix socket. In the default
zero-copy mode it maps the agent's DRAM arena (the fd arrives with the HELLO
reply) and moves chunk bytes straight between the caller's buffers and the
mapping; only ~100-byte control frames cross the socket. Inline mode sends
the bytes in the frames instead (same semantics, for clients that cannot map
shared memory).

The two modes are two transports behind one interface (`kvpool.agent.transport`).

Batch calls also take torch tensors (on a GPU or the CPU), or a chunk as a list of
tensor segments, and copy them straight to and from the arena on a stream the
caller may pass (`kvpool.agent.gpu`, imported only when a tensor is passed: this
module never imports torch).

If the agent restarts, the client reconnects with backoff, maps the new
arena, and retries the call that failed; leases never survive a reconnect,
so a retried put or get starts over.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from . import leasefree
from . import protocol as p
from .constants import (
    DEFAULT_SOCKET,
    ENV_LEASE_FREE,
    ENV_LOCAL_LOOKUP,
    ENV_PUT_AHEAD,
    ENV_SOCKET,
    ENV_TENANT,
    KEY_BYTES,
    PEER_TIER_CODE,
    TIER_CODES,
    TIER_NAMES,
)
from .hostcopy import BlockTargets, HostTargets
from .protocol import EngineBlocks
from .putwindows import PutCall
from .transport import (
    Buffer,
    BufferCopies,
    HeldCasts,
    Meanwhile,
    Mode,
    PutResult,
    ReadTarget,
    Transport,
    ZeroCopyTransport,
    as_bytes_view,
    connect,
)

if TYPE_CHECKING:
    from .gpu import DeviceArena, Registrar

__all__ = ["BATCH_WINDOW", "AgentUnavailable", "Buffer", "EngineBlocks", "KVPoolClient",
           "PutResult", "ReadTarget"]

T = TypeVar("T")
DRAM_CODE = TIER_CODES["dram"]
WAIT_KEYS = 16
"""Keys a WAIT names at most: the first of those a window still waits for. Peer reads
land about in the window's order, so the first few are the ones to hear of; a WAIT of all
of them would cost the agent a look at every one each time a few landed."""

BATCH_WINDOW = 128
"""Requests a batch call keeps in flight: bounds queued replies and leases held at once."""


def default_socket(socket_path: str | os.PathLike[str] | None = None) -> str:
    """The agent socket to use: `socket_path`, else `$KVPOOL_SOCKET`, else the socket an
    agent started without `--socket` serves (one default for the client and the CLI)."""
    if socket_path is not None and os.fspath(socket_path):
        return os.fspath(socket_path)
    return os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET


_PLANNED = (BlockTargets, HostTargets)
"""Targets whose every destination is known before the read (`leasefree.read_planned`)."""


class AgentUnavailable(ConnectionError):
    """The agent could not be reached within the reconnect budget."""


class KVPoolClient:
    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        mode: Mode = "zero_copy",
        tenant: str | None = None,
        name: str = "",
        reconnect_timeout: float = 10.0,
        timeout: float = 30.0,
        batch_window: int = BATCH_WINDOW,
        registrar: Registrar | None = None,
        local_lookup: bool | None = None,
        pod: str = "",
        model: str = "",
        block_size: int = 0,
        chunk_tokens: int = 0,
        put_ahead: bool | None = None,
        lease_free: bool | None = None,
    ) -> None:
        """`socket_path` defaults to `$KVPOOL_SOCKET`, else the agent's default
        (`/run/kvpool/agent.sock`): where `kvpool agent` serves when given none.

        `registrar` pins each arena mapping for DMA when tensors first use it; by
        default CUDA's (`cudaHostRegister`) where torch sees a GPU, else none.

        `local_lookup` answers `lookup` from the tables the agent publishes in shared
        memory (its DRAM keys and, where it reads peers and has no NVMe tier, the keys
        readable peers hold), without a round trip, where they can say (docs/client.md);
        the agent is still told of each such LOOKUP (not waited for), so hit counts and
        the eviction order stay as if it had been asked.

        `pod`, `model` and `block_size` (tokens per engine block) name the engine for KV
        events (docs/events.md): its pod's topic is `kv@<pod>@<model>`. `chunk_tokens`
        (tokens per chunk key) lets the agent count the prefill tokens LOOKUPs serve.
        All optional.

        `put_ahead`: each `put`'s COMMIT asks for the next put's write lease of its size, so
        the next put of that size needs one round trip, not two; the connection holds one
        spare lease per size (at most `protocol.MAX_SPARE_LEASES` sizes) in the arena
        meanwhile (docs/client.md). None reads `$KVPOOL_PUT_AHEAD`.

        `lease_free`: `get_many_into` and `get_into` read DRAM chunks of one extent straight
        from the arena where the lookup index says where they are, with no ACQUIRE (each
        copy checked against its checksum and the index after it; anything else goes
        through a lease as before: docs/protocol.md, "Reads without a lease"); the agent is
        told of the reads with the next call, not waited for. None reads
        `$KVPOOL_LEASE_FREE` (`0`/`false`/`no` or `1`/`true`/`yes`), and without it follows
        `local_lookup` (a plain client's reads stay in step with the agent)."""
        self.socket_path = default_socket(socket_path)
        self.mode = mode
        self.tenant = tenant if tenant is not None else os.environ.get(ENV_TENANT, "")
        self.name = name
        self.reconnect_timeout = reconnect_timeout
        self.timeout = timeout
        self.batch_window = batch_window
        self.registrar = registrar
        if local_lookup is None:
            local_lookup = os.environ.get(ENV_LOCAL_LOOKUP, "") in ("1", "true", "yes")
        self.local_lookup = local_lookup
        if put_ahead is None:
            put_ahead = os.environ.get(ENV_PUT_AHEAD, "") in ("1", "true", "yes")
        self.put_ahead = put_ahead
        self.lease_free = env_flag(ENV_LEASE_FREE, local_lookup) if lease_free is None \
            else lease_free
        self._metas = leasefree.Metas()
        """The metadata of chunks seen so far, for lease-free reads (by its hash)."""
        self.reads_without_lease = 0
        """Chunks read without a lease so far (`lease_free`)."""
        self.pod = pod
        self.model = model
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self._rid = itertools.count(1)
        self._transport: Transport | None = None
        self.hello: p.HelloReply | None = None
        self._connect()

    # -- connection

    def _connect(self) -> None:
        hello = p.Hello(next(self._rid), p.PROTOCOL_VERSION, self.name, self.tenant,
                        pod=self.pod, model=self.model, block_size=self.block_size,
                        chunk_tokens=self.chunk_tokens)
        transport, reply = connect(self.socket_path, self.mode, hello, self.timeout, self._rid)
        self._drop_transport()
        if isinstance(transport, ZeroCopyTransport):
            transport.put_ahead = self.put_ahead
        self._transport = transport
        self.hello = reply

    def _reconnect(self) -> None:
        if self._transport is not None:
            self._transport.conn.close()
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.02
        while True:
            try:
                self._connect()
                return
            except (OSError, p.ProtocolError) as e:
                if time.monotonic() + delay > deadline:
                    raise AgentUnavailable(
                        f"agent at {self.socket_path} unreachable for "
                        f"{self.reconnect_timeout:.0f}s: {e}") from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _drop_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def _live(self) -> Transport:
        """The transport of an open connection, reconnecting if the last one was dropped."""
        if self._transport is None or self._transport.conn.closed:
            self._reconnect()
        assert self._transport is not None
        return self._transport

    @property
    def connected(self) -> bool:
        """Whether the connection is open (a call made now would not reconnect first)."""
        return self._transport is not None and not self._transport.conn.closed

    @property
    def _arena(self) -> memoryview | None:
        """The mapped arena in zero-copy mode (None inline); for tests that write it."""
        t = self._transport
        return t.arena if isinstance(t, ZeroCopyTransport) else None

    def close(self) -> None:
        self._drop_transport()

    def __enter__(self) -> KVPoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, req: p.Request) -> p.Reply:
        """One request on the live connection; an error reply raises `ProtocolError`."""
        return self._live().conn.call(req)

    def _retrying(self, fn: Callable[[Transport], T]) -> T:
        try:
            return fn(self._live())
        except (ConnectionError, TimeoutError, OSError) as e:
            if isinstance(e, AgentUnavailable):
                raise
            self._reconnect()
            return fn(self._live())

    # -- API

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the pool holds (in any tier)."""
        return len(self._lookup_codes(keys))

    def lookup_tiers(self, keys: Sequence[bytes]) -> list[str]:
        """The tier of each key of the longest stored prefix: "dram", "nvme", "peer" or
        "shared".

        A prefix longer than one LOOKUP takes (`MAX_LOOKUP_KEYS`) is asked in windows,
        the next only while the previous one was a hit all the way.
        """
        return [TIER_NAMES.get(t, str(t)) for t in self._lookup_codes(keys)]

    def _lookup_codes(self, keys: Sequence[bytes]) -> bytes:
        """`lookup_tiers` as the reply's tier codes (a byte a key: no name made per key
        for a caller that only counts them)."""
        def call(window: Sequence[bytes], t: Transport) -> bytes:
            reply = t.conn.call(p.Lookup(t.conn.rid(), list(window)))
            assert isinstance(reply, p.LookupReply)
            return reply.tiers

        codes = b""
        for start in range(0, max(len(keys), 1), p.MAX_LOOKUP_KEYS):
            window = keys[start : start + p.MAX_LOOKUP_KEYS]
            found = self._local_lookup(window)
            if found is None:
                found = self._retrying(partial(call, window))
            codes += found
            if len(found) < len(window):
                break
        return codes

    def lookup_nowait(self, keys: Sequence[bytes]) -> int | None:
        """How many leading keys the pool holds, answered from the agent's shared-memory
        index alone, whatever `local_lookup` says; None where only the socket can say (see
        `local_lookup`) or while the connection is down. It never waits on the agent (for a
        caller that must not block, e.g. an engine's scheduler) and never reconnects."""
        t = self._transport
        if t is not None and _peer_gone(t.conn.sock):
            self._drop_transport()  # the agent went away: `connected` says so
        if len(keys) > p.MAX_LOOKUP_KEYS:
            return None
        found = self._local_lookup(keys, always=True)
        return None if found is None else len(found)

    def _local_lookup(self, window: Sequence[bytes], always: bool = False) -> bytes | None:
        """The window's answer from the shared-memory tables, or None: ask the socket."""
        t = self._transport
        # An agent that is gone (its end of the socket closed) answers nothing from its
        # tables, which stay mapped but no longer change: the socket says it is gone (the
        # lookup then goes there, and reconnects or fails as any call does). A stopped
        # agent's tables still answer.
        if not (self.local_lookup or always) or not isinstance(t, ZeroCopyTransport) \
                or t.index is None or t.conn.hung_up():
            return None
        codes = t.index.answer(window)
        if codes is None:
            return None
        # The agent still hears of the lookup, with this client's next call: the hit
        # chunks' place in the eviction order and the hit counts stay as if it had asked
        # (prefetch has nothing to do: the tables answer only when no local tier below
        # DRAM may hold more of the prefix). One with peer keys goes at once: the agent
        # reads the peer chunks that follow a key in the same batch as it only once it
        # has the LOOKUP, and their reads may come soon, from another connection (an
        # engine's workers).
        t.conn.tell(p.Lookup(t.conn.rid(), list(window)), now=PEER_TIER_CODE in codes)
        return codes

    def contains(self, key: bytes) -> bool:
        return self.lookup([key]) == 1

    def put(self, key: bytes, data: Buffer, meta: bytes = b"", *,
            blocks: EngineBlocks | None = None, to: str | None = None) -> bool:
        """Store a chunk; False if the key was already stored (deduplicated). `blocks`:
        the engine blocks it covers, for KV events (docs/events.md). It returns once the
        agent has answered its COMMIT: never for a chunk the agent has not stored.

        `to` hands the chunk off to the node that will read it (its Kubernetes node name,
        or its agent's peer address): the agent pushes it there after COMMIT, where it is
        pinned until read (docs/cross-node.md#hand-off). The put never waits for the push,
        and a push that fails leaves the chunk readable by key from every node."""
        src = as_bytes_view(data)
        self._metas.learn(meta)
        return self._retrying(lambda t: t.put(key, src, meta, blocks, to or ""))

    def get(self, key: bytes, *, verify: bool = True) -> bytes | None:
        """The chunk's bytes, or None on a miss (or, with `verify`, a chunk whose bytes
        fail its checksum: checked in the copy's own pass, it costs a read next to
        nothing; docs/client.md)."""
        got = self.get_with_meta(key, verify=verify)
        return None if got is None else got[0]

    def get_with_meta(self, key: bytes, *, verify: bool = True) -> tuple[bytes, bytes] | None:
        """The chunk's bytes and metadata, or None on a miss."""
        return self._retrying(lambda t: t.get(key, verify))

    def expect_meta(self, meta: bytes) -> None:
        """Metadata the caller's reads expect (e.g. its KV layout's): a lease-free read of a
        chunk of it then needs no leased read first to learn it (`lease_free`). The
        checksum still decides: a chunk of other metadata whose hash matched fails it."""
        self._metas.learn(meta)

    def get_into(self, key: bytes, out: Buffer, *, verify: bool = True) -> int:
        """Copy the chunk into `out`; returns its size, or 0 on a miss."""
        dst = as_bytes_view(out)

        def read(t: Transport) -> int:
            if not self._lease_free_on(t):
                return t.get_into(key, dst, verify)
            # A window of one: lease-free where it can, else under a lease (learning the
            # chunk's metadata for the next read).
            got = [0]
            self._read_window([key], 0, lambda i, n, m: dst, got, verify, None, None, False, t)
            return got[0]
        return self._retrying(read)

    # -- batches: one round trip for N reads, two for N writes (zero-copy)

    def get_many_into(self, keys: Sequence[bytes], target: ReadTarget, *,
                      verify: bool | None = None, stream: object = None,
                      meanwhile: Meanwhile = None,
                      read: Sequence[int] | None = None) -> list[int]:
        """Copy each stored chunk into the buffer `target(index, size, meta)` gives for it.

        The ACQUIREs of a window go out in one write and their replies come back in
        order, so a batch costs one round trip (RELEASEs are not waited for). Returns
        the size read per key: 0 for a miss, a chunk `target` declined, or a chunk that
        failed its checksum. Inline mode reads key by key.

        With `lease_free`, the DRAM chunks the lookup index describes are read first
        without a lease (into buffers and host ranges, always checked), and only the rest
        are ACQUIREd; `target` may then be asked twice for a key whose lease-free copy
        failed its checks (the second time for its leased read). A `HostTargets` or
        `BlockTargets` target (every destination known before the read) is read so in one
        compiled call, the whole call at once (`leasefree.read_planned`), the keys it leaves
        as above.

        `verify`: True checks every chunk against its checksum; None (the default) checks
        the chunks copied into buffers (in the copy's own pass, nearly free) but not those
        copied into tensors (that would take a pass of its own over device memory);
        False checks none.

        `target` may also give a torch tensor or a list of tensor segments (filled in
        order), on a GPU or the CPU. Their copies are issued on `stream` (a
        `torch.cuda.Stream`; default the device's current stream); each window waits
        for an event recorded after its copies before releasing its leases, so the
        tensors hold the chunks when this returns.

        `meanwhile`: the caller's work to do while the agent answers the first ACQUIREs
        (e.g. planning the destinations `target` gives): called once, after they are sent
        and before `target` is first called (never for no keys).

        `read`: the sizes a `read_blocks` of the same keys into the same target gave (a
        `HostTargets` or `BlockTargets` target only): the chunks it read are not read again,
        only those it left (0).
        """
        sizes = [0] * len(keys)
        if read is not None and (not isinstance(target, _PLANNED) or len(read) != len(keys)):
            raise ValueError("get_many_into: `read` needs a HostTargets or BlockTargets "
                             "target and one size per key")
        if meanwhile is not None:  # once, even when a window is retried after a reconnect
            meanwhile = _once(meanwhile)
        if isinstance(target, _PLANNED):
            # Every destination known before the read: the whole call lease-free in one
            # compiled call where the lookup index allows, before any window is made (an
            # engine's load: no Python per chunk); the keys left take the windows below.
            t = self._transport
            left = None
            if read is not None:  # the compiled call ran already (`read_blocks`)
                sizes[:] = read
                left = [i for i, size in enumerate(read) if not size]
            elif self.lease_free and isinstance(t, ZeroCopyTransport) \
                    and t.index is not None and not t.conn.closed:
                # (`_lease_free_on`, inline: an engine's load)
                if meanwhile is not None:
                    meanwhile()  # (before the first copy: there is no answer to wait for)
                got = leasefree.read_planned(t.index, t.base, t.arena.nbytes, keys, 0, target,
                                             sizes)
                if got is not None:
                    left, done = got
                    if done:  # (`_told_reads`, inline)
                        self.reads_without_lease += len(done)
                        t.conn.tell_reads(done)
            if left is not None:
                if left:
                    self._metas.learn(target.blocks.meta if isinstance(target, BlockTargets)
                                      else target.meta)
                    rest = self.get_many_into(
                        [keys[i] for i in left],
                        leasefree.socket_target(target, 0, left, {}, self._metas),
                        verify=verify, stream=stream, meanwhile=meanwhile)
                    for j, i in enumerate(left):
                        sizes[i] = rest[j]
                return sizes
        step = self._live().window(self.batch_window, self._max_leases())
        tensors = stream is not None or "torch" in sys.modules
        for start in range(0, len(keys), step):
            window = keys[start : start + step]
            self._retrying(partial(self._read_window, window, start, target, sizes, verify,
                                   stream, meanwhile, tensors))
        return sizes

    def _lease_free_on(self, t: Transport) -> bool:
        return self.lease_free and isinstance(t, ZeroCopyTransport) and t.index is not None \
            and not t.conn.closed

    def _told_reads(self, t: Transport, keys: list[bytes]) -> None:
        """Tell the agent of chunks read without a lease (with the next write)."""
        if keys:
            self.reads_without_lease += len(keys)
            t.conn.tell_reads(keys)

    def _read_window(self, keys: Sequence[bytes], start: int, target: ReadTarget,
                     sizes: list[int], verify: bool | None, stream: object,
                     meanwhile: Meanwhile, tensors: bool, t: Transport) -> None:
        """One window of `get_many_into`: what the lookup index allows without a lease
        (`leasefree`), then the rest through ACQUIRE (its target learning each chunk's
        metadata, for later lease-free reads)."""
        left: Sequence[int] = range(len(keys))
        remembered: leasefree.Remembered = {}
        if self._lease_free_on(t):
            assert isinstance(t, ZeroCopyTransport) and t.index is not None
            if meanwhile is not None:
                meanwhile()  # (the targets may need it: there is no answer to wait for)
            left, remembered, done = leasefree.read_window(
                t.index, t.arena, t.base, self._metas, keys, start, target, sizes)
            self._told_reads(t, done)
            if left and self.hello is not None and self.hello.peers:
                left = self._read_landing(t, keys, start, target, sizes, left, remembered)
            if not left:
                return
        if len(left) == len(keys) and not remembered:
            rest, at, leased = keys, start, leasefree.learning(target, self._metas)
            got = sizes
        else:
            rest, at = [keys[i] for i in left], 0
            leased = leasefree.socket_target(target, start, left, remembered, self._metas)
            got = [0] * len(rest)
        if tensors:
            self._tensor_get_window(rest, at, leased, got, verify, stream, meanwhile, t)
        else:
            _get_window(rest, at, leased, got, verify is not False, meanwhile, t)
        if got is not sizes:
            for j, i in enumerate(left):
                sizes[start + i] = got[j]

    def _read_landing(self, t: ZeroCopyTransport, keys: Sequence[bytes], start: int,
                      target: ReadTarget, sizes: list[int], left: list[int],
                      remembered: leasefree.Remembered) -> list[int]:
        """Of the window's keys `left` (not read without a lease), those a peer read is
        bringing into DRAM read without a lease as they land: a WAIT answers once some
        have (docs/protocol.md, "Waiting for peer chunks"), they are read, and the rest
        waited for again. Returns the keys left for ACQUIRE: those no peer read brings
        (NVMe, the shared tier, a miss), whose read failed, or whose lease-free read did
        not pass, and those whose destination is not host memory (`remembered`).

        The agent then answers one WAIT per few chunks landed where it answered an
        ACQUIRE and a RELEASE per chunk: at 1 MiB chunks its event loop's work per chunk
        is what bounds a window's speed (docs/benchmarks.md)."""
        assert t.index is not None
        rest: list[int] = []
        coming: list[int] = []
        for i in left:
            (rest if i in remembered or len(keys[i]) != KEY_BYTES else coming).append(i)
        while coming:
            asked = coming[:WAIT_KEYS]
            reply = t.conn.call(p.Wait(t.conn.rid(), [keys[i] for i in asked]))
            assert isinstance(reply, p.WaitReply)
            landed: list[int] = []
            still: list[int] = []
            for i, code in zip(asked, reply.tiers, strict=False):
                (landed if code == DRAM_CODE else still if code == PEER_TIER_CODE
                 else rest).append(i)
            still += asked[len(reply.tiers):]  # (past the first key coming: not looked at)
            coming = still + coming[len(asked):]
            if not landed:
                if still or len(reply.tiers) > len(asked):  # (never from an agent that
                    rest += coming                          # keeps to WAIT's answer)
                    break
                continue  # none of these is coming
            got = [0] * len(landed)
            failed, leased, done = leasefree.read_window(
                t.index, t.arena, t.base, self._metas, [keys[i] for i in landed], 0,
                leasefree.socket_target(target, start, landed, {}, self._metas), got)
            self._told_reads(t, done)
            for j, i in enumerate(landed):
                sizes[start + i] = got[j]
            rest += (landed[j] for j in failed)
            remembered.update((landed[j], dest) for j, dest in leased.items())
        rest.sort()
        return rest

    def read_blocks(self, keys: Sequence[bytes], target: BlockTargets,
                    then: Callable[[], object]) -> list[int] | None:
        """Read the chunks of the call into their blocks without a lease, in the one compiled
        call (`leasefree.read_planned`), and tell the agent of the reads (one READ, written
        now). Returns the size read per key, 0 for a chunk not read so (not in DRAM as one
        WSUM extent of the blocks' size and metadata, changed meanwhile, or failing its
        checksum); `then()` (e.g. telling the engine the load is done) is called before the
        READ when every chunk was read. None where the call cannot be read so at all
        (`lease_free` off, no connection, not compiled yet): nothing read, nothing told.
        The chunks left are read by `get_many_into(keys, target, read=sizes)`, which does
        not read the others again. Block ids outside the blocks raise ValueError, nothing
        read.

        `get_many_into` reads such a call the same way first; this is its shortest form, for
        a caller with little time to spare (vLLM's connector: a load's own time is what
        its engine waits for, and in an engine's process each Python call runs cold)."""
        t = self._transport
        if not self.lease_free or not isinstance(t, ZeroCopyTransport) or t.index is None \
                or t.conn.sock is None:
            return None
        sizes = [0] * len(keys)
        got = leasefree.read_planned(t.index, t.base, t.arena.nbytes, keys, 0, target, sizes)
        if got is None:
            return None
        left, done = got
        self.reads_without_lease += len(done)
        if not left:
            then()
        if done:
            t.conn.tell(p.Read(t.conn.rid(), done), now=True)
        return sizes

    def releases_held(self) -> HeldCasts:
        """Reads made in the block end their leases when it ends, not as each returns: the
        RELEASEs go out in one write then (or with any call made meanwhile). The chunks were
        copied (and checked) when each read returned; a caller hands them on first, e.g. a
        connector telling its engine that a load is done. The agent hears of reads made
        without a lease at the same time (their READ is made then: `tell_reads`)."""
        return self._live().conn.held_casts()

    def put_many(self, keys: Sequence[bytes], data: Sequence[Buffer],
                 metas: Sequence[bytes] | None = None, *,
                 stream: object = None,
                 blocks: Sequence[EngineBlocks | None] | None = None,
                 to: str | None = None) -> list[PutResult]:
        """Store each buffer under its key (with its metadata); one result per key.

        Zero-copy: the ALLOCs of a window go out in one write, the bytes are copied
        into the arena, then the COMMITs go out in one write, with the ALLOCs of a window
        ahead: the agent's round trips overlap the copies (`kvpool.agent.putwindows`). A
        chunk the agent refuses (no space, too large) fails alone. Inline mode puts key
        by key.

        A chunk may instead be a torch tensor or a list of tensor segments (its bytes
        are theirs in order), on a GPU or the CPU: copied on `stream` straight into the
        arena, checksummed where the tensors are (WSUM kind), and committed after an
        event recorded after its copies completed. One call takes buffers or tensors.

        `blocks`, one per key (or None), the engine blocks each chunk covers: what the
        agent's KV events say of it (docs/events.md).

        `to`: the node that will read every chunk of the call, where each is pushed after
        its COMMIT and pinned until read (a hand-off, as `put`'s).
        """
        metas = metas if metas is not None else [b""] * len(keys)
        if not len(keys) == len(data) == len(metas):
            raise ValueError("put_many needs as many buffers and metas as keys")
        for meta in dict.fromkeys(metas):
            self._metas.learn(meta)
        if blocks is not None and len(blocks) != len(keys):
            raise ValueError("put_many needs as many blocks as keys")
        tensor_results = self._put_tensors(keys, data, metas, stream, blocks, to or "") \
            if "torch" in sys.modules else None
        if tensor_results is not None:
            return tensor_results
        views = [as_bytes_view(d) for d in data]
        call = PutCall(keys, [v.nbytes for v in views], metas, [False] * len(keys), blocks,
                       to or "")
        self._put_windows(call, lambda t: t.put_windows(call, views, self.batch_window,
                                                        self._max_leases()))
        return call.results

    def _put_windows(self, call: PutCall, put: Callable[[Transport], None]) -> None:
        """`put(transport)` puts the call's windows from `call.done` on. After a dropped
        connection, reconnect and go on from the first window not done (its chunks
        committed before the drop are found stored: False); a window that fails twice
        raises, as any call retried once."""
        failed_at = -1
        while True:
            try:
                put(self._live())
                return
            except (ConnectionError, TimeoutError, OSError) as e:
                if isinstance(e, AgentUnavailable) or call.done == failed_at:
                    raise
                failed_at = call.done
                self._reconnect()

    # -- tensors (kvpool.agent.gpu, imported only here)

    def _device(self, t: ZeroCopyTransport) -> DeviceArena:
        """The transport's mapping as tensors see it: registered once per mapping."""
        if t.device is None:
            from . import gpu

            registrar = self.registrar if self.registrar is not None \
                else gpu.default_registrar()
            t.device = gpu.DeviceArena(t.arena, registrar)
        device: DeviceArena = t.device
        return device

    def _put_tensors(self, keys: Sequence[bytes], data: Sequence[Any], metas: Sequence[bytes],
                     stream: object, blocks: Sequence[EngineBlocks | None] | None = None,
                     to: str = "") -> list[PutResult] | None:
        """put_many of tensor chunks; None if `data` holds no tensor."""
        from . import gpu

        is_tensor = [gpu.is_chunk(d) for d in data]
        if not any(is_tensor):
            return None
        if not all(is_tensor):
            raise TypeError("put_many takes buffers or tensors in one call, not both")
        chunks = [gpu.parts_of(d, f"the chunk of key {i}") for i, d in enumerate(data)]
        gpu.device_of(chunks)
        call = PutCall(keys, gpu.chunk_sizes(chunks), metas, [False] * len(keys), blocks, to)

        def put(t: Transport) -> None:
            if isinstance(t, ZeroCopyTransport):
                t.write_windows(call, self._device(t).write_copies(chunks, metas, stream),
                                self.batch_window, self._max_leases())
            else:  # inline: the bytes travel in the frame, from the host, a chunk at a time
                t.put_windows(call, gpu.HostChunks(chunks), self.batch_window,
                              self._max_leases())
        self._put_windows(call, put)
        return call.results

    def _tensor_get_window(self, keys: Sequence[bytes], start: int, target: ReadTarget,
                           sizes: list[int], verify: bool | None, stream: object,
                           meanwhile: Meanwhile, t: Transport) -> None:
        from . import gpu

        if isinstance(t, ZeroCopyTransport):
            # a buffer among the tensors is copied as without tensors (verified by default)
            buffers = BufferCopies(t.arena, verify=verify is not False, base=t.base)
            self._device(t).get_window(t.conn, keys, start, target, sizes, verify, stream,
                                       buffers, meanwhile)
            return
        # Inline: the chunk arrives in the frame; tensors are filled from the host bytes.
        staged: dict[int, tuple[Any, bytearray]] = {}

        def staging(i: int, size: int, meta: bytes) -> Buffer | None:
            out = target(i, size, meta)
            if out is None or not gpu.is_chunk(out):
                return out
            staged[i] = (out, bytearray(size))
            return staged[i][1]
        t.get_window(keys, start, staging, sizes, verify is not False, meanwhile)
        for i, (out, buf) in staged.items():
            if sizes[i]:
                gpu.scatter(bytes(buf), out, f"the destination of key {i}")

    def _max_leases(self) -> int:
        return self.hello.max_leases if self.hello is not None else self.batch_window

    def delete(self, key: bytes, *, local: bool = False) -> bool:
        """Delete the chunk from the pool: this node's tiers, the shared tier and, with
        peers on, the copies other nodes hold (in the background); whether this node held
        it. `local`: this node's copy only (as an eviction would)."""
        def call(t: Transport) -> bool:
            reply = t.conn.call(p.Delete(t.conn.rid(), key, local))
            assert isinstance(reply, p.DeleteReply)
            return reply.existed
        return self._retrying(call)

    def pin(self, key: bytes) -> None:
        self._retrying(lambda t: t.conn.call(p.Pin(t.conn.rid(), key)))

    def unpin(self, key: bytes) -> None:
        self._retrying(lambda t: t.conn.call(p.Unpin(t.conn.rid(), key)))

    def stats(self) -> dict[str, Any]:
        def call(t: Transport) -> dict[str, Any]:
            reply = t.conn.call(p.Stats(t.conn.rid()))
            assert isinstance(reply, p.StatsReply)
            return reply.stats
        return self._retrying(call)


def env_flag(name: str, default: bool) -> bool:
    """A yes/no environment variable (`1`, `true`, `yes` / `0`, `false`, `no`), or
    `default` when it is unset or says neither."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    return default


def _peer_gone(sock: socket.socket | None) -> bool:
    """Whether the agent closed this socket (EOF waiting), without reading or waiting."""
    if sock is None:
        return True
    readable = select.poll()
    readable.register(sock, select.POLLIN)
    if not readable.poll(0):
        return False  # nothing to read: the agent has not closed it
    try:  # readable: a reply owed to a told request, or the end of the stream
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _once(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn`, called at most once however often the result is."""
    pending = [fn]

    def once() -> None:
        while pending:
            pending.pop()()
    return once


def _get_window(keys: Sequence[bytes], start: int, target: ReadTarget, sizes: list[int],
                verify: bool, meanwhile: Meanwhile, t: Transport) -> None:
    t.get_window(keys, start, target, sizes, verify, meanwhile)

