"""The dashboard and alert rules: generated, committed, well-formed and unit-tested."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool.operator import alerts, dashboard

from .conftest import CHART, REPO

RULES_FILE = CHART / "files" / "kvpool-rules.yaml"
DASHBOARD_FILE = CHART / "files" / "kvpool-dashboard.json"
ALERT_TESTS = Path(__file__).with_name("alerts-test.yaml")
RUNBOOK = REPO / "docs" / "runbook.md"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool (Debian package prometheus) is not installed"
)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


# ----------------------------------------------------------------------------- drift


def test_committed_rule_file_is_the_generated_one() -> None:
    assert RULES_FILE.read_text() == alerts.render(), (
        "regenerate: python -m kvpool.operator.alerts charts/kvpool/files/kvpool-rules.yaml"
    )


def test_committed_dashboard_is_the_generated_one() -> None:
    assert DASHBOARD_FILE.read_text() == dashboard.render(), (
        "regenerate: python -m kvpool.operator.dashboard charts/kvpool/files/kvpool-dashboard.json"
    )


def test_generators_write_the_file_they_are_given(tmp_path: Path) -> None:
    for module, name in ((alerts, "rules.yaml"), (dashboard, "dashboard.json")):
        target = tmp_path / name
        assert module.main([str(target)]) == 0
        assert target.read_text() == module.render()


# ----------------------------------------------------------------------------- alerts


def _alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


EXPECTED_ALERTS = {
    "KVPoolAgentDown",
    "KVPoolTierUnhealthy",
    "KVPoolSharedTierUnreachable",
    "KVPoolDRAMNotLocked",
    "KVPoolIntegrityFailures",
    "KVPoolEvictionThrash",
    "KVPoolWriteBehindDrops",
    "KVPoolEventsDropped",
    "KVPoolPeerUnreachable",
    "KVPoolPeerCertificateExpiring",
    "KVPoolPeerBadChecksums",
    "KVPoolPeerReadsTimingOut",
    "KVPoolHandoffFailing",
    "KVPoolPeerDeletesDropped",
    "KVPoolPeerDirectoryFull",
    "KVPoolHitRatioCollapse",
    "KVPoolOperatorReconcileErrors",
}


def test_the_rule_file_has_every_alert_of_the_design() -> None:
    assert {r["alert"] for r in _alert_rules()} == EXPECTED_ALERTS


def test_every_alert_has_for_severity_summary_description_and_runbook() -> None:
    for rule in _alert_rules():
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, rule["alert"]
        assert annotations["summary"].endswith("."), rule["alert"]
        assert len(annotations["description"]) > 40, rule["alert"]
        assert annotations["runbook_url"] == (f"{alerts.RUNBOOK_BASE_URL}#{rule['alert'].lower()}")


def _github_anchors(markdown: str) -> set[str]:
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_every_runbook_url_points_at_a_section_of_docs_runbook() -> None:
    anchors = _github_anchors(RUNBOOK.read_text())
    for rule in _alert_rules():
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in anchors, f"docs/runbook.md has no section for {rule['alert']}"


@needs_promtool
def test_promtool_accepts_the_rule_file() -> None:
    result = _promtool("check", "rules", str(RULES_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    rules = sum(len(g["rules"]) for g in yaml.safe_load(RULES_FILE.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in result.stdout


def _unit_tests() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    return tests


def test_every_alert_has_a_unit_test_where_it_fires_and_one_where_it_is_silent() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for test in _unit_tests():
        for case in test["alert_rule_test"]:
            (firing if case["exp_alerts"] else silent).add(case["alertname"])
    assert firing == EXPECTED_ALERTS
    assert silent == EXPECTED_ALERTS


def test_unit_tests_also_feed_series_that_must_not_fire() -> None:
    """Each test has more input series than alerts it expects: the others stay silent."""
    for test in _unit_tests():
        fired = max(len(c["exp_alerts"]) for c in test["alert_rule_test"])
        assert len(test["input_series"]) > fired, test["name"]


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    result = _promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_unit_tests_fail_when_an_alert_is_broken(tmp_path: Path) -> None:
    """The unit tests are not vacuous: an alert that never fires makes them fail."""
    broken = RULES_FILE.read_text().replace('up{job="kvpool-agent"} == 0', "up == 42")
    assert broken != RULES_FILE.read_text()
    rules = tmp_path / "rules.yaml"
    rules.write_text(broken)
    spec = yaml.safe_load(ALERT_TESTS.read_text())
    spec["rule_files"] = [str(rules)]
    test_file = tmp_path / "alerts-test.yaml"
    test_file.write_text(yaml.safe_dump(spec))
    result = _promtool("test", "rules", str(test_file))
    assert result.returncode != 0
    assert "KVPoolAgentDown" in result.stdout + result.stderr


# ----------------------------------------------------------------------------- dashboard


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text())
    return loaded


def _graph_panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_has_the_template_variables_of_the_design() -> None:
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "pool", "node"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "pool", "node"):
        assert variables[name]["type"] == "query"
        assert variables[name]["multi"] and variables[name]["includeAll"]
        assert variables[name]["definition"].startswith("label_values(")
        assert variables[name]["definition"].endswith(f", {name})")


def test_dashboard_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = _dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        xs = range(g["x"], g["x"] + g["w"])
        mine = {(x, y) for x in xs for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine


def test_every_panel_queries_prometheus_through_the_datasource_variable() -> None:
    for panel in _graph_panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert target["expr"] and target["legendFormat"]


def test_every_agent_panel_filters_by_namespace_pool_and_node() -> None:
    for panel in _graph_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            if "kvpool_operator_" in expr:
                continue
            for var in ("$namespace", "$node"):
                assert var in expr, f"{panel['title']}: {expr}"
            assert "$pool" in expr, f"{panel['title']}: {expr}"


def test_counters_are_read_with_rate_over_the_rate_interval() -> None:
    for panel in _graph_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            windows = re.findall(r"\[([^\]]+)\]", expr)
            if re.search(r"_total\b|_bucket\b", expr):
                assert windows, f"{panel['title']} reads a counter without a range: {expr}"
            for window in windows:
                # last_over_time(...[1h]) only finds a down agent's pool; all else is rates.
                assert window == "$__rate_interval" or "last_over_time" in expr, expr
            for counter in re.findall(r"(kvpool_\w+_total|kvpool_\w+_bucket)", expr):
                assert re.search(rf"(rate|increase)\({counter}\b", expr), expr


EXPECTED_PANELS = {
    "Tier used vs capacity",
    "Block hit ratio (overall)",
    "Block hit ratio per tier (share of looked-up keys)",
    "Tier hit ratio (of keys reaching the tier)",
    "Hits and misses per tier",
    "Bytes per second in and out per tier",
    "Op latency p50 / p99",
    "Evictions by reason",
    "Demotions, promotions and prefetches",
    "TTL expiries",
    "Shared tier health per node",
    "Write-behind queue depth and dropped writes",
    "Integrity failures",
    "Clients and leases",
    "DRAM locked bytes",
    "Agent up per node",
    "Operator reconcile errors",
    "Tokens served from the pool",
    "Token hit ratio",
    "KV events per second",
    "KV events dropped",
    "Peer directory",
    "Peer directory use",
    "Peer directory full",
    "Peer certificate expires in",
}


def test_dashboard_has_every_panel_of_the_design() -> None:
    titles = {p["title"] for p in _graph_panels()}
    assert titles >= EXPECTED_PANELS


def test_dashboard_reads_only_documented_metrics() -> None:
    metrics_doc = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(kvpool_[a-z_]+)`", metrics_doc))
    documented |= {
        "kvpool_operator_reconciles_total",
        "kvpool_operator_reconcile_errors_total",
        "kvpool_operator_reconcile_duration_seconds",
    }
    used = set()
    for panel in _graph_panels():
        for target in panel["targets"]:
            used |= set(re.findall(r"\b(kvpool_[a-z_]+)", target["expr"]))
    for rule in _alert_rules():
        used |= set(re.findall(r"\b(kvpool_[a-z_]+)", rule["expr"]))
    base = {re.sub(r"_bucket$", "", m) for m in used}
    assert base <= documented, base - documented
