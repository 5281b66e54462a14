"""The peer tier of one agent: its server, its links to the other agents of the pool, and
the directory of each tenant space, kept current from the links' subscriptions.

Peers are the static `peers.addresses` and whatever `peers.discovery` resolves to,
re-resolved every `DISCOVERY_INTERVAL` (a headless Service lists every agent, this one
included: a link that reaches this agent's own server finds out at the handshake, by the
agent id, and stops). A peer the name stops listing is dropped with its entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry

from ..config import ConfigError, Peers, expand_env, parse_host_port
from ..metrics import Sample
from . import auth
from .directory import PeerDirectory
from .links import ArenaTarget, Fetched, PeerLink
from .metrics import PeerMetrics
from .server import Holdings, PeerServer

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL = 10.0
FETCH_THREADS = 16
"""Worker threads receiving chunks from peers, for all peers together (each sends one
link's batches; a link has at most `peers.connections` of them at once)."""


def tls_contexts(cfg: Peers) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server, client) TLS contexts: each side shows its certificate and requires one
    signed by the pool's CA. Agents are reached by IP, so the name is not checked: the CA
    is the pool's own."""
    if cfg.tls is None:
        return None, None
    t = cfg.tls
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(t.ca_file))
    server.load_cert_chain(str(t.cert_file), str(t.key_file))
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(t.ca_file))
    client.load_cert_chain(str(t.cert_file), str(t.key_file))
    client.check_hostname = False
    return server, client


class PeerNetwork:
    def __init__(self, cfg: Peers, spaces: dict[str, Holdings], registry: CollectorRegistry,
                 pool: str) -> None:
        assert cfg.secret_file is not None  # the config requires it when enabled
        self.cfg = cfg
        self.advertise = None if cfg.advertise is None else expand_env(cfg.advertise,
                                                                       os.environ)
        try:
            self.secret = auth.read_secret(cfg.secret_file)
        except (OSError, ValueError) as e:
            raise ConfigError(f"peers.secretFile: {e}") from e
        self.agent_id = os.urandom(16)
        self.m = PeerMetrics(registry, pool)
        self.directories = {tenant: PeerDirectory() for tenant in spaces}
        self._server_tls, self._client_tls = tls_contexts(cfg)
        self.server = PeerServer(spaces, self.secret, self.agent_id, self.m, self._server_tls)
        self.links: dict[tuple[str, int], PeerLink] = {}
        self.by_index: list[PeerLink | None] = []
        self.pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kvpool-peer")
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.server.start(self.cfg.address, self.cfg.port)
        for a in self.cfg.addresses:
            self._link(*parse_host_port(a))
        if self.cfg.discovery is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._discover()))
        log.info("peer tier serving on %s:%d%s, %d static peers%s", self.cfg.address,
                 self.cfg.port, " (TLS)" if self._server_tls else "", len(self.cfg.addresses),
                 f", discovery {self.cfg.discovery}" if self.cfg.discovery else "")

    def _link(self, host: str, port: int) -> None:
        if (host, port) in self.links or self._is_me(host, port):
            return
        link = PeerLink(len(self.by_index), host, port, secret=self.secret,
                        agent_id=self.agent_id, connections=self.cfg.connections,
                        tls=self._client_tls, directories=self.directories, metrics=self.m)
        self.links[(host, port)] = link
        self.by_index.append(link)
        link.task = asyncio.get_running_loop().create_task(link.run())

    def _unlink(self, key: tuple[str, int]) -> None:
        link = self.links.pop(key)
        self.by_index[link.index] = None
        link.close()
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
                for key in set(self.links) - found - static:
                    log.info("peer %s:%d no longer listed by %s", *key, self.cfg.discovery)
                    self._unlink(key)
            except OSError as e:
                log.warning("peer discovery: %s does not resolve: %s", self.cfg.discovery, e)
            await asyncio.sleep(DISCOVERY_INTERVAL)

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

    async def fetch(self, link: PeerLink, tenant: str, key: bytes,
                    target: ArenaTarget) -> Fetched | str:
        """The chunk read from `link` into `target` (`PeerLink.fetch`), within
        `peers.timeout` from now."""
        return await link.fetch(tenant, key, target, time.monotonic() + self.cfg.timeout,
                                self.pool)

    def fetch_many(self, link: PeerLink, reads: list[tuple[str, bytes, ArenaTarget]]
                   ) -> list[asyncio.Future[Fetched | str]]:
        """Reads from `link` queued together (one pipelined batch where they fit one,
        `PeerLink.fetch_many`), each within `peers.timeout` from now."""
        return link.fetch_many(reads, time.monotonic() + self.cfg.timeout, self.pool)

    # -- state

    def samples(self) -> Iterator[Sample]:
        for tenant, d in self.directories.items():
            labels = {"tenant": tenant} if tenant else {}
            yield Sample("kvpool_peer_directory_entries", "Remote chunks in the peer "
                         "directory", labels, len(d))
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

    async def close(self) -> None:
        self.server.close()
        for t in self._tasks:
            t.cancel()
        for link in list(self.links.values()):
            link.close()
        with contextlib.suppress(Exception):
            self.pool.shutdown(wait=False, cancel_futures=True)
