"""Shared set-up of the chart tests: the chart, rendered through the real Helm engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpool"
RELEASE = "kvpool"
NAMESPACE = "kvpool"

ALL_TOGGLES_ON: dict[str, Any] = {
    "podMonitor": {"enabled": True},
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
    "examples": {"enabled": True},
    "webhook": {"enabled": True},
    "metricsService": {"enabled": True},
    "rbac": {"create": True},
    "serviceAccount": {"create": True},
    "operator": {"podDisruptionBudget": {"enabled": True}},
}
"""Every optional part of the chart switched on."""


class Rendered:
    """One render of the chart: template path -> text, and the parsed objects."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.objects: list[dict[str, Any]] = []
        for path, text in sorted(files.items()):
            if not path.endswith((".yaml", ".yml")):
                continue
            for doc in yaml.safe_load_all(text):
                if doc is not None:
                    self.objects.append(doc)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, found {len(found)}"
        return found[0]

    @property
    def notes(self) -> str:
        return next(t for p, t in self.files.items() if p.endswith("NOTES.txt"))


@pytest.fixture(scope="session")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(str(CHART)) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart: helm_python.Chart) -> Any:
    def _render(values: dict[str, Any] | None = None, namespace: str = NAMESPACE) -> Rendered:
        files = chart.render(values or {}, name=RELEASE, namespace=namespace, is_install=True)
        return Rendered(files)

    return _render


@pytest.fixture(scope="session")
def defaults(render: Any) -> Rendered:
    result: Rendered = render()
    return result


@pytest.fixture(scope="session")
def everything(render: Any) -> Rendered:
    result: Rendered = render(ALL_TOGGLES_ON)
    return result
