"""A pool's status, computed from what the operator observed: pure functions.

Conditions (Kubernetes API conventions: `type`, `status`, CamelCase `reason`,
`message`, `observedGeneration`, `lastTransitionTime`):

- `Ready`: every desired node runs a ready agent of the current template. An invalid
  spec stored past the admission webhook changes nothing that runs: `Ready` keeps
  following the agents of the last good spec (`status.appliedGeneration`; the spec
  itself is kept in `status.appliedSpec`, where the pod webhook and a restarted operator
  find it), and `Degraded`/`InvalidSpec` says why the edit is not applied.
- `Progressing`: the agent DaemonSet is rolling out (or being created).
- `Degraded`: something the user must fix — the reason says what.

A problem found while reconciling (missing policy or Secret, invalid spec, an
API error, a failed garbage-collection Job) is kept in `Degraded` until a
reconcile succeeds; the DaemonSet's rollout drives `Ready` and `Progressing`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.agent.units import format_size

from . import api

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"


class Reason:
    """Every reason a pool's conditions can carry (documented in docs/operator.md)."""

    AGENTS_READY = "AgentsReady"
    AGENTS_NOT_READY = "AgentsNotReady"
    NO_NODES = "NoMatchingNodes"
    CREATING = "Creating"
    ROLLING_OUT = "RollingOut"
    ROLLOUT_COMPLETE = "RolloutComplete"
    AS_EXPECTED = "AsExpected"
    DELETING = "Deleting"
    # Problems (Degraded=True):
    POLICY_NOT_FOUND = "PolicyNotFound"
    INVALID_POLICY = "InvalidPolicy"
    SECRET_NOT_FOUND = "SecretNotFound"
    SECRET_KEY_MISSING = "SecretKeyMissing"
    INVALID_SPEC = "InvalidSpec"
    PORT_CONFLICT = "PortConflict"
    """Two ports of the agent collide (spec.events.port, replayPort, agent.metricsPort)."""
    FORBIDDEN = "Forbidden"
    """The operator policy does not allow what the pool asks for (image, root, ...)."""
    APPLY_FAILED = "ApplyFailed"
    GC_FAILED = "GarbageCollectionFailed"


PROBLEM_REASONS = (
    Reason.POLICY_NOT_FOUND,
    Reason.INVALID_POLICY,
    Reason.SECRET_NOT_FOUND,
    Reason.SECRET_KEY_MISSING,
    Reason.INVALID_SPEC,
    Reason.PORT_CONFLICT,
    Reason.FORBIDDEN,
    Reason.APPLY_FAILED,
    Reason.GC_FAILED,
)

INVALID_EDITS = (Reason.INVALID_SPEC, Reason.PORT_CONFLICT)
"""Reasons of a spec the operator cannot render: running agents stay as they were."""


@dataclass
class Problem(Exception):
    """Why a pool cannot be reconciled; ends up as `Degraded=True` with this reason."""

    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


def now_rfc3339() -> str:
    return (
        datetime.datetime.now(datetime.UTC)
        .replace(microsecond=0)
        .isoformat()
        .replace("+00:00", "Z")
    )


@dataclass(frozen=True)
class Rollout:
    """The agent DaemonSet's rollout, from its status."""

    exists: bool
    desired: int = 0
    ready: int = 0
    updated: int = 0
    available: int = 0
    current_generation: bool = True
    reported: bool = False
    """The DaemonSet controller has written a status."""

    @classmethod
    def of(cls, daemon_set: Mapping[str, Any] | None) -> Rollout:
        if daemon_set is None:
            return cls(exists=False)
        st = daemon_set.get("status") or {}
        generation = (daemon_set.get("metadata") or {}).get("generation")
        observed = st.get("observedGeneration")
        return cls(
            exists=True,
            desired=int(st.get("desiredNumberScheduled") or 0),
            ready=int(st.get("numberReady") or 0),
            updated=int(st.get("updatedNumberScheduled") or 0),
            available=int(st.get("numberAvailable") or 0),
            # Without generations (some test servers) the status counts are all we have.
            current_generation=generation is None or (observed or 0) >= generation,
            reported="desiredNumberScheduled" in st,
        )

    @property
    def observed(self) -> bool:
        """The DaemonSet controller has reported on the current template."""
        return self.exists and self.current_generation and self.reported

    @property
    def complete(self) -> bool:
        return (
            self.observed
            and self.updated == self.desired
            and self.ready == self.desired
            and self.available == self.desired
        )


def problem_of(conditions: Sequence[Mapping[str, Any]]) -> Problem | None:
    """The reconcile problem recorded in existing conditions, if any."""
    for c in conditions:
        if c.get("type") == DEGRADED and c.get("status") == "True":
            reason = str(c.get("reason", ""))
            if reason in PROBLEM_REASONS:
                return Problem(reason, str(c.get("message", "")))
    return None


def _condition(
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
    previous: Mapping[str, Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    text = "True" if status else "False"
    before = previous.get(type_)
    since = now
    if before is not None and before.get("status") == text and before.get("lastTransitionTime"):
        since = str(before["lastTransitionTime"])
    cond: dict[str, Any] = {"type": type_, "status": text, "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    cond["lastTransitionTime"] = since
    return cond


FIRST_REPORT = (
    "the agent DaemonSet is created: waiting for the DaemonSet controller's first report "
    "on its agents"
)
"""A DaemonSet without a status yet (brand new): no count of it means anything."""


def counts_message(rollout: Rollout) -> str:
    """The agents' counts, leading with the one that keeps the pool from `Ready`, so a
    message never reads as ready beside a not-ready reason (one reading of the DaemonSet
    status decides both)."""
    if rollout.ready >= rollout.desired and rollout.available < rollout.desired:
        # Ready agents not yet available: the DaemonSet's minReadySeconds, or a pod that
        # stopped being ready between the controller's counts.
        return (
            f"{rollout.available}/{rollout.desired} agents available, {rollout.ready} ready, "
            f"{rollout.updated} updated"
        )
    return f"{rollout.ready}/{rollout.desired} agents ready, {rollout.updated} updated"


def conditions(
    rollout: Rollout,
    problem: Problem | None,
    generation: int | None,
    previous: Sequence[Mapping[str, Any]] = (),
    now: str | None = None,
    deleting: bool = False,
    node_selector: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Ready, Progressing and Degraded for this observation."""
    selector = ", ".join(f"{k}={v}" for k, v in sorted((node_selector or {}).items()))
    no_nodes_message = (
        f"no node matches nodeSelector {selector} (with the pool's tolerations)"
        if selector
        else "no schedulable node takes the agent (its tolerations match no tainted node)"
    )
    now = now or now_rfc3339()
    prev = {str(c.get("type")): c for c in previous}

    def cond(type_: str, status: bool, reason: str, message: str) -> dict[str, Any]:
        return _condition(type_, status, reason, message, generation, prev, now)

    nodes = counts_message(rollout)
    # What is happening, in words: never the previous spec's counts as if current.
    if rollout.exists and not rollout.current_generation:
        waiting: str | None = (
            "rolling out: the DaemonSet controller has not yet taken up the new spec"
        )
    elif rollout.observed and rollout.desired > 0 and rollout.updated < rollout.desired:
        waiting = (
            f"rolling out: {rollout.updated}/{rollout.desired} agents updated, "
            f"{rollout.ready} ready"
        )
    else:
        waiting = None
    if problem is not None and (problem.reason not in INVALID_EDITS or not rollout.exists):
        # An invalid edit leaves running agents as they are: Ready follows them.
        ready = cond(READY, False, problem.reason, problem.message)
    elif not rollout.exists:
        ready = cond(READY, False, Reason.CREATING, "the agent DaemonSet is being created")
    elif not rollout.reported:
        ready = cond(READY, False, Reason.CREATING, FIRST_REPORT)
    elif waiting is not None:
        ready = cond(READY, False, Reason.AGENTS_NOT_READY, waiting)
    elif rollout.observed and rollout.desired == 0:
        ready = cond(READY, False, Reason.NO_NODES, no_nodes_message)
    elif rollout.complete and rollout.desired > 0:
        ready = cond(READY, True, Reason.AGENTS_READY, nodes)
    else:
        ready = cond(READY, False, Reason.AGENTS_NOT_READY, nodes)

    if deleting:
        progressing = cond(PROGRESSING, True, Reason.DELETING, "the pool is being deleted")
    elif problem is not None:
        progressing = cond(PROGRESSING, False, problem.reason, "blocked: " + problem.message)
    elif not rollout.exists:
        progressing = cond(PROGRESSING, True, Reason.CREATING, "creating the agent DaemonSet")
    elif not rollout.reported:
        progressing = cond(PROGRESSING, True, Reason.CREATING, FIRST_REPORT)
    elif waiting is not None:
        progressing = cond(PROGRESSING, True, Reason.ROLLING_OUT, waiting)
    elif rollout.complete or (rollout.observed and rollout.desired == 0):
        progressing = cond(
            PROGRESSING,
            False,
            Reason.ROLLOUT_COMPLETE,
            nodes if rollout.desired else no_nodes_message,
        )
    else:
        progressing = cond(PROGRESSING, True, Reason.ROLLING_OUT, nodes)

    if problem is not None:
        degraded = cond(DEGRADED, True, problem.reason, problem.message)
    else:
        degraded = cond(DEGRADED, False, Reason.AS_EXPECTED, "")
    return [ready, progressing, degraded]


def capacity(pool: api.KVCachePool, desired: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tiers = pool.spec.tiers
    sizes = {
        "dram": tiers.effective_dram().size,
        "nvme": tiers.nvme.size if tiers.nvme else None,
    }
    for tier, size in sizes.items():
        if size is not None:
            out[tier] = {"perNode": format_size(size), "total": format_size(size * desired)}
    return out


def applied_pool(body: Mapping[str, Any]) -> api.KVCachePool | None:
    """The pool as its agents run it: its metadata with `status.appliedSpec`, the last spec
    the operator applied; None if there is none (or it no longer parses)."""
    spec = (body.get("status") or {}).get("appliedSpec")
    if not isinstance(spec, Mapping):
        return None
    try:
        return api.parse_pool({"metadata": dict(body.get("metadata") or {}), "spec": spec})
    except api.InvalidSpec:
        return None


def running_pool(body: Mapping[str, Any], problem: Problem | None) -> api.KVCachePool | None:
    """The pool the status describes: the stored spec, or, while an invalid edit of it is
    refused, the last spec applied (what the agents run). Stored status keeps this across
    operator restarts, so capacity follows the nodes and pods still join the pool."""
    if problem is None or problem.reason not in INVALID_EDITS:
        try:
            return api.parse_pool(body)
        except api.InvalidSpec:
            pass
    return applied_pool(body)


def pool_status(
    *,
    pool: api.KVCachePool | None,
    generation: int | None,
    daemon_set: Mapping[str, Any] | None,
    problem: Problem | None,
    previous: Sequence[Mapping[str, Any]] = (),
    policy: api.ResolvedPolicy | None = None,
    socket: str | None = None,
    now: str | None = None,
    deleting: bool = False,
    applied_spec: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The status to merge into the pool (keys left out are left as they are).

    `applied_spec`: the stored spec just applied (reconciled without a problem), kept as
    `appliedSpec`. A pool the operator policy forbids runs no agents: its `appliedSpec`
    goes."""
    rollout = Rollout.of(daemon_set)
    status: dict[str, Any] = {
        "conditions": conditions(
            rollout,
            problem,
            generation,
            previous,
            now,
            deleting,
            node_selector=pool.spec.node_selector if pool is not None else None,
        ),
        "nodes": {
            "desired": rollout.desired,
            "ready": rollout.ready,
            "updated": rollout.updated,
            "available": rollout.available,
        },
    }
    if generation is not None:
        status["observedGeneration"] = generation
        if problem is None and pool is not None and not deleting:
            status["appliedGeneration"] = generation
    if problem is None and applied_spec is not None and not deleting:
        status["appliedSpec"] = dict(applied_spec)
    elif problem is not None and problem.reason == Reason.FORBIDDEN:
        status["appliedSpec"] = None  # merge patch: removed (its agents were deleted)
    if pool is not None:
        status["tiers"] = "+".join(pool.spec.tiers.served())
        status["capacity"] = capacity(pool, rollout.desired)
    if policy is not None:
        status["policy"] = policy.to_wire()
    if socket is not None:
        status["socket"] = socket
    return status


def keep_transition_times(
    new: Sequence[Mapping[str, Any]], live: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """`new` conditions, with the live `lastTransitionTime` where the status did not change."""
    before = {str(c.get("type")): c for c in live}
    out = []
    for c in new:
        c = dict(c)
        old = before.get(str(c.get("type")))
        if (
            old is not None
            and old.get("status") == c.get("status")
            and old.get("lastTransitionTime")
        ):
            c["lastTransitionTime"] = old["lastTransitionTime"]
        out.append(c)
    return out


def changed(current: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether merging `new` into `current` status would change anything."""
    current = current or {}
    return any(current.get(k) != v for k, v in new.items())
