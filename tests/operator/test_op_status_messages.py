"""Ready and Progressing messages say what is happening, never the previous spec's counts
as if they were current."""

from __future__ import annotations

from typing import Any

from kvpool.operator import status
from kvpool.operator.status import Rollout


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
