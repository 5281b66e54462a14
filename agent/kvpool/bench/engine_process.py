"""An inference engine in a process of its own, driven by JSON lines: the driver writes a
command per line to its stdin and reads a reply per line from its stdout; the engine's own
output (logs, prints) goes to a log file. The vLLM part of the bench and the engine tests
drive their engines (each as a pod would be: a fresh process) through it; the engine side
keeps its replies apart from its output (`reply_channel`) and ends through `run_main`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NoReturn, Protocol, TextIO


class EngineProc(Protocol):
    """What `EngineProcess` uses of its process (`subprocess.Popen`'s)."""

    returncode: Any
    stdin: IO[str] | None
    stdout: IO[str] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class EngineExited(RuntimeError):
    """The engine process ended where a reply was due; the message ends with its log."""


class EngineProcess:
    def __init__(self, name: str, args: list[str], env: dict[str, str], workdir: Path) -> None:
        self.name = name
        self.log_path = workdir / f"vllm-{name}.log"
        # The files an engine leaves in its temp directory (vLLM's distributed-init file,
        # LMCache's IPC sockets: a few each start, never removed) go in one of its own,
        # removed with this object, not in the machine's /tmp for good. Short: a socket's
        # path has at most 107 bytes (LMCache shortens its names past that, not the dir).
        self.scratch = Path(tempfile.mkdtemp(prefix="kvpool-engine-"))
        self._scratch = weakref.finalize(self, shutil.rmtree, self.scratch, ignore_errors=True)
        env = {**env, "TMPDIR": str(self.scratch), "VLLM_RPC_BASE_PATH": str(self.scratch)}
        with self.log_path.open("w") as log:
            self.proc = self.spawn(args, env, workdir, log)

    def spawn(self, args: list[str], env: dict[str, str], workdir: Path,
              log: TextIO) -> EngineProc:
        """The engine's process: a pipe to its stdin and one from its stdout, its stderr
        the log (the engine tests' harness may start it another way)."""
        return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, text=True, env=env, cwd=workdir)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def read(self) -> dict[str, Any]:
        """The engine's next reply."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            raise EngineExited(f"engine {self.name} exited ({self.proc.returncode}):\n"
                               f"{self.log()[-8000:]}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def __call__(self, op: str, **args: Any) -> dict[str, Any]:
        """Command `op` with `args`, and its reply."""
        self.send(json.dumps({"op": op, **args}))
        return self.read()

    def quit(self) -> None:
        """Ask the engine to quit; killed if it has not within a minute (or cannot be told)."""
        if self.proc.poll() is None:
            try:
                self.send(json.dumps({"op": "quit"}))
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._scratch()  # (its temp directory; with the object otherwise)


# -- the engine's side


def reply_channel() -> TextIO:
    """In the engine process: its stdout, kept for the replies the driver reads; whatever
    else is printed from now on (the engine's logs, its prints) goes to stderr, the log."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return reply


def run_main(main: Callable[[list[str]], int]) -> NoReturn:
    """In the engine process: `main(sys.argv[1:])`, then exit with its code (1, the
    traceback on stderr, when it raised) at once: the engines leave non-daemon threads
    behind (LMCache's after a failure), and the driver must never wait on them."""
    try:
        code = main(sys.argv[1:])
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
