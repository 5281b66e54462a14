"""The peer tier of one agent: its server, its links to the other agents of the pool, and
the directory of each tenant space, kept current from the links' subscriptions.

Peers are the static `peers.addresses` and whatever `peers.discovery` resolves to (a
headless Service lists every agent, this one included: a link that reaches this agent's
own server finds out at the handshake, by the agent id, and stops), re-resolved every
`DISCOVERY_INTERVAL`, or every `DISCOVERY_RETRY` while a peer is unreachable or a node is
away (a pod made again comes back at another address: found in seconds, not at the next
full interval). A peer the name stops listing is dropped with its entries.

Hand-offs: a chunk a client put with a hint naming another node is queued here
(`push`, bounded: a full queue drops the push, never the put) and offered to that node's
agent by a few workers, what is queued together in one batch (one write of PUSH offers
on one connection); the receiver reads the batch's chunks like any peer reads (one
pipelined batch of FETCHes) and pins them until read.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client import CollectorRegistry

from .. import probekernel
from ..config import ConfigError, Peers, expand_env, parse_host_port
from ..lookupindex import PeerIndex
from ..metrics import Sample
from . import auth, wire
from .awaynodes import NODE_KEEP, AwayNodes
from .credentials import RELOAD_SECONDS, Credentials
from .deletelog import DeleteLog, Item, Waiting
from .directory import NO_PEER, PeerDirectory
from .links import (
    MAX_BATCH_BYTES,
    MAX_PENDING_DELETES,
    PUSH_TIMEOUT,
    ArenaTarget,
    Fetched,
    PeerLink,
)
from .metrics import PeerMetrics
from .server import Holdings, PeerServer

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL = 10.0
DISCOVERY_RETRY = 2.0
"""Seconds between resolves of `peers.discovery` while a peer is unreachable or a node is
away (`awaynodes`): one query every two seconds of each agent while the pool is changing."""
FETCH_THREADS = 16
"""Worker threads receiving chunks from peers, for all peers together (each sends one
link's batches; a link has at most `peers.connections` of them at once)."""
PUSH_QUEUE = 4096
"""Hand-off pushes waiting to be offered; past it a push is dropped (counted), the put is
not held back."""
PUSH_WORKERS = 2
"""Pushes offered at once (each holds a connection to its peer and a worker thread)."""
DELETE_RETRY = 1.0
"""Seconds between attempts to deliver DELETEs to a peer that follows and did not answer
(one unreachable gets them when its link is back, before its inventory)."""
DELETE_TIMEOUT = 5.0
"""Seconds a batch of DELETEs to a peer may take."""
CLOSE_WAIT = 5.0
"""Seconds the stop waits for the peer tier's tasks to end once cancelled."""
MAX_LOGGED = 1024
"""Hint names and peers remembered as failing (each logged once until a push works)."""


_WAITING_DOC = ("DELETEs waiting for a peer (queued, on their way, refused), or for a node "
                "away (under its last address)")


class PeerNetwork:
    def __init__(self, cfg: Peers, spaces: dict[str, Holdings], registry: CollectorRegistry,
                 pool: str, node: str = "", deletes_file: Path | None = None) -> None:
        assert cfg.secret_file is not None  # the config requires it when enabled
        self.cfg = cfg
        self.advertise = None if cfg.advertise is None else expand_env(cfg.advertise,
                                                                       os.environ)
        self.m = PeerMetrics(registry, pool)
        self.credentials = Credentials(cfg, self.m)
        self.agent_id = auth.new_agent_id()
        self.directories = {tenant: PeerDirectory(cfg.delete_holdoff, cfg.max_entries)
                            for tenant in spaces}
        # Compiled now (on a thread), not at the first large LOOKUP: a peer's entries are
        # dropped in one compiled pass, and a drop may come before any LOOKUP does.
        probekernel.compile_soon()
        self.node = node
        """This agent's node name: what other agents' push hints name to reach it."""
        self.spaces = spaces
        self.server = PeerServer(spaces, self.credentials, self.agent_id, self.m, node)
        self.server.on_subscribe = self._followed_by
        self.links: dict[tuple[str, int], PeerLink] = {}
        self.by_index: list[PeerLink | None] = []
        self.pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kvpool-peer")
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = False
        self._pushes: asyncio.Queue[tuple[str, bytes, int, str]] | None = None
        self._failing: set[str] = set()
        """Push targets whose failure was logged (once, until a push to them works)."""
        self._deletes = asyncio.Event()
        """Set when DELETEs were queued for peers."""
        self._published: list[PeerIndex] = []
        """The spaces' peer tables (`publish`): each link's `readable` is written to each."""
        self.delete_log: DeleteLog | None = None
        """The DELETEs waiting for peers, on file (`deletes_file`, in the state directory):
        None without one, where they wait in memory only."""
        self._saved: dict[str, Waiting] = {}
        """DELETEs the file said wait for peers not linked yet, by peer name: each link
        takes its own as it is made; those of a peer no longer listed wait for its node
        (`away`) where the file names it, else are dropped."""
        self.away = AwayNodes(MAX_PENDING_DELETES)
        """The DELETEs waiting for nodes whose links went (`awaynodes`), by node name."""
        if deletes_file is not None:
            try:
                self.delete_log, self._saved = DeleteLog.open(deletes_file)
            except OSError as e:
                raise ConfigError(f"stateDir: the peer deletes file {deletes_file}: {e}") from e
            self.delete_log.live = self._waiting

    def publish(self, tenant: str, index: PeerIndex) -> None:
        """Mirror `tenant`'s directory and every peer's state into `index` (the peer table
        its clients answer LOOKUP from: `lookupindex`)."""
        self.directories[tenant].publish(index)
        self._published.append(index)
        for link in self.by_index:
            if link is not None:
                index.set_readable(link.index, link.readable)

    def _publish_link(self, link: PeerLink) -> None:
        """Write `link`'s `readable` to every peer table; at the end of a suspect or slow
        period, again (nothing else tells of it)."""
        if self.closed:  # (a suspect period's end, or a worker's mark, after the stop)
            return
        readable = link.readable
        for index in self._published:
            index.set_readable(link.index, readable)
        left = link.unreadable_until - time.monotonic()
        if left > 0 and not link.closed:
            asyncio.get_running_loop().call_later(left, self._publish_link, link)

    async def start(self) -> None:
        await self.server.start(self.cfg.address, self.cfg.port)
        for a in self.cfg.addresses:
            self._link(*parse_host_port(a))
        loop = asyncio.get_running_loop()
        if self.cfg.discovery is not None:
            self._tasks.append(loop.create_task(self._discover()))
        else:
            self._drop_unlisted()
        self._pushes = asyncio.Queue(PUSH_QUEUE)
        self._tasks += [loop.create_task(self._push_worker()) for _ in range(PUSH_WORKERS)]
        self._tasks.append(loop.create_task(self._delete_worker()))
        self._tasks.append(loop.create_task(self._reload()))
        log.info("peer tier serving on %s:%d%s, %d static peers%s", self.cfg.address,
                 self.cfg.port, " (TLS)" if self.cfg.tls else "", len(self.cfg.addresses),
                 f", discovery {self.cfg.discovery}" if self.cfg.discovery else "")

    def _link(self, host: str, port: int) -> None:
        if (host, port) in self.links or self._is_me(host, port):
            return
        link = PeerLink(len(self.by_index), host, port, credentials=self.credentials,
                        agent_id=self.agent_id, connections=self.cfg.connections,
                        directories=self.directories, metrics=self.m)
        self.links[(host, port)] = link
        self.by_index.append(link)
        loop = asyncio.get_running_loop()

        def changed() -> None:  # (a suspect mark comes from a worker thread)
            with contextlib.suppress(RuntimeError):  # the loop is closed: the agent stops
                loop.call_soon_threadsafe(self._publish_link, link)
        link.on_change = changed
        link.log = self.delete_log
        link.away = self.away.items
        link.on_node = self._node_known
        saved = self._saved.pop(link.name, None)
        node = "" if self.delete_log is None else self.delete_log.nodes.get(link.name, "")
        if saved and self._names_a_node(node):
            # They wait for that node, which this address may no longer be (an address
            # reused by another node's pod): taken once the link's stream names it.
            self._park(node, link.name, saved, went=False)
        elif saved:
            self._hand(link, link.name, saved, "since before the restart")
        self._publish_link(link)
        link.task = loop.create_task(link.run())

    def _hand(self, link: PeerLink, name: str, saved: Waiting, since: str) -> None:
        """Queue DELETEs that waited for `link`'s peer under the name `name` (the file's,
        or an away node's: `link`'s own name, or the one its node had before), sent when
        it is reachable, before its inventory is taken (a link following it already: at
        once, its copies unlisted meanwhile). One it refused whose `REFUSED_KEEP` ran out
        meanwhile is dropped, and past `MAX_PENDING_DELETES` the oldest (counted); the
        others go as if new (one refused again waits `REFUSED_KEEP` from that refusal).
        `since`: when they began to wait, for the log."""
        now = time.time()
        expired = [item for item, until in saved.items() if until and until <= now]
        for item in expired:
            del saved[item]
        over = list(itertools.islice(saved, max(0, len(saved) - MAX_PENDING_DELETES)))
        for item in over:
            del saved[item]
        for tenant, key in saved:  # queued before the drops are written: a rewrite keeps them
            link.queue_delete(tenant, key)
            d = self.directories.get(tenant)
            if d is not None:
                d.remove(key, link.index)
        if self.delete_log is not None and name != link.name:  # on file under its name now
            self.delete_log.wait_each(link.name, list(saved))
            self.delete_log.gone(name, list(saved))
        dropped = expired + over
        self._drop_saved(name, dropped)
        log.info("peer %s: %d deletes waiting for it %s, sent when it is reachable%s",
                 link.name, len(saved), since,
                 f" ({len(dropped)} dropped: refused past their time, or past the bound)"
                 if dropped else "")
        self._deletes.set()

    def _names_a_node(self, node: str) -> bool:
        """Whether a peer's node name tells its node (and so its agent) apart: not where
        it is this agent's own (agents run by hand on one host, without `nodeName`, all
        say the host's name)."""
        return bool(node) and node != self.node

    def _node_known(self, link: PeerLink) -> None:
        """`link`'s peer said its node: the DELETEs waiting for that node while it was away
        go to it (`awaynodes`)."""
        if not self._names_a_node(link.node):
            return
        for name, saved in self.away.take(link.node).items():
            self._hand(link, name, saved, f"for its node {link.node}" if name == link.name
                       else f"since its node {link.node} was at {name}")

    def _park(self, node: str, name: str, waiting: Waiting, went: bool = True) -> None:
        """What waited for the link `name` to `node` waits for the node: the link went
        (`went`), or the file said so at the start (given at once to a link that follows
        the node already)."""
        same = [link for link in self.links.values()
                if link.node == node and not link.closed and not link.is_self]
        if len(same) == 1:  # (two would be two agents saying one node: neither is it)
            if waiting:
                self._hand(same[0], name, waiting, f"since its node {node} was at {name}")
            return
        for old, item in self.away.park(node, name, waiting, time.time()):
            self._drop_saved(old, [item])
        log.info("peer %s (node %s) %s: %d deletes wait for the node at any address, up "
                 "to %g s", name, node, "went" if went else "since before the restart",
                 len(waiting), NODE_KEEP)

    def _expire_away(self, now: float) -> None:
        """The nodes away for `NODE_KEEP` (wall clock `now`): their DELETEs go to the link
        at the address they were last at where it is listed still and names no other node
        (no link named this one meanwhile: that address is taken to be it, as before nodes
        were named), else they are dropped, counted."""
        for node, by_name in self.away.expire(now).items():
            for name, saved in by_name.items():
                link = next((x for x in self.links.values() if x.name == name), None)
                if link is not None and not link.closed and link.node in ("", node):
                    self._hand(link, name, saved, f"for {NODE_KEEP:g} s at its listed address")
                    continue
                self._drop_saved(name, list(saved))
                log.warning("peer %s: its node %s did not come back within %g s: the %d "
                            "deletes that waited for it are dropped", name, node, NODE_KEEP,
                            len(saved))

    def _drop_unlisted(self) -> None:
        """The DELETEs the file said wait for peers this agent does not have (its config or
        discovery no longer names them): those of a peer whose node the file names wait
        for that node (`_park`), as when a running agent's link goes; the others are
        dropped, counted."""
        nodes = {} if self.delete_log is None else self.delete_log.nodes
        for name, saved in self._saved.items():
            node = nodes.get(name, "")
            if self._names_a_node(node):
                self._park(node, name, saved)
                continue
            self._drop_saved(name, list(saved))
            log.warning("peer %s is no longer a peer: the %d deletes that waited for it "
                        "are dropped", name, len(saved))
        self._saved.clear()

    def _drop_saved(self, name: str, items: list[Item]) -> None:
        """Drop DELETEs the file said wait for peer `name`: counted, and off the file."""
        for _ in items:
            self.m.deleted(name, "sent", "dropped")
        if self.delete_log is not None:
            self.delete_log.gone(name, items)

    def _waiting(self) -> Iterator[tuple[str, Item, float]]:
        """(peer name, DELETE, until) of every DELETE waiting for a peer now (`until`: the
        wall-clock time a refused one is dropped at, else 0), for the file's rewrite."""
        for name, saved in self._saved.items():
            for item, until in saved.items():
                yield name, item, until
        for link in self.links.values():
            for item, until in link.waiting().items():
                yield link.name, item, until
        yield from self.away.entries()

    def _unlink(self, key: tuple[str, int]) -> None:
        link = self.links.pop(key)
        self.by_index[link.index] = None
        link.close()
        if self._names_a_node(link.node) and not link.is_self:  # (back at another address?)
            self._park(link.node, link.name, link.waiting())
        elif self.delete_log is not None:  # they go with the link, as in memory
            self.delete_log.gone(link.name, [*link.deletes, *link.refused])
        for d in self.directories.values():
            d.drop_peer(link.index)

    def _is_me(self, host: str, port: int) -> bool:
        return port == self.cfg.port and host == self.advertise

    async def _discover(self) -> None:
        assert self.cfg.discovery is not None
        loop = asyncio.get_running_loop()
        static = {parse_host_port(a) for a in self.cfg.addresses}
        while True:
            try:
                infos = await loop.getaddrinfo(self.cfg.discovery, self.cfg.port,
                                               type=socket.SOCK_STREAM)
                found = {(str(i[4][0]), self.cfg.port) for i in infos}
                for key in found - self.links.keys():
                    self._link(*key)
                if self._saved:  # (the first answer: the peers it does not list are gone)
                    self._drop_unlisted()
                for key in set(self.links) - found - static:
                    log.info("peer %s:%d no longer listed by %s", *key, self.cfg.discovery)
                    self._unlink(key)
            except OSError as e:
                log.warning("peer discovery: %s does not resolve: %s", self.cfg.discovery, e)
            waited = 0.0
            while waited < DISCOVERY_INTERVAL:
                await asyncio.sleep(DISCOVERY_RETRY)
                waited += DISCOVERY_RETRY
                if self.away.nodes or any(link.unreachable for link in self.links.values()):
                    break  # (the pool is changing: its new addresses are looked for sooner)

    async def _reload(self) -> None:
        """Look at the secret and TLS files every `RELOAD_SECONDS` (`Credentials`); once a
        secret is no longer accepted, end the connections proven with it, both ways."""
        while True:
            await asyncio.sleep(RELOAD_SECONDS)
            try:
                if not self.credentials.refresh():
                    continue
            except Exception:  # (a bug: logged, and the next look tries again)
                log.exception("peers: reading the secret and TLS files again failed")
                continue
            ended = self.server.end_stale()
            for link in self.links.values():
                ended += link.end_stale()
            if ended:
                log.info("peers: %d connections proven with a secret no longer accepted "
                         "ended", ended)

    # -- reads

    def holder(self, tenant: str, key: bytes) -> tuple[PeerLink, int] | None:
        """The link to the peer the directory says holds `key`, and its size."""
        d = self.directories.get(tenant)
        got = None if d is None else d.holder(key)
        if got is None:
            return None
        link = self.by_index[got[0]]
        if link is None or not link.readable:
            return None
        return link, got[1]

    def readable(self) -> bytes:
        """One byte per peer number: 1 where that peer may be read now (`holder`'s rule)."""
        return bytes(link is not None and link.readable for link in self.by_index)

    async def fetch(self, link: PeerLink, tenant: str, key: bytes,
                    target: ArenaTarget) -> Fetched | str:
        """The chunk read from `link` into `target` (`PeerLink.fetch`), within
        `peers.timeout` from now."""
        return await link.fetch(tenant, key, target, time.monotonic() + self.cfg.timeout,
                                self.pool)

    def fetch_many(self, link: PeerLink, reads: list[tuple[str, bytes, ArenaTarget]],
                   timeout: float | None = None,
                   then: list[Callable[[Fetched | str], None]] | None = None,
                   alone: bool = False) -> list[asyncio.Future[Fetched | str]]:
        """Reads from `link` queued together (one pipelined batch where they fit one,
        `PeerLink.fetch_many`: a future per read, or with `then` a callback per read; with
        `alone`, a batch of their own), each within `timeout` (by default `peers.timeout`)
        from now."""
        deadline = time.monotonic() + (self.cfg.timeout if timeout is None else timeout)
        return link.fetch_many(reads, deadline, self.pool, then, alone)

    # -- hand-offs

    def link_to(self, node: str) -> PeerLink | None:
        """The link to the peer a push hint names: by its node name, else its address
        (`host` or `host:port`, for peers without node names)."""
        found = None
        for link in self.links.values():
            if link.is_self:
                continue
            if link.node == node:
                return link
            if found is None and node in (link.host, link.name):
                found = link
        return found

    def link_of(self, peer_id: bytes) -> PeerLink | None:
        """The link to the agent whose id is `peer_id` (a push offer's sender)."""
        for link in self.links.values():
            if link.peer_id == peer_id and not link.is_self and not link.closed:
                return link
        return None

    def push(self, tenant: str, key: bytes, size: int, to: str) -> None:
        """Queue a hand-off of `key` to the node `to`; never waits (a full queue drops
        it: counted, and the consumer can still read it by key)."""
        if to == self.node:
            return  # the reader is on this node: the chunk is already where it reads
        if self._pushes is None:
            return
        try:
            self._pushes.put_nowait((tenant, key, size, to))
        except asyncio.QueueFull:
            self.m.pushed("", "dropped", 0.0)
            self._log_once("queue", "push queue full (%d): pushes dropped until it drains",
                           PUSH_QUEUE)

    async def _push_worker(self) -> None:
        """Offers queued pushes: whatever is queued when it is free (a put_many's window,
        a request's saves), up to `wire.MAX_PUSH_BATCH` chunks and `MAX_BATCH_BYTES`,
        goes out as one batch per node named."""
        assert self._pushes is not None
        while True:
            batch = [await self._pushes.get()]
            total = batch[0][2]
            while len(batch) < wire.MAX_PUSH_BATCH and not self._pushes.empty():
                nxt = self._pushes.get_nowait()
                batch.append(nxt)
                total += nxt[2]
                if total >= MAX_BATCH_BYTES:
                    break
            by_node: dict[str, list[tuple[str, bytes, int]]] = {}
            for tenant, key, size, to in batch:
                by_node.setdefault(to, []).append((tenant, key, size))
            for to, offers in by_node.items():
                try:
                    await self._push_batch(offers, to)
                except Exception:
                    log.exception("push of %d chunks to %s failed", len(offers), to)

    async def _push_batch(self, offers: list[tuple[str, bytes, int]], to: str) -> None:
        link = self.link_to(to)
        if link is None:
            for _ in offers:
                self.m.pushed("", "unknown", 0.0)
            self._log_once(to, "push hint %r names no peer of this agent: pushes to it "
                           "dropped (the reader can still read the chunks by key)", to)
            return
        if link.unreachable:
            for _ in offers:
                self.m.pushed(link.name, "unreachable", 0.0)
            self._log_once(to, "push to %s (%s): the peer is unreachable", to, link.name)
            return
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self.pool, link.push_many, offers,
                                             start + PUSH_TIMEOUT)
        for (_, key, _), (result, why, at) in zip(offers, results, strict=True):
            self.m.pushed(link.name, result, at - start)
            if result in ("ok", "held"):
                self._failing.discard(to)
                self._failing.discard("queue")
            else:
                self._log_once(to, "push of %s to %s (%s): %s%s", key.hex(), to, link.name,
                               result, f": {why}" if why else "")

    # -- deletes (docs/cross-node.md#delete)

    def delete(self, tenant: str, key: bytes, here: bool, sender: bytes | None = None) -> None:
        """A DELETE of `key` in `tenant`'s space: no peer is read from for it any more, and
        it goes to every peer (`here`: made on this node, by a client) or, made on another
        node and received from it (`sender`: that agent's id), to the peers unreachable from
        here only (when each is back, before its inventory is taken: one that missed it from
        the deleting node may be reachable from here first). Never waits."""
        d = self.directories.get(tenant)
        if d is not None:
            by = None if sender is None else self.link_of(sender)
            # The sender's own ADDs are not held off: it took the DELETE before sending it.
            d.forget(key, NO_PEER if by is None else by.index)
        waiting = []
        for link in self.links.values():
            if link.is_self or link.closed or (link.synced and not here):
                continue  # (a peer this agent follows got it from the deleting node)
            link.queue_delete(tenant, key)
            waiting.append(link.name)
        if self.away.nodes:  # and every node away (`awaynodes`)
            names, dropped = self.away.add((tenant, key))
            waiting += names
            for name, item in dropped:
                self._drop_saved(name, [item])
        if self.delete_log is not None and waiting:
            self.delete_log.wait((tenant, key), waiting)  # one write for every peer
        self._deletes.set()

    def _followed_by(self, peer_id: bytes) -> None:
        """The agent whose id is `peer_id` subscribed to this one: it follows this agent
        now, so the DELETEs it refused before go to it again."""
        for link in self.links.values():
            if link.peer_id == peer_id and link.followed():
                self._deletes.set()

    async def _delete_worker(self) -> None:
        """Delivers queued DELETEs to the peers this agent follows now (an unreachable
        peer's wait for its link: `PeerLink.run` sends them first)."""
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deletes.wait(), DELETE_RETRY)
            self._deletes.clear()
            self._expire_away(time.time())
            now = time.monotonic()
            for link in list(self.links.values()):
                link.expire_refused(now)
                while link.deletes and link.synced and not link.closed:
                    batch = link.take_deletes()
                    follows = link.follows
                    try:
                        left, refused = await loop.run_in_executor(
                            self.pool, link.delete_many, batch,
                            time.monotonic() + DELETE_TIMEOUT)
                    except RuntimeError:  # the executor is shut down: the agent stops
                        return
                    link.answered(batch, left, refused, follows)
                    if left:
                        for _ in left:
                            self.m.deleted(link.name, "sent", "error")
                        break

    def _log_once(self, what: str, msg: str, *args: object) -> None:
        if what in self._failing or len(self._failing) >= MAX_LOGGED:
            return
        self._failing.add(what)
        log.warning(msg, *args)

    # -- state

    def samples(self) -> Iterator[Sample]:
        for tenant, d in self.directories.items():
            labels = {"tenant": tenant} if tenant else {}
            yield Sample("kvpool_peer_directory_entries", "Remote chunks in the peer "
                         "directory", labels, len(d))
            if d.max_entries is not None:
                yield Sample("kvpool_peer_directory_capacity_entries", "Most remote chunks "
                             "the peer directory lists (peers.maxEntries)", labels,
                             d.max_entries)
            yield Sample("kvpool_peer_directory_full", "Remote chunks announced and not "
                         "listed: the directory held peers.maxEntries", labels, d.refused,
                         counter=True)
            holdings = self.spaces.get(tenant)
            if holdings is not None:
                yield Sample("kvpool_peer_handoff_pinned_bytes", "Arena bytes pinned by "
                             "chunks pushed here (hand-offs) and not read yet", labels,
                             holdings.handoff_bytes)
        for link in self.links.values():
            if link.is_self:
                continue
            up = link.synced
            yield Sample("kvpool_peer_up", "1 while this agent follows the peer's inventory "
                         "(connected, authenticated, synced)", {"peer": link.name},
                         1 if up else 0)
            yield Sample("kvpool_peer_directory_lag_seconds", "Seconds between a peer's last "
                         "inventory message being sent and its arrival here",
                         {"peer": link.name}, link.lag)
            yield Sample("kvpool_peer_deletes_waiting", _WAITING_DOC,
                         {"peer": link.name, "peer_node": link.node},
                         len(link.deletes) + len(link.taken) + len(link.refused))
        for node, away in self.away.nodes.items():  # (each under its last address)
            yield Sample("kvpool_peer_deletes_waiting", _WAITING_DOC,
                         {"peer": next(reversed(away.waiting)), "peer_node": node},
                         sum(len(q) for q in away.waiting.values()))

    async def close(self) -> None:
        """Stop serving and reading; returns once the tasks have ended (a link's task
        drops its peer's entries as it ends: before the spaces' tables close, not after,
        where it failed on their released memory, logged at every stop)."""
        self.closed = True
        await self.server.close()
        for t in self._tasks:
            t.cancel()
        for link in list(self.links.values()):
            link.close()
        ending = [t for t in [*self._tasks, *(link.task for link in self.links.values())]
                  if t is not None and not t.done()]
        if ending:
            await asyncio.wait(ending, timeout=CLOSE_WAIT)
        # The workers end before the spaces close: a read receives into the arena. Their
        # connections are shut down (`PeerLink.close`); one still connecting ends at its
        # connection, or its deadline.
        workers = asyncio.ensure_future(asyncio.to_thread(
            self.pool.shutdown, wait=True, cancel_futures=True))
        done, _ = await asyncio.wait([workers], timeout=CLOSE_WAIT)
        if not done:
            log.warning("peer reads still under way %gs into the stop", CLOSE_WAIT)
        if self.delete_log is not None:
            self.delete_log.close()
