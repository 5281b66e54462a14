"""The agent's HTTP endpoint: `/metrics`, `/healthz`, `/readyz`."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


async def serve_http(addr: str, registry: CollectorRegistry,
                     ready: Callable[[], bool]) -> web.AppRunner:
    """Start serving on `addr` (host:port); the runner's cleanup() stops it."""
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = addr.rpartition(":")
    await web.TCPSite(runner, host.strip("[]"), int(port)).start()
    return runner
