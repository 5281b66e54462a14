"""The chart's default image is the one `scripts/build-image` builds: the package version.

Runs in the plain suite (no image needed): a release that bumps pyproject.toml's version
without the chart's appVersion would make `helm install` pull an image no one built.
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import helm_python
import yaml

from kvpool.operator import render
from tests.chart.conftest import CHART, NAMESPACE, RELEASE, Rendered

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_chart_app_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == VERSION
    assert values["image"]["tag"] in ("", VERSION)


def test_chart_operator_and_build_script_default_to_one_image() -> None:
    built = subprocess.run([str(REPO / "scripts" / "build-image"), "--print-ref"], check=True,
                           capture_output=True, text=True).stdout.strip()
    with helm_python.Chart.load(str(CHART)) as chart:
        rendered = Rendered(chart.render({}, name=RELEASE, namespace=NAMESPACE, is_install=True))
    operator = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert built == f"ghcr.io/kvpool/kvpool:{VERSION}"
    assert operator["image"] == built
    assert f"--agent-image={built}" in operator["args"]
    # The operator's own default, for pools it renders without the chart's flag.
    assert render.default_agent_image() == built
