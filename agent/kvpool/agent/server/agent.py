"""The agent process: its spaces, their sockets, housekeeping, policy reload, HTTP.

One asyncio loop serves every connection of every space (connection.py reads
and answers frames, dispatch.py says what each op does). Housekeeping expires
leases and TTLs, reloads the policy file when it changes and probes an
unhealthy shared tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import resource
import signal
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from .. import protocol as p
from ..config import AgentConfig, ConfigError, EventsTopic, load_policy
from ..constants import ENV_NODE_NAME
from ..events import IdentityLog, Publisher, TierEvents, node_topic
from ..metrics import AgentMetrics, Sample
from ..nodelabel import NodeLabeler
from ..peers.network import PeerNetwork
from ..peers.server import Watch
from ..tiers.peer import PeerTier
from .banner import bound_address, kept_line, tiers_line
from .connection import Closed, Connection
from .dispatch import Dispatcher
from .http import serve_http
from .space import Space

log = logging.getLogger("kvpool.agent")

HOUSEKEEPING_INTERVAL = 0.5
LISTEN_BACKLOG = 512
ACCEPT_BACKOFF = 0.05
ACCEPT_BACKOFF_MAX = 1.0
"""Seconds an accept loop waits after running out of file descriptors, doubling to the max:
the pending client stays in the listen backlog and is accepted once fds are free again."""
FD_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_RETRY = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})
"""accept() errors that concern one client only: the next accept goes on at once."""
RESERVED_FDS = 64
"""File descriptors kept for the agent's own files (arena, journals, NVMe reads, HTTP);
at most a quarter of the limit."""


def connection_cap(fd_limit: int, spaces: int) -> int:
    """Most connections one space may hold: an equal share of the descriptors left once the
    agent's own are set aside, so one tenant's flood cannot take another tenant's."""
    reserved = min(RESERVED_FDS, fd_limit // 4)
    return max(1, (fd_limit - reserved) // spaces)


def trim_memory() -> None:
    """Hand freed heap pages back to the system (glibc keeps large freed blocks otherwise:
    its mmap threshold rises to the largest block freed, so frames of many MiB come from
    the heap). Elsewhere a no-op."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        fn: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return fn


_malloc_trim = _find_malloc_trim()


def fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.metrics = AgentMetrics(config.pool, config.node_name or "")
        self.policy = config.policy
        self.policy_version: FileVersion | None = None
        """The policy file as last loaded (or refused)."""
        self._policy_changing: FileVersion | None = None
        """The policy file as seen at the last look, when it differed from the loaded one:
        it is loaded once it has looked the same twice (a writer has finished)."""
        if config.policy_file is not None:
            self.policy_version = file_version(config.policy_file)  # first: no change missed
            self.policy = load_policy(config.policy_file)
        self.spaces = [Space(tenant, cfg, self.metrics, self.policy)
                       for tenant, cfg in config.spaces()]
        self.connections: dict[int, Connection] = {}
        self._next_cid = 1
        self.ready = False
        self.accepting: dict[int, asyncio.Task[None]] = {}
        """Accept loop of each space (by index); readiness needs every one alive."""
        self.stalled: set[int] = set()
        """Spaces whose accept loop is waiting for file descriptors."""
        self.started = False
        """Set once serving: a failure after that keeps the arena (a warm restart's)."""
        self.dispatcher = Dispatcher(config, self.metrics, self._clients_of)
        self.metrics.add_state(self._samples)
        self.publisher: Publisher | None = None
        if config.events.enabled:
            self.publisher = self._publish_events()
        self.peers: PeerNetwork | None = None
        if config.peers.enabled:
            self.peers = self._join_peers()

    def _join_peers(self) -> PeerNetwork:
        """The peer tier (docs/cross-node.md): serve this agent's chunks to the pool's
        other agents, and count and read theirs in every space."""
        # The name push hints reach this agent by: the node's, as the DaemonSet gives it.
        node = self.config.node_name or os.environ.get(ENV_NODE_NAME) or socket.gethostname()
        network = PeerNetwork(self.config.peers, {s.tenant: s.store for s in self.spaces},
                              self.metrics.registry, self.config.pool, node,
                              self.config.peer_deletes_path())
        for space in self.spaces:
            space.store.attach_peer(PeerTier(network, space.tenant))
            if space.index.peers is not None:  # each tenant space publishes its own
                network.publish(space.tenant, space.index.peers)
            space.store.observe(Watch(network.server, space.tenant, space.store))
        self.metrics.add_state(network.samples)
        return network

    def _publish_events(self) -> Publisher:
        """Open the KV-event sockets and hand each space its tracker (docs/events.md)."""
        ev = self.config.events
        m = self.metrics
        publisher = Publisher(
            host=ev.address, port=ev.port, replay_port=ev.replay_port,
            replay_depth=ev.replay_depth, queue_depth=ev.queue_depth, shape=ev.payload,
            medium={"dram": ev.medium.dram, "nvme": ev.medium.nvme, "shared": ev.medium.shared},
            published=m.events_published.inc, dropped=m.events_dropped.inc)
        node = self.config.node_name or socket.gethostname()
        for space in self.spaces:
            topic = None
            if ev.topic is EventsTopic.NODE:
                topic = node_topic(node, self.config.pool, space.tenant)
            space.attach_events(TierEvents(
                space.tenant, publisher, node_topic=topic,
                remembered=IdentityLog(space.config.identities_path())))
        log.info("KV events on %s (replay %s), %s topics, %s payload", publisher.endpoint,
                 publisher.replay_endpoint or "off", ev.topic.value, ev.payload.value)
        return publisher

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
        sock.setblocking(False)
        return sock  # bound, not listening yet: `run` listens once the agent is whole

    def serving(self) -> bool:
        """Ready: started, and every space accepting (none dead, none out of descriptors)."""
        return (self.ready and not self.stalled
                and all(not t.done() for t in self.accepting.values()))

    async def _accept_loop(self, index: int, space: Space, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        backoff = ACCEPT_BACKOFF
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:
                if e.errno in ACCEPT_RETRY:
                    continue
                if e.errno not in FD_EXHAUSTED:
                    raise
                if index not in self.stalled:
                    log.warning("out of file descriptors (%s): not accepting clients%s for "
                                "now; retrying", e.strerror,
                                f" of tenant {space.tenant}" if space.isolated else "")
                    self.stalled.add(index)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, ACCEPT_BACKOFF_MAX)
                continue
            if index in self.stalled:
                self.stalled.discard(index)
                log.info("accepting clients again")
            backoff = ACCEPT_BACKOFF
            cap = connection_cap(fd_limit(), len(self.spaces))
            if self._clients_of(space) >= cap:
                self._refuse(sock, cap)
                continue
            sock.setblocking(False)
            cid, self._next_cid = self._next_cid, self._next_cid + 1
            conn = Connection(self.dispatcher, space, sock, cid)
            self.connections[cid] = conn
            conn.task = loop.create_task(self._run_connection(conn))

    def _refuse(self, sock: socket.socket, cap: int) -> None:
        """Answer a client over its space's share with an error (best effort) and close."""
        self.metrics.connections_refused.inc()
        try:
            sock.setblocking(False)
            sock.send(p.encode(p.ErrorReply(
                rid=0, code=int(p.ErrorCode.TOO_MANY_CONNECTIONS),
                message=f"this socket already serves {cap} connections, its share of the "
                        "agent's file descriptors; close idle ones or retry later")))
        except OSError:
            pass
        finally:
            sock.close()

    async def _run_connection(self, conn: Connection) -> None:
        try:
            await conn.serve()
        except Closed as e:
            log.debug("client %d closed: %s", conn.id, e)
        except Exception:
            log.exception("client %d failed", conn.id)
        finally:
            self.connections.pop(conn.id, None)
            try:
                conn.store.disconnect(conn.id)
                conn.ended()
            except Exception:  # logged, and the descriptor still goes
                log.exception("cleaning up after client %d failed", conn.id)
            finally:
                conn.close()

    # -- housekeeping

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            for space in self.spaces:
                space.store.expire()
            if self.dispatcher.memory_released:
                self.dispatcher.memory_released = False
                trim_memory()
            self._maybe_reload_policy()
            for space in self.spaces:
                await space.store.probe_shared()

    def _maybe_reload_policy(self) -> None:
        path = self.config.policy_file
        if path is None:
            return
        try:
            version = file_version(path)
        except OSError:
            return
        if version == self.policy_version:
            self._policy_changing = None
            return
        if version != self._policy_changing:
            # Changed since the last look: wait a look, so that a file being written in
            # place (truncated, then written) is not read half-way.
            self._policy_changing = version
            return
        self._policy_changing = None
        self.policy_version = version
        try:
            if version.size == 0:  # what a write in place looks like half-way
                raise ConfigError(f"{path}: empty (write {{}} for the default policy)")
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
        endpoint = await serve_http(self.config.metrics_addr, self.metrics.registry,
                                    self.serving)
        if self.peers is not None:
            await self.peers.start()
        # Only now can a client connect: one that can finds the whole agent up (its
        # metrics endpoint too; a test that counts the agent's descriptors once its
        # socket answers once saw the HTTP listener open after the count).
        for _, listener in listeners:
            listener.listen(LISTEN_BACKLOG)
        self.accepting = {i: loop.create_task(self._accept_loop(i, space, listener))
                          for i, (space, listener) in enumerate(listeners)}
        for task in self.accepting.values():
            task.add_done_callback(_report_stopped)
        tasks = list(self.accepting.values())
        tasks.append(loop.create_task(self._housekeeping()))
        # The node label is what the webhook's node affinity schedules client pods by.
        labeler = NodeLabeler.from_config(self.config)
        self.ready = self.started = True
        labeler.start()
        metrics = ", ".join(f"http://{bound_address(a)}/metrics" for a in endpoint.addresses)
        for space in self.spaces:
            log.info("kvpool agent serving pool %s%s on %s: %s; metrics %s",
                     self.config.pool, f" tenant {space.tenant}" if space.isolated else "",
                     space.config.socket_path,
                     tiers_line(space.config, space.arena.size, space.arena.path), metrics)
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
                conn.close()
            await endpoint.close()
            if self.peers is not None:
                await self.peers.close()
            for space in self.spaces:
                space.close()
            if self.publisher is not None:
                self.publisher.close()
            log.info("kvpool agent stopped; %s", kept_line(
                self.config, [(s.arena.path, s.arena.size) for s in self.spaces]))


def _report_stopped(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("an accept loop stopped: not ready", exc_info=task.exception())


def run_agent(config: AgentConfig) -> None:
    asyncio.run(Agent(config).run())


class FileVersion(NamedTuple):
    """What tells one content of a file from another without reading it: a rename over it
    changes the inode, a write in place the modification time or the size (or both: a
    coarse clock may give a truncation and the write after it the same time)."""

    mtime_ns: int
    size: int
    inode: int


def file_version(path: Path) -> FileVersion:
    st = path.stat()  # through symlinks: a ConfigMap update re-points `..data`
    return FileVersion(st.st_mtime_ns, st.st_size, st.st_ino)
