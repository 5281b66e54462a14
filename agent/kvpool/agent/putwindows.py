"""A zero-copy `put_many`'s windows, pipelined: the agent's round trips overlap the copies.

A window costs the agent its ALLOCs and its COMMITs, and the client its copies (and, for
tensors, the DMA and the checksums' read-back). Done one after the other, the copies wait
for the ALLOCs' round trip and the next window for the COMMITs'. Here a window's COMMITs
go out in one write with the ALLOCs of the window after the next, so while the client
copies window n the agent commits window n-1 and answers the ALLOCs of window n+1, whose
replies are in by the time the client wants them (the replies come in the order the
requests went: the COMMITs' of n-1, then the ALLOCs' of n+1). A window's copies start as
its ALLOC replies are read, one by one; its COMMITs still go only once its own copies
are fenced (`Copies.fence`).

The agent handles a connection's requests in order, so a window's COMMITs are done before
the ALLOCs sent after them: at most two windows hold write leases at once, the one being
copied and the next. The next window's ALLOCs go out that early only while the two fit the
connection's share (`AHEAD_SHARE` of the arena, the lease limit), else with this window's
COMMITs (one write, one round trip a window).

Failure of any kind (an exception mid-window, a copy or a fence that fails, a dropped
connection) ends every lease not committed by ABORT, only once no copy that started may
still write its pages (`Copies.settle`) and once every reply owed has been read: the
COMMITs' replies then say what was stored (those windows are done, `PutCall.done`), the
ALLOCs' which leases were granted. A connection that failed itself (dropped, or a reply
not in within the timeout) is closed at once instead, which ends them at the agent: a
stalled agent costs the call one timeout, not one per reply owed.
A refused COMMIT (its chunk's result the error) leaves its lease to an ABORT as well, sent
when no reply is owed any more: `Connection` reads a cast's reply before the next call's,
which holds only while a cast follows every reply posted before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import protocol as p
from .constants import PAGE_BYTES

if TYPE_CHECKING:
    from .transport import Copies, Digest, PutResult, WindowConnection

AHEAD_SHARE = 4
"""Two windows' chunks together take at most 1/this of the arena for the next window's
ALLOCs to go out before this window's COMMITs: the agent lets one connection's uncommitted
writes take half of it (beyond, an ALLOC is refused), and the rest of the arena stays for
other chunks, which a chunk being written cannot be evicted to make room for."""

CopiesOf = Callable[[int, int], "Copies"]
"""The copy step of the call's keys [lo, hi): one window's (`transport.Copies`)."""


@dataclass(slots=True)
class PutCall:
    """What a `put_many` writes, key by key, and how far it got."""

    keys: Sequence[bytes]
    sizes: Sequence[int]
    metas: Sequence[bytes]
    results: list[PutResult]
    blocks: Sequence[p.EngineBlocks | None] | None = None
    to: str = ""
    """The node every chunk is handed off to (COMMIT's hint)."""
    done: int = 0
    """Keys, from the first, whose results are final (their windows' COMMITs answered): a
    call resumed after a reconnect goes on from here."""


@dataclass(slots=True)
class _Owed:
    """A write's requests whose replies are not read yet."""

    window: int
    allocs: int = 0
    """ALLOCs of the window not answered yet (an ALLOC group)."""
    commits: list[tuple[int, int]] | None = None
    """A COMMIT group: (index in the call, lease) of each COMMIT, in order."""


def write_windows(conn: WindowConnection, call: PutCall, copies_of: CopiesOf, step: int,
                  arena_bytes: int, max_leases: int) -> None:
    """Put the call's chunks from `call.done` on, `step` keys a window, pipelined (the
    module's docstring). Results go to `call.results`, one per key; `call.done` moves past
    each window as its COMMITs are answered."""
    _Puts(conn, call, copies_of, step, arena_bytes, max_leases).run()


class _Puts:
    def __init__(self, conn: WindowConnection, call: PutCall, copies_of: CopiesOf, step: int,
                 arena_bytes: int, max_leases: int) -> None:
        self.conn, self.call, self.copies_of = conn, call, copies_of
        n = len(call.keys)
        self.windows = [(lo, min(lo + step, n)) for lo in range(call.done, n, step)]
        self.room = (arena_bytes // AHEAD_SHARE, max_leases)
        self.posted = 0
        """Windows whose ALLOCs went out."""
        self.owed: deque[_Owed] = deque()
        """The groups of requests whose replies are not read, in the order they went."""
        self.open: dict[int, None] = {}
        """Write leases granted and not committed (no COMMIT sent): ABORTed on failure."""
        self.refused: list[int] = []
        """Leases whose COMMIT was refused: ABORTed once no reply is owed."""
        self.copies: Copies | None = None
        """The copies of the window being copied, until they are fenced."""
        self.dma = False
        """The copies are a device's (`Copies.dma`): every ALLOC says so."""

    def run(self) -> None:
        if not self.windows:
            return
        first = self.copies_of(*self.windows[0])
        self.dma = first.dma  # one device a call
        try:
            self._post(self._next_allocs(-1))
            for w in range(len(self.windows)):
                commits = self._copy(w, first if w == 0 else self.copies_of(*self.windows[w]))
                self.owed.append(_Owed(w, commits=[(i, lease) for i, lease, _ in commits]))
                reqs = [c for _, _, c in commits]
                reqs += self._next_allocs(w)  # after the COMMITs: the agent ends those first
                for _, lease, _ in commits:
                    del self.open[lease]
                self._post(reqs)
            while self.owed:
                self._read_commits()
        except BaseException as e:
            self._fail(broken=isinstance(e, OSError))
            raise
        self.conn.cast(*[p.Abort(self.conn.rid(), lease) for lease in self.refused])

    def _footprint(self, w: int) -> tuple[int, int]:
        lo, hi = self.windows[w]
        return sum(-(-n // PAGE_BYTES) for n in self.call.sizes[lo:hi]) * PAGE_BYTES, hi - lo

    def _ahead(self, w: int) -> bool:
        """Whether windows w and w + 1 may hold write leases together."""
        (b0, n0), (b1, n1) = self._footprint(w), self._footprint(w + 1)
        return b0 + b1 <= self.room[0] and n0 + n1 <= self.room[1]

    def _next_allocs(self, w: int) -> list[p.Request]:
        """The ALLOCs to send once window `w`'s COMMITs are out (w = -1: at the start):
        the next window's if not sent yet, and the one after it where the two fit."""
        reqs: list[p.Request] = []
        call, conn = self.call, self.conn
        while self.posted < len(self.windows) and (
                self.posted <= w + 1 or (self.posted == w + 2 and self._ahead(w + 1))):
            lo, hi = self.windows[self.posted]
            reqs += [p.Alloc(conn.rid(), call.keys[i], call.sizes[i], call.metas[i], self.dma,
                             call.to) for i in range(lo, hi)]
            self.owed.append(_Owed(self.posted, allocs=hi - lo))
            self.posted += 1
        return reqs

    def _post(self, reqs: list[p.Request]) -> None:
        """Send in one write; a write that fails closes the connection (the replies owed
        will never come: the agent ends a closed connection's leases itself)."""
        try:
            self.conn.post(reqs)
        except OSError:
            self.conn.close()
            raise

    def _copy(self, w: int, copies: Copies) -> list[tuple[int, int, p.Request]]:
        """Read window `w`'s ALLOC replies (the COMMIT replies owed before them first),
        copying each granted chunk as its reply comes; fence the copies; its COMMITs, as
        (index in the call, lease, COMMIT)."""
        while self.owed[0].commits is not None:
            self._read_commits()
        group = self.owed[0]
        assert group.window == w
        call, conn = self.call, self.conn
        lo, _ = self.windows[w]
        self.copies = copies
        written: list[tuple[int, p.AllocReply]] = []
        digests: list[Digest] = []
        for i in range(group.allocs):
            reply = conn.replies(1)[0]
            group.allocs -= 1
            if isinstance(reply, p.ErrorReply):
                call.results[lo + i] = p.ProtocolError(reply.code, reply.message)
            elif isinstance(reply, p.AllocReply) and reply.exists:
                call.results[lo + i] = False
            else:
                assert isinstance(reply, p.AllocReply)
                self.open[reply.lease] = None  # before its copies: settled on failure
                written.append((i, reply))
                digests.append(copies.write(i, reply))
        self.owed.popleft()
        copies.fence()
        self.copies = None
        commits: list[tuple[int, int, p.Request]] = []
        for (i, reply), digest in zip(written, digests, strict=True):
            checksum, kind = digest()
            commit = p.Commit(conn.rid(), reply.lease, checksum, kind, to=call.to)
            blocks = call.blocks[lo + i] if call.blocks is not None else None
            commits.append((lo + i, reply.lease, p.with_blocks(commit, blocks)))
        return commits

    def _read_commits(self) -> None:
        """The replies of the COMMIT group owed first: the results of its window, done."""
        group = self.owed[0]
        assert group.commits is not None
        replies = self.conn.replies(len(group.commits)) if group.commits else []
        self.owed.popleft()
        for (i, lease), reply in zip(group.commits, replies, strict=True):
            if isinstance(reply, p.ErrorReply):
                self.call.results[i] = p.ProtocolError(reply.code, reply.message)
                self.refused.append(lease)
            else:  # False: another client committed the key first (its copy is kept)
                assert isinstance(reply, p.CommitReply)
                self.call.results[i] = reply.stored
        self.call.done = self.windows[group.window][1]

    def _fail(self, broken: bool) -> None:
        """Settle the copies that started, read every reply owed (what was committed, what
        was granted), then ABORT every lease not committed; if the connection fails meanwhile,
        close it (the agent ends a closed connection's leases itself). `broken`: the call
        failed on the connection itself (a timeout, a reset): it is closed at once, since
        an agent that did not answer in time would cost the caller another timeout per
        reply owed, and a read that timed out may have left the stream mid-frame."""
        if self.copies is not None:
            self.copies.settle()
            self.copies = None
        if broken:
            self.conn.close()
            return
        try:
            while self.owed:
                group = self.owed[0]
                if group.commits is not None:
                    self._read_commits()
                    continue
                for reply in self.conn.replies(group.allocs):
                    if isinstance(reply, p.AllocReply) and not reply.exists:
                        self.open[reply.lease] = None
                self.owed.popleft()
        except (OSError, p.ProtocolError):
            self.conn.close()
            return
        self.conn.cast(*[p.Abort(self.conn.rid(), lease)
                         for lease in [*self.open, *self.refused]])
