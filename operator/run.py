"""Running the operator: kopf embedded, with its metrics, liveness and webhook servers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .render import Settings


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: list[str] = field(default_factory=list)
    clusterwide: bool = False
    metrics_port: int = 8080
    liveness_port: int = 8081
    webhook_port: int = 9443
    webhook_cert_dir: Path | None = None
    settings: Settings = field(default_factory=Settings)
    resync_seconds: float = 300.0


def run_operator(options: OperatorOptions) -> None:
    raise NotImplementedError("the operator's handlers are being written")
