"""What the agent's log tells whoever runs it: every tier with its size and place, the
addresses it really bound, and at stop what it keeps and how to free it."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import threading
import time
import urllib.request
from pathlib import Path

from kvpool.agent.config import AgentConfig
from kvpool.bench.local import LocalAgent, free_port

from ..support import wait_until
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
        # (Its socket answers from `listen`, a moment before the line is written.)
        wait_until(lambda: any(m.startswith("kvpool agent serving") for m in messages(agent)),
                   "the agent's serving line")
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


def test_an_agent_stopped_while_clients_and_peers_connect_logs_no_traceback(
        tmp_path: Path) -> None:
    # Peer connections are served by asyncio's stream server: one still open at the stop
    # (here: waiting for its handshake, or accepted as the agent closes) once ended in a
    # logged "Exception in callback StreamReaderProtocol..." traceback.
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    port = free_port()
    config = tmp_path / "agent.yaml"
    config.write_text(json.dumps({"peers": {
        "enabled": True, "address": "127.0.0.1", "port": port, "secretFile": str(secret)}}))
    agent = LocalAgent("--no-lock", "--config", str(config), workdir=tmp_path,
                       dram="16Mi").start()
    held: list[socket.socket] = []
    stopping = threading.Event()

    def connect() -> None:  # until the agent is gone: both kinds of connection, held open
        while not stopping.is_set():
            for family, address in ((socket.AF_INET, ("127.0.0.1", port)),
                                    (socket.AF_UNIX, str(agent.socket_path))):
                s = socket.socket(family, socket.SOCK_STREAM)
                try:
                    s.connect(address)
                except OSError:
                    s.close()
                    continue
                if len(held) < 400:
                    held.append(s)
                else:  # enough held: connect and leave at once (descriptors are finite)
                    s.close()

    connecting = threading.Thread(target=connect)
    connecting.start()
    try:
        while len(held) < 40:  # some connections the agent serves when it is told to stop
            time.sleep(0.01)
        agent.stop(remove_arena=False)
    finally:
        stopping.set()
        connecting.join()
        for s in held:
            s.close()
        agent.stop()
    log = agent.log()
    assert "kvpool agent stopped" in log
    assert "Traceback" not in log and "Exception in callback" not in log, log
