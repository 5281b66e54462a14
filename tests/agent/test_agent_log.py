"""What the agent's log tells whoever runs it: every tier with its size and place, the
addresses it really bound, and at stop what it keeps and how to free it."""

from __future__ import annotations

import json
import re
import shlex
import urllib.request
from pathlib import Path

from kvpool.agent.config import AgentConfig
from kvpool.bench.local import LocalAgent

from .test_cli import kvpool, left_in_shm


def messages(agent: LocalAgent) -> list[str]:
    return [json.loads(line)["msg"] for line in agent.log().splitlines()
            if line.startswith("{")]


def test_start_names_every_tier_and_the_bound_metrics_port_and_stop_says_what_is_kept(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    agent = LocalAgent("--no-lock", "--metrics-addr", "127.0.0.1:0", "--nvme-dir",
                       str(tmp_path / "nvme"), "--nvme", "32Mi", "--shared", store.as_uri(),
                       workdir=tmp_path, dram="16Mi").start()
    try:
        serving = next(m for m in messages(agent) if m.startswith("kvpool agent serving"))
        assert (f"on {agent.socket_path}: DRAM 16.0 MiB at {agent.arena_path}; NVMe 32.0 MiB "
                f"at {tmp_path / 'nvme'}; shared {store.as_uri()}; metrics ") in serving
        port = re.search(r"metrics http://127\.0\.0\.1:(\d+)/metrics", serving)
        assert port is not None and port.group(1) != "0", serving
        with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics") as r:
            assert b"kvpool_" in r.read()  # the port logged is the one that serves
        agent.stop(remove_arena=False)
        stopped = next(m for m in messages(agent) if m.startswith("kvpool agent stopped"))
        assert f"kept for a warm restart: the DRAM arena {agent.arena_path} (16.0 MiB)" \
            in stopped
        command = stopped.rpartition("free them with: ")[2]
        assert command == (f"kvpool cleanup --socket {agent.socket_path} "
                           f"--arena {agent.arena_path}")
        run = kvpool(*shlex.split(command)[1:], timeout=60)  # the hint works as given
        assert run.returncode == 0, run.stderr
        assert left_in_shm(agent.arena_path) == []
    finally:
        agent.stop()


def test_the_cleanup_hint_names_the_pool_and_tenants_an_agent_ran_with() -> None:
    from kvpool.agent.server.banner import cleanup_command

    cfg = AgentConfig.model_validate({"socketPath": "/run/kv/a.sock", "pool": "team",
                                      "tenants": [{"name": "x"}, {"name": "y"}]})
    assert cleanup_command(cfg) == ("kvpool cleanup --socket /run/kv/a.sock --pool team "
                                    "--tenant x --tenant y")
    assert cleanup_command(AgentConfig()) == "kvpool cleanup --socket /run/kvpool/agent.sock"
