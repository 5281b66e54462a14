"""render(): golden output for a minimal and a full pool; every object valid Kubernetes."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml
from op_support import GOLDEN_SETTINGS, check_golden

from kvpool.agent.config import AgentConfig, TierPolicy
from kvpool.operator import api, render
from kvpool.operator.crds import to_yaml
from kvpool.operator.operator_policy import Forbidden

K8S_VERSION = "1.33.0"
UID = "6f1e3c1a-2b7d-4c55-9a0e-1d2c3b4a5f60"


def _with_uid(body: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(body)
    body["metadata"]["uid"] = UID
    return body


def _by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objects}


def _validate(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            continue  # a Prometheus Operator CRD, not a built-in kind
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_minimal_pool_renders_as_golden(pool_minimal: dict) -> None:
    objects = render.render(api.parse_pool(_with_uid(pool_minimal)), None, GOLDEN_SETTINGS)
    _validate(objects)
    check_golden("pool-minimal.yaml", "---\n".join(to_yaml(o) for o in objects))


def test_full_pool_renders_as_golden(pool_full: dict, policy_full: dict) -> None:
    pool = api.parse_pool(_with_uid(pool_full))
    objects = render.render(pool, api.parse_policy(policy_full), GOLDEN_SETTINGS)
    _validate(objects)
    check_golden("pool-full.yaml", "---\n".join(to_yaml(o) for o in objects))
    job = render.render_gc_job(pool, GOLDEN_SETTINGS)
    _validate([job])
    check_golden("pool-full-gc-job.yaml", to_yaml(job))


def test_render_is_deterministic(pool_full: dict, policy_full: dict) -> None:
    pool, policy = api.parse_pool(pool_full), api.parse_policy(policy_full)
    assert render.render(pool, policy) == render.render(pool, policy)


def test_namespaced_objects_are_owned_by_the_pool_and_labelled(pool_full: dict) -> None:
    objects = render.render(api.parse_pool(_with_uid(pool_full)), None, GOLDEN_SETTINGS)
    for obj in objects:
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "llama-70b"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvpool-operator"
        assert meta["labels"]["app.kubernetes.io/part-of"] == "kvpool"
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            # Cluster-scoped objects cannot be owned by a namespaced pool: the finalizer
            # deletes them; the labels say whose they are.
            assert "ownerReferences" not in meta and "namespace" not in meta
            assert meta["labels"][render.POOL_NAMESPACE_LABEL] == "inference"
        else:
            assert meta["namespace"] == "inference"
            (owner,) = meta["ownerReferences"]
            assert owner == {
                "apiVersion": "kvpool.io/v1alpha1",
                "kind": "KVCachePool",
                "name": "llama-70b",
                "uid": UID,
                "controller": True,
            }


def test_config_map_holds_the_agent_config_and_policy(pool_full: dict, policy_full: dict) -> None:
    pool, policy = api.parse_pool(pool_full), api.parse_policy(policy_full)
    cm = _by_kind(render.render(pool, policy))["ConfigMap"]
    cfg = AgentConfig.model_validate(yaml.safe_load(cm["data"]["agent.yaml"]))
    assert cfg.pool == "inference.llama-70b"
    assert str(cfg.socket_path) == "/run/kvpool/inference.llama-70b/agent.sock"
    assert cfg.metrics_addr == "0.0.0.0:9400"
    assert str(cfg.policy_file) == "/etc/kvpool/policy.yaml"
    assert cfg.tiers.dram.size == 64 << 30 and cfg.tiers.dram.lock
    assert cfg.tiers.nvme is not None and cfg.tiers.nvme.size == 1 << 40
    assert cfg.tiers.shared is not None and cfg.tiers.shared.url == "s3://kv-cache/llama-70b"
    assert cfg.tiers.shared.endpoint_url == "http://minio.storage.svc:9000"
    assert TierPolicy.model_validate(yaml.safe_load(cm["data"]["policy.yaml"])) == policy.spec


def test_credentials_come_from_the_secret_never_the_config_map(pool_full: dict) -> None:
    objects = render.render(api.parse_pool(pool_full), None)
    cm = _by_kind(objects)["ConfigMap"]
    assert "AWS_" not in cm["data"]["agent.yaml"] and "kvpool-s3" not in cm["data"]["agent.yaml"]
    container = _by_kind(objects)["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key]["valueFrom"] == {"secretKeyRef": {"name": "kvpool-s3", "key": key}}
    assert env["KVPOOL_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "KVPOOL_POD_NAMESPACE" in env


def test_agent_container_runs_the_agent_locked_and_read_only(pool_minimal: dict) -> None:
    ds = _by_kind(render.render(api.parse_pool(pool_minimal), None))["DaemonSet"]
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvpool", "agent", "--config", "/etc/kvpool/agent.yaml"]
    assert container["image"] == render.default_agent_image()
    assert render.default_agent_image() == f"ghcr.io/kvpool/kvpool:{render.package_version()}"
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # Memory for the 8Gi arena plus the agent itself and its lookup table.
    assert container["resources"]["limits"]["memory"] == "8513Mi"


def test_unlocked_arena_adds_no_capability(pool_minimal: dict) -> None:
    body = copy.deepcopy(pool_minimal)
    body["spec"]["tiers"]["dram"]["locked"] = False
    ds = _by_kind(render.render(api.parse_pool(body), None))["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_huge_pages_request_hugepages_and_use_hugetlbfs(pool_minimal: dict) -> None:
    body = copy.deepcopy(pool_minimal)
    body["spec"]["tiers"]["dram"]["hugePages"] = True
    objects = render.render(api.parse_pool(body), None)
    _validate(objects)
    pod = _by_kind(objects)["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["hugepages-2Mi"] == "8Gi"
    dram = next(v for v in pod["volumes"] if v["name"] == "dram")
    assert dram["hostPath"]["path"] == "/dev/hugepages/kvpool/default.small"
    # hugetlbfs takes no write(2): the journal is on the host's tmpfs, as long-lived.
    journal = next(v for v in pod["volumes"] if v["name"] == "journal")
    assert journal["hostPath"] == {"path": "/dev/shm/kvpool/default.small",
                                   "type": "DirectoryOrCreate"}
    cfg = AgentConfig.model_validate(
        yaml.safe_load(_by_kind(objects)["ConfigMap"]["data"]["agent.yaml"]))
    assert str(cfg.tiers.dram.journal_dir) == render.JOURNAL_MOUNT
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["journal"] == render.JOURNAL_MOUNT
    assert render.JOURNAL_MOUNT in pod["initContainers"][0]["command"]  # the agent's UID


def test_the_agent_keeps_its_state_in_a_host_dir_on_disk_that_its_config_names(
    pool_minimal: dict,
) -> None:
    """A pool without NVMe still remembers its shared stores across a reboot of the node:
    its state directory is a per-pool hostPath off the tmpfs, mounted where `stateDir`
    says, and handed to the agent's UID like its other host directories."""
    objects = _by_kind(render.render(api.parse_pool(pool_minimal), None))
    cfg = AgentConfig.model_validate(yaml.safe_load(objects["ConfigMap"]["data"]["agent.yaml"]))
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert cfg.tiers.nvme is None
    assert cfg.state_dir is not None and str(cfg.state_dir) == render.STATE_MOUNT
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert state["hostPath"] == {
        "path": "/var/lib/kvpool/state/default.small",
        "type": "DirectoryOrCreate",
    }
    mount = {"name": "state", "mountPath": str(cfg.state_dir)}
    assert mount in agent["volumeMounts"]
    (init,) = pod["initContainers"]
    assert mount in init["volumeMounts"] and str(cfg.state_dir) in init["command"]


def test_the_state_directory_is_a_pool_setting_and_a_deleted_pool_reclaims_it(
    pool_minimal: dict,
) -> None:
    """`spec.stateHostPath` places the pool's state directory (`<dir>/<ns>.<name>`); the
    reclaim DaemonSet of a deleted pool mounts its parent (and the NVMe directory's) on
    the agents' nodes and removes the pool's directories there, as root with the host-dirs
    container's two capabilities. Before, the path was fixed and nothing removed it."""
    pool_minimal["spec"].update(stateHostPath="/data/kvpool/state/",
                                tiers={"dram": {"size": "1Gi"},
                                       "nvme": {"hostPath": "/mnt/nvme", "size": "1Gi"}},
                                nodeSelector={"gpu": "yes"})
    pool = api.parse_pool(pool_minimal)
    pod = _by_kind(render.render(pool, None))["DaemonSet"]["spec"]["template"]["spec"]
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert state["hostPath"]["path"] == "/data/kvpool/state/default.small"

    reclaim = render.render_reclaim_daemon_set(pool)
    _validate([reclaim])
    spec = reclaim["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "yes"}
    # The arena's tmpfs directory and the socket directory too: an arena file left on the
    # node holds the host's memory for good.
    assert {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]} == {
        "state": "/data/kvpool/state", "nvme": "/mnt/nvme", "dram": "/dev/shm/kvpool",
        "sockets": "/run/kvpool"}
    (init,) = spec["initContainers"]
    assert init["command"] == [
        "python3", "-m", "kvpool.operator.hostdirs", "--remove",
        *(f"{render.RECLAIM_MOUNT}/{name}/default.small"
          for name in ("state", "nvme", "dram", "sockets"))]
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": list(render.HOST_DIRS_CAPABILITIES)}
    (done,) = spec["containers"]
    assert done["securityContext"]["runAsNonRoot"] and "volumeMounts" not in done
    # Not the agents' pods: no Service, PodMonitor or agent selector takes them.
    labels = reclaim["spec"]["template"]["metadata"]["labels"]
    assert not render.selector_labels(pool).items() <= labels.items()

    # An arena on huge pages: its hugetlbfs directory, and its journal's on the tmpfs.
    pool_minimal["spec"]["tiers"]["dram"]["hugePages"] = True
    huge = render.render_reclaim_daemon_set(api.parse_pool(pool_minimal))
    assert {v["name"]: v["hostPath"]["path"]
            for v in huge["spec"]["template"]["spec"]["volumes"]} == {
        "state": "/data/kvpool/state", "nvme": "/mnt/nvme", "dram": "/dev/hugepages/kvpool",
        "journal": "/dev/shm/kvpool", "sockets": "/run/kvpool"}
    del pool_minimal["spec"]["tiers"]["dram"]["hugePages"]

    pool_minimal["spec"]["stateHostPath"] = "/opt/state"
    with pytest.raises(Forbidden, match=r"spec\.stateHostPath"):
        render.render(api.parse_pool(pool_minimal), None)


def test_agent_config_change_rolls_the_pods_policy_change_does_not(
    pool_minimal: dict, policy_full: dict
) -> None:
    pool = api.parse_pool(pool_minimal)

    def template_annotations(p: api.KVCachePool, pol: api.KVTierPolicy | None) -> dict:
        ds = _by_kind(render.render(p, pol))["DaemonSet"]
        return ds["spec"]["template"]["metadata"]["annotations"]

    base = template_annotations(pool, None)
    # The agent reloads policy.yaml in place: no restart, no lost DRAM tier.
    assert template_annotations(pool, api.parse_policy(policy_full)) == base
    bigger = copy.deepcopy(pool_minimal)
    bigger["spec"]["tiers"]["dram"]["size"] = "16Gi"
    changed = template_annotations(api.parse_pool(bigger), None)
    assert changed[render.CONFIG_CHECKSUM_ANNOTATION] != base[render.CONFIG_CHECKSUM_ANNOTATION]


def test_agent_rbac_allows_get_and_patch_on_nodes_only(pool_minimal: dict) -> None:
    kinds = _by_kind(render.render(api.parse_pool(pool_minimal), None))
    assert kinds["ClusterRole"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}
    ]
    binding = kinds["ClusterRoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvpool-small", "namespace": "default"}
    ]
    assert binding["roleRef"]["name"] == kinds["ClusterRole"]["metadata"]["name"]
    pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]


def test_pod_monitor_only_when_enabled(pool_minimal: dict) -> None:
    pool = api.parse_pool(pool_minimal)
    assert "PodMonitor" not in _by_kind(render.render(pool, None))
    with_monitor = render.render(pool, None, render.Settings(pod_monitor=True))
    assert _by_kind(with_monitor)["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == (
        "metrics"
    )


def test_shared_file_url_mounts_the_shared_path(pool_minimal: dict) -> None:
    body = copy.deepcopy(pool_minimal)
    body["spec"]["tiers"]["shared"] = {"url": "file:///mnt/lustre/kv", "reclaimPolicy": "Delete"}
    pool = api.parse_pool(body)
    objects = render.render(pool, None)
    job = render.render_gc_job(pool)
    _validate([*objects, job])
    pod = _by_kind(objects)["DaemonSet"]["spec"]["template"]["spec"]
    assert {"name": "shared", "mountPath": "/mnt/lustre/kv"} in pod["containers"][0]["volumeMounts"]
    gc = job["spec"]["template"]["spec"]["containers"][0]
    assert gc["command"] == ["kvpool", "gc", "--shared", "file:///mnt/lustre/kv", "--all"]


def test_gc_job_carries_the_credentials(pool_full: dict) -> None:
    job = render.render_gc_job(api.parse_pool(pool_full))
    gc = job["spec"]["template"]["spec"]["containers"][0]
    assert gc["command"] == ["kvpool", "gc", "--shared", "s3://kv-cache/llama-70b", "--all"]
    env = {e["name"]: e for e in gc["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "kvpool-s3"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage.svc:9000"


def test_a_pool_with_tenants_renders_them_into_the_agent_config_and_the_gc_job(
        pool_full: dict) -> None:
    body = copy.deepcopy(pool_full)
    body["spec"]["tenants"] = [{"name": "chat", "dram": "8Gi"}, {"name": "search"}]
    pool = api.parse_pool(body)
    objects = render.render(pool, None)
    _validate(objects)
    config_map = _by_kind(objects)["ConfigMap"]
    cfg = AgentConfig.model_validate(yaml.safe_load(config_map["data"]["agent.yaml"]))
    assert [t.name for t in cfg.tenants] == ["chat", "search"]
    sockets = [str(c.socket_path) for _, c in cfg.spaces()]
    assert sockets == [f"{render.tenant_socket_dir(pool, t)}/agent.sock"
                       for t in ("chat", "search")]
    job = render.render_gc_job(pool)
    _validate([job])
    gc = job["spec"]["template"]["spec"]["containers"][0]
    assert gc["command"][-4:] == ["--tenant", "chat", "--tenant", "search"]


def test_long_names_are_shortened_within_limits() -> None:
    name = "a" * 55
    body = {
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"tiers": {"dram": {"size": 1 << 30}}},
    }
    objects = render.render(api.parse_pool(body), None)
    _validate(objects)
    for obj in objects:
        limit = 253 if obj["kind"].startswith("ClusterRole") else 63
        assert len(obj["metadata"]["name"]) <= limit


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tiers": {"dram": {"size": "0"}}}, "spec.tiers.dram.size"),
        ({"tiers": {"dram": {"size": "lots"}}}, "spec.tiers.dram.size"),
        ({"tiers": {}}, "spec.tiers"),
        ({"tiers": {"nvme": {"hostPath": "relative", "size": "1Gi"}}}, "spec.tiers.nvme.hostPath"),
        ({"tiers": {"nvme": {"hostPath": "/mnt"}}}, "spec.tiers.nvme.size"),
        ({"tiers": {"shared": {"url": "http://x"}}}, "spec.tiers.shared.url"),
        (
            {"tiers": {"shared": {"url": "file:///x", "credentialsSecret": "s"}}},
            "spec.tiers.shared.credentialsSecret",
        ),
        ({"tiers": {"dram": {"size": "3Mi", "hugePages": True}}}, "spec.tiers.dram"),
        ({"tiers": {"dram": {"size": "1Gi"}}, "chunkTokens": 0}, "spec.chunkTokens"),
        (
            {"tiers": {"dram": {"size": "1Gi"}}, "agent": {"metricsPort": 80}},
            "spec.agent.metricsPort",
        ),
        ({"tiers": {"dram": {"size": "1Gi"}}, "tiers2": {}}, "spec.tiers2"),
    ],
)
def test_invalid_pool_names_the_field_and_renders_nothing(change: dict, field: str) -> None:
    body = {"metadata": {"name": "p", "namespace": "ns"}, "spec": change}
    with pytest.raises(api.InvalidSpec) as err:
        render.render(api.parse_pool(body), None)
    assert field in str(err.value)


def test_pool_id_too_long_for_a_node_label_is_invalid() -> None:
    body = {
        "metadata": {"name": "p" * 60, "namespace": "team"},
        "spec": {"tiers": {"dram": {"size": 1}}},
    }
    with pytest.raises(api.InvalidSpec, match="63 characters"):
        api.parse_pool(body)


def test_invalid_policy_names_the_field() -> None:
    body = {
        "metadata": {"name": "p"},
        "spec": {"tiers": {"dram": {"lowWatermark": 0.9, "highWatermark": 0.5}}},
    }
    with pytest.raises(api.InvalidSpec, match=r"spec\.tiers\.dram"):
        api.parse_policy(body)
