"""One agent per space: a second agent on the same socket or arena is refused untouched.

A space's arena, commit journal and socket are claimed before the agent reads, resizes or
rewrites any of them. The arena and journal are claimed by an exclusive `flock` on a lock
file beside the journal (the arena's own fd cannot carry the lock: clients hold its open
file description through SCM_RIGHTS, so a lock on it would outlive a dead agent and
refuse its restart). The kernel drops the lock when the holding process dies, so a
SIGKILLed agent's restart is never refused. The socket is claimed by asking it: a socket
that answers has an agent behind it.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from .config import ConfigError


class SpaceClaim:
    """Held for as long as the agent serves the space; `release` (or exit) ends it.
    `path`: the lock file of the arena at `arena` (`AgentConfig.lock_path`)."""

    def __init__(self, path: Path, arena: Path, socket_path: Path) -> None:
        refuse_if_served(socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"another agent (pid {holder}) holds the arena {arena} and its journal "
                f"(lock {path}); refusing to start, nothing was changed") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only fd of the description drops the flock
            self.fd = -1


def refuse_if_served(path: Path) -> None:
    """Raise when an agent answers on the socket path (a stale socket file is left alone
    here: binding replaces it once everything is claimed)."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return
    finally:
        probe.close()
    raise ConfigError(f"another agent is already serving {path}; refusing to start, "
                      "nothing was changed")
