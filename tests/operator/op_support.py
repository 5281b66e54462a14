"""Helpers of the operator tests: example manifests and builders of the objects the tests
start from, golden files, render settings."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from kvpool.operator import api
from kvpool.operator.render import Settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE_GOLDEN = os.environ.get("KVPOOL_UPDATE_GOLDEN") == "1"

NAMESPACE = "inference"
"""The namespace the operator under test watches."""

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


def pool_body(
    name: str | None = None,
    source: str = "pool-minimal.yaml",
    namespace: str = NAMESPACE,
    **spec: Any,
) -> dict[str, Any]:
    """A KVCachePool manifest: the one of docs/examples/<source> (its own name unless
    `name`), in `namespace`, with `spec` keys replaced."""
    body = copy.deepcopy(example(source, api.POOL_KIND))
    body["metadata"]["namespace"] = namespace
    if name is not None:
        body["metadata"]["name"] = name
    body["spec"].update(spec)
    return body


def policy_body(name: str | None = None, namespace: str = NAMESPACE) -> dict[str, Any]:
    """The KVTierPolicy of docs/examples/policy.yaml (its own name unless `name`)."""
    body = copy.deepcopy(example("policy.yaml", api.POLICY_KIND))
    body["metadata"]["namespace"] = namespace
    if name is not None:
        body["metadata"]["name"] = name
    return body


def secret_body() -> dict[str, Any]:
    """The credentials Secret of docs/examples/pool.yaml's shared tier."""
    return copy.deepcopy(example("pool.yaml", "Secret"))


def pod_body(pool: str = "small", **spec: Any) -> dict[str, Any]:
    """The pod of docs/examples/pod.yaml as a ReplicaSet controller creates it (no
    metadata.namespace), asking for `pool` only (no tenant annotation), `spec` keys replaced."""
    pod = copy.deepcopy(example("pod.yaml", "Pod"))
    pod["metadata"].pop("namespace", None)
    pod["metadata"]["annotations"] = {api.POOL_ANNOTATION: pool}
    pod["spec"].update(spec)
    return pod


def condition(pool: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    """The pool's condition of `type_`, or {} when it has none (yet)."""
    for c in ((pool or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


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
