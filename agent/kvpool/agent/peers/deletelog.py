"""The peer DELETEs waiting for their peers, on file in the agent's state directory.

A client's DELETE goes to every peer (docs/cross-node.md#delete); a peer unreachable then,
or one that refuses it (it does not follow this agent yet), gets it later. Kept in memory
only, those waiting DELETEs went with a restart of the agent (a crash, a SIGKILL, an
upgrade) and the peer's copy of a deleted key stayed in the pool. Here each change to them
is appended to a file in the state directory (`stateDir`), which a starting agent reads
back: what waited for a peer is sent to it when it is reachable, before its inventory.

The file is framed records (`records`):

- PEER (id, name, node): a peer, by its link's name (`host:port`), for the records after
  it, and its node's name where its inventory stream said it (empty where not yet, or from
  an agent older than the field): a PEER record of an id seen before names its node anew
  (a restart parks what waited for a peer no longer listed by that node, `awaynodes`);
- WAIT (tenant, key, peer ids, until): the DELETE of `key` in `tenant`'s space waits for
  those peers; `until` is 0 (until delivered), or for a DELETE a peer refused the
  wall-clock time it is dropped at (`REFUSED_KEEP` after the refusal);
- GONE (peer id, [(tenant, key), ...]): those wait no more for that peer (it answered
  them, or they were dropped).

A client's DELETE is one record, one write(2) whatever the number of peers, never synced:
it survives the agent's crash or SIGKILL (the page cache holds it), while a power loss of
the node may lose the last seconds of changes. A kill mid-write leaves a torn last record:
its CRC fails, reading stops there (logged) and the start cuts it off. Once the file holds
more than twice the waiting DELETEs plus `COMPACT_FLOOR` entries it is rewritten from
them, synced and renamed into place (a power loss finds the old file or the new one whole);
a start rewrites it too. A DELETE answered by the peer just before a kill, its GONE not
written yet, is sent again by the restarted agent: a copy the peer stored again meanwhile
goes too, as with any late DELETE (a miss, never wrong bytes).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec

from .. import atomicfile
from ..records import HEAD_BYTES, frame, whole_records

log = logging.getLogger(__name__)

PEER, WAIT, GONE = 1, 2, 3
COMPACT_FLOOR = 1 << 16
"""Entries allowed beyond twice the waiting DELETEs before the file is rewritten. With every
peer reachable a DELETE adds two entries per peer (its WAIT and its GONE): one rewrite (a
sync) every 32,768 DELETEs per peer at most."""

Item = tuple[str, bytes]
"""A DELETE: (tenant, key)."""
Waiting = OrderedDict[Item, float]
"""One peer's waiting DELETEs, oldest first, each with the wall-clock time it is dropped at
(one the peer refused) or 0 (until delivered)."""


class _Peer(msgspec.Struct, array_like=True):
    id: int
    name: str
    node: str = ""


class _Wait(msgspec.Struct, array_like=True):
    tenant: str
    key: bytes
    peers: list[int]
    until: float = 0.0


class _Gone(msgspec.Struct, array_like=True):
    peer: int
    items: list[tuple[str, bytes]]


_enc = msgspec.msgpack.Encoder()
_dec_peer = msgspec.msgpack.Decoder(_Peer)
_dec_wait = msgspec.msgpack.Decoder(_Wait)
_dec_gone = msgspec.msgpack.Decoder(_Gone)


def read(path: Path) -> dict[str, Waiting]:
    """What the file says waits, per peer name; what follows a torn or damaged record is
    left out (logged)."""
    return read_nodes(path)[0]


def read_nodes(path: Path) -> tuple[dict[str, Waiting], dict[str, str]]:
    """`read`'s answer, and the node of each peer name whose node the file says."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}, {}
    names: dict[int, str] = {}
    nodes: dict[str, str] = {}
    waiting: dict[str, Waiting] = {}
    end = 0
    for kind, payload in whole_records(data):
        try:
            if kind == PEER:
                peer = _dec_peer.decode(payload)
                names[peer.id] = peer.name
                if peer.node:
                    nodes[peer.name] = peer.node
            elif kind == WAIT:
                wait = _dec_wait.decode(payload)
                item = (wait.tenant, wait.key)
                for i in wait.peers:
                    q = waiting.setdefault(names[i], OrderedDict())
                    q.pop(item, None)
                    q[item] = wait.until
            elif kind == GONE:
                gone = _dec_gone.decode(payload)
                q = waiting.get(names[gone.peer], OrderedDict())
                for tenant, key in gone.items:
                    q.pop((tenant, key), None)
            else:
                break
        except (msgspec.DecodeError, KeyError):  # whole, yet not ours: nothing after it
            break
        end += HEAD_BYTES + len(payload)
    if end < len(data):
        log.warning("peer deletes %s: its last %d bytes are torn or damaged (the agent "
                    "was killed while writing them): ignored", path, len(data) - end)
    return {name: q for name, q in waiting.items() if q}, nodes


class DeleteLog:
    """The file of the DELETEs waiting for peers, appended to as they wait and go (event
    loop only) and rewritten from what waits (`live`) once it has grown."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.live: Callable[[], Iterable[tuple[str, Item, float]]] = tuple
        """(peer name, DELETE, until) of every DELETE waiting now, for a rewrite (set by the
        peer network)."""
        self.ids: dict[str, int] = {}
        """The peers the file names since its last rewrite, by their ids there."""
        self.nodes: dict[str, str] = {}
        """Each peer name's node, where known (`set_node`, or the file at the start)."""
        self.fd = -1
        self.size = 0
        self.entries = 0
        """Entries (a peer's DELETE waiting, or gone) written since the last rewrite, with
        the ones a failed write meant to."""
        self._compact_at = COMPACT_FLOOR
        self.rewrites = 0
        self.failing = False
        """A failed write was logged (once until one works)."""

    @classmethod
    def open(cls, path: Path) -> tuple[DeleteLog, dict[str, Waiting]]:
        """The file at `path` (its directory made where missing), rewritten from what it
        says waits (a torn tail cut off), and what that is. Raises OSError."""
        saved, nodes = read_nodes(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        opened = cls(path)
        opened.nodes = {name: node for name, node in nodes.items() if name in saved}
        opened.rewrite([(name, item, until) for name, q in saved.items()
                        for item, until in q.items()])
        return opened, saved

    def wait(self, item: Item, peers: list[str], until: float = 0.0) -> None:
        """`item` waits for each of `peers` (one record, whatever their number)."""
        self._maybe_compact()
        records: list[bytes] = []
        ids = [self._id(name, records) for name in peers]
        records.append(frame(WAIT, _enc.encode(_Wait(item[0], item[1], ids, until))))
        self._write(records, len(peers))

    def wait_each(self, peer: str, items: list[Item], until: float = 0.0) -> None:
        """`items` wait for `peer`: refused, until the wall-clock time `until`; or, 0,
        until delivered (queued again)."""
        if not items:
            return
        self._maybe_compact()
        records: list[bytes] = []
        ids = [self._id(peer, records)]
        records += [frame(WAIT, _enc.encode(_Wait(tenant, key, ids, until)))
                    for tenant, key in items]
        self._write(records, len(items))

    def gone(self, peer: str, items: list[Item]) -> None:
        """`items` wait no more for `peer`: it answered them, or they were dropped."""
        if not items or peer not in self.ids:  # none of its DELETEs is in the file
            return
        self._maybe_compact()
        if peer not in self.ids:  # (rewritten without it)
            return
        self._write([frame(GONE, _enc.encode(_Gone(self.ids[peer], items)))], len(items))

    def set_node(self, peer: str, node: str) -> None:
        """`peer`'s node is `node` (its inventory stream said so): on file with its
        DELETEs from now on."""
        if self.nodes.get(peer) == node:
            return
        self.nodes[peer] = node
        if peer in self.ids:  # its PEER record again, with the node
            self._write([frame(PEER, _enc.encode(_Peer(self.ids[peer], peer, node)))], 0)

    def _id(self, name: str, records: list[bytes]) -> int:
        got = self.ids.get(name)
        if got is None:
            got = self.ids[name] = len(self.ids)
            records.append(frame(PEER, _enc.encode(_Peer(got, name,
                                                         self.nodes.get(name, "")))))
        return got

    def _write(self, records: list[bytes], entries: int) -> None:
        """Append `records` in one write. Never raises: the DELETEs wait in memory either
        way; a write that fails is cut off (a torn record would hide every later one) and
        the next change rewrites the file whole."""
        self.entries += entries
        if self.fd < 0:
            return
        data = records[0] if len(records) == 1 else b"".join(records)
        try:
            written = os.write(self.fd, data)
            if written != len(data):
                raise OSError(f"short write: {written} of {len(data)} bytes")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.size)
            self._compact_at = min(self._compact_at, self.entries)
            if not self.failing:
                self.failing = True
                log.error("peer deletes %s: a change could not be written (%s): a restart "
                          "before the file is rewritten may lose or resend it", self.path, e)
            return
        self.failing = False
        self.size += len(data)

    def _maybe_compact(self) -> None:
        if self.entries < self._compact_at or self.fd < 0:
            return
        try:
            self.rewrite(list(self.live()))
        except OSError as e:
            # Again after as many entries more, not at every change.
            self._compact_at = self.entries + COMPACT_FLOOR
            log.error("peer deletes %s could not be rewritten: %s", self.path, e)

    def rewrite(self, live: list[tuple[str, Item, float]]) -> None:
        """Replace the file by a WAIT record per (peer, DELETE) of `live`. Raises OSError
        (the file as it was)."""
        ids: dict[str, int] = {}
        records: list[bytes] = []
        for name, (tenant, key), until in live:
            got = ids.get(name)
            if got is None:
                got = ids[name] = len(ids)
                records.append(frame(PEER, _enc.encode(_Peer(got, name,
                                                             self.nodes.get(name, "")))))
            records.append(frame(WAIT, _enc.encode(_Wait(tenant, key, [got], until))))
        # Synced before the rename: a power loss must not find the new name over blocks
        # never written, which would lose every DELETE waiting, not only the last ones.
        atomicfile.replace(self.path, records, tmp=self.path.with_name(self.path.name + ".tmp"),
                           mode=0o600)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self.ids = ids
        self.entries = len(live)
        self._compact_at = 2 * len(live) + COMPACT_FLOOR
        self.rewrites += 1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
