"""The operator policy: a pool cannot run other images, root, every-taint tolerations or
system host directories unless the cluster admin allows it — refused by `kvpool render`,
by the pool admission webhook, and, stored anyway, left without agents."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from op_cluster import Cluster, Emulator, pool_known
from op_support import EXAMPLES, condition, example, pod_body, pool_body
from typer.testing import CliRunner

from kvpool.operator import api
from kvpool.operator.cli import app
from kvpool.operator.operator_policy import (
    DEFAULT_HOST_PATH_ROOTS,
    Forbidden,
    OperatorPolicy,
    check,
    host_path_problem,
    image_allowed,
    problems,
)

OPERATOR_IMAGE = "ghcr.io/kvpool/kvpool:1.2.3"


def _pool(**spec: Any) -> api.KVCachePool:
    return api.parse_pool(pool_body(**spec))


@pytest.mark.parametrize(
    ("image", "prefixes", "allowed"),
    [
        ("ghcr.io/kvpool/kvpool:2.0", ["ghcr.io/kvpool/kvpool"], True),
        ("ghcr.io/kvpool/kvpool@sha256:" + "a" * 64, ["ghcr.io/kvpool/kvpool"], True),
        ("ghcr.io/kvpool/kvpool", ["ghcr.io/kvpool/kvpool"], True),
        ("ghcr.io/kvpool/kvpool-evil:1", ["ghcr.io/kvpool/kvpool"], False),
        ("ghcr.io/kvpool/kvpool/sub:1", ["ghcr.io/kvpool/kvpool"], False),
        ("evil.io/ghcr.io/kvpool/kvpool:1", ["ghcr.io/kvpool/kvpool"], False),
        ("registry.local:5000/ml/agent:1", ["registry.local:5000/ml/"], True),
        ("registry.local:5000/mlx/agent:1", ["registry.local:5000/ml/"], False),
    ],
)
def test_image_is_allowed_by_repository_or_by_prefix(
    image: str, prefixes: list[str], allowed: bool
) -> None:
    assert image_allowed(image, prefixes) is allowed


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/mnt/nvme0/kvpool", None),
        ("/mnt", None),
        ("/mnt//nvme0/./kvpool/", None),
        ("/etc", "system directory"),
        ("/etc/kvpool", "system directory"),
        ("//etc", "system directory"),
        ("/", "system directory"),
        ("/proc/1", "system directory"),
        ("/var/lib/kubelet/pods", "system directory"),
        ("/var/run/containerd", "system directory"),
        ("/mnt/../etc", "'..'"),
        ("/mnt/nvme/..", "'..'"),
        ("mnt/nvme", "absolute"),
        ("/home/user", "not below an allowed host path root"),
        ("/mntx", "not below an allowed host path root"),
    ],
)
def test_host_paths_are_normalized_and_checked_against_roots_and_deny_list(
    path: str, reason: str | None
) -> None:
    problem = host_path_problem(path, DEFAULT_HOST_PATH_ROOTS)
    if reason is None:
        assert problem is None
    else:
        assert problem is not None and reason in problem


def test_system_directories_are_refused_even_when_the_admin_allows_their_root() -> None:
    assert host_path_problem("/etc", ["/"]) is not None
    assert host_path_problem("/var/lib/kubelet", ["/var/lib"]) is not None
    assert host_path_problem("/var/lib/kvpool", ["/var/lib"]) is None


def test_default_policy_refuses_what_roots_the_nodes() -> None:
    pool = _pool(
        tolerations=[{"operator": "Exists"}],
        agent={"image": "evil.io/miner:1", "runAsUser": 0},
        tiers={
            "dram": {"size": "1Gi"},
            "nvme": {"hostPath": "/etc", "size": "1Gi"},
            "shared": {"url": "file:///proc"},
        },
        socketDir="/var/lib/kubelet",
        stateHostPath="/etc/kvpool",
    )
    found = problems(pool, OperatorPolicy(), OPERATOR_IMAGE)
    fields = [p.split(":")[0] for p in found]
    assert fields == [
        "spec.agent.image",
        "spec.agent.runAsUser",
        "spec.socketDir",
        "spec.stateHostPath",
        "spec.tiers.nvme.hostPath",
        "spec.tiers.shared.url",
        "spec.tolerations[0]",
    ]
    assert "ghcr.io/kvpool/kvpool" in found[0]  # the default: the operator's own repository
    with pytest.raises(Forbidden, match="not allowed by the operator policy"):
        check(pool, OperatorPolicy(), OPERATOR_IMAGE)


def test_a_permissive_policy_allows_each_in_turn() -> None:
    pool = _pool(
        tolerations=[{"operator": "Exists", "effect": "NoSchedule"}],
        agent={"image": "registry.local/ml/agent:1", "runAsUser": 0},
        tiers={"dram": {"size": "1Gi"}, "nvme": {"hostPath": "/scratch/kv", "size": "1Gi"}},
        stateHostPath="/scratch/state",
    )
    policy = OperatorPolicy(
        allowed_images=("registry.local/ml/",),
        allow_root=True,
        host_path_roots=("/scratch", "/run/kvpool"),
        allow_tolerate_all_taints=True,
    )
    assert problems(pool, policy, OPERATOR_IMAGE) == []


def test_kv_events_are_allowed_by_default_and_refused_where_the_policy_says_so(
    tmp_path: Any,
) -> None:
    pool = _pool(events={"enabled": True})
    assert problems(pool, OperatorPolicy(), OPERATOR_IMAGE) == []
    (found,) = problems(pool, OperatorPolicy(allow_events=False), OPERATOR_IMAGE)
    assert found.startswith("spec.events.enabled: ") and "token ids" in found
    # Events off ask nothing of the policy.
    assert problems(_pool(events={"enabled": False}), OperatorPolicy(allow_events=False),
                    OPERATOR_IMAGE) == []
    # `kvpool render --no-allow-events` (env KVPOOL_ALLOW_EVENTS for the operator) refuses it.
    path = tmp_path / "pool.yaml"
    path.write_text((EXAMPLES / "pool-minimal.yaml").read_text() + "  events:\n    enabled: true\n")
    assert runner.invoke(app, ["render", "-f", str(path)]).exit_code == 0
    result = runner.invoke(app, ["render", "-f", str(path), "--no-allow-events"])
    assert result.exit_code == 2 and "spec.events.enabled" in result.stderr


def test_peers_are_allowed_by_default_and_refused_where_the_policy_says_so(
    tmp_path: Any,
) -> None:
    pool = _pool(peers={"enabled": True})
    assert problems(pool, OperatorPolicy(), OPERATOR_IMAGE) == []
    (found,) = problems(pool, OperatorPolicy(allow_peers=False), OPERATOR_IMAGE)
    assert found.startswith("spec.peers.enabled: ") and "pod network" in found
    assert problems(_pool(peers={"enabled": False}), OperatorPolicy(allow_peers=False),
                    OPERATOR_IMAGE) == []
    # `kvpool render --no-allow-peers` (env KVPOOL_ALLOW_PEERS for the operator) refuses it.
    path = tmp_path / "pool.yaml"
    path.write_text((EXAMPLES / "pool-minimal.yaml").read_text() + "  peers:\n    enabled: true\n")
    assert runner.invoke(app, ["render", "-f", str(path)]).exit_code == 0
    result = runner.invoke(app, ["render", "-f", str(path), "--no-allow-peers"])
    assert result.exit_code == 2 and "spec.peers.enabled" in result.stderr


def test_keyed_tolerations_and_the_default_image_pass_the_default_policy() -> None:
    pool = _pool(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}])
    assert problems(pool, OperatorPolicy(), OPERATOR_IMAGE) == []


# --------------------------------------------------------------------------- kvpool render

runner = CliRunner()


def _forbidden_file(tmp_path: Any) -> str:
    path = tmp_path / "pool.yaml"
    text = (EXAMPLES / "pool-minimal.yaml").read_text()
    path.write_text(text + "  agent:\n    runAsUser: 0\n")
    assert api.parse_pool(example("pool-minimal.yaml", api.POOL_KIND))  # the base is valid
    return str(path)


def test_render_refuses_a_pool_outside_the_policy_with_one_error_line(tmp_path: Any) -> None:
    result = runner.invoke(app, ["render", "-f", _forbidden_file(tmp_path)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "spec.agent.runAsUser" in lines[0] and "root" in lines[0]
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_render_takes_the_policy_from_flags_and_environment(tmp_path: Any) -> None:
    path = _forbidden_file(tmp_path)
    assert runner.invoke(app, ["render", "-f", path, "--allow-root"]).exit_code == 0
    env = {"KVPOOL_ALLOW_ROOT": "true"}
    assert runner.invoke(app, ["render", "-f", path], env=env).exit_code == 0


def test_render_refuses_a_relative_host_path_root(tmp_path: Any) -> None:
    result = runner.invoke(
        app, ["render", "-f", str(EXAMPLES / "pool-minimal.yaml"), "--host-path-root", "data"]
    )
    assert result.exit_code == 2 and result.stderr.startswith("error: --host-path-root")


# --------------------------------------------------------------------------- operator


@pytest.mark.kmock(cls=Emulator)
async def test_admission_refuses_a_pool_outside_the_policy_with_the_reason(
    cluster: Cluster,
) -> None:
    response = await cluster.admit_pool(pool_body(agent={"runAsUser": 0}))
    assert response["allowed"] is False
    assert "spec.agent.runAsUser" in response["status"]["message"]
    response = await cluster.admit_pool(pool_body())
    assert response["allowed"] is True


@pytest.mark.kmock(cls=Emulator)
async def test_admission_never_refuses_an_update_that_leaves_the_spec(cluster: Cluster) -> None:
    """A pool a tightened policy no longer allows can still get its finalizer removed."""
    old = pool_body(agent={"runAsUser": 0})
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = []
    response = await cluster.admit_pool(new, "UPDATE", old)
    assert response["allowed"] is True
    edited = copy.deepcopy(old)
    edited["spec"]["agent"]["image"] = "evil.io/miner:1"
    response = await cluster.admit_pool(edited, "UPDATE", old)
    assert response["allowed"] is False and "evil.io/miner:1" in response["status"]["message"]


@pytest.mark.kmock(cls=Emulator)
async def test_a_stored_pool_outside_the_policy_says_why_and_runs_no_agents(
    cluster: Cluster,
) -> None:
    name = pool_body()["metadata"]["name"]
    ds_name = f"kvpool-{name}"
    await cluster.create(pool_body())
    await cluster.eventually(lambda: cluster.get("apps/v1", "DaemonSet", ds_name), "agents")

    # Edited past the webhook (down, or not installed): the agents go.
    await cluster.edit_pool(name, {"agent": {"runAsUser": 0}})

    cond = await cluster.condition_of(name, "Degraded", "True", "Forbidden")
    assert "spec.agent.runAsUser" in cond["message"]
    pool = await cluster.pool(name)
    ready = condition(pool, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "Forbidden"
    # No agents run: no last good spec is kept for pods to join.
    assert "appliedSpec" not in (pool or {})["status"]

    async def no_agents() -> bool:
        return await cluster.get("apps/v1", "DaemonSet", ds_name) is None

    await cluster.eventually(no_agents, "the DaemonSet to be deleted")


@pytest.mark.kmock(cls=Emulator)
async def test_pods_of_a_stored_pool_outside_the_policy_are_refused_with_the_reason(
    cluster: Cluster,
) -> None:
    """The pod webhook applies the operator policy too: a pod gets none of a forbidden
    pool's mounts (here a socket directory among the kubelet's pod volumes)."""
    await cluster.create(pool_body(socketDir="/var/lib/kubelet/pods/kvpool"))  # past the webhook
    await cluster.condition_of("small", "Degraded", "True", "Forbidden")
    response = await cluster.admit_pod(pod_body(), until=pool_known)
    assert response["allowed"] is False, response
    message = response["status"]["message"]
    assert "not allowed by the operator policy" in message
    assert "spec.socketDir: '/var/lib/kubelet/pods/kvpool' is a system directory" in message
    assert "patch" not in response
    assert message in response["warnings"]
