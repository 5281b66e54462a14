"""The operator's own Prometheus metrics (served on `--metrics-port` at `/metrics`).

Every labelled series is created at start with value 0, so an alert on
reconcile errors has a series to evaluate before the first error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from . import api
from .status import PROBLEM_REASONS

REGISTRY = CollectorRegistry(auto_describe=True)

KINDS = (api.POOL_KIND, api.POLICY_KIND)
RESULTS = ("success", "error")

RECONCILES = Counter(
    "kvpool_operator_reconciles",
    "Reconciles of kvpool resources, by kind and result (success or error).",
    ["kind", "result"],
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "kvpool_operator_reconcile_errors",
    "Reconciles that failed, by kind and reason (the pool's Degraded reason).",
    ["kind", "reason"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "kvpool_operator_reconcile_duration_seconds",
    "Time one reconcile took, API calls included.",
    ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)


def init() -> None:
    """Create every series with value 0."""
    for kind in KINDS:
        for result in RESULTS:
            RECONCILES.labels(kind=kind, result=result)
        for reason in PROBLEM_REASONS:
            RECONCILE_ERRORS.labels(kind=kind, reason=reason)
        RECONCILE_DURATION.labels(kind=kind)


init()


@contextmanager
def timed(kind: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        RECONCILE_DURATION.labels(kind=kind).observe(time.perf_counter() - start)


def succeeded(kind: str) -> None:
    RECONCILES.labels(kind=kind, result="success").inc()


def failed(kind: str, reason: str) -> None:
    RECONCILES.labels(kind=kind, result="error").inc()
    RECONCILE_ERRORS.labels(kind=kind, reason=reason).inc()


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics in a background thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)
