"""Fixtures for the shared tier: a real S3-compatible server (moto's) on 127.0.0.1,
a real directory standing for a shared mount, and one `Backend` handle per
store so the same contract tests run against both.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import xxhash
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from moto.server import ThreadedMotoServer
from werkzeug.serving import make_server

from kvpool.agent.config import SharedTier
from kvpool.agent.metrics import AgentMetrics
from kvpool.agent.tiers.base import ChunkRecord
from kvpool.agent.tiers.factory import open_shared_tier
from kvpool.agent.tiers.shared import SharedChunkTier, object_name
from kvpool.bench.local import free_port

REGION = "us-east-1"
_bucket_ids = itertools.count()


def start_moto(port: int) -> ThreadedMotoServer:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def s3_client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name=REGION)


def make_chunk(seed: int, size: int = 4096, tenant: str = "acme") -> ChunkRecord:
    """A chunk with a valid checksum, distinct bytes per seed."""
    key = xxhash.xxh3_128_digest(f"key-{seed}".encode())
    data = (seed.to_bytes(4, "little") * (size // 4 + 1))[:size]
    meta = b'{"shape":[2,4]}'
    h = xxhash.xxh3_64()
    h.update(meta)
    h.update(data)
    return ChunkRecord(key, data, h.intdigest(), meta, tenant, fingerprint_id=0xF1F2)


def counter(metrics: AgentMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"pool": metrics.pool, **labels})
    return value or 0.0


class RestartableMoto:
    """A moto server on a fixed port that a test can stop (a real outage: the
    socket closes, connections are refused) and start again; moto keeps its
    state in-process, so the buckets survive the restart like a real store's."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: ThreadedMotoServer | None = None
        self.start()

    def start(self) -> None:
        assert self._server is None
        self._server = start_moto(self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class StallingMoto:
    """moto's S3 app in a server of the test's own whose requests of one method (DELETE
    unless `hold` names another) wait while the test holds them (`hold`, `free`): a store
    that stalls on deletes, or on lookups (HEAD), so the agent's threads that make them stay
    busy for as long as the test needs."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._method = "DELETE"
        self.held = 0
        """Requests waiting now."""
        app = DomainDispatcherApplication(create_backend_app)

        def stalling(environ: dict[str, Any], start_response: Any) -> Any:
            if environ["REQUEST_METHOD"] == self._method and not self._open.is_set():
                with self._lock:
                    self.held += 1
                self._open.wait(60)  # a bound, should the test fail while holding
                with self._lock:
                    self.held -= 1
            return app(environ, start_response)

        self._server = make_server(host, 0, stalling, threaded=True,
                                   request_handler=MotoRequestHandler)
        self.endpoint = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def hold(self, method: str = "DELETE") -> None:
        self._method = method
        self._open.clear()

    def free(self) -> None:
        self._open.set()

    def stop(self) -> None:
        self.free()
        self._server.shutdown()
        self._thread.join()


@pytest.fixture
def stalling_moto() -> Iterator[StallingMoto]:
    server = StallingMoto()
    yield server
    server.stop()


@pytest.fixture
def own_moto() -> Iterator[RestartableMoto]:
    server = RestartableMoto()
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def aws_env() -> Iterator[None]:
    """Dummy credentials, and nothing read from the machine's own AWS files."""
    mp = pytest.MonkeyPatch()
    for var in list(os.environ):
        if var.startswith("AWS_"):
            mp.delenv(var)
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    mp.setenv("AWS_DEFAULT_REGION", REGION)
    mp.setenv("AWS_CONFIG_FILE", os.devnull)
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    yield
    mp.undo()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    server = start_moto(free_port())
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    name = f"kvpool-test-{os.getpid()}-{next(_bucket_ids)}"
    s3_client(moto_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def metrics() -> AgentMetrics:
    return AgentMetrics("test")


class Backend:
    """One shared store as the tests see it: open tiers on it, and reach behind their back."""

    def __init__(self, kind: str, url: str, endpoint: str | None, metrics: AgentMetrics) -> None:
        self.kind, self.url, self.endpoint, self.metrics = kind, url, endpoint, metrics
        self._opened: list[SharedChunkTier] = []

    def config(self, **overrides: Any) -> SharedTier:
        fields: dict[str, Any] = {"url": self.url, "endpoint_url": self.endpoint,
                                  "request_timeout": 5.0, "lookup_budget": 2.0}
        fields.update(overrides)
        return SharedTier(**fields)

    def open(self, metrics: AgentMetrics | None = None, **overrides: Any) -> SharedChunkTier:
        tier = open_shared_tier(self.config(**overrides), metrics or self.metrics)
        self._opened.append(tier)
        return tier

    # -- behind the tier's back

    def _s3(self) -> tuple[Any, str, str]:
        bucket, _, prefix = self.url[5:].partition("/")
        return s3_client(str(self.endpoint)), bucket, f"{prefix}/" if prefix else ""

    def _path(self, name: str) -> Path:
        return Path(self.url[7:]) / name[:2] / name

    def raw_put(self, key: bytes, blob: bytes) -> None:
        if self.kind == "s3":
            client, bucket, prefix = self._s3()
            client.put_object(Bucket=bucket, Key=prefix + object_name(key), Body=blob)
        else:
            path = self._path(object_name(key))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)

    def raw_get(self, key: bytes) -> bytes | None:
        if self.kind == "s3":
            client, bucket, prefix = self._s3()
            try:
                body: bytes = client.get_object(Bucket=bucket,
                                                Key=prefix + object_name(key))["Body"].read()
            except client.exceptions.NoSuchKey:
                return None
            return body
        path = self._path(object_name(key))
        return path.read_bytes() if path.exists() else None

    def raw_put_foreign(self, name: str) -> None:
        """An object that is not kvpool's, under the same prefix."""
        if self.kind == "s3":
            client, bucket, prefix = self._s3()
            client.put_object(Bucket=bucket, Key=prefix + name, Body=b"not a chunk")
        else:
            (Path(self.url[7:]) / name).write_bytes(b"not a chunk")

    def close(self) -> None:
        for tier in self._opened:
            tier.close()


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path,
            metrics: AgentMetrics) -> Iterator[Backend]:
    if request.param == "s3":
        endpoint: str = request.getfixturevalue("moto_endpoint")
        bucket: str = request.getfixturevalue("bucket")
        b = Backend("s3", f"s3://{bucket}/pools/ns.pool", endpoint, metrics)
    else:
        b = Backend("file", f"file://{tmp_path / 'shared'}", None, metrics)
    yield b
    b.close()


Factory = Callable[..., SharedChunkTier]
