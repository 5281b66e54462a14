"""vLLM engine processes for the engine tests, and the no-connector reference they share.

Each engine is a fresh process (`vllm_engine.py`, or `lmcache_vllm_engine.py` for LMCache's
connector) in the vLLM test environment (tests/install-vllm), as a vLLM pod would be: forked
from the run's `Zygote`, which imported vLLM once (~11 s of CPU that each engine paid
again), it builds its engine, connector and KV cache itself. An engine start still costs
~2-5 s of CPU, so the modules reuse engines across scenarios, start independent ones at
once, and share one reference engine (no connector at all) for the whole session:
`Reference` answers any prompt on the test model once.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, TextIO

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.bench import needs
from kvpool.bench.engine_process import EngineProcess
from kvpool.bench.local import LocalAgent
from kvpool.bench.vllm_ttft import CONNECTOR, prompt

from . import vllm_engine

HARNESS = Path(vllm_engine.__file__)
ZYGOTE = HARNESS.with_name("zygote.py")
START_TIMEOUT = 300
KVPOOL_CONNECTOR = CONNECTOR
"""What docs/integrations.md tells a user to pass as --kv-transfer-config."""
tokens = prompt
"""A prompt of `n` token ids for seed `seed` (the model's vocabulary is 1000; 0-2 special)."""


def vllm_python() -> Path:
    """The vLLM environment's python: $KVPOOL_VLLM_PYTHON, else tests/install-vllm's place."""
    path = needs.vllm_python()
    if not path.exists():
        pytest.fail(f"no vLLM test environment at {path}: run tests/install (tests/install-vllm)")
    return path


def write_models(*dirs_and_seeds: tuple[Path, int]) -> None:
    """The test model (same shape; weights from each seed) into each dir, each by a process
    forked from the run's zygote (transformers imported already: ~0.5 s of CPU a model where
    a process of its own took ~3.5)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for d, seed in dirs_and_seeds:
        with (d.parent / f"{d.name}.log").open("w+") as log:
            proc = zygote().spawn([str(vllm_python()), str(HARNESS), "model", str(d), str(seed)],
                                  env, d.parent, log)
            proc.stdin.close()
            out = proc.stdout.read()
            proc.stdout.close()
            log.seek(0)
            assert proc.wait(timeout=300) == 0, (out + log.read())[-4000:]


class Zygote:
    """The driver's side of `zygote.py`: a process of the vLLM environment that imported
    vLLM once and forks each engine from there (an engine's start then costs ~2 s of CPU
    where it cost ~14). Started by the first test run that asks (`zygote()`), kept for the
    run: every engine module's engines come from it."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (kept for the run: its output)
        self.proc = subprocess.Popen([str(vllm_python()), str(ZYGOTE), str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        theirs.close()
        self.lock = threading.Lock()
        self.ready = False
        self.exits: dict[int, int] = {}

    def _next(self, timeout: float | None) -> dict[str, Any] | None:
        """The zygote's next message; None if none came within `timeout`."""
        self.sock.settimeout(timeout)
        try:
            msg = self.sock.recv(1 << 16)
        except TimeoutError:
            return None
        if not msg:
            code = self.proc.wait()
            self.log.seek(0)
            raise RuntimeError(f"the vLLM zygote ended ({code}):\n{self.log.read()[-8000:]}")
        reply: dict[str, Any] = json.loads(msg)
        if "exit" in reply:
            self.exits[reply["exit"]] = reply["code"]
        return reply

    def spawn(self, args: list[str], env: dict[str, str], cwd: Path, stderr: TextIO,
              netns: str | None = None) -> ForkedEngine:
        """`args` (vLLM's python, a script and its arguments) forked from the zygote, in
        network namespace `netns` if given (on another node)."""
        with self.lock:
            while not self.ready:  # its imports
                self.ready = bool((self._next(300) or {}).get("ready"))
            stdin_r, stdin_w = os.pipe()
            stdout_r, stdout_w = os.pipe()
            request = {"argv": args[1:], "env": env, "cwd": str(cwd), "netns": netns}
            socket.send_fds(self.sock, [json.dumps(request).encode()],
                            [stdin_r, stdout_w, stderr.fileno()])
            os.close(stdin_r)
            os.close(stdout_w)
            while "pid" not in (reply := self._next(60) or {}):
                pass
            return ForkedEngine(self, reply["pid"], os.fdopen(stdin_w, "w"),
                                os.fdopen(stdout_r))

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """`pid`'s exit code once it has ended, waiting up to `timeout` (0: not at all)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while pid not in self.exits:
                left = None if end is None else max(0.001, end - time.monotonic())
                if self._next(left) is None:
                    break
            return self.exits.get(pid)

    def close(self) -> None:
        self.sock.close()  # the zygote ends when it sees its end closed
        self.proc.wait(timeout=60)
        self.log.close()


class ForkedEngine:
    """An engine forked by the zygote, as `EngineProcess` uses a `subprocess.Popen`."""

    def __init__(self, zygote: Zygote, pid: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.zygote, self.pid, self.stdin, self.stdout = zygote, pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout or 0)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


_zygote: Zygote | None = None


def zygote() -> Zygote:
    """The run's zygote, started now if it is not yet (its imports go on meanwhile)."""
    global _zygote
    if _zygote is None:
        _zygote = Zygote()
        atexit.register(_zygote.close)
    return _zygote


class Engine(EngineProcess):
    """A vLLM engine process answering the harness's JSON commands."""

    def __init__(self, name: str, model: Path, agent: LocalAgent | None, workdir: Path,
                 tenant: str = "team-a", connector: dict[str, Any] | None = KVPOOL_CONNECTOR,
                 chunk_tokens: int = 64, harness: Path = HARNESS,
                 llm_args: dict[str, Any] | None = None, netns: str | None = None,
                 **env_extra: str) -> None:
        env = dict(os.environ, KVPOOL_TENANT=tenant, KVPOOL_CHUNK_TOKENS=str(chunk_tokens),
                   POD_NAME=f"vllm-{name}", **env_extra)
        if llm_args:
            env[vllm_engine.ENV_LLM_ARGS] = json.dumps(llm_args)
        if agent is not None:
            env["KVPOOL_SOCKET"] = str(agent.socket_path)
        self.netns = netns  # on another node: in its network namespace
        args = [str(vllm_python()), str(harness), "serve", str(model)]
        if connector is not None:
            args.append(json.dumps(connector))
        super().__init__(name, args, env, workdir)
        self.started: dict[str, Any] = {}

    def spawn(self, args: list[str], env: dict[str, str], workdir: Path,
              log: TextIO) -> Any:
        """Forked from the run's zygote: vLLM imported already."""
        return zygote().spawn(args, env, workdir, log, self.netns)

    def ready(self) -> dict[str, Any]:
        if not self.started:
            self.started = self.read()
        assert self.started.get("ready"), self.started
        return self.started

    def generate(self, *prompts: list[int], max_tokens: int = 8) -> dict[str, Any]:
        self.submit(*prompts, max_tokens=max_tokens)
        return self.read()

    def submit(self, *prompts: list[int], max_tokens: int = 8) -> None:
        """A generate of `prompts`, sent without waiting for its reply (`read` takes it):
        what makes engines generate at once, or a request run while the test acts."""
        self.send(json.dumps({"op": "generate", "prompts": list(prompts),
                              "max_tokens": max_tokens}))


def stats(agent: LocalAgent) -> dict[str, Any]:
    with KVPoolClient(agent.socket_path) as c:
        return c.stats()


class Reference:
    """vLLM's engine with no connector at all on the test model: the greedy output each
    connector's run of a prompt must equal. Started when first asked for (beside the
    engines a module starts), kept for the session, each prompt run alone once."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model, self.workdir = model, workdir
        self.engine: Engine | None = None
        self.outputs: dict[str, list[int]] = {}

    def start(self) -> None:
        if self.engine is None:
            self.engine = Engine("reference", self.model, None, self.workdir, connector=None)

    def __call__(self, prompt: list[int]) -> list[int]:
        """The no-connector greedy output of `prompt` (8 tokens)."""
        key = json.dumps(prompt)
        if key not in self.outputs:
            self.start()
            assert self.engine is not None
            self.engine.ready()
            self.outputs[key] = self.engine.generate(prompt)["outputs"][0]
        return self.outputs[key]

    def quit(self) -> None:
        if self.engine is not None:
            self.engine.quit()
            print(f"engine reference: {self.engine.started}")
