"""The operator, run by kopf against a stateful API server on loopback (kmock)."""

from __future__ import annotations

import logging
from typing import Any

import kubernetes_validate
import pytest
import yaml
from op_cluster import NAMESPACE, Cluster, Emulator, patched
from op_support import condition, example, policy_body, pool_body, secret_body

from kvpool.operator import api, metrics
from kvpool.operator.handlers import Context, reconcile_pool
from kvpool.operator.render import Names, Settings

pytestmark = pytest.mark.kmock(cls=Emulator)

POLICY_NAME = "llama-70b"
POOL_NAME = "llama-70b"
ROLE = Names(NAMESPACE, POOL_NAME).cluster_role
"""The pool's ClusterRole and ClusterRoleBinding (kvpool-agent-inference-llama-70b-<hash>)."""


def _pool(**spec: Any) -> dict[str, Any]:
    """The full example pool (llama-70b: DRAM, NVMe and an S3 tier, policy llama-70b)."""
    return pool_body(source="pool.yaml", **spec)




async def test_pool_and_policy_create_owned_agent_objects(cluster: Cluster) -> None:
    await cluster.create(secret_body())
    await cluster.create(policy_body())
    await cluster.create(_pool())

    ds = await cluster.eventually(
        lambda: cluster.get("apps/v1", "DaemonSet", "kvpool-llama-70b"), "the DaemonSet"
    )
    pool = await cluster.pool(POOL_NAME)
    assert pool is not None
    owner = ds["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "KVCachePool",
        POOL_NAME,
        pool["metadata"]["uid"],
    )
    for api_version, kind, name in [
        ("v1", "ConfigMap", "kvpool-llama-70b"),
        ("v1", "ServiceAccount", "kvpool-llama-70b"),
        ("v1", "Service", "kvpool-llama-70b-metrics"),
    ]:
        obj = await cluster.eventually(
            lambda a=api_version, k=kind, n=name: cluster.get(a, k, n), kind
        )
        assert obj["metadata"]["ownerReferences"] == ds["metadata"]["ownerReferences"]
    role = await cluster.eventually(
        lambda: cluster.get(
            "rbac.authorization.k8s.io/v1", "ClusterRole", ROLE, None
        ),
        "the ClusterRole",
    )
    assert role["rules"][0]["resources"] == ["nodes"]
    await cluster.eventually(
        lambda: cluster.get(
            "rbac.authorization.k8s.io/v1",
            "ClusterRoleBinding",
            ROLE,
            None,
        ),
        "the ClusterRoleBinding",
    )

    async def progressing() -> dict[str, Any] | None:
        c = condition(await cluster.pool(POOL_NAME), "Progressing")
        return c if c and c["status"] == "True" else None

    cond = await cluster.eventually(progressing, "Progressing=True")
    pool = await cluster.pool(POOL_NAME)
    assert pool is not None
    status = pool["status"]
    assert status["policy"]["name"] == POLICY_NAME and status["policy"]["generation"] == 1
    assert status["tiers"] == "dram+nvme+shared"
    assert status["socket"] == "/run/kvpool/inference.llama-70b/agent.sock"
    assert status["observedGeneration"] == 1
    assert condition(pool, "Degraded")["status"] == "False"
    assert condition(pool, "Ready")["status"] == "False"
    assert cond["observedGeneration"] == 1


async def test_second_reconcile_changes_nothing(cluster: Cluster) -> None:
    """A replayed event (kmock replays every object on each new watch) is a no-op."""
    await cluster.create(secret_body())
    await cluster.create(policy_body())
    await cluster.create(_pool())
    await cluster.eventually(
        lambda: cluster.get("apps/v1", "DaemonSet", "kvpool-llama-70b"), "the DaemonSet"
    )

    async def settled() -> dict[str, Any] | None:
        p = await cluster.pool(POOL_NAME)
        return p if p and (p.get("status") or {}).get("policy") else None

    pool = await cluster.eventually(settled, "the pool's status")
    children = [
        ("apps/v1/daemonsets", NAMESPACE, "kvpool-llama-70b"),
        ("v1/configmaps", NAMESPACE, "kvpool-llama-70b"),
        ("v1/serviceaccounts", NAMESPACE, "kvpool-llama-70b"),
        ("v1/services", NAMESPACE, "kvpool-llama-70b-metrics"),
        ("rbac.authorization.k8s.io/v1/clusterroles", None, ROLE),
    ]
    versions = [len(cluster.emulator.objects[key].history) for key in children]
    settings = Settings(agent_image="ghcr.io/kvpool/kvpool:test", version="test")
    await cluster.call(
        reconcile_pool,
        Context(kube=cluster.kube, settings=settings),
        pool,
        logging.getLogger("test"),
    )
    assert [len(cluster.emulator.objects[key].history) for key in children] == versions
    after = await cluster.pool(POOL_NAME)
    assert after is not None and after["status"] == pool["status"]


async def _start_pool(cluster: Cluster, **spec_changes: Any) -> dict[str, Any]:
    await cluster.create(secret_body())
    await cluster.create(policy_body())
    await cluster.create(_pool(**spec_changes))

    async def reconciled() -> dict[str, Any] | None:
        p = await cluster.pool(POOL_NAME)
        return p if p and (p.get("status") or {}).get("policy") else None

    return await cluster.eventually(reconciled, "the first reconcile")


async def test_policy_update_changes_config_map_and_pool_status(cluster: Cluster) -> None:
    await _start_pool(cluster)
    cm = await cluster.get("v1", "ConfigMap", "kvpool-llama-70b")
    ds = await cluster.get("apps/v1", "DaemonSet", "kvpool-llama-70b")
    assert cm is not None and ds is not None
    assert yaml.safe_load(cm["data"]["policy.yaml"])["prefetch"]["lookaheadChunks"] == 8

    await cluster.edit_policy(POLICY_NAME, {"prefetch": {"lookaheadChunks": 32}})

    async def new_policy_in_config_map() -> dict[str, Any] | None:
        c = await cluster.get("v1", "ConfigMap", "kvpool-llama-70b")
        policy = yaml.safe_load((c or {}).get("data", {}).get("policy.yaml", "{}"))
        return c if policy.get("prefetch", {}).get("lookaheadChunks") == 32 else None

    await cluster.eventually(new_policy_in_config_map, "policy.yaml with lookaheadChunks 32")

    async def status_shows_generation_2() -> dict[str, Any] | None:
        p = await cluster.pool(POOL_NAME)
        return p if (p or {}).get("status", {}).get("policy", {}).get("generation") == 2 else None

    pool = await cluster.eventually(status_shows_generation_2, "policy generation 2 in status")
    before = pool["status"]["policy"]["checksum"]
    assert before != "" and len(before) == 16
    # The agents reload policy.yaml in place: the pod template did not change.
    ds_after = await cluster.get("apps/v1", "DaemonSet", "kvpool-llama-70b")
    assert ds_after is not None
    assert ds_after["spec"]["template"] == ds["spec"]["template"]

    async def policy_status() -> dict[str, Any] | None:
        p = await cluster.get(api.API_VERSION, api.POLICY_KIND, POLICY_NAME)
        st = (p or {}).get("status") or {}
        return st if st.get("observedGeneration") == 2 else None

    st = await cluster.eventually(policy_status, "the policy's status")
    assert st["pools"] == [POOL_NAME] and st["checksum"] == pool["status"]["policy"]["checksum"]


async def test_daemon_set_rollout_drives_the_conditions(cluster: Cluster) -> None:
    await _start_pool(cluster)
    await cluster.report_agents("kvpool-llama-70b", desired=3, ready=1, updated=3, available=1)
    rolling = await cluster.condition_of(POOL_NAME, "Progressing", "True", "RollingOut")
    assert rolling["message"] == "1/3 agents ready, 3 updated"
    ready = condition(await cluster.pool(POOL_NAME), "Ready")
    assert ready["reason"] == "AgentsNotReady"

    await cluster.report_agents("kvpool-llama-70b", desired=3, ready=3, updated=3, available=3)
    await cluster.condition_of(POOL_NAME, "Ready", "True", "AgentsReady")
    pool = await cluster.pool(POOL_NAME)
    assert pool is not None
    assert condition(pool, "Progressing")["reason"] == "RolloutComplete"
    assert pool["status"]["nodes"] == {"desired": 3, "ready": 3, "updated": 3, "available": 3}
    assert pool["status"]["capacity"]["dram"] == {"perNode": "64Gi", "total": "192Gi"}

    await cluster.report_agents("kvpool-llama-70b", desired=0, ready=0, updated=0, available=0)
    await cluster.condition_of(POOL_NAME, "Ready", "False", "NoMatchingNodes")


async def test_a_deleted_daemon_set_is_put_back(cluster: Cluster) -> None:
    await _start_pool(cluster)
    await cluster.delete("apps/v1", "DaemonSet", "kvpool-llama-70b")
    key = ("apps/v1/daemonsets", NAMESPACE, "kvpool-llama-70b")

    async def recreated() -> bool:
        obj = cluster.emulator.objects[key]
        return not obj.deleted and obj.history[-2] is None

    await cluster.eventually(recreated, "the DaemonSet to be created again")


async def test_missing_policy_is_degraded_until_it_exists(cluster: Cluster) -> None:
    await cluster.create(secret_body())
    await cluster.create(_pool())

    cond = await cluster.condition_of(POOL_NAME, "Degraded", "True", "PolicyNotFound")
    assert "'llama-70b'" in cond["message"] and "spec.policyRef" in cond["message"]
    assert await cluster.get("apps/v1", "DaemonSet", "kvpool-llama-70b") is None
    ready = condition(await cluster.pool(POOL_NAME), "Ready")
    assert ready["reason"] == "PolicyNotFound"

    await cluster.create(policy_body())  # the policy's handler re-reconciles the pool

    await cluster.condition_of(POOL_NAME, "Degraded", "False", "AsExpected")
    assert await cluster.get("apps/v1", "DaemonSet", "kvpool-llama-70b") is not None


async def test_missing_secret_is_degraded_and_retried(cluster: Cluster) -> None:
    await cluster.create(policy_body())
    await cluster.create(_pool())

    cond = await cluster.condition_of(POOL_NAME, "Degraded", "True", "SecretNotFound")
    assert "kvpool-s3" in cond["message"]
    secret = secret_body()
    del secret["stringData"]["AWS_SECRET_ACCESS_KEY"]
    await cluster.create(secret)
    cond = await cluster.condition_of(POOL_NAME, "Degraded", "True", "SecretKeyMissing")
    assert "AWS_SECRET_ACCESS_KEY" in cond["message"]
    await cluster.patch("v1", "Secret", "kvpool-s3", {"stringData": {"AWS_SECRET_ACCESS_KEY": "x"}})

    await cluster.condition_of(POOL_NAME, "Degraded", "False", "AsExpected")  # retried
    errors = metrics.RECONCILE_ERRORS.labels(kind="KVCachePool", reason="SecretNotFound")
    assert errors._value.get() >= 1


async def test_invalid_pool_is_degraded_and_renders_nothing(cluster: Cluster) -> None:
    body = _pool(tiers={"dram": {"size": "3Mi", "hugePages": True}}, policyRef=None)
    del body["spec"]["policyRef"]
    await cluster.create(body)

    cond = await cluster.condition_of(POOL_NAME, "Degraded", "True", "InvalidSpec")
    assert "spec.tiers.dram" in cond["message"]
    assert await cluster.get("v1", "ConfigMap", "kvpool-llama-70b") is None


async def test_delete_with_reclaim_delete_runs_gc_job_then_lets_go(cluster: Cluster) -> None:
    shared = dict(_pool()["spec"]["tiers"]["shared"], reclaimPolicy="Delete")
    tiers = dict(_pool()["spec"]["tiers"], shared=shared)
    pool = await _start_pool(cluster, tiers=tiers)
    assert "kvpool.io/finalizer" in pool["metadata"]["finalizers"]
    gc_job = Names(NAMESPACE, POOL_NAME).gc_job(pool["metadata"]["uid"])

    await cluster.delete(api.API_VERSION, api.POOL_KIND, POOL_NAME)
    job = await cluster.eventually(lambda: cluster.get("batch/v1", "Job", gc_job), "the gc Job")
    gc = job["spec"]["template"]["spec"]["containers"][0]
    assert gc["command"] == ["kvpool", "gc", "--shared", "s3://kv-cache/llama-70b", "--all"]

    await cluster.condition_of(POOL_NAME, "Progressing", "True", "Deleting")
    # The finalizer holds the pool while the Job runs.
    assert await cluster.pool(POOL_NAME) is not None

    # The Job fails: a clear condition, the finalizer stays.
    await cluster.patch(
        "batch/v1",
        "Job",
        gc_job,
        {
            "status": {
                "failed": 4,
                "conditions": [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit",
                    }
                ],
            }
        },
        "status",
    )

    cond = await cluster.condition_of(POOL_NAME, "Degraded", "True", "GarbageCollectionFailed")
    assert "backoff limit" in cond["message"] and "reclaimPolicy" in cond["message"]
    assert await cluster.pool(POOL_NAME) is not None

    # Retrying (delete the failed Job) and succeeding releases the pool.
    await cluster.delete("batch/v1", "Job", gc_job)

    async def new_job() -> dict[str, Any] | None:
        j = await cluster.get("batch/v1", "Job", gc_job)
        return j if j and not (j.get("status") or {}).get("failed") else None

    await cluster.eventually(new_job, "a new gc Job")
    await cluster.patch(
        "batch/v1",
        "Job",
        gc_job,
        {
            "status": {
                "succeeded": 1,
                "conditions": [{"type": "Complete", "status": "True"}],
            }
        },
        "status",
    )
    await cluster.report_reclaimed(POOL_NAME)

    async def gone() -> bool:
        return await cluster.pool(POOL_NAME) is None

    await cluster.eventually(gone, "the pool to be deleted")
    key = ("rbac.authorization.k8s.io/v1/clusterroles", None, ROLE)
    assert cluster.emulator.objects[key].deleted


async def test_delete_in_a_terminating_namespace_does_not_block(cluster: Cluster) -> None:
    """No pod can start in a namespace being deleted: waiting for a gc Job would keep the
    namespace terminating forever, so the pool lets go and its chunks are kept."""
    shared = dict(_pool()["spec"]["tiers"]["shared"], reclaimPolicy="Delete")
    await _start_pool(cluster, tiers=dict(_pool()["spec"]["tiers"], shared=shared))
    cluster.emulator.terminating = {NAMESPACE}
    await cluster.delete(api.API_VERSION, api.POOL_KIND, POOL_NAME)

    async def gone() -> bool:
        return await cluster.pool(POOL_NAME) is None

    await cluster.eventually(gone, "the pool to be deleted")


async def test_delete_with_retain_lets_go_without_gc(cluster: Cluster) -> None:
    pool = await _start_pool(cluster)
    gc_job = Names(NAMESPACE, POOL_NAME).gc_job(pool["metadata"]["uid"])
    await cluster.delete(api.API_VERSION, api.POOL_KIND, POOL_NAME)
    await cluster.report_reclaimed(POOL_NAME)

    async def gone() -> bool:
        return await cluster.pool(POOL_NAME) is None

    await cluster.eventually(gone, "the pool to be deleted")
    assert await cluster.get("batch/v1", "Job", gc_job) is None
    assert (
        await cluster.get(
            "rbac.authorization.k8s.io/v1",
            "ClusterRoleBinding",
            ROLE,
            None,
        )
        is None
    )


async def test_delete_stops_the_agents_then_removes_the_node_directories_on_every_node(
        cluster: Cluster) -> None:
    """`nodeReclaimPolicy: Delete` (the default): the finalizer deletes the agents'
    DaemonSet in the foreground, then runs a DaemonSet on the pool's nodes that removes the
    pool's state directory (below `stateHostPath`), NVMe, DRAM arena and socket directories,
    and lets the pool go
    once it is ready on every node. Before, both stayed on every node for good."""
    await _start_pool(cluster, stateHostPath="/data/kvpool-state",
                      nodeSelector={"gpu": "h100"})
    reclaim = Names(NAMESPACE, POOL_NAME).reclaim
    await cluster.delete(api.API_VERSION, api.POOL_KIND, POOL_NAME)

    ds = await cluster.eventually(lambda: cluster.get("apps/v1", "DaemonSet", reclaim),
                                  "the reclaim DaemonSet")
    # The agents went first (a real API server keeps their DaemonSet, deleted in the
    # foreground, until their pods are gone: only then does the reclaim start).
    assert await cluster.get("apps/v1", "DaemonSet", "kvpool-llama-70b") is None
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}  # the agents' nodes
    (init,) = pod["initContainers"]
    assert init["command"][-4:] == ["/var/lib/kvpool/reclaim/state/inference.llama-70b",
                                    "/var/lib/kvpool/reclaim/nvme/inference.llama-70b",
                                    "/var/lib/kvpool/reclaim/dram/inference.llama-70b",
                                    "/var/lib/kvpool/reclaim/sockets/inference.llama-70b"]
    # The arena's tmpfs file too: left on the node it would hold the host's memory for good.
    assert {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]} == {
        "state": "/data/kvpool-state", "nvme": "/mnt/nvme0/kvpool",
        "dram": "/dev/shm/kvpool", "sockets": "/run/kvpool"}
    # The finalizer holds the pool until every node reports its directories gone.
    await cluster.report_agents(reclaim, 3, 2, 3, 2)
    await cluster.condition_of(POOL_NAME, "Progressing", "True", "Deleting")
    assert await cluster.pool(POOL_NAME) is not None
    await cluster.report_reclaimed(POOL_NAME, nodes=3)

    async def gone() -> bool:
        return await cluster.pool(POOL_NAME) is None

    await cluster.eventually(gone, "the pool to be deleted")
    assert await cluster.get("apps/v1", "DaemonSet", reclaim) is None


async def test_delete_with_node_reclaim_retain_keeps_the_node_directories(
        cluster: Cluster) -> None:
    await _start_pool(cluster, nodeReclaimPolicy="Retain")
    await cluster.delete(api.API_VERSION, api.POOL_KIND, POOL_NAME)

    async def gone() -> bool:
        return await cluster.pool(POOL_NAME) is None

    await cluster.eventually(gone, "the pool to be deleted")
    reclaim = Names(NAMESPACE, POOL_NAME).reclaim
    assert not [c for c in cluster.emulator.calls if c.name == reclaim]


async def test_webhook_injects_socket_env_and_affinity(cluster: Cluster) -> None:
    await _start_pool(cluster)
    pod = example("pod.yaml", "Pod")
    mutated = patched(pod, await cluster.admit_pod(pod))
    spec = mutated["spec"]
    assert {
        "name": "kvpool-socket",
        "hostPath": {"path": "/run/kvpool/inference.llama-70b", "type": "DirectoryOrCreate"},
    } in spec["volumes"]
    container = spec["containers"][0]
    assert {"name": "kvpool-socket", "mountPath": "/run/kvpool/inference.llama-70b"} in (
        container["volumeMounts"]
    )
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {
        "KVPOOL_SOCKET": "/run/kvpool/inference.llama-70b/agent.sock",
        "KVPOOL_POOL": "inference.llama-70b",
        "KVPOOL_TENANT": "chat",
        "KVPOOL_CHUNK_TOKENS": "256",
    }
    kubernetes_validate.validate(pod, "1.33.0", strict=True)
    kubernetes_validate.validate(mutated, "1.33.0", strict=True)
    # The agent (UID/GID 65532) serves its socket to its group.
    assert spec["securityContext"]["supplementalGroups"] == [65532]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {
            "matchExpressions": [
                {"key": "pool.kvpool.io/inference.llama-70b", "operator": "In", "values": ["ready"]}
            ]
        }
    ]


async def test_webhook_rejects_a_pod_naming_an_unknown_pool(cluster: Cluster) -> None:
    pod = example("pod.yaml", "Pod")
    pod["metadata"]["annotations"]["kvpool.io/pool"] = "no-such-pool"
    response = await cluster.admit_pod(pod)
    assert response["allowed"] is False
    assert "no-such-pool" in response["status"]["message"]
    assert "not found" in response["status"]["message"]


async def test_webhook_leaves_other_pods_alone(cluster: Cluster) -> None:
    pod = example("pod.yaml", "Pod")
    del pod["metadata"]["annotations"]
    response = await cluster.admit_pod(pod)
    assert response["allowed"] is True and "patch" not in response


async def test_invalid_policy_degrades_its_pools_with_the_field(cluster: Cluster) -> None:
    policy = policy_body()
    policy["spec"]["tiers"]["dram"]["lowWatermark"] = 0.99  # above highWatermark 0.92
    await cluster.create(secret_body())
    await cluster.create(policy)
    await cluster.create(_pool())

    cond = await cluster.condition_of(POOL_NAME, "Degraded", "True", "InvalidPolicy")
    assert "spec.tiers.dram" in cond["message"]
    assert await cluster.get("v1", "ConfigMap", "kvpool-llama-70b") is None
