"""Pure parts of the operator: conditions, pod injection, apply's diffing, metrics, CLI flags."""

from __future__ import annotations

import copy
import urllib.request
from typing import Any

import pytest
from op_support import GOLDEN_SETTINGS, example
from typer.testing import CliRunner

from kvpool.bench.local import free_port
from kvpool.operator import api, cli, metrics, status, webhook
from kvpool.operator.kube import contains, path_of, removals
from kvpool.operator.status import Problem, Reason, Rollout

NOW = "2026-01-01T00:00:00Z"


def _ds(generation: int | None = 2, **st: int) -> dict[str, Any]:
    meta = {"generation": generation} if generation is not None else {}
    return {"metadata": meta, "status": st}


def _all_ready(
    nodes: int, observed: int | None = None, generation: int | None = 2
) -> dict[str, Any]:
    """A DaemonSet whose `nodes` agents are all scheduled, updated, ready and available, as
    its controller reported having observed generation `observed` (None: no generations)."""
    counts = dict(
        desiredNumberScheduled=nodes,
        numberReady=nodes,
        updatedNumberScheduled=nodes,
        numberAvailable=nodes,
    )
    if observed is not None:
        counts["observedGeneration"] = observed
    return _ds(generation, **counts)


def _by_type(conds: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in conds}


@pytest.mark.parametrize(
    ("daemon_set", "problem", "expected"),
    [
        (
            None,
            None,
            {
                "Ready": ("False", "Creating"),
                "Progressing": ("True", "Creating"),
                "Degraded": ("False", "AsExpected"),
            },
        ),
        (
            _ds(),  # no status yet: its controller has not reported
            None,
            {"Ready": ("False", "Creating"), "Progressing": ("True", "Creating")},
        ),
        (
            _all_ready(2, observed=1),
            None,
            {"Ready": ("False", "AgentsNotReady"), "Progressing": ("True", "RollingOut")},
        ),
        (
            _all_ready(2, observed=2),
            None,
            {"Ready": ("True", "AgentsReady"), "Progressing": ("False", "RolloutComplete")},
        ),
        (
            _all_ready(2, generation=None),
            None,
            {"Ready": ("True", "AgentsReady")},
        ),
        (
            _ds(observedGeneration=2, desiredNumberScheduled=0),
            None,
            {"Ready": ("False", "NoMatchingNodes")},
        ),
        (
            _all_ready(2, observed=2),
            Problem(Reason.SECRET_NOT_FOUND, "Secret 's' not found"),
            {
                "Ready": ("False", "SecretNotFound"),
                "Progressing": ("False", "SecretNotFound"),
                "Degraded": ("True", "SecretNotFound"),
            },
        ),
    ],
)
def test_conditions_follow_rollout_and_problems(
    daemon_set: dict[str, Any] | None, problem: Problem | None, expected: dict[str, Any]
) -> None:
    conds = status.conditions(Rollout.of(daemon_set), problem, generation=3, now=NOW)
    got = _by_type(conds)
    for type_, value in expected.items():
        assert got[type_] == value
    for c in conds:
        assert c["observedGeneration"] == 3 and c["lastTransitionTime"] == NOW


def test_unchanged_condition_keeps_its_transition_time() -> None:
    first = status.conditions(Rollout.of(None), None, 1, now="2026-01-01T00:00:00Z")
    second = status.conditions(
        Rollout.of(None), None, 1, previous=first, now="2026-02-02T00:00:00Z"
    )
    assert [c["lastTransitionTime"] for c in second] == ["2026-01-01T00:00:00Z"] * 3
    ready = _all_ready(1, observed=2)
    third = status.conditions(
        Rollout.of(ready), None, 1, previous=second, now="2026-03-03T00:00:00Z"
    )
    times = {c["type"]: c["lastTransitionTime"] for c in third}
    assert times == {
        "Ready": "2026-03-03T00:00:00Z",
        "Progressing": "2026-03-03T00:00:00Z",
        "Degraded": "2026-01-01T00:00:00Z",
    }


def test_problem_survives_daemon_set_updates() -> None:
    conds = status.conditions(Rollout.of(None), Problem(Reason.POLICY_NOT_FOUND, "gone"), 1)
    assert status.problem_of(conds) == Problem(Reason.POLICY_NOT_FOUND, "gone")
    assert status.problem_of(status.conditions(Rollout.of(None), None, 1)) is None


def test_observed_generation_absent_when_the_server_has_none() -> None:
    pool = api.parse_pool(example("pool-minimal.yaml", api.POOL_KIND))
    st = status.pool_status(pool=pool, generation=None, daemon_set=None, problem=None, now=NOW)
    assert "observedGeneration" not in st
    assert all("observedGeneration" not in c for c in st["conditions"])
    assert st["capacity"] == {"dram": {"perNode": "8Gi", "total": "0"}}


# --------------------------------------------------------------------------- webhook


def _pool() -> api.KVCachePool:
    body = example("pool.yaml", api.POOL_KIND)
    return api.parse_pool(body)


def test_inject_adds_socket_env_affinity_and_is_idempotent() -> None:
    pod = example("pod.yaml", "Pod")
    pod["spec"]["containers"].append(
        {
            "name": "sidecar",
            "image": "busybox",
            "env": [{"name": "KVPOOL_TENANT", "value": "stale"}],
        }
    )
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]},
                    {"matchExpressions": [{"key": "tpu", "operator": "Exists"}]},
                ]
            }
        }
    }
    webhook.inject(pod, _pool())
    once = copy.deepcopy(pod)
    webhook.inject(pod, _pool())
    assert pod == once
    for container in pod["spec"]["containers"]:
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["KVPOOL_TENANT"] == "chat"
        assert env["KVPOOL_SOCKET"] == "/run/kvpool/inference.llama-70b/agent.sock"
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    for term in terms:  # ORed terms: the pool's label is required in each
        assert {
            "key": "pool.kvpool.io/inference.llama-70b",
            "operator": "In",
            "values": ["ready"],
        } in term["matchExpressions"]
        assert len(term["matchExpressions"]) == 2
    assert pod["metadata"]["annotations"][webhook.INJECTED_ANNOTATION] == "inference.llama-70b"


@pytest.mark.parametrize(
    ("run_as_user", "groups"), [(None, [7, 65532]), (1000, [7, 1000]), (0, [7])]
)
def test_inject_adds_the_agents_group_never_root(
    run_as_user: int | None, groups: list[int]
) -> None:
    """The agent's socket is mode 0660: a non-root client needs the agent's group; a root
    agent's group (0) is never handed to a pod."""
    body = example("pool.yaml", api.POOL_KIND)
    if run_as_user is not None:
        body["spec"].setdefault("agent", {})["runAsUser"] = run_as_user
    pod = example("pod.yaml", "Pod")
    pod["spec"]["securityContext"] = {"supplementalGroups": [7]}
    webhook.inject(pod, api.parse_pool(body))
    webhook.inject(pod, api.parse_pool(body))
    assert pod["spec"]["securityContext"]["supplementalGroups"] == groups


def test_tenant_defaults_to_the_namespace() -> None:
    pod = example("pod.yaml", "Pod")
    del pod["metadata"]["annotations"][api.TENANT_ANNOTATION]
    webhook.inject(pod, _pool())
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["KVPOOL_TENANT"] == "inference"


def test_invalid_tenant_is_rejected() -> None:
    pod = example("pod.yaml", "Pod")
    pod["metadata"]["annotations"][api.TENANT_ANNOTATION] = "not a tenant!"
    with pytest.raises(webhook.Rejected, match=r"kvpool\.io/tenant"):
        webhook.inject(pod, _pool())


def _tenanted_pool(*tenants: str) -> api.KVCachePool:
    body = example("pool.yaml", api.POOL_KIND)
    body["spec"]["tenants"] = [{"name": t} for t in tenants]
    return api.parse_pool(body)


def test_in_a_pool_with_tenants_a_pod_mounts_only_its_tenants_socket_directory() -> None:
    pod = example("pod.yaml", "Pod")  # annotated tenant "chat"
    webhook.inject(pod, _tenanted_pool("chat", "search"))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == webhook.SOCKET_VOLUME)
    assert volume["hostPath"] == {
        "path": "/run/kvpool/inference.llama-70b/tenants/chat", "type": "Directory"}
    for container in pod["spec"]["containers"]:
        mount = next(m for m in container["volumeMounts"]
                     if m["name"] == webhook.SOCKET_VOLUME)
        assert mount["mountPath"] == "/run/kvpool/inference.llama-70b"
        env = {e["name"]: e["value"] for e in container["env"]}
        # The same socket path inside the pod: clients need no change.
        assert env["KVPOOL_SOCKET"] == "/run/kvpool/inference.llama-70b/agent.sock"
        assert env["KVPOOL_TENANT"] == "chat"


def test_a_tenant_the_pool_does_not_list_is_rejected() -> None:
    pod = example("pod.yaml", "Pod")
    with pytest.raises(webhook.Rejected,
                       match=r"tenant 'chat' .* is not a tenant of KVCachePool 'llama-70b'; "
                             r"its tenants are search, code"):
        webhook.inject(pod, _tenanted_pool("search", "code"))


@pytest.mark.parametrize(("tenants", "error"), [
    ([{"name": "a"}, {"name": "a"}], "spec.tenants: tenant 'a' is listed twice"),
    ([{"name": "a", "dram": "1Ti"}], "spec.tenants: tenants ask for 1.0 TiB of dram"),
    ([{"name": "a", "nvme": "1Gi"}], None),  # the example pool has NVMe: fine
])
def test_pool_tenants_must_fit_the_tiers(tenants: list[dict[str, Any]], error: str | None) -> None:
    body = example("pool.yaml", api.POOL_KIND)
    body["spec"]["tenants"] = tenants
    if error is None:
        assert api.parse_pool(body).spec.tenants[0].name == "a"
    else:
        with pytest.raises(api.InvalidSpec, match=error):
            api.parse_pool(body)


def test_unknown_or_deleting_pool_is_rejected_by_name() -> None:
    with pytest.raises(webhook.Rejected, match="'ghost' not found in namespace 'inference'"):
        webhook.check_pool("ghost", "inference", None)
    body = example("pool.yaml", api.POOL_KIND)
    body["metadata"]["deletionTimestamp"] = NOW
    with pytest.raises(webhook.Rejected, match="being deleted"):
        webhook.check_pool("llama-70b", "inference", body)


def test_mutate_pod_through_the_handler_code() -> None:
    import kopf

    from kvpool.operator.handlers import mutate_pod

    pod = example("pod.yaml", "Pod")
    body = kopf.Body(copy.deepcopy(pod))
    patch = kopf.Patch(body=body)
    index = {("inference", "llama-70b"): [example("pool.yaml", api.POOL_KIND)]}
    mutate_pod(body, patch, index, GOLDEN_SETTINGS)
    ops = patch.as_json_patch()
    assert any(op["path"] == "/spec/volumes" for op in ops)
    with pytest.raises(kopf.AdmissionError, match="not found"):
        mutate_pod(body, kopf.Patch(body=body), {}, GOLDEN_SETTINGS)


# --------------------------------------------------------------------------- apply


def test_contains_ignores_server_defaults_but_not_changes() -> None:
    desired = {"spec": {"containers": [{"name": "a", "image": "x"}], "paused": False}}
    live = {
        "spec": {
            "containers": [{"name": "a", "image": "x", "imagePullPolicy": "Always"}],
            "paused": False,
        },
        "status": {},
    }
    assert contains(live, desired)
    assert not contains(live, {"spec": {"containers": [{"name": "a", "image": "y"}]}})
    assert not contains(live, {"spec": {"containers": []}})
    assert not contains({"x": 0}, {"x": False})


def test_removals_trim_keys_the_operator_no_longer_renders() -> None:
    live = {
        "data": {"agent.yaml": "a", "old.yaml": "b"},
        "spec": {"template": {"spec": {"nodeSelector": {"gpu": "yes"}}}},
    }
    desired = {"data": {"agent.yaml": "a"}, "spec": {"template": {"spec": {}}}}
    assert removals(live, desired) == {
        "data": {"old.yaml": None},
        "spec": {"template": {"spec": {"nodeSelector": None}}},
    }
    assert removals(live, live) == {}


def test_paths_of_core_custom_and_cluster_scoped_kinds() -> None:
    assert path_of("v1", "ConfigMap", "ns", "c") == "/api/v1/namespaces/ns/configmaps/c"
    assert path_of("kvpool.io/v1alpha1", "KVCachePool", "ns") == (
        "/apis/kvpool.io/v1alpha1/namespaces/ns/kvcachepools"
    )
    assert path_of("rbac.authorization.k8s.io/v1", "ClusterRole", None, "r") == (
        "/apis/rbac.authorization.k8s.io/v1/clusterroles/r"
    )


# --------------------------------------------------------------------------- metrics, CLI


def test_metrics_series_exist_from_the_start() -> None:
    port = free_port()
    metrics.serve(port, addr="127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'kvpool_operator_reconciles_total{kind="KVCachePool",result="error"}' in text
    for reason in status.PROBLEM_REASONS:
        assert (
            f'kvpool_operator_reconcile_errors_total{{kind="KVCachePool",reason="{reason}"}}'
            in text
        )
    assert 'kvpool_operator_reconcile_duration_seconds_bucket{kind="KVTierPolicy",le="0.1"}' in text


def test_operator_command_maps_flags_and_env_to_options(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    import kvpool.operator.run as run

    monkeypatch.setattr(run, "run_operator", seen.append)
    monkeypatch.setenv("KVPOOL_AGENT_IMAGE", "registry.local/kvpool:dev")
    result = CliRunner().invoke(
        cli.app,
        [
            "operator",
            "-n",
            "a",
            "--namespace",
            "b",
            "--metrics-port",
            "9090",
            "--webhook-cert-dir",
            "/tls",
            "--pod-monitor",
        ],
    )
    assert result.exit_code == 0, result.output
    (options,) = seen
    assert options.namespaces == ["a", "b"] and not options.clusterwide
    assert options.metrics_port == 9090 and options.liveness_port == 8081
    assert options.webhook_port == 9443 and str(options.webhook_cert_dir) == "/tls"
    assert options.settings.agent_image == "registry.local/kvpool:dev"
    assert options.settings.pod_monitor is True


def test_operator_command_needs_certificates_for_the_webhook() -> None:
    result = CliRunner().invoke(cli.app, ["operator", "-A"])
    assert result.exit_code == 2 and "--webhook-cert-dir" in result.stderr
