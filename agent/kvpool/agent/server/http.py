"""The agent's HTTP endpoint: `/metrics`, `/healthz`, `/readyz`.

Served by the agent's event loop itself (`asyncio.start_server`): HTTP/1.1, persistent
connections (a probe or a scraper keeps one open: an agent out of descriptors still
answers it), GET and HEAD of three paths; anything else is answered 404 or 405, a request
that is not HTTP 400, then closed. The metrics are collected on the loop, as every other
reader of the agent's state is. (aiohttp served it before: importing it was about a
fifth of every agent start's CPU, for three fixed answers.)

A client cannot hold more than a request's head in the agent (`MAX_HEAD`) nor keep a
connection idle past `IDLE_TIMEOUT`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

MAX_HEAD = 16 * 1024
"""Bytes of a request's line and headers at most."""
IDLE_TIMEOUT = 120.0
"""Seconds a connection may take to send a request's head (idle between requests included):
longer than a scrape interval (the chart's is 30 s), so that a scraper's kept connection is
not closed just as it sends its next request."""
TEXT = "text/plain; charset=utf-8"


class HttpEndpoint:
    """The listening server and its open connections, until `close`."""

    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool]) -> None:
        self.registry, self.ready = registry, ready
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    @property
    def addresses(self) -> list[tuple[object, ...]]:
        """The addresses it listens on (host, port...), as the sockets say."""
        return [] if self.server is None else [s.getsockname() for s in self.server.sockets]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self.writers):  # (kept open by their clients, idle)
            writer.close()
        if self.server is not None:
            await self.server.wait_closed()

    def answer(self, method: bytes, target: bytes) -> tuple[HTTPStatus, str, bytes]:
        """(status, content type, body) of a request."""
        path = target.partition(b"?")[0]
        if path not in (b"/metrics", b"/healthz", b"/readyz"):
            return HTTPStatus.NOT_FOUND, TEXT, b"not found: /metrics, /healthz, /readyz\n"
        if method not in (b"GET", b"HEAD"):
            return HTTPStatus.METHOD_NOT_ALLOWED, TEXT, b"GET or HEAD\n"
        if path == b"/metrics":  # (collected for a HEAD too: its Content-Length)
            return HTTPStatus.OK, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == b"/healthz":
            return HTTPStatus.OK, TEXT, b"ok\n"
        if self.ready():
            return HTTPStatus.OK, TEXT, b"ready\n"
        return HTTPStatus.SERVICE_UNAVAILABLE, TEXT, b"not ready\n"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_TIMEOUT)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                        ConnectionError):
                    return  # closed, idle too long, or a head past MAX_HEAD
                lines = head[:-4].split(b"\r\n")
                request = lines[0].split()
                headers = dict(_header(line) for line in lines[1:])
                if (len(request) != 3 or not request[2].startswith(b"HTTP/1.")
                        or headers.get(b"content-length", b"0") != b"0"
                        or b"transfer-encoding" in headers):
                    # Not a request of this endpoint's (none has a body): said, then closed.
                    writer.write(_response(HTTPStatus.BAD_REQUEST, TEXT, b"bad request\n",
                                           head=False, keep=False))
                    await writer.drain()
                    return
                method, target, version = request
                connection = headers.get(b"connection", b"").lower()
                keep = (connection == b"keep-alive" if version == b"HTTP/1.0"
                        else connection != b"close")
                status, kind, body = self.answer(method, target)
                writer.write(_response(status, kind, body, head=method == b"HEAD", keep=keep))
                await writer.drain()
                if not keep:
                    return
        except ConnectionError:
            return
        finally:
            self.writers.discard(writer)
            writer.close()


def _header(line: bytes) -> tuple[bytes, bytes]:
    name, _, value = line.partition(b":")
    return name.strip().lower(), value.strip()


def _response(status: HTTPStatus, kind: str, body: bytes, *, head: bool, keep: bool) -> bytes:
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Type: {kind}",
             f"Content-Length: {len(body)}"]
    if status is HTTPStatus.METHOD_NOT_ALLOWED:
        lines.append("Allow: GET, HEAD")
    if not keep:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head else body)


async def serve_http(addr: str, registry: CollectorRegistry,
                     ready: Callable[[], bool]) -> HttpEndpoint:
    """Start serving on `addr` (host:port; an IPv6 host in brackets); `close()` stops it.
    An address in use raises OSError (EADDRINUSE), as binding does."""
    endpoint = HttpEndpoint(registry, ready)
    host, _, port = addr.rpartition(":")
    endpoint.server = await asyncio.start_server(
        endpoint.serve, host.strip("[]") or None, int(port), limit=MAX_HEAD)
    return endpoint
