"""Ready and Progressing messages say what is happening, never the previous spec's counts
as if they were current."""

from __future__ import annotations

from typing import Any

import pytest
from op_cluster import Cluster, Emulator
from op_support import condition, pool_body

from kvpool.operator import status
from kvpool.operator.status import FIRST_REPORT, Rollout


def _ds(generation: int, **st: int) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "status": st}


def _messages(daemon_set: dict[str, Any], **kwargs: Any) -> dict[str, tuple[str, str]]:
    conds = status.conditions(Rollout.of(daemon_set), None, 3, **kwargs)
    return {c["type"]: (c["reason"], c["message"]) for c in conds}


def test_a_spec_change_not_yet_taken_up_is_rolling_out_not_the_old_counts() -> None:
    old_counts = dict(
        desiredNumberScheduled=10, numberReady=10, updatedNumberScheduled=10, numberAvailable=10
    )
    got = _messages(_ds(5, observedGeneration=4, **old_counts))
    message = got["Ready"][1]
    assert message.startswith("rolling out") and "10/10" not in message
    assert got["Progressing"][0] == "RollingOut"


def test_a_rollout_says_how_many_agents_are_updated() -> None:
    got = _messages(
        _ds(5, observedGeneration=5, desiredNumberScheduled=10, numberReady=9,
            updatedNumberScheduled=3, numberAvailable=9)
    )
    assert got["Ready"][1] == "rolling out: 3/10 agents updated, 9 ready"
    assert got["Progressing"] == ("RollingOut", "rolling out: 3/10 agents updated, 9 ready")


def test_no_matching_node_names_the_node_selector() -> None:
    got = _messages(
        _ds(5, observedGeneration=5, desiredNumberScheduled=0),
        node_selector={"nvidia.com/gpu.present": "true"},
    )
    reason, message = got["Ready"]
    assert reason == "NoMatchingNodes"
    assert message.startswith("no node matches nodeSelector nvidia.com/gpu.present=true")
    assert "0/0" not in message and "0/0" not in got["Progressing"][1]


# --------------------------------------------------------------------------- the operator


@pytest.mark.kmock(cls=Emulator)
async def test_a_brand_new_daemon_set_waits_for_its_controllers_first_report(
    cluster: Cluster,
) -> None:
    await cluster.create(pool_body())
    # The emulator runs no DaemonSet controller: the DaemonSet keeps no status, as a real
    # one has none until its controller first reports.
    ready = await cluster.condition_of("small", "Ready", "False", "Creating")
    assert ready["message"] == FIRST_REPORT
    assert "first report" in ready["message"] and "rolling out" not in ready["message"]
    progressing = condition(await cluster.pool("small"), "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "Creating")
    assert progressing["message"] == FIRST_REPORT


@pytest.mark.kmock(cls=Emulator)
async def test_ready_agents_not_yet_available_say_so_in_reason_and_message(
    cluster: Cluster,
) -> None:
    await cluster.create(pool_body())
    await cluster.eventually(lambda: cluster.get("apps/v1", "DaemonSet", "kvpool-small"), "agents")
    await cluster.report_agents("kvpool-small", desired=10, ready=10, updated=10, available=9)

    async def counted() -> dict[str, Any] | None:
        pool = await cluster.pool("small")
        nodes = ((pool or {}).get("status") or {}).get("nodes") or {}
        return pool if nodes.get("available") == 9 else None

    pool = await cluster.eventually(counted, "the DaemonSet's counts in the status")
    ready = condition(pool, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "AgentsNotReady")
    assert ready["message"].startswith("9/10 agents available"), ready
    assert "10/10 agents ready" not in ready["message"]
    progressing = condition(pool, "Progressing")
    assert (progressing["reason"], progressing["message"]) == ("RollingOut", ready["message"])

    await cluster.report_agents("kvpool-small", desired=10, ready=10, updated=10, available=10)
    ready = await cluster.condition_of("small", "Ready", "True", "AgentsReady")
    assert ready["message"] == "10/10 agents ready, 10 updated"
