"""The chart, rendered by the real Helm engine, yields valid Kubernetes objects."""

from __future__ import annotations

import base64
import copy
import json
import re
from datetime import UTC, datetime
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from kvpool.operator.alerts import RUNBOOK_BASE_URL, rule_groups
from kvpool.operator.api import parse_policy, parse_pool
from kvpool.operator.operator_policy import DEFAULT_HOST_PATH_ROOTS, OperatorPolicy

from .conftest import ALL_TOGGLES_ON, CHART, NAMESPACE, Rendered

KUBE_VERSION = "1.33.0"
MONITORING_GROUP = "monitoring.coreos.com/"
"""Prometheus Operator CRs: kubernetes-validate has no schema for them; checked below."""
KVPOOL_GROUP = "kvpool.io/"
"""Our own CRs (the examples): checked against the chart's CRDs and the API models."""


def _validate_builtin(objects: list[dict[str, Any]]) -> list[str]:
    kinds = []
    for obj in objects:
        if obj["apiVersion"].startswith((MONITORING_GROUP, KVPOOL_GROUP)):
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        kinds.append(obj["kind"])
    return kinds


# ----------------------------------------------------------------------------- rendering


def test_default_render_yields_the_operator_and_its_webhook(defaults: Rendered) -> None:
    kinds = sorted(o["kind"] for o in defaults.objects)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "PodDisruptionBudget",
            "Service",  # operator metrics
            "Service",  # webhook
            "Secret",
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
        ]
    )


def test_every_builtin_object_of_the_default_render_is_valid_kubernetes(
    defaults: Rendered,
) -> None:
    validated = _validate_builtin(defaults.objects)
    assert len(validated) == len(defaults.objects)


def test_every_toggle_on_adds_monitoring_dashboard_and_examples(everything: Rendered) -> None:
    for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule", "KVCachePool", "KVTierPolicy"):
        everything.one(kind)
    dashboards = [
        c for c in everything.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-dashboard")
    ]
    assert len(dashboards) == 1


def test_every_builtin_object_with_every_toggle_on_is_valid_kubernetes(
    everything: Rendered,
) -> None:
    validated = _validate_builtin(everything.objects)
    custom = [
        o
        for o in everything.objects
        if o["apiVersion"].startswith((MONITORING_GROUP, KVPOOL_GROUP))
    ]
    assert len(validated) + len(custom) == len(everything.objects)
    assert len(validated) >= 10


def test_strict_validation_rejects_an_unknown_field(defaults: Rendered) -> None:
    """The validator used above is not vacuous: a misspelt field fails."""
    deployment = copy.deepcopy(defaults.one("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_helm_lint_is_clean() -> None:
    report = helm_python.lint(str(CHART), kube_version=f"v{KUBE_VERSION}", strict=True)
    assert report["errors"] == []
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert serious == []


def test_helm_lint_with_every_toggle_on_is_clean() -> None:
    report = helm_python.lint(
        str(CHART), ALL_TOGGLES_ON, kube_version=f"v{KUBE_VERSION}", strict=True
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# ----------------------------------------------------------------------------- values


def test_values_schema_rejects_a_value_of_the_wrong_type(render: Any) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="timeoutSeconds"):
        render({"webhook": {"timeoutSeconds": "ten"}})


def test_values_schema_rejects_an_unknown_value(render: Any) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="podMonitr"):
        render({"podMonitr": {"enabled": True}})


def test_values_schema_rejects_a_bad_failure_policy(render: Any) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="failurePolicy"):
        render({"webhook": {"failurePolicy": "Sometimes"}})


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def _leaves(values: dict[str, Any], schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths of every value in values.yaml, checking each is declared in the schema."""
    out = []
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        props = schema.get("properties", {})
        assert key in props, f"{where} is in values.yaml but not in values.schema.json"
        out.append(where)
        if isinstance(value, dict) and props[key].get("additionalProperties") is False:
            out += _leaves(value, props[key], where)
    return out


def test_values_schema_mirrors_values_yaml() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = _schema()
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(values, schema)
    declared = _leaves(values, schema)

    def schema_paths(s: dict[str, Any], path: str = "") -> list[str]:
        out = []
        for key, sub in s.get("properties", {}).items():
            where = f"{path}.{key}" if path else key
            out.append(where)
            if sub.get("additionalProperties") is False:
                out += schema_paths(sub, where)
        return out

    # `global` is Helm's, not ours: everything else in the schema is in values.yaml.
    assert sorted(p for p in schema_paths(schema) if p != "global") == sorted(declared)


def test_every_value_has_a_comment_above_it() -> None:
    """Every value the schema declares (not the contents of free-form maps such as
    `resources`) has a comment line right above it in values.yaml."""
    text = (CHART / "values.yaml").read_text()
    declared = set(_leaves(yaml.safe_load(text), _schema()))
    lines = text.splitlines()
    key = re.compile(r"^( *)([A-Za-z][A-Za-z0-9_]*):")
    stack: list[tuple[int, str]] = []
    seen, missing = set(), []
    for i, line in enumerate(lines):
        m = key.match(line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        path = ".".join(name for _, name in stack)
        if path not in declared:
            continue
        seen.add(path)
        if not (i and lines[i - 1].strip().startswith("#")):
            missing.append(path)
    assert seen == declared
    assert missing == []


# ----------------------------------------------------------------------------- operator


def test_operator_runs_one_replica_with_a_disruption_budget(defaults: Rendered) -> None:
    deployment = defaults.one("Deployment")
    assert deployment["spec"]["replicas"] == 1
    pdb = defaults.one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_operator_runs_the_chart_version_with_the_documented_flags(defaults: Rendered) -> None:
    container = defaults.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/kvpool/kvpool:0.1.0"
    assert container["command"] == ["kvpool"]
    assert container["args"] == [
        "operator",
        "--all-namespaces",
        "--metrics-port=8080",
        "--liveness-port=8081",
        "--webhook-port=9443",
        "--webhook-cert-dir=/etc/kvpool/webhook-tls",
        "--agent-image=ghcr.io/kvpool/kvpool:0.1.0",
    ]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["webhook-tls"] == "/etc/kvpool/webhook-tls"


def test_watch_namespaces_replace_all_namespaces(render: Any) -> None:
    rendered = render({"operator": {"watchNamespaces": ["ml", "research"]}})
    args = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" not in args
    assert "--namespace=ml" in args
    assert "--namespace=research" in args


def _namespace_verbs(rendered: Rendered) -> set[str]:
    return {
        verb
        for rule in rendered.one("ClusterRole")["rules"]
        if "namespaces" in rule["resources"]
        for verb in rule["verbs"]
    }


def test_namespaces_are_listed_only_to_serve_namespace_patterns(
    render: Any, defaults: Rendered
) -> None:
    assert _namespace_verbs(defaults) == set()
    assert _namespace_verbs(render({"operator": {"watchNamespaces": ["ml"]}})) == set()
    patterns = render({"operator": {"watchNamespaces": ["ml", "team-*"]}})
    assert _namespace_verbs(patterns) == {"list", "watch"}
    _validate_builtin(patterns.objects)


def test_cluster_role_grants_what_the_operator_touches_and_no_wildcards(
    defaults: Rendered,
) -> None:
    rules = defaults.one("ClusterRole")["rules"]
    granted = {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert not [g for g in granted if "*" in g]
    expected = {
        ("kvpool.io", "kvcachepools", "watch"),
        ("kvpool.io", "kvcachepools", "patch"),
        ("kvpool.io", "kvcachepools/status", "patch"),
        ("kvpool.io", "kvtierpolicies", "watch"),
        ("kvpool.io", "kvtierpolicies/status", "patch"),
        ("apps", "daemonsets", "create"),
        ("apps", "daemonsets", "delete"),  # the agents of a pool the policy does not allow
        ("", "configmaps", "create"),
        ("", "serviceaccounts", "create"),
        ("", "services", "create"),
        ("", "secrets", "get"),
        ("", "secrets", "create"),  # the pool's peer secret (spec.peers), made once
        ("networking.k8s.io", "networkpolicies", "create"),
        ("", "events", "create"),
        ("", "nodes", "get"),
        ("", "nodes", "patch"),
        ("batch", "jobs", "create"),
        ("rbac.authorization.k8s.io", "clusterroles", "create"),
        ("rbac.authorization.k8s.io", "clusterroles", "delete"),
        ("rbac.authorization.k8s.io", "clusterrolebindings", "create"),
        ("monitoring.coreos.com", "podmonitors", "create"),
    }
    assert expected <= granted
    # Secrets: never list or watch (no Secret but those a pool names or the operator made
    # is read); nodes: no more than the agents are granted; no escalate/bind anywhere.
    assert {v for g, r, v in granted if r == "secrets"} == {"get", "create", "patch", "delete"}
    assert {v for g, r, v in granted if r == "nodes"} == {"get", "patch"}
    assert not {v for _, _, v in granted} & {"escalate", "bind", "impersonate"}
    assert not [g for g in granted if g[1] == "customresourcedefinitions"]


def test_cluster_role_binding_binds_the_operator_service_account(defaults: Rendered) -> None:
    binding = defaults.one("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == defaults.one("ClusterRole")["metadata"]["name"]
    sa = defaults.one("ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": NAMESPACE}
    ]
    pod = defaults.one("Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["name"]


# ----------------------------------------------------------------------------- policy


def _policy_env(rendered: Rendered) -> dict[str, str]:
    container = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("KVPOOL_")}


def test_default_render_carries_the_operator_policy_with_the_operators_defaults(
    defaults: Rendered,
) -> None:
    """`helm template` shows the policy, and it is the one `kvpool operator` defaults to."""
    env = _policy_env(defaults)
    assert env == {
        "KVPOOL_ALLOWED_IMAGES": "ghcr.io/kvpool/kvpool",
        "KVPOOL_ALLOW_ROOT": "false",
        "KVPOOL_HOST_PATH_ROOTS": " ".join(DEFAULT_HOST_PATH_ROOTS),
        "KVPOOL_ALLOW_TOLERATE_ALL_TAINTS": "false",
        "KVPOOL_ALLOW_EVENTS": "true",
        "KVPOOL_ALLOW_PEERS": "true",
    }
    default = OperatorPolicy()
    assert not default.allow_root and not default.allow_tolerate_all_taints
    assert default.allow_events and default.allow_peers
    assert env["KVPOOL_HOST_PATH_ROOTS"].split() == list(default.host_path_roots)


def test_allowed_images_default_to_the_agent_images_repository(render: Any) -> None:
    digest = "sha256:" + "a" * 64
    assert _policy_env(render({"image": {"repository": "r.local:5000/kv", "digest": digest}}))[
        "KVPOOL_ALLOWED_IMAGES"
    ] == "r.local:5000/kv"
    assert _policy_env(render({"operator": {"agentImage": "r.local:5000/agent:2"}}))[
        "KVPOOL_ALLOWED_IMAGES"
    ] == "r.local:5000/agent"


def test_operator_policy_values_reach_the_operator(render: Any) -> None:
    env = _policy_env(
        render(
            {
                "operatorPolicy": {
                    "allowedImages": ["r.local/ml/", "ghcr.io/kvpool/kvpool"],
                    "allowRoot": True,
                    "hostPathRoots": ["/scratch"],
                    "allowTolerateAllTaints": True,
                    "allowEvents": False,
                    "allowPeers": False,
                }
            }
        )
    )
    assert env == {
        "KVPOOL_ALLOWED_IMAGES": "r.local/ml/ ghcr.io/kvpool/kvpool",
        "KVPOOL_ALLOW_ROOT": "true",
        "KVPOOL_HOST_PATH_ROOTS": "/scratch",
        "KVPOOL_ALLOW_TOLERATE_ALL_TAINTS": "true",
        "KVPOOL_ALLOW_EVENTS": "false",
        "KVPOOL_ALLOW_PEERS": "false",
    }


def test_values_schema_rejects_a_relative_host_path_root(render: Any) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="hostPathRoots"):
        render({"operatorPolicy": {"hostPathRoots": ["data"]}})


def test_pools_and_policies_are_validated_by_the_operator_at_admission(
    defaults: Rendered,
) -> None:
    hooks = {h["name"]: h for h in defaults.one("ValidatingWebhookConfiguration")["webhooks"]}
    assert sorted(hooks) == ["validate-policy.kvpool.io", "validate-pool.kvpool.io"]
    for hook, path, resource in [
        (hooks["validate-pool.kvpool.io"], "/kvpool-validate-pool", "kvcachepools"),
        (hooks["validate-policy.kvpool.io"], "/kvpool-validate-policy", "kvtierpolicies"),
    ]:
        assert hook["clientConfig"]["service"]["path"] == path
        assert hook["rules"][0]["resources"] == [resource]
        assert hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
        assert hook["failurePolicy"] == "Fail"
        assert "namespaceSelector" not in hook  # a pool in any namespace runs on the nodes


# ----------------------------------------------------------------------------- webhook


def _services(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {s["metadata"]["name"]: s for s in rendered.of_kind("Service")}


def test_webhook_points_at_its_service_with_the_generated_ca(defaults: Rendered) -> None:
    mwc = defaults.one("MutatingWebhookConfiguration")
    (hook,) = mwc["webhooks"]
    ref = hook["clientConfig"]["service"]
    assert ref["path"] == "/kvpool-inject"
    service = _services(defaults)[ref["name"]]
    assert service["metadata"]["namespace"] == ref["namespace"] == NAMESPACE
    (port,) = service["spec"]["ports"]
    assert port["port"] == ref["port"]
    assert port["targetPort"] == "webhook"
    container = defaults.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in container["ports"]

    secret = defaults.one("Secret")
    assert secret["type"] == "kubernetes.io/tls"
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]


def test_webhook_certificate_is_signed_by_the_ca_for_the_service_dns_name(
    defaults: Rendered,
) -> None:
    secret = defaults.one("Secret")["data"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    service = defaults.one("MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]
    dns = f"{service['service']['name']}.{NAMESPACE}.svc"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert dns in names.get_values_for_type(x509.DNSName)
    assert cert.not_valid_after_utc > datetime.now(UTC).replace(year=datetime.now(UTC).year + 5)
    assert base64.b64decode(secret["tls.key"]).startswith(b"-----BEGIN RSA PRIVATE KEY-----")


def test_webhook_only_sees_annotated_pods_outside_its_own_namespace(defaults: Rendered) -> None:
    (hook,) = defaults.one("MutatingWebhookConfiguration")["webhooks"]
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    (condition,) = hook["matchConditions"]
    assert "'kvpool.io/pool' in object.metadata.annotations" in condition["expression"]
    (expr,) = hook["namespaceSelector"]["matchExpressions"]
    assert expr["key"] == "kubernetes.io/metadata.name"
    assert expr["operator"] == "NotIn"
    assert NAMESPACE in expr["values"]
    assert "kube-system" in expr["values"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["sideEffects"] == "None"


def test_webhook_failure_policy_and_match_conditions_are_configurable(render: Any) -> None:
    rendered = render({"webhook": {"failurePolicy": "Ignore", "matchConditions": False}})
    (hook,) = rendered.one("MutatingWebhookConfiguration")["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert "matchConditions" not in hook


def test_webhook_disabled_removes_its_objects_and_flags(render: Any) -> None:
    rendered = render({"webhook": {"enabled": False}})
    assert rendered.of_kind("MutatingWebhookConfiguration") == []
    assert rendered.of_kind("Secret") == []
    args = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--webhook")] == ["--webhook-port=0"]
    _validate_builtin(rendered.objects)


# ----------------------------------------------------------------------------- monitoring


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_pod_monitor_scrapes_agents_everywhere_and_adds_node_and_job(
    everything: Rendered,
) -> None:
    pm = everything.one("PodMonitor")
    assert set(pm) == {"apiVersion", "kind", "metadata", "spec"}
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = pm["spec"]
    assert set(spec) == {"namespaceSelector", "selector", "podMetricsEndpoints"}
    assert spec["namespaceSelector"] == {"any": True}
    assert spec["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "kvpool", "app.kubernetes.io/component": "agent"}
    }
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["path"] == "/metrics"
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "node",
        "action": "replace",
    } in endpoint["relabelings"]
    assert {"targetLabel": "job", "replacement": "kvpool-agent", "action": "replace"} in endpoint[
        "relabelings"
    ]


def test_operator_pod_monitor_labels_agent_series_as_the_chart_does(everything: Rendered) -> None:
    """`kvpool operator --pod-monitor` renders one PodMonitor per pool; its series must carry
    the same job and node labels as the chart's, or the agent-up panel and KVPoolAgentDown
    (`up{job="kvpool-agent"}`) never see them."""
    from kvpool.agent.constants import AGENT_JOB
    from kvpool.operator.render import Settings, render

    docs = list(yaml.safe_load_all((CHART.parents[1] / "docs/examples/pool.yaml").read_text()))
    pool = parse_pool(next(d for d in docs if d["kind"] == "KVCachePool"))
    per_pool = next(
        o for o in render(pool, None, Settings(pod_monitor=True)) if o["kind"] == "PodMonitor"
    )
    (chart_endpoint,) = everything.one("PodMonitor")["spec"]["podMetricsEndpoints"]
    (pool_endpoint,) = per_pool["spec"]["podMetricsEndpoints"]
    assert pool_endpoint["relabelings"] == chart_endpoint["relabelings"]
    assert {"targetLabel": "job", "replacement": AGENT_JOB, "action": "replace"} in (
        pool_endpoint["relabelings"]
    )
    assert (pool_endpoint["port"], pool_endpoint["path"]) == (
        chart_endpoint["port"],
        chart_endpoint["path"],
    )


def test_service_monitor_selects_the_operator_metrics_service(everything: Rendered) -> None:
    sm = everything.one("ServiceMonitor")
    spec = sm["spec"]
    assert set(spec) == {"namespaceSelector", "selector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selected = [
        s
        for s in everything.of_kind("Service")
        if _labels_match(spec["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert len(selected) == 1
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    assert selected[0]["spec"]["ports"][0]["targetPort"] == "metrics"


def test_prometheus_rule_carries_the_generated_groups(everything: Rendered) -> None:
    rule = everything.one("PrometheusRule")
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert rule["spec"] == rule_groups()


def test_prometheus_rule_runbook_base_url_is_configurable(render: Any) -> None:
    base = "https://wiki.example.com/kvpool/runbook"
    rendered = render({"prometheusRule": {"enabled": True, "runbookBaseURL": base}})
    urls = [
        r["annotations"]["runbook_url"]
        for g in rendered.one("PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
        if "alert" in r
    ]
    assert urls
    assert all(u.startswith(base + "#") for u in urls)
    assert not [u for u in urls if RUNBOOK_BASE_URL in u]


def test_monitoring_labels_reach_the_prometheus_operator_objects(render: Any) -> None:
    release = {"release": "kube-prometheus-stack"}
    rendered = render(
        {
            "podMonitor": {"enabled": True, "labels": release},
            "serviceMonitor": {"enabled": True, "labels": release},
            "prometheusRule": {"enabled": True, "labels": release},
        }
    )
    for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule"):
        assert rendered.one(kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_dashboard_config_map_has_sidecar_label_folder_and_the_generated_json(
    everything: Rendered,
) -> None:
    from kvpool.operator.dashboard import dashboard

    (cm,) = [
        c for c in everything.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "kvpool"
    assert json.loads(cm["data"]["kvpool.json"]) == dashboard()


def test_dashboard_config_map_can_go_to_grafanas_namespace(render: Any) -> None:
    rendered = render({"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}})
    (cm,) = rendered.of_kind("ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"


# ----------------------------------------------------------------------------- examples, CRDs


def test_example_pool_and_policy_are_valid_for_the_operator(everything: Rendered) -> None:
    policy = parse_policy(everything.one("KVTierPolicy"))
    pool = parse_pool(everything.one("KVCachePool"))
    assert pool.spec.policy_ref is not None
    assert pool.spec.policy_ref.name == policy.metadata.name
    # Not the release namespace, whose pods the webhook never sees.
    assert pool.metadata.namespace == policy.metadata.namespace == "default"


def test_examples_refuse_the_release_namespace(render: Any) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=r"examples\.namespace"):
        render({"examples": {"enabled": True, "namespace": NAMESPACE}})


def _crd_docs(folder: str) -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted((CHART.parent.parent / folder).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                docs[doc["metadata"]["name"]] = doc
    return docs


def test_chart_crds_are_identical_to_the_top_level_crds() -> None:
    chart_crds = _crd_docs("charts/kvpool/crds")
    assert set(chart_crds) == {"kvcachepools.kvpool.io", "kvtierpolicies.kvpool.io"}
    assert chart_crds == _crd_docs("crds")


def test_example_pool_and_policy_match_the_chart_crds(everything: Rendered) -> None:
    crds = _crd_docs("charts/kvpool/crds")
    for kind, name in (("KVCachePool", "kvcachepools"), ("KVTierPolicy", "kvtierpolicies")):
        crd = crds[f"{name}.kvpool.io"]
        (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
        obj = everything.one(kind)
        assert obj["apiVersion"] == f"kvpool.io/{version['name']}"
        schema = version["schema"]["openAPIV3Schema"]
        # OpenAPI v3 schemas use draft 4's boolean exclusiveMinimum/-Maximum.
        jsonschema.Draft4Validator({**schema, "required": ["spec"]}).validate({"spec": obj["spec"]})


# ----------------------------------------------------------------------------- notes


def test_notes_tell_the_next_commands(defaults: Rendered, everything: Rendered) -> None:
    assert "kubectl apply -f docs/examples/pool.yaml" in defaults.notes
    assert "rollout status deployment/kvpool" in defaults.notes
    assert "grafanaDashboard.enabled=true" in defaults.notes
    assert '"kvpool / Tiered KV-cache"' in everything.notes
    assert '"kvpool" once the Grafana sidecar' in everything.notes
    assert "kubectl -n default get kvcachepools example -w" in everything.notes


def _granted(rendered: Rendered) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rendered.one("ClusterRole")["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_cluster_role_lets_the_operator_apply_everything_it_renders(defaults: Rendered) -> None:
    """Cross-check with the operator's own render: every object it applies for a pool with
    all tiers (and a PodMonitor, and the gc Job) can be read, created and patched, and every
    permission it grants the agents is one it holds (RBAC escalation prevention)."""
    from kvpool.operator.render import Settings, render, render_gc_job

    docs = list(yaml.safe_load_all((CHART.parents[1] / "docs/examples/pool.yaml").read_text()))
    pool = parse_pool(next(d for d in docs if d["kind"] == "KVCachePool"))
    objects = [*render(pool, None, Settings(pod_monitor=True)), render_gc_job(pool)]
    granted = _granted(defaults)
    kinds = set()
    for obj in objects:
        group = obj["apiVersion"].rpartition("/")[0]
        resource = {"NetworkPolicy": "networkpolicies"}.get(obj["kind"], obj["kind"].lower() + "s")
        kinds.add(obj["kind"])
        verbs = {"get", "create"} if obj["kind"] == "Job" else {"get", "create", "patch"}
        for verb in verbs:
            assert (group, resource, verb) in granted, (obj["kind"], verb)
        for rule in obj.get("rules", []):
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    for v in rule["verbs"]:
                        assert (g, r, v) in granted, f"{obj['kind']} grants {v} {r}"
    assert {"DaemonSet", "ConfigMap", "ClusterRole", "PodMonitor", "Job", "Secret",
            "NetworkPolicy"} <= kinds


def test_api_server_would_trust_the_webhook_certificate_over_tls(
    defaults: Rendered, tmp_path: Any
) -> None:
    """A real TLS handshake on 127.0.0.1: a server holding the chart's tls.crt/tls.key (as the
    operator does from its cert dir) is accepted by a client that trusts only the caBundle
    and checks the webhook Service's DNS name, as the API server does."""
    import socket
    import ssl
    import threading

    secret = defaults.one("Secret")["data"]
    (hook,) = defaults.one("MutatingWebhookConfiguration")["webhooks"]
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_bytes(base64.b64decode(secret[name]))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client_ctx = ssl.create_default_context(
        cadata=base64.b64decode(hook["clientConfig"]["caBundle"]).decode()
    )
    service = hook["clientConfig"]["service"]
    dns = f"{service['name']}.{service['namespace']}.svc"

    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        port = listener.getsockname()[1]
        served: list[bytes] = []

        def serve() -> None:
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                served.append(tls.recv(16))
                tls.sendall(b"ok")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            client_ctx.wrap_socket(raw, server_hostname=dns) as tls,
        ):
            tls.sendall(b"hello")
            assert tls.recv(16) == b"ok"
        thread.join(timeout=10)
    assert served == [b"hello"]

    # The same client refuses a name the certificate was not made for.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        port = listener.getsockname()[1]

        def serve_once() -> None:
            conn, _ = listener.accept()
            try:
                server_ctx.wrap_socket(conn, server_side=True).close()
            except (ssl.SSLError, OSError):
                conn.close()

        thread = threading.Thread(target=serve_once, daemon=True)
        thread.start()
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            pytest.raises(ssl.SSLCertVerificationError),
        ):
            client_ctx.wrap_socket(raw, server_hostname="other.example.svc")
        thread.join(timeout=10)
