"""The files an agent keeps on its node, and whether an agent still uses them.

Each space of an agent (one per tenant, or the pool's one) has a socket, a DRAM arena, the
arena's commit journal and, with a `file://` shared tier, the record of the shared stores it
has used (`seenstores`). The arena, the journal and the record stay after a clean stop, on
purpose: a restarted agent finds its chunks in them again (a warm restart), and knows its
shared store's absent mount from a new store. `kvpool cleanup` frees them once no agent
serves them; a start that fails removes what it created itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .config import AgentConfig


@dataclass(frozen=True, slots=True)
class SpaceFiles:
    """Where one space of an agent lives on the node."""

    tenant: str
    """"" for the one space of a pool without tenants."""
    socket: Path
    arena: Path
    journal: Path
    lock: Path
    """Held (flock) by the agent serving the space; see `claim`."""
    stores: Path
    """The record of the `file://` shared stores the space has used (`seenstores`)."""
    identities: Path | None = None
    """The chunks' identities for KV events (`events.remembered`) when they live with the
    journal; None: in the NVMe directory, with the chunks."""


def space_files(config: AgentConfig) -> list[SpaceFiles]:
    """The socket, arena, journal, lock file and store record of every space `config`
    describes."""
    return [SpaceFiles(tenant, cfg.socket_path, cfg.arena_path(), cfg.journal_path(),
                       cfg.lock_path(), cfg.stores_path(),
                       None if cfg.tiers.nvme is not None else cfg.identities_path())
            for tenant, cfg in config.spaces()]


class InUse(Exception):
    """A space's files are still in use; the message says by whom."""


def remove_space_files(space: SpaceFiles) -> list[tuple[Path, int]]:
    """Remove a stopped space's arena, journal, store record and lock file: (path, bytes) of
    each removed.

    Raises InUse while an agent answers on the socket or holds the lock, or a process maps
    the arena. The lock is held while the files go, so no agent starts on them meanwhile.
    """
    if answers(space.socket):
        raise InUse(f"an agent is serving {space.socket}: stop it first")
    try:
        fd = os.open(space.lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise InUse(f"an agent holds {space.lock} (the lock of {space.arena}): "
                            "stop it first") from None
        holders = mapped_by(space.arena)
        if holders:
            raise InUse(f"{space.arena} is still mapped by process "
                        f"{', '.join(map(str, holders))} (an agent or its clients): "
                        "stop them first")
        removed = []
        for path in (space.arena, space.journal, space.stores, space.identities, space.lock):
            if path is None:
                continue
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append((path, size))
        return removed
    finally:
        if fd >= 0:
            os.close(fd)


def answers(socket_path: Path) -> bool:
    """True when something accepts connections on the Unix socket (an agent serving it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(socket_path))
        except OSError:
            return False
    return True


def mapped_by(path: Path) -> list[int]:
    """Ids of the processes (those this user may inspect) that have `path` mapped.

    An agent maps its arena, and so does every zero-copy client it handed the arena to.
    """
    target = str(path.absolute())
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            maps = (entry / "maps").read_text()
        except OSError:  # gone, or not ours to read
            continue
        if any(line.endswith(target) or line.endswith(target + " (deleted)")
               for line in maps.splitlines()):
            pids.append(int(entry.name))
    return pids


def _topmost_missing(path: Path) -> Path | None:
    """The highest ancestor of `path` (or itself) that does not exist yet."""
    path = path.absolute()
    if path.exists():
        return None
    top = path
    for parent in path.parents:
        if parent.exists():
            break
        top = parent
    return top


class StartFiles:
    """What a start of the agent may create, taken before it starts.

    After a failed start, `remove_created` deletes the sockets, arenas, journals, store records
    and locks that did not exist before, and the directories made for them while they are
    empty. Nothing that existed before is touched: an arena left by a previous run keeps its
    chunks.
    """

    def __init__(self, config: AgentConfig) -> None:
        files: list[Path] = []
        dirs: list[Path] = []
        for space in space_files(config):
            files += [space.socket, space.arena, space.journal, space.lock]
            dirs += [space.socket.parent, space.arena.parent]
        deletes = config.peer_deletes_path()
        if config.peers.enabled and deletes is not None:
            files.append(deletes)
            dirs.append(deletes.parent)
        for _, cfg in config.spaces():
            files += [*cfg.stores_paths(), cfg.identities_path()]
            if cfg.tiers.nvme is not None:
                dirs.append(cfg.tiers.nvme.path)
            if cfg.state_dir is not None:
                dirs.append(cfg.state_dir)
            if cfg.tiers.shared is not None and cfg.tiers.shared.url.startswith("file://"):
                dirs.append(Path(cfg.tiers.shared.url.removeprefix("file://")))
        self.new_files = [f for f in files if not f.exists() and not f.is_symlink()]
        self.new_dirs = [d for d in (_topmost_missing(d) for d in dirs) if d is not None]

    def remove_created(self) -> None:
        for f in self.new_files:
            with contextlib.suppress(OSError):  # never made (the start failed before it)
                f.unlink()
        for top in dict.fromkeys(self.new_dirs):
            _remove_empty_dirs(top)


def _remove_empty_dirs(top: Path) -> None:
    """rmdir `top` and the directories under it, deepest first, where they are empty."""
    if not top.is_dir():
        return
    below: Iterable[tuple[str, list[str], list[str]]] = os.walk(top, topdown=False)
    for root, _, _ in below:
        with contextlib.suppress(OSError):  # not empty: something else is in it
            os.rmdir(root)
