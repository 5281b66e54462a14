"""Helpers of the operator tests: example manifests, golden files, render settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from kvpool.operator.render import Settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE_GOLDEN = os.environ.get("KVPOOL_UPDATE_GOLDEN") == "1"

GOLDEN_SETTINGS = Settings(
    agent_image="ghcr.io/kvpool/kvpool:golden", version="golden", pod_monitor=True
)
"""Render settings of the golden files: fixed image and version, so a release changes nothing."""


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def example(name: str, kind: str) -> dict[str, Any]:
    """The first object of `kind` in docs/examples/<name>."""
    for doc in load_docs(EXAMPLES / name):
        if doc.get("kind") == kind:
            return doc
    raise LookupError(f"no {kind} in {name}")


def check_golden(name: str, text: str) -> None:
    """Compare with tests/operator/golden/<name>; KVPOOL_UPDATE_GOLDEN=1 rewrites it."""
    path = GOLDEN / name
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with KVPOOL_UPDATE_GOLDEN=1"
    assert text == path.read_text(), (
        f"render differs from {path.name}; if intended, rerun with KVPOOL_UPDATE_GOLDEN=1 "
        "and review the diff"
    )
