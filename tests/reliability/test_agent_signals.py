"""The agent process stopped or killed under load from several client processes.

Clients see errors (a timeout, `AgentUnavailable`) while the agent cannot answer, and
carry on by themselves once it can; no read ever returns wrong bytes; every chunk whose
put was acknowledged (and not deleted or evicted) is still there afterwards; and the
agent ends with no leases and its arena bytes accounted for by the chunks it holds.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from .chunks import chunk_key
from .conftest import (
    Load,
    alive,
    assert_dram_accounted,
    assert_no_wrong_bytes,
    assert_stored,
    evictions,
    inline_client,
    metric,
    new_agent,
    no_leases,
    wait_until,
)

WORKERS = 4
CLIENT_ERRORS = {"TimeoutError", "AgentUnavailable", "ConnectionError", "ConnectionResetError",
                 "BrokenPipeError", "ConnectionRefusedError", "FileNotFoundError"}
"""What a client may see while the agent cannot answer: its socket errors, never a
protocol error (those would mean the agent answered wrongly)."""


def check_after(agent: Any, load: Load, statuses: list[dict[str, Any]]) -> None:
    assert_no_wrong_bytes(statuses)
    seen = {e for s in statuses for e in s["errors"]}
    assert seen <= CLIENT_ERRORS, f"clients saw errors a dead agent cannot explain: {seen}"
    with inline_client(agent) as c:
        wait_until(lambda: no_leases(c), "every lease to end with its connection")
        assert evictions(agent) == 0  # so every acknowledged chunk must still be stored
        assert_stored(c, load.acked(statuses))
        assert_dram_accounted(c, [chunk_key(load.space, i)
                                  for i in range(WORKERS * load.per_worker)])
    assert metric(agent, "kvpool_leases", kind="read") == 0
    assert metric(agent, "kvpool_leases", kind="write") == 0


def test_stopped_agent_times_clients_out_and_serves_them_again_after_sigcont(
        tmp_path: Path, loads: list[Load]) -> None:
    with new_agent(tmp_path / "agent") as agent:
        assert agent.proc is not None
        load = Load(agent.socket_path, tmp_path / "load", workers=WORKERS, space="sigstop",
                    timeout=1.0, reconnect_timeout=1.0)
        loads.append(load)
        wait_until(lambda: load.all(lambda s: sum(s["ok"].values()) >= 50), "the load")

        agent.proc.send_signal(signal.SIGSTOP)
        try:
            # A stopped agent still accepts connections (the kernel does), so clients
            # learn of it only through their timeouts: every one of them must.
            wait_until(lambda: load.all(lambda s: s["errors"]), "every client to time out")
        finally:
            agent.proc.send_signal(signal.SIGCONT)
        before = load.statuses()
        wait_until(lambda: load.all(lambda s: s["errors_then_ok"] >= 1)
                   and load.progressed(before), "every client to be served again")
        statuses = load.finish()
        assert alive(agent)
        assert all(s["errors"].get("TimeoutError", 0) + s["errors"].get("AgentUnavailable", 0)
                   for s in statuses)
        check_after(agent, load, statuses)


def test_killed_agent_restarts_warm_and_clients_reconnect_by_themselves(
        tmp_path: Path, loads: list[Load]) -> None:
    with new_agent(tmp_path / "agent") as agent:
        load = Load(agent.socket_path, tmp_path / "load", workers=WORKERS, space="sigkill",
                    timeout=5.0, reconnect_timeout=0.5)
        loads.append(load)
        wait_until(lambda: load.all(lambda s: sum(s["ok"].values()) >= 50), "the load")

        agent.kill(signal.SIGKILL)
        # Down long enough that every client has failed a call: the agent restarts only then.
        wait_until(lambda: load.all(lambda s: s["errors"]), "every client to see the outage")
        before = load.statuses()
        agent.start()  # same arena and journal: a warm restart
        wait_until(lambda: load.all(lambda s: s["errors_then_ok"] >= 1)
                   and load.progressed(before), "every client to reconnect")
        statuses = load.finish()
        assert all(s["reconnects"] for s in statuses)
        assert "warm restart" in agent.log()
        check_after(agent, load, statuses)
