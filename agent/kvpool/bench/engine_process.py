"""An inference engine in a process of its own, driven by JSON lines: the driver writes a
command per line to its stdin and reads a reply per line from its stdout; the engine's own
output (logs, prints) goes to a log file. The vLLM part of the bench and the engine tests
drive their engines (each as a pod would be: a fresh process) through it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


class EngineExited(RuntimeError):
    """The engine process ended where a reply was due; the message ends with its log."""


class EngineProcess:
    def __init__(self, name: str, args: list[str], env: dict[str, str], workdir: Path) -> None:
        self.name = name
        self.log_path = workdir / f"vllm-{name}.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
