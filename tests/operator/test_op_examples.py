"""The example custom resources against the generated schemas, CEL rules included.

The API server defaults, validates the OpenAPI schema and evaluates the CEL
rules; `crd_admission.admit` does the same, so both valid examples and broken
variants are checked the way a cluster would check them.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from crd_admission import admit
from op_support import EXAMPLES, load_docs

from kvpool.operator import api, crds

EXAMPLE_FILES = ["pool.yaml", "pool-minimal.yaml", "policy.yaml"]


def _schema(kind: str) -> dict[str, Any]:
    return crds.pool_schema() if kind == api.POOL_KIND else crds.policy_schema()


def _custom_resources() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name in EXAMPLE_FILES:
        for doc in load_docs(EXAMPLES / name):
            if doc["kind"] in (api.POOL_KIND, api.POLICY_KIND):
                out.append((f"{name}:{doc['kind']}", doc))
    return out


@pytest.mark.parametrize(
    ("where", "doc"), _custom_resources(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_example_is_admitted_and_parses_to_the_same_spec(where: str, doc: dict) -> None:
    defaulted, errors = admit(_schema(doc["kind"]), doc)
    assert errors == [], where
    parse = api.parse_pool if doc["kind"] == api.POOL_KIND else api.parse_policy
    # The server's defaults and the models' defaults agree.
    assert parse(defaulted).spec == parse(doc).spec


def test_every_example_file_has_a_custom_resource() -> None:
    kinds = {w.split(":")[1] for w, _ in _custom_resources()}
    assert kinds == {api.POOL_KIND, api.POLICY_KIND}


def _resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": kind,
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": spec,
    }


def _pool(**spec: Any) -> dict[str, Any]:
    return _resource(api.POOL_KIND, spec)


def _policy(**spec: Any) -> dict[str, Any]:
    return _resource(api.POLICY_KIND, spec)


INVALID = [
    ("no tier", _pool(tiers={}), "at least one tier"),
    ("zero size", _pool(tiers={"dram": {"size": "0"}}), "greater than zero"),
    ("zero int size", _pool(tiers={"dram": {"size": 0}}), "greater than zero"),
    ("not a quantity", _pool(tiers={"dram": {"size": "lots"}}), "greater than zero"),
    ("nvme without size", _pool(tiers={"nvme": {"hostPath": "/mnt"}}), "'size' is a required"),
    ("bad url", _pool(tiers={"shared": {"url": "http://x"}}), "does not match"),
    (
        "credentials for file://",
        _pool(tiers={"shared": {"url": "file:///mnt/x", "credentialsSecret": "s"}}),
        "s3:// URLs only",
    ),
    (
        "bad reclaim policy",
        _pool(tiers={"shared": {"url": "s3://b", "reclaimPolicy": "Keep"}}),
        "is not one of",
    ),
    (
        "tiny port",
        _pool(tiers={"dram": {"size": "1Gi"}}, agent={"metricsPort": 80}),
        "less than the minimum",
    ),
    (
        "low above high",
        _policy(tiers={"dram": {"lowWatermark": 0.9, "highWatermark": 0.8}}),
        "lowWatermark must be below highWatermark",
    ),
    (
        "low above default high",
        _policy(tiers={"nvme": {"lowWatermark": 0.99}}),
        "lowWatermark must be below highWatermark",
    ),
    ("zero ttl", _policy(tiers={"dram": {"ttl": "0s"}}), "duration greater than zero"),
    ("bad ttl", _policy(tiers={"dram": {"ttl": "soon"}}), "duration greater than zero"),
    ("bad eviction", _policy(tiers={"dram": {"eviction": "random"}}), "is not one of"),
    ("bad pin", _policy(pins=["xyz"]), "does not match"),
    ("zero quota", _policy(tenants=[{"name": "a", "quota": {"dram": "0Gi"}}]), "greater than zero"),
]


@pytest.mark.parametrize(("what", "doc", "message"), INVALID, ids=[i[0] for i in INVALID])
def test_invalid_resource_is_rejected_by_schema_or_cel(what: str, doc: dict, message: str) -> None:
    _, errors = admit(_schema(doc["kind"]), doc)
    assert any(message in e for e in errors), errors
    # ... and the operator's models reject it too, so it never renders.
    parse = api.parse_pool if doc["kind"] == api.POOL_KIND else api.parse_policy
    with pytest.raises(api.InvalidSpec):
        parse(doc)


def test_cel_error_names_the_field() -> None:
    doc = _policy(tiers={"shared": {"lowWatermark": 0.99}})
    _, errors = admit(crds.policy_schema(), doc)
    assert errors == [".spec.tiers.shared.lowWatermark: lowWatermark must be below highWatermark"]


def test_minimal_policy_is_all_defaults() -> None:
    defaulted, errors = admit(crds.policy_schema(), _policy())
    assert errors == []
    assert api.parse_policy(defaulted).spec == api.parse_policy(_policy()).spec


def test_valid_sizes_in_every_notation() -> None:
    for size in ("512Mi", "8Gi", "10G", 1073741824, "1.5Gi"):
        doc = _pool(tiers={"dram": {"size": size}})
        assert admit(crds.pool_schema(), copy.deepcopy(doc))[1] == [], size
        api.parse_pool(doc)
