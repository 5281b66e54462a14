"""The agent process: its spaces, their sockets, housekeeping, policy reload, HTTP.

One asyncio loop serves every connection of every space (connection.py reads
and answers frames, dispatch.py says what each op does). Housekeeping expires
leases and TTLs, reloads the policy file when it changes and probes an
unhealthy shared tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Iterator

from ..config import AgentConfig, ConfigError, load_policy
from ..metrics import AgentMetrics, Sample
from ..nodelabel import NodeLabeler
from .connection import Closed, Connection
from .dispatch import Dispatcher
from .http import serve_http
from .space import Space

log = logging.getLogger("kvpool.agent")

HOUSEKEEPING_INTERVAL = 0.5


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
        self.connections: dict[int, Connection] = {}
        self._next_cid = 1
        self.ready = False
        self.started = False
        """Set once serving: a failure after that keeps the arena (a warm restart's)."""
        self.dispatcher = Dispatcher(config, self.metrics, self._clients_of)
        self.metrics.add_state(self._samples)

    def _clients_of(self, space: Space) -> int:
        return sum(1 for c in self.connections.values() if c.space is space)

    def _samples(self) -> Iterator[Sample]:
        for space in self.spaces:
            yield from space.samples()
        yield Sample("kvpool_clients", "Connected clients", {}, len(self.connections))

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
            conn = Connection(self.dispatcher, space, sock, cid)
            self.connections[cid] = conn
            conn.task = loop.create_task(self._run_connection(conn))

    async def _run_connection(self, conn: Connection) -> None:
        try:
            await conn.serve()
        except Closed as e:
            log.debug("client %d closed: %s", conn.id, e)
        except Exception:
            log.exception("client %d failed", conn.id)
        finally:
            self.connections.pop(conn.id, None)
            conn.store.disconnect(conn.id)
            conn.sock.close()

    # -- housekeeping

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

    # -- the process

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        listeners = [(space, self._bind(space)) for space in self.spaces]
        runner = await serve_http(self.config.metrics_addr, self.metrics.registry,
                                  lambda: self.ready)
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
