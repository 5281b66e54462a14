"""The pod webhook, as the API server calls it: the namespace comes from the admission
request, native sidecars are injected like containers, and warnings say what to expect."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from op_cluster import Cluster, Emulator, patched
from op_support import condition, pod_body, pool_body

from kvpool.operator import api

pytestmark = pytest.mark.kmock(cls=Emulator)

SOCKET_DIR = "/run/kvpool/inference.small"


async def _start_pool(cluster: Cluster) -> None:
    await cluster.create(pool_body())

    async def reconciled() -> bool:
        return bool(condition(await cluster.pool("small"), "Degraded"))

    await cluster.eventually(reconciled, "the pool reconciled")


async def test_a_pod_without_metadata_namespace_joins_the_pool_of_its_request(
    cluster: Cluster,
) -> None:
    await _start_pool(cluster)
    pod = pod_body()
    mutated = patched(pod, await cluster.admit_pod(pod))
    env = {e["name"]: e["value"] for e in mutated["spec"]["containers"][0]["env"]}
    assert env["KVPOOL_POOL"] == "inference.small"
    assert "namespace" not in mutated["metadata"]  # the patch adds nothing but the pool's


async def test_native_sidecars_get_the_socket_and_env_but_other_init_containers_do_not(
    cluster: Cluster,
) -> None:
    await _start_pool(cluster)
    sidecar = {"name": "cache-proxy", "image": "proxy:1", "restartPolicy": "Always"}
    setup = {"name": "download", "image": "fetch:1"}
    pod = pod_body(initContainers=[setup, sidecar])
    mutated = patched(pod, await cluster.admit_pod(pod))
    setup_out, sidecar_out = mutated["spec"]["initContainers"]
    assert {"name": "kvpool-socket", "mountPath": SOCKET_DIR} in sidecar_out["volumeMounts"]
    assert "KVPOOL_SOCKET" in {e["name"] for e in sidecar_out["env"]}
    assert "volumeMounts" not in setup_out and "env" not in setup_out


async def test_a_pod_joining_a_pool_that_does_not_serve_yet_gets_a_warning(
    cluster: Cluster,
) -> None:
    await _start_pool(cluster)  # no agent is ready on the emulator
    response = await cluster.admit_pod(pod_body())
    assert response["allowed"] is True
    (warning,) = response["warnings"]
    assert "KVCachePool 'small'" in warning
    assert "the pod waits for a node whose agent serves the pool" in warning


async def test_a_pod_naming_an_unknown_pool_is_refused_with_a_warning(cluster: Cluster) -> None:
    pod = pod_body()
    pod["metadata"]["annotations"]["kvpool.io/pool"] = "nope"
    response = await cluster.admit_pod(pod)
    assert response["allowed"] is False
    assert "'nope' not found in namespace 'inference'" in response["status"]["message"]
    assert any("not found" in w for w in response["warnings"])


def test_a_ready_pool_gives_no_warning() -> None:
    from kvpool.operator.webhook import readiness_warning

    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert readiness_warning("small", ready) is None
    waiting = {"status": {"conditions": [{"type": "Ready", "status": "False",
                                         "reason": "NoMatchingNodes", "message": "no node"}]}}
    assert "NoMatchingNodes" in (readiness_warning("small", waiting) or "")


async def test_an_update_of_a_pod_whose_pool_was_deleted_passes_untouched(
    cluster: Cluster,
) -> None:
    """The webhook acts on CREATE only, whatever operations its registration sends."""
    await _start_pool(cluster)
    pod = pod_body()
    pod["metadata"]["name"] = "vllm-0"
    joined = patched(pod, await cluster.admit_pod(pod))  # the pod as it was created
    await cluster.delete(api.API_VERSION, api.POOL_KIND, "small")
    await cluster.report_reclaimed("small")

    def refused(response: dict[str, Any]) -> bool:
        return response["allowed"] is False and "not found" in response["status"]["message"]

    # Once the pool is gone, a new pod naming it is refused ...
    await cluster.admit_pod(pod, until=refused)
    # ... but an update of a pod that joined it (a label, its status) is not the webhook's.
    relabelled = copy.deepcopy(joined)
    relabelled["metadata"].setdefault("labels", {})["rollout"] = "2"
    response = await cluster.admit_pod(relabelled, "UPDATE", old=joined)
    assert response["allowed"] is True, response
    assert "patch" not in response and "warnings" not in response, response
