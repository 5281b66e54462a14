"""vLLM engine processes for the engine tests, and the no-connector reference they share.

Each engine is a fresh process (`vllm_engine.py`, or `lmcache_vllm_engine.py` for LMCache's
connector) in the vLLM test environment (tests/install-vllm), as a vLLM pod would be. An
engine start costs ~15-35 s of the machine's two cores, so the modules reuse engines across
scenarios, start independent ones at once, and share one reference engine (no connector at
all) for the whole session: `Reference` answers any prompt on the test model once.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvpool.agent.client import KVPoolClient
from kvpool.bench import needs
from kvpool.bench.engine_process import EngineProcess
from kvpool.bench.local import LocalAgent
from kvpool.bench.vllm_ttft import CONNECTOR, prompt

from . import vllm_engine

HARNESS = Path(vllm_engine.__file__)
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
    """The test model (same shape; weights from each seed) into each dir, all at once."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    procs = [subprocess.Popen([str(vllm_python()), str(HARNESS), "model", str(d), str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
             for d, seed in dirs_and_seeds]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out.decode(errors="replace")[-4000:]


class Engine(EngineProcess):
    """A vLLM engine process answering the harness's JSON commands."""

    def __init__(self, name: str, model: Path, agent: LocalAgent | None, workdir: Path,
                 tenant: str = "team-a", connector: dict[str, Any] | None = KVPOOL_CONNECTOR,
                 chunk_tokens: int = 64, harness: Path = HARNESS,
                 llm_args: dict[str, Any] | None = None, prefix: tuple[str, ...] = (),
                 **env_extra: str) -> None:
        env = dict(os.environ, KVPOOL_TENANT=tenant, KVPOOL_CHUNK_TOKENS=str(chunk_tokens),
                   POD_NAME=f"vllm-{name}", **env_extra)
        if llm_args:
            env[vllm_engine.ENV_LLM_ARGS] = json.dumps(llm_args)
        if agent is not None:
            env["KVPOOL_SOCKET"] = str(agent.socket_path)
        # `prefix`: run it under this command (e.g. `ip netns exec NS`: on another node)
        args = [*prefix, str(vllm_python()), str(harness), "serve", str(model)]
        if connector is not None:
            args.append(json.dumps(connector))
        super().__init__(name, args, env, workdir)
        self.started: dict[str, Any] = {}

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
