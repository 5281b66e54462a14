"""Generated docs stay in sync with the models."""

from __future__ import annotations

from op_support import ROOT

from kvpool.operator import metrics, status
from kvpool.operator.reference import render_reference


def test_crd_reference_is_generated_from_the_models() -> None:
    path = ROOT / "docs" / "crd-reference.md"
    assert path.read_text() == render_reference(), (
        "docs/crd-reference.md is stale: run "
        "`python -m kvpool.operator.reference docs/crd-reference.md`"
    )


def test_operator_doc_names_every_reason_and_metric() -> None:
    text = (ROOT / "docs" / "operator.md").read_text()
    reasons = [v for k, v in vars(status.Reason).items() if not k.startswith("_")]
    for reason in reasons:
        assert f"`{reason}`" in text, f"docs/operator.md does not explain reason {reason}"
    for name in (
        "kvpool_operator_reconciles_total",
        "kvpool_operator_reconcile_errors_total",
        "kvpool_operator_reconcile_duration_seconds",
    ):
        assert name in text
    for flag in (
        "--namespace",
        "--all-namespaces",
        "--metrics-port",
        "--liveness-port",
        "--webhook-port",
        "--webhook-cert-dir",
        "--agent-image",
        "--pod-monitor",
    ):
        assert flag in text, flag
    assert metrics.KINDS
