"""The client is a light library: an inference process that imports it, or an image that
installs it the light way (docs/client.md, "Installing the client in an inference image"),
gets msgspec and xxhash and nothing of the agent's server, the operator or the tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

from kvpool.agent import __version__
from kvpool.bench.local import LocalAgent

from .support import REPO_ROOT

CLIENT_MODULES = ["kvpool.agent.client", "kvpool.agent.keys"]
"""What an inference process imports to compute keys and talk to its agent."""
LIGHT_KVPOOL_MODULES = {
    "kvpool", "kvpool.agent", "kvpool.agent.client", "kvpool.agent.transport",
    "kvpool.agent.keys", "kvpool.agent.protocol", "kvpool.agent.checksums",
    "kvpool.agent.wsumkernel", "kvpool.agent.constants", "kvpool.agent.lookupindex",
    "kvpool.agent.hostcopy", "kvpool.agent.jit", "kvpool.agent.lookupkernel",
    "kvpool.agent.leasefree", "kvpool.agent.leasekernel", "kvpool.agent.copythreads",
    "kvpool.agent.chunkblocks", "kvpool.agent.putwindows",
}
"""Every kvpool module the client may pull in (the server side, the operator, the tools
and the pydantic config model are none of them)."""
HEAVY = ["kopf", "kubernetes", "boto3", "botocore", "typer", "rich", "aiohttp",
         "prometheus_client", "pydantic", "yaml"]
OPTIONAL = ["torch", "numpy", "llvmlite"]
"""Imported only when a call needs them: torch when a tensor is passed (kvpool.agent.gpu),
numpy and llvmlite when a WSUM checksum is computed on the CPU (kvpool.agent.checksums)."""


def _without_pythonpath() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_importing_the_client_and_keys_loads_no_server_module_and_no_heavy_dependency() -> None:
    probe = ("import json, sys\n"
             f"for name in {CLIENT_MODULES!r}: __import__(name)\n"
             "print(json.dumps(sorted(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = set(json.loads(run.stdout))
    assert {m for m in loaded if m.split(".")[0] == "kvpool"} <= LIGHT_KVPOOL_MODULES, (
        sorted(m for m in loaded if m.startswith("kvpool") and m not in LIGHT_KVPOOL_MODULES))
    assert not {m.split(".")[0] for m in loaded} & set(HEAVY)
    assert not {m.split(".")[0] for m in loaded} & set(OPTIONAL)


_ROUND_TRIP = textwrap.dedent("""
    import importlib.util, sys
    from kvpool.agent.client import KVPoolClient
    from kvpool.agent.keys import Fingerprint, chunk_keys

    # Light indeed: none of the agent's or the operator's dependencies is installed.
    missing = [m for m in {heavy!r} if importlib.util.find_spec(m) is not None]
    assert not missing, missing
    fp = Fingerprint("llama-3-8b", "bfloat16", layers=2, kv_heads=2, head_dim=8,
                     chunk_tokens=4, tenant="team-a")
    keys = chunk_keys(fp, list(range(12)))
    with KVPoolClient(sys.argv[1], name="light") as c:
        for i, k in enumerate(keys):
            assert c.put(k, bytes([i]) * fp.chunk_bytes(2))
        assert c.lookup(keys) == 3
        assert c.get(keys[2]) == bytes([2]) * fp.chunk_bytes(2)
    print(keys[-1].hex())
""")


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment where docs/client.md's recipe installed the client."""
    tmp_path = tmp_path_factory.mktemp("light")
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    # The recipe's build step; --no-build-isolation builds with the setuptools at hand
    # instead of fetching one, and the pins take the client's dependencies as installed
    # here, so pip's cache can serve them.
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(REPO_ROOT),
                    f"msgspec=={version('msgspec')}", f"xxhash=={version('xxhash')}"],
                   check=True, timeout=600)
    # A fresh environment of the machine's Python, nothing from this one.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    # The recipe's install step, aimed at that environment.
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-deps", "--no-index", "--find-links", str(wheels), "kvpool",
                    "msgspec", "xxhash"], check=True, timeout=600)
    return venv


def test_the_light_install_recipe_gives_a_working_client_without_the_agents_dependencies(
        tmp_path: Path, light_venv: Path) -> None:
    light_python = str(light_venv / "bin" / "python")

    (tmp_path / "agent").mkdir()
    with LocalAgent("--no-lock", workdir=tmp_path / "agent", dram="16Mi") as agent:
        run = subprocess.run([light_python, "-c", _ROUND_TRIP.format(heavy=HEAVY),
                              str(agent.socket_path)],
                             cwd=tmp_path, env=_without_pythonpath(), capture_output=True,
                             text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    from kvpool.agent.keys import Fingerprint, chunk_keys

    fp = Fingerprint("llama-3-8b", "bfloat16", layers=2, kv_heads=2, head_dim=8,
                     chunk_tokens=4, tenant="team-a")
    assert run.stdout.strip() == chunk_keys(fp, list(range(12)))[-1].hex()


def test_the_kvpool_command_of_the_light_install_shows_the_agents_stats(
        tmp_path: Path, light_venv: Path) -> None:
    """`kubectl exec <inference pod> -- kvpool stats` (docs/cli.md, integrations.md) works
    where only the client is installed; the commands that need the agent's dependencies
    say so in one line."""
    kvpool = str(light_venv / "bin" / "kvpool")

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kvpool, *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**_without_pythonpath(), **env})

    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"kvpool {__version__}"
    with LocalAgent("--no-lock", workdir=tmp_path, dram="16Mi") as agent:
        stats = run("stats", KVPOOL_SOCKET=str(agent.socket_path))
        as_json = run("stats", "--json", "--socket", str(agent.socket_path))
    assert stats.returncode == 0, stats.stderr
    assert stats.stdout.splitlines()[0] == "pool default"
    assert stats.stdout.splitlines()[1].split() == [
        "tier", "capacity", "used", "chunks", "hits", "misses", "healthy", "notes"]
    assert stats.stdout.splitlines()[2].split()[:3] == ["dram", "16.0", "MiB"]
    assert "read leases 0" in stats.stdout
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["tiers"]["dram"]["capacity_bytes"] == 16 << 20
    agent_cmd = run("agent")
    assert agent_cmd.returncode == 2
    assert agent_cmd.stderr.strip().splitlines() == [
        "error: kvpool agent needs the full kvpool install (typer and the rest of its "
        "dependencies are not installed here); this client-only install runs kvpool stats "
        "and kvpool --version"]
    away = run("stats", "--socket", str(tmp_path / "none.sock"))
    assert away.returncode == 2
    assert away.stderr.strip() == (f"error: --socket {tmp_path / 'none.sock'}: cannot reach "
                                   "the agent: No such file or directory")


INTEGRATIONS = ["kvpool.agent.integrations.lmcache", "kvpool.agent.integrations.sglang",
                *(f"kvpool.agent.integrations.vllm.{m}" for m in (
                    "scheduler", "worker", "settings", "layout", "link", "jobs"))]
ENGINE_STACKS = {"torch", "lmcache", "sglang", "vllm"}
"""What an engine image has of its own: the engines and their torch."""


def test_the_engine_image_recipe_brings_everything_the_connectors_import_but_the_engine(
        tmp_path: Path, light_venv: Path) -> None:
    """docs/integrations.md installs kvpool into an engine image the light way: there, every
    module each connector imports, but its engine and torch, imports (the connector modules
    themselves need the engine: tests/integrations runs them with it)."""
    probe = textwrap.dedent("""
        import ast, importlib, importlib.util, json, sys
        engine = set(sys.argv[1].split(","))
        failed, imported = {}, []
        for module in sys.argv[2:]:
            origin = importlib.util.find_spec(module).origin
            package = module.rpartition(".")[0]
            for node in ast.walk(ast.parse(open(origin).read())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                    base = node.module or ""
                    if node.level:
                        parent = package.rsplit(".", node.level - 1)[0]
                        base = f"{parent}.{base}" if base else parent
                    names = [base]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] in engine:
                        continue
                    try:
                        importlib.import_module(name)
                        imported.append(name)
                    except ImportError as e:
                        failed[name] = str(e)
        print(json.dumps({"failed": failed, "imported": sorted(set(imported))}))
    """)
    run = subprocess.run([str(light_venv / "bin" / "python"), "-c", probe,
                          ",".join(ENGINE_STACKS), *INTEGRATIONS],
                         cwd=tmp_path, env=_without_pythonpath(), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["failed"] == {}
    assert {"msgspec", "kvpool.agent.client", "kvpool.agent.keys",
            "kvpool.agent.integrations"} <= set(found["imported"])
