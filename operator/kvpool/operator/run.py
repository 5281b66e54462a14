"""Running the operator: kopf embedded, with its metrics, liveness and webhook servers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf

from . import metrics
from .handlers import FINALIZER, Context, build_registry
from .kube import Kube
from .render import Settings
from .webhook import with_request_namespace


@dataclass(frozen=True)
class OperatorOptions:
    """Everything `kvpool operator` takes from its flags and environment."""

    namespaces: list[str] = field(default_factory=list)
    clusterwide: bool = False
    metrics_port: int = 8080
    liveness_port: int = 8081
    webhook_port: int = 9443
    webhook_cert_dir: Path | None = None
    webhook_insecure: bool = False
    """Serve the webhook over plain HTTP (tests only)."""
    webhook_addr: str = "0.0.0.0"
    settings: Settings = field(default_factory=Settings)
    resync_seconds: float = 300.0
    retry_delay: float = 30.0
    retry_max: float = 300.0
    gc_poll: float = 10.0


class NamespacedWebhookServer(kopf.WebhookServer):
    """kopf's webhook server, giving each admitted object the admission request's namespace
    when its metadata has none (as for most controllers' pods): kopf passes handlers the
    object only, not the request."""

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def with_namespace(request: Any, **kwargs: Any) -> Any:
            with_request_namespace(request)
            return await fn(request, **kwargs)

        async for config in super().__call__(with_namespace):
            yield config


NAMESPACE_PATTERN_CHARS = frozenset("*?[!,")
"""What makes a --namespace value a kopf pattern (globs, `!` negations, `,` lists), not a
name (kopf's own test, plus `[`, which its glob matching understands too)."""


def has_patterns(namespaces: list[str]) -> bool:
    return any(NAMESPACE_PATTERN_CHARS & set(ns) for ns in namespaces)


def make_settings(options: OperatorOptions) -> kopf.OperatorSettings:
    """kopf settings: our finalizer and annotation keys, a webhook server, no peering."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvpool.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvpool.io", key="last-handled-configuration"
    )
    settings.peering.standalone = True
    # Scanning is kopf's watch of namespaces and CRDs. Without it kopf serves exact
    # namespace names only and silently ignores a glob (it never lists namespaces to
    # expand it); so it is on exactly when --namespace carries a pattern (the chart then
    # grants list/watch on namespaces and CRDs), and off otherwise, which needs neither.
    settings.scanning.disabled = options.clusterwide or not has_patterns(options.namespaces)
    settings.admission.managed = None  # the chart owns the MutatingWebhookConfiguration
    # Handler warnings and errors (a missing Secret, an API error, a gc Job that runs) also
    # become Events on the pool, for `kubectl describe`; successes stay in the log only.
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    if options.webhook_port:
        if options.webhook_insecure:
            settings.admission.server = NamespacedWebhookServer(
                addr=options.webhook_addr, port=options.webhook_port, insecure=True
            )
        else:
            if options.webhook_cert_dir is None:
                raise ValueError("the webhook needs a certificate directory")
            settings.admission.server = NamespacedWebhookServer(
                addr=options.webhook_addr,
                port=options.webhook_port,
                certfile=str(options.webhook_cert_dir / "tls.crt"),
                pkeyfile=str(options.webhook_cert_dir / "tls.key"),
            )
    return settings


def make_context(
    options: OperatorOptions, kube: Kube, connection: kopf.ConnectionInfo | None = None
) -> Context:
    return Context(
        kube=kube,
        settings=options.settings,
        retry_delay=options.retry_delay,
        retry_max=options.retry_max,
        gc_poll=options.gc_poll,
        connection=connection,
    )


async def operate(
    options: OperatorOptions,
    kube: Kube,
    *,
    connection: kopf.ConnectionInfo | None = None,
    ready_flag: asyncio.Event | None = None,
    stop_flag: asyncio.Event | None = None,
) -> None:
    """Run kopf with the kvpool handlers until `stop_flag` is set (or forever)."""
    metrics.init()
    registry = build_registry(
        resync_seconds=options.resync_seconds, webhook=bool(options.webhook_port)
    )
    liveness = f"http://0.0.0.0:{options.liveness_port}/healthz" if options.liveness_port else None
    await kopf.operator(
        registry=registry,
        settings=make_settings(options),
        standalone=True,
        clusterwide=options.clusterwide,
        namespaces=options.namespaces,
        liveness_endpoint=liveness,
        memo=kopf.Memo(kvpool=make_context(options, kube, connection)),
        ready_flag=ready_flag,
        stop_flag=stop_flag,
    )


def run_operator(options: OperatorOptions) -> None:
    """`kvpool operator`: serve metrics, then run kopf until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if options.metrics_port:
        metrics.serve(options.metrics_port)
    asyncio.run(operate(options, Kube.from_environment()))
