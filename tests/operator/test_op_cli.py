"""`kvpool crds` and `kvpool render`, as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import kubernetes_validate
import yaml
from op_support import EXAMPLES
from typer.testing import CliRunner

from kvpool.operator import crds
from kvpool.operator.cli import app

runner = CliRunner()


def test_crds_prints_every_crd() -> None:
    result = runner.invoke(app, ["crds"], prog_name="kvpool")
    assert result.exit_code == 0, result.output
    assert list(yaml.safe_load_all(result.stdout)) == crds.crds()


def test_crds_output_dir_writes_one_file_per_crd(tmp_path) -> None:
    result = runner.invoke(app, ["crds", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kvcachepools.kvpool.io.yaml",
        "kvtierpolicies.kvpool.io.yaml",
    ]


def test_render_examples_as_a_new_user_prints_valid_manifests() -> None:
    """`kvpool render -f docs/examples/pool.yaml -f docs/examples/policy.yaml`, for real."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpool.operator.cli",
            "render",
            "-f",
            str(EXAMPLES / "pool.yaml"),
            "-f",
            str(EXAMPLES / "policy.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "Secret",  # the example runs the peer tier: its Secret (the value made by the operator),
        "NetworkPolicy",  # the policy guarding the peer port,
        "DaemonSet",
        "Service",
        "Service",  # the example turns KV events on: their headless Service
        "Service",  # and the peers' headless Service
    ]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    # The example file also holds the Secret: it is named on stderr, not rendered.
    assert "ignoring Secret kvpool-s3" in proc.stderr


def test_kvpool_command_forwards_to_the_operator_commands() -> None:
    """`kvpool render` and `kvpool crds`, through the one `kvpool` command line."""
    render = subprocess.run(
        [sys.executable, "-m", "kvpool.agent", "render", "-f", str(EXAMPLES / "pool-minimal.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert render.returncode == 0, render.stderr
    assert [d["kind"] for d in yaml.safe_load_all(render.stdout)][-2:] == ["DaemonSet", "Service"]
    listed = subprocess.run(
        [sys.executable, "-m", "kvpool.agent", "crds"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert list(yaml.safe_load_all(listed.stdout)) == crds.crds()


def test_render_minimal_pool_alone() -> None:
    result = runner.invoke(app, ["render", "-f", str(EXAMPLES / "pool-minimal.yaml")])
    assert result.exit_code == 0, result.output
    assert "kind: DaemonSet" in result.stdout


def test_render_without_the_referenced_policy_says_which() -> None:
    result = runner.invoke(app, ["render", "-f", str(EXAMPLES / "pool.yaml")])
    assert result.exit_code == 2
    assert "KVTierPolicy 'llama-70b'" in result.stderr


def test_render_of_an_invalid_pool_names_the_field_and_prints_nothing(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: kvpool.io/v1alpha1\nkind: KVCachePool\nmetadata: {name: p}\n"
        "spec: {tiers: {dram: {size: 0}}}\n"
    )
    result = runner.invoke(app, ["render", "-f", str(bad)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "spec.tiers.dram.size" in result.stderr


def test_operator_refuses_to_start_without_namespaces() -> None:
    result = runner.invoke(app, ["operator", "--webhook-port", "0"])
    assert result.exit_code == 2
    assert "--all-namespaces" in result.stderr
