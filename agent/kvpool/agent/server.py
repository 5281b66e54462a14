"""The agent process: Unix-socket server, metrics endpoint, housekeeping.

One asyncio loop serves every connection. Each connection reads whole frames,
answers them in order, and is closed when it sends garbage, stalls inside a
frame, or stops reading its replies; its leases end with it. Nothing a
client sends can stop the loop.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import inspect
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import __version__
from . import protocol as p
from .arena import Arena
from .claim import SpaceClaim
from .config import AgentConfig, ConfigError, TierPolicy, load_policy
from .metrics import AgentMetrics
from .nodelabel import NodeLabeler
from .store import MAX_LEASES_PER_CLIENT, ChunkStore, OpError, open_journal
from .tiers.dram import DramTier
from .tiers.factory import open_shared_tier
from .tiers.nvme import NvmeTier

log = logging.getLogger("kvpool.agent")

FRAME_TIMEOUT = 10.0
"""Longest a client may take to send the rest of a frame it started."""
SEND_TIMEOUT = 10.0
"""Longest a reply may wait for a client to read; then the client is dropped."""
HOUSEKEEPING_INTERVAL = 0.5


class _Closed(Exception):
    """The connection must close (EOF, timeout, or a frame we cannot recover from)."""


class Connection:
    def __init__(self, agent: Agent, space: Space, sock: socket.socket, cid: int) -> None:
        self.agent = agent
        self.space = space
        self.store = space.store
        self.sock = sock
        self.id = cid
        self.tenant = space.tenant
        self.hello = False
        self.buf = bytearray(64 * 1024)
        self.start = 0
        self.end = 0
        self.task: asyncio.Task[None] | None = None

    async def _fill(self, need: int, timeout: float | None) -> None:
        """Read until `need` bytes are buffered from self.start."""
        loop = asyncio.get_running_loop()
        if self.start + need > len(self.buf) and self.start:
            pending = self.end - self.start
            self.buf[:pending] = self.buf[self.start : self.end]
            self.start, self.end = 0, pending
        while self.end - self.start < need:
            if self.end == len(self.buf):
                # Grow by doubling as bytes arrive: a length prefix alone must not make
                # the agent allocate a whole frame for a client that never sends it.
                grown = bytearray(min(self.start + need, 2 * len(self.buf)))
                grown[: self.end] = self.buf[: self.end]
                self.buf = grown
            view = memoryview(self.buf)[self.end :]
            try:
                if timeout is None:
                    n = await loop.sock_recv_into(self.sock, view)
                else:
                    n = await asyncio.wait_for(loop.sock_recv_into(self.sock, view), timeout)
            except TimeoutError as e:
                raise _Closed("frame not completed in time") from e
            except OSError as e:
                raise _Closed(f"receive failed: {e}") from e
            finally:
                view.release()
            if n == 0:
                raise _Closed("peer closed" if self.end == self.start else "truncated frame")
            self.end += n

    async def read_frame(self) -> bytes:
        if self.end == self.start:
            self.start = self.end = 0
        await self._fill(1, None)  # idle between frames: no limit
        await self._fill(p.HEADER.size, FRAME_TIMEOUT)  # inside a frame: the frame timeout
        (length,) = p.HEADER.unpack_from(self.buf, self.start)
        limit = self.agent.max_frame_bytes
        if length > limit:
            await self.send_error(0, p.ErrorCode.FRAME_TOO_LARGE,
                                  f"frame of {length} bytes exceeds the limit of {limit}")
            raise _Closed("frame too large")
        self.start += p.HEADER.size
        await self._fill(length, FRAME_TIMEOUT)
        body = bytes(self.buf[self.start : self.start + length])
        self.start += length
        return body

    async def send(self, frame: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_sendall(self.sock, frame), SEND_TIMEOUT)
        except TimeoutError as e:
            raise _Closed("client does not read its replies") from e
        except OSError as e:
            raise _Closed(f"send failed: {e}") from e

    async def send_error(self, rid: int, code: p.ErrorCode, message: str) -> None:
        await self.send(p.encode(p.ErrorReply(rid=rid, code=int(code), message=message)))

    async def serve(self) -> None:
        agent = self.agent
        while True:
            body = await self.read_frame()
            started = time.perf_counter()
            try:
                req = p.request_decoder.decode(body)
            except msgspec.ValidationError as e:
                tag = p.peek_tag(body)
                if tag is not None and tag not in p.Op._value2member_map_:
                    agent.metrics.op_error(0, p.ErrorCode.UNKNOWN_OP)
                    await self.send_error(0, p.ErrorCode.UNKNOWN_OP, f"unknown op {tag}")
                    raise _Closed("unknown op") from e
                agent.metrics.op_error(tag or 0, p.ErrorCode.BAD_FRAME)
                await self.send_error(0, p.ErrorCode.BAD_FRAME, f"malformed request: {e}")
                raise _Closed("malformed frame") from e
            except msgspec.DecodeError as e:
                agent.metrics.op_error(0, p.ErrorCode.BAD_FRAME)
                await self.send_error(0, p.ErrorCode.BAD_FRAME, f"undecodable frame: {e}")
                raise _Closed("undecodable frame") from e
            op = p.Op(type(req).__struct_config__.tag)
            try:
                if not self.hello and op is not p.Op.HELLO:
                    raise OpError(p.ErrorCode.HELLO_REQUIRED, "send HELLO first")
                if op is p.Op.HELLO:
                    assert isinstance(req, p.Hello)
                    await self._hello(req)
                else:
                    reply = agent.handlers[op](self, req)
                    if inspect.isawaitable(reply):
                        reply = await reply
                    await self.send(p.encode(reply))
                agent.metrics.ops_ok[op].inc()
            except OpError as e:
                agent.metrics.op_error(op, e.code)
                await self.send_error(req.rid, e.code, e.message)
            except _Closed:
                raise
            except Exception as e:  # a bug must cost one request, not the agent
                log.exception("internal error serving %s", op.name)
                agent.metrics.op_error(op, p.ErrorCode.INTERNAL)
                await self.send_error(req.rid, p.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            agent.metrics.latency[op].observe(time.perf_counter() - started)

    async def _hello(self, req: p.Hello) -> None:
        agent = self.agent
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
                raise OpError(p.ErrorCode.TENANT_MISMATCH,
                              f"this socket serves tenant {space.tenant!r}, "
                              f"the client claims {req.tenant!r}")
        else:
            self.tenant = req.tenant  # one space: the claim only picks quotas and priority
        self.hello = True
        cfg = agent.config
        frame = p.encode(p.HelloReply(
            rid=req.rid, version=p.PROTOCOL_VERSION, agent_version=__version__, pool=cfg.pool,
            arena_bytes=space.arena.size, max_chunk_bytes=cfg.max_chunk_bytes,
            max_meta_bytes=cfg.max_meta_bytes, max_frame_bytes=agent.max_frame_bytes,
            max_leases=MAX_LEASES_PER_CLIENT, tenant=self.tenant,
        ))
        # The arena fd rides on the reply (SCM_RIGHTS); the reply is small and
        # the connection fresh, so one sendmsg carries it whole.
        fds = array.array("i", [space.arena.client_fd()])
        try:
            sent = self.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except BlockingIOError as e:
            raise _Closed("client does not read its replies") from e
        if sent < len(frame):
            await self.send(frame[sent:])


class Space:
    """What one tenant (or the whole pool) is served from: socket, arena, store."""

    def __init__(self, tenant: str, config: AgentConfig, metrics: AgentMetrics,
                 policy: TierPolicy) -> None:
        self.tenant = tenant
        """The tenant this space serves; "" for the one space of a pool without tenants."""
        self.config = config
        dram_cfg = config.tiers.dram
        self.claim = SpaceClaim(config.arena_path(), config.socket_path)  # before touching any
        self.arena = Arena(config.arena_path(), dram_cfg.size, lock=dram_cfg.lock,
                           huge_pages=dram_cfg.huge_pages)
        nvme = None
        if config.tiers.nvme is not None:
            nvme = NvmeTier(config.tiers.nvme.path, config.tiers.nvme.size)
        shared = None
        if config.tiers.shared is not None:
            shared = open_shared_tier(config.tiers.shared, metrics)
        journal, entries = open_journal(config)
        if not self.arena.reused:
            entries = []  # a new arena holds nothing the journal describes
        self.store = ChunkStore(config, DramTier(self.arena), nvme, metrics, policy,
                                journal, shared)
        kept, dropped = self.store.recover(entries)
        if kept or dropped:
            log.info("warm restart%s: %d chunks kept from the arena, %d dropped",
                     f" of tenant {tenant}" if self.isolated else "", kept, dropped)

    @property
    def isolated(self) -> bool:
        """True when the pool has tenants: the socket decides a connection's tenant."""
        return bool(self.tenant)

    def state_samples(self) -> Any:
        for name, doc, labels, value in self.store.state_samples():
            yield name, doc, {**labels, "tenant": self.tenant} if self.isolated else labels, value

    def close(self) -> None:
        self.store.close()
        if self.store.journal is not None:
            self.store.journal.close()
        self.arena.close()
        self.claim.release()


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.metrics = AgentMetrics(config.pool, config.node_name or "")
        self.policy = config.policy
        self.policy_mtime: float | None = None
        if config.policy_file is not None:
            self.policy = load_policy(config.policy_file)
            self.policy_mtime = config.policy_file.stat().st_mtime
        self.spaces = [Space(tenant, cfg, self.metrics, self.policy)
                       for tenant, cfg in config.spaces()]
        self.max_frame_bytes = config.max_chunk_bytes + config.max_meta_bytes + 4096
        self.connections: dict[int, Connection] = {}
        self._next_cid = 1
        self.ready = False
        self.started = False
        """Set once serving: a failure after that keeps the arena (a warm restart's)."""
        self.metrics.add_state(self._state_samples)
        self.handlers: dict[p.Op, Callable[[Connection, Any], Any]] = {
            p.Op.LOOKUP: self._lookup,
            p.Op.ALLOC: self._alloc,
            p.Op.COMMIT: self._commit,
            p.Op.ABORT: self._abort,
            p.Op.ACQUIRE: self._acquire,
            p.Op.RELEASE: self._release,
            p.Op.PUT: lambda c, r: p.PutReply(r.rid, c.store.put(r.key, r.data, r.checksum,
                                                                  r.meta, c.tenant)),
            p.Op.GET: self._get,
            p.Op.DELETE: lambda c, r: p.DeleteReply(r.rid, c.store.delete(r.key)),
            p.Op.PIN: self._pin,
            p.Op.UNPIN: self._unpin,
            p.Op.STATS: lambda c, r: p.StatsReply(r.rid, self.stats(c.space)),
        }

    # -- op handlers that need more than one line

    async def _lookup(self, c: Connection, r: p.Lookup) -> p.LookupReply:
        return p.LookupReply(r.rid, *await c.store.lookup(r.keys))

    def _alloc(self, c: Connection, r: p.Alloc) -> p.AllocReply:
        granted = c.store.alloc(r.key, r.size, r.meta, c.tenant, c.id)
        if granted is None:
            return p.AllocReply(r.rid, 0, [], exists=True)
        return p.AllocReply(r.rid, granted.lease, granted.extents)

    def _commit(self, c: Connection, r: p.Commit) -> p.CommitReply:
        c.store.commit(r.lease, r.checksum, c.id)
        return p.CommitReply(r.rid)

    def _abort(self, c: Connection, r: p.Abort) -> p.AbortReply:
        c.store.abort(r.lease, c.id)
        return p.AbortReply(r.rid)

    def _release(self, c: Connection, r: p.Release) -> p.ReleaseReply:
        c.store.release(r.lease, c.id)
        return p.ReleaseReply(r.rid)

    def _pin(self, c: Connection, r: p.Pin) -> p.PinReply:
        c.store.pin(r.key)
        return p.PinReply(r.rid)

    def _unpin(self, c: Connection, r: p.Unpin) -> p.UnpinReply:
        c.store.unpin(r.key)
        return p.UnpinReply(r.rid)

    async def _acquire(self, c: Connection, r: p.Acquire) -> p.AcquireReply:
        g = await c.store.acquire(r.key, c.id)
        return p.AcquireReply(r.rid, g.lease, g.size, g.checksum, g.extents, g.meta, g.tier)

    async def _get(self, c: Connection, r: p.Get) -> p.GetReply:
        data, digest, meta, tier = await c.store.get(r.key)
        return p.GetReply(r.rid, data, digest, meta, tier)

    def stats(self, space: Space) -> dict[str, Any]:
        """STATS of one space: a tenant sees its own chunks and clients, nobody else's."""
        out = space.store.stats()
        if space.isolated:
            out["tenant"] = space.tenant
        out["clients"] = sum(1 for c in self.connections.values() if c.space is space)
        out["agent_version"] = __version__
        return out

    def _state_samples(self) -> Any:
        for space in self.spaces:
            yield from space.state_samples()
        yield ("kvpool_clients", "Connected clients", {}, len(self.connections))

    # -- serving

    def _bind(self, space: Space) -> socket.socket:
        path = space.config.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        if space.isolated:  # only this tenant's pods mount the directory: owner and group
            os.chmod(path.parent, 0o750)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise ConfigError(f"{path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # stale socket of an agent that is gone
            else:
                raise ConfigError(f"another agent is already serving {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        os.chmod(path, 0o660)
        sock.listen(512)
        sock.setblocking(False)
        return sock

    async def _accept_loop(self, space: Space, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            cid, self._next_cid = self._next_cid, self._next_cid + 1
            conn = Connection(self, space, sock, cid)
            self.connections[cid] = conn
            conn.task = loop.create_task(self._run_connection(conn))

    async def _run_connection(self, conn: Connection) -> None:
        try:
            await conn.serve()
        except _Closed as e:
            log.debug("client %d closed: %s", conn.id, e)
        except Exception:
            log.exception("client %d failed", conn.id)
        finally:
            self.connections.pop(conn.id, None)
            conn.store.disconnect(conn.id)
            conn.sock.close()

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            for space in self.spaces:
                space.store.expire()
            self._maybe_reload_policy()
            for space in self.spaces:
                await space.store.probe_shared()

    def _maybe_reload_policy(self) -> None:
        path = self.config.policy_file
        if path is None:
            return
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return
        if mtime == self.policy_mtime:
            return
        self.policy_mtime = mtime
        try:
            policy = load_policy(path)
        except ConfigError as e:
            self.metrics.policy_reloads["invalid"].inc()
            log.error("policy not reloaded, keeping the last good one: %s", e)
            return
        for space in self.spaces:
            space.store.set_policy(policy)
        self.policy = policy
        self.metrics.policy_reloads["ok"].inc()
        log.info("policy reloaded from %s", path)

    async def _metrics_app(self) -> web.AppRunner:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.metrics.registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        async def readyz(_: web.Request) -> web.Response:
            if self.ready:
                return web.Response(text="ready\n")
            return web.Response(status=503, text="not ready\n")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, _, port = self.config.metrics_addr.rpartition(":")
        await web.TCPSite(runner, host.strip("[]"), int(port)).start()
        return runner

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        listeners = [(space, self._bind(space)) for space in self.spaces]
        runner = await self._metrics_app()
        tasks = [loop.create_task(self._accept_loop(space, listener))
                 for space, listener in listeners]
        tasks.append(loop.create_task(self._housekeeping()))
        # The node label is what the webhook's node affinity schedules client pods by.
        labeler = NodeLabeler.from_config(self.config)
        self.ready = self.started = True
        labeler.start()
        for space in self.spaces:
            log.info("kvpool agent serving pool %s%s on %s (DRAM %d bytes at %s, metrics %s)",
                     self.config.pool, f" tenant {space.tenant}" if space.isolated else "",
                     space.config.socket_path, space.arena.size, space.arena.path,
                     self.config.metrics_addr)
        try:
            await stop.wait()
        finally:
            self.ready = False
            await labeler.stop()
            for t in tasks:
                t.cancel()
            for space, listener in listeners:
                listener.close()
                with contextlib.suppress(OSError):
                    space.config.socket_path.unlink()
            for conn in list(self.connections.values()):
                conn.sock.close()
            await runner.cleanup()
            for space in self.spaces:
                space.close()
            log.info("kvpool agent stopped")


def run_agent(config: AgentConfig) -> None:
    asyncio.run(Agent(config).run())
