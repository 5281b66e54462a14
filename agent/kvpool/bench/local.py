"""Start and stop a real agent process on this machine (demo, bench, tests)."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


PORT_TRIES = 3
"""Starts with a new metrics port when the one picked was taken meanwhile."""


class MetricsPortTaken(RuntimeError):
    """The agent could not bind the metrics port picked for it: another process has it."""


class LocalAgent:
    """`kvpool agent` as a child process with its socket, arena and metrics in a temp dir."""

    def __init__(self, *args: str, workdir: Path | None = None, dram: str = "64Mi",
                 start_timeout: float = 30.0, log_path: Path | None = None,
                 arena: Path | None = None, prefix: list[str] | None = None,
                 metrics_host: str = "127.0.0.1") -> None:
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="kvpool-")
        self.workdir = workdir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.socket_path = self.workdir / "agent.sock"
        # Named after the whole workdir path, not its last part: two agents whose workdirs
        # share a name (tmp_path / "agent" in two concurrent test runs) must never share an
        # arena, or one's start truncates the file the other has mapped (SIGBUS, or its
        # chunks zeroed). The same workdir still finds its arena again (warm restarts).
        digest = hashlib.sha256(str(self.workdir.resolve()).encode()).hexdigest()[:12]
        self.arena_path = arena or Path("/dev/shm") / f"kvpool-{self.workdir.name}-{digest}.arena"
        self.metrics_host = metrics_host
        self.metrics_port = free_port()
        self.metrics_url = f"http://{metrics_host}:{self.metrics_port}"
        self.prefix = prefix or []
        """Run the agent under this command (e.g. `ip netns exec NS`: another node)."""
        self.log_path = log_path or self.workdir / "agent.log"
        self.args = [
            "--socket", str(self.socket_path), "--arena", str(self.arena_path),
            "--metrics-addr", f"{metrics_host}:{self.metrics_port}", "--dram", dram, *args,
        ]
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalAgent:
        for _ in range(PORT_TRIES - 1):
            try:
                return self._start()
            except MetricsPortTaken:
                # free_port's port was free when it looked, and another process (a test
                # running beside this one) bound it before the agent did: take another.
                self._use_metrics_port(free_port())
        return self._start()

    def _use_metrics_port(self, port: int) -> None:
        at = self.args.index("--metrics-addr") + 1
        self.args[at] = f"{self.metrics_host}:{port}"
        self.metrics_port, self.metrics_url = port, f"http://{self.metrics_host}:{port}"

    def _start(self) -> LocalAgent:
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "kvpool.agent", "agent", *self.args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                taken = f"--metrics-addr {self.metrics_host}:{self.metrics_port}: ".encode()
                if taken in self.log_path.read_bytes()[log_start:]:
                    raise MetricsPortTaken(self.metrics_port)
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{self.log()}")
            if self._answers():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"agent did not start in {self.start_timeout}s:\n{self.log()}")

    def _answers(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(self.socket_path))
            except OSError:
                return False
        return True

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self, remove_arena: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if remove_arena:
            for p in (self.arena_path, *(self.arena_path.with_suffix(x)
                                         for x in (".journal", ".stores", ".lock", ".identities"))):
                if p.exists():
                    os.unlink(p)
        if self._tmp is not None and remove_arena:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalAgent:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
