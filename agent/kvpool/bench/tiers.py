"""G3 and G4 parts of `kvpool bench`: the tiers against the plain baseline.

G3 times the agent's NVMe tier code (`NvmeTier.write`: header, temp file,
rename; `NvmeTier.read`: whole blob, decode and checksum check) in this
process, against a raw `open/write/close` and `open/read` of the same bytes
in the same directory (a temp dir on the root filesystem, through the page
cache: no O_DIRECT, no fsync on either side). The rebuild figure is
`NvmeTier(root)` construction (it scans and indexes every chunk file's
header) over 10^5 chunk files, warm page cache.

G4 runs against a moto server (a local S3-compatible server on 127.0.0.1,
started here and stopped after) and times, through real agents on one bucket:

- put: `KVPoolClient.put` into an agent started with a shared tier, until its
  write-behind queue reports the upload written (`stats()` polled every ms);
- get: `KVPoolClient.get_into` through a second agent that has never held the
  key: a shared-tier read, checksum check and promotion into its DRAM, then
  the client's copy out of the arena;

against plain boto3 `put_object` / `get_object` of the same bytes on the same
server. Beside them, `tier_*`: the shared tier class (`open_shared_tier`) in
this process, with no agent, to tell the tier's cost from the agent's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kvpool.agent.client import KVPoolClient
from kvpool.agent.config import SharedTier
from kvpool.agent.protocol import checksum
from kvpool.agent.tiers.base import ChunkRecord
from kvpool.agent.tiers.factory import open_shared_tier
from kvpool.agent.tiers.nvme import NvmeTier

from .data_path import bench_key, payload, prefaulted
from .local import LocalAgent, free_port
from .stats import child_server, throughput, timed

BUCKET = "kvpool-bench"


def _raw_write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
    finally:
        os.close(fd)


def _raw_read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def run_g3(nbytes: int, reps: int, rebuild_files: int) -> dict[str, Any]:
    """The `g3` section and the G3 rebuild time for the `scale` section."""
    data = payload(nbytes)
    digest = checksum(data)
    root = Path(tempfile.mkdtemp(prefix="kvpool-bench-g3-"))
    try:
        tier = NvmeTier(root / "tier", capacity=1 << 40)
        raw = root / "raw"
        raw.mkdir()
        recs = [ChunkRecord(bench_key(i), data, digest) for i in range(reps + 2)]
        def read(i: int) -> None:
            got = tier.read(recs[i].key)
            if got is None or got.size != nbytes:
                raise RuntimeError("G3 bench chunk missing")

        t = timed({"write_gbps": lambda i: tier.write(recs[i]), "read_gbps": read,
                   "raw_write_gbps": lambda i: _raw_write(raw / f"{i}.bin", data),
                   "raw_read_gbps": lambda i: _raw_read(raw / f"{i}.bin")}, reps, warmup=2)
        out: dict[str, Any] = throughput(nbytes, t)
        out["write_vs_raw"] = round(out["write_gbps"] / out["raw_write_gbps"], 3)
        out["read_vs_raw"] = round(out["read_gbps"] / out["raw_read_gbps"], 3)
        out["chunk_bytes"] = nbytes

        many = root / "rebuild"
        small = NvmeTier(many, capacity=1 << 40)
        tiny = b"r" * 64
        tiny_sum = checksum(tiny)
        for i in range(rebuild_files):
            small.write(ChunkRecord(i.to_bytes(16, "little"), tiny, tiny_sum))
        t0 = time.perf_counter()
        again = NvmeTier(many, capacity=1 << 40)
        rebuild_s = time.perf_counter() - t0
        if again.chunks != rebuild_files:
            raise RuntimeError(f"G3 rebuild indexed {again.chunks} of {rebuild_files} files")
        out["rebuild_s"] = round(rebuild_s, 3)
        out["rebuild_files"] = rebuild_files
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 in a child process; its endpoint URL."""
    import urllib.request

    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return True
        except OSError:
            return False

    with child_server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                      ready=answers, what="moto server"):
        yield url


def _shared_agent(stack: contextlib.ExitStack, root: Path, name: str, shared: SharedTier,
                  dram: int) -> KVPoolClient:
    """An agent (its own arena, no NVMe) on the shared tier `shared`; a client of it."""
    workdir = root / name
    workdir.mkdir()
    cfg = workdir / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"pool": "bench", "tiers": {
        "shared": shared.model_dump(mode="json", by_alias=True, exclude_none=True)}}))
    agent = stack.enter_context(LocalAgent("--no-lock", "--config", str(cfg), workdir=workdir,
                                           dram=str(dram), start_timeout=60))
    return stack.enter_context(KVPoolClient(agent.socket_path))


def _uploaded(client: KVPoolClient, n: int) -> bool:
    """Whether the agent's write-behind queue has written `n` chunks and holds none."""
    q = client.stats()["tiers"]["shared"]["queue"]
    return bool(q["written"] >= n and q["pending"] == 0 and q["in_flight"] == 0)


def run_g4(nbytes: int, reps: int) -> dict[str, Any]:
    """The `g4` section: through agents (`put_gbps`, `get_gbps`) and in process (`tier_*`)."""
    import boto3

    for k, v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)  # moto accepts any; the agents inherit them
    data = payload(nbytes)
    out_buf = prefaulted(nbytes)
    out_view = memoryview(out_buf)
    root = Path(tempfile.mkdtemp(prefix="kvpool-bench-g4-"))
    try:
        with moto_server() as url, contextlib.ExitStack() as stack:
            s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
            s3.create_bucket(Bucket=BUCKET)

            def boto_get(i: int) -> None:
                body = s3.get_object(Bucket=BUCKET, Key=f"raw/{i}")["Body"].read()
                if len(body) != nbytes:
                    raise RuntimeError("boto3 bench object truncated")

            shared = SharedTier(url=f"s3://{BUCKET}/agents", endpoint_url=url,
                                region="us-east-1", addressing_style="path")
            # Room for every chunk of the run: nothing is evicted while timed.
            dram = (reps + 2) * nbytes + (64 << 20)
            writer = _shared_agent(stack, root, "writer", shared, dram)
            reader = _shared_agent(stack, root, "reader", shared, dram)

            def agent_put(i: int) -> None:
                # Timed until the write-behind upload has landed, not only until
                # the client's COMMIT: that is when another node can read it.
                if not writer.put(bench_key(i), data):
                    raise RuntimeError("G4 bench key already stored")
                while not _uploaded(writer, i + 1):
                    time.sleep(0.001)

            def agent_get(i: int) -> None:
                # The reader agent has never seen the key: ACQUIRE reads it from the
                # store, verifies it and promotes it into its DRAM, then the client copies.
                if reader.get_into(bench_key(i), out_view) != nbytes:
                    raise RuntimeError("G4 bench chunk missing in the second agent")

            tier = open_shared_tier(shared.model_copy(update={"url": f"s3://{BUCKET}/tier"}))
            stack.callback(tier.close)
            digest = checksum(data)

            def tier_get(i: int) -> None:
                got = tier.read(bench_key(i))
                if got is None or got.size != nbytes:
                    raise RuntimeError("G4 bench chunk missing")

            t = timed({
                "boto3_put_gbps": lambda i: s3.put_object(Bucket=BUCKET, Key=f"raw/{i}",
                                                          Body=data),
                "boto3_get_gbps": boto_get, "put_gbps": agent_put, "get_gbps": agent_get,
                "tier_put_gbps": lambda i: tier.write(ChunkRecord(bench_key(i), data, digest)),
                "tier_get_gbps": tier_get,
            }, reps, warmup=1)
            if bytes(out_view[:64]) != data[:64]:
                raise RuntimeError("G4 bench chunk read back wrong")
    finally:
        out_view.release()
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = throughput(nbytes, t)
    for op in ("put", "get"):
        out[f"{op}_vs_boto3"] = round(out[f"{op}_gbps"] / out[f"boto3_{op}_gbps"], 3)
        out[f"tier_{op}_vs_boto3"] = round(out[f"tier_{op}_gbps"] / out[f"boto3_{op}_gbps"], 3)
    out["chunk_bytes"] = nbytes
    return out
