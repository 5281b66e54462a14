"""The CRDs: generated from the models, valid Kubernetes objects, committed copies in sync."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from op_support import ROOT

from kvpool.operator import crds


@pytest.mark.parametrize("crd", crds.crds(), ids=lambda c: c["metadata"]["name"])
def test_crd_is_a_valid_kubernetes_object(crd: dict) -> None:
    kubernetes_validate.validate(crd, "1.33.0", strict=True)


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("crd", crds.crds(), ids=lambda c: c["metadata"]["name"])
def test_crd_schema_is_structural_and_documented(crd: dict) -> None:
    version = crd["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert "$ref" not in node and "anyOf" not in node and "oneOf" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        in_spec = path.startswith(".spec.")
        if in_spec and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description"
    assert version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[-1] == "Age"


def test_pool_crd_carries_the_cross_field_rules() -> None:
    spec = crds.pool_schema()["properties"]["spec"]
    tiers = spec["properties"]["tiers"]
    assert "at least one tier" in tiers["x-kubernetes-validations"][0]["message"]
    size = tiers["properties"]["dram"]["properties"]["size"]
    assert size["x-kubernetes-validations"][0]["rule"] == crds.SIZE_RULE
    policy = crds.policy_schema()["properties"]["spec"]
    dram_rules = policy["properties"]["tiers"]["properties"]["dram"]
    assert dram_rules["x-kubernetes-validations"][0]["rule"] == (
        "self.lowWatermark < self.highWatermark"
    )


def test_shared_tier_rules_default_like_the_agent() -> None:
    """The CRD's default for shared-tier rules is the agent's (drop on evict, write-through)."""
    policy = crds.policy_schema()["properties"]["spec"]
    default = policy["properties"]["tiers"]["properties"]["shared"]["default"]
    assert default["onEvict"] == "drop" and default["writeThrough"] is True


@pytest.mark.parametrize("directory", ["crds", "charts/kvpool/crds"])
def test_committed_crds_equal_the_generated_ones(directory: str) -> None:
    folder = ROOT / directory
    for crd in crds.crds():
        path: Path = folder / crds.crd_filename(crd)
        assert path.exists(), f"{path} missing: run `kvpool crds -o {directory}`"
        assert yaml.safe_load(path.read_text()) == crd, (
            f"{path} is stale: run `kvpool crds -o {directory}`"
        )
        assert path.read_text() == crds.to_yaml(crd)
    generated = {crds.crd_filename(c) for c in crds.crds()}
    assert {p.name for p in folder.glob("*.yaml")} == generated


def test_crds_yaml_is_every_crd_as_one_stream() -> None:
    docs = list(yaml.safe_load_all(crds.crds_yaml()))
    assert docs == crds.crds()
