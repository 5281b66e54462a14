"""G3 and G4 parts of `kvpool bench`: the tiers' I/O code against the plain baseline.

G3 times the agent's NVMe tier code (`NvmeTier.write`: header, temp file,
rename; `NvmeTier.read`: whole blob, decode and checksum check) in this
process, against a raw `open/write/close` and `open/read` of the same bytes
in the same directory (a temp dir on the root filesystem, through the page
cache: no O_DIRECT, no fsync on either side). The rebuild figure is
`NvmeTier(root)` construction (it scans and indexes every chunk file's
header) over 10^5 chunk files, warm page cache.

G4 times the agent's shared tier (`open_shared_tier`, s3:// backend) against
plain boto3 `put_object` / `get_object` on the same moto server (a local
S3-compatible server on 127.0.0.1, started here and stopped after).

Both are in-process through the tier classes, not through the agent socket
(a socket round trip adds one control RTT per chunk, see `control`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .bench_data import bench_key, payload
from .bench_stats import gbps, timed
from .local import free_port
from .protocol import checksum
from .tiers.base import ChunkRecord
from .tiers.nvme import NvmeTier


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
        w = timed(lambda i: tier.write(recs[i]), reps, warmup=2)

        def read(i: int) -> None:
            got = tier.read(recs[i].key)
            if got is None or got.size != nbytes:
                raise RuntimeError("G3 bench chunk missing")

        r = timed(read, reps, warmup=2)
        rw = timed(lambda i: _raw_write(raw / f"{i}.bin", data), reps, warmup=2)
        rr = timed(lambda i: _raw_read(raw / f"{i}.bin"), reps, warmup=2)
        out: dict[str, Any] = {
            **gbps(nbytes, w).fields("write_gbps"), **gbps(nbytes, r).fields("read_gbps"),
            **gbps(nbytes, rw).fields("raw_write_gbps"),
            **gbps(nbytes, rr).fields("raw_read_gbps"),
        }
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
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("moto server did not answer in 15s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def run_g4(nbytes: int, reps: int) -> dict[str, Any]:
    """The `g4` section."""
    import boto3

    from .config import SharedTier
    from .tiers.shared import open_shared_tier

    for k, v in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    data = payload(nbytes)
    with moto_server() as url:
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        s3.create_bucket(Bucket="kvpool-bench")
        bp = timed(lambda i: s3.put_object(Bucket="kvpool-bench", Key=f"raw/{i}", Body=data),
                   reps, warmup=1)

        def boto_get(i: int) -> None:
            body = s3.get_object(Bucket="kvpool-bench", Key=f"raw/{i}")["Body"].read()
            if len(body) != nbytes:
                raise RuntimeError("boto3 bench object truncated")

        bg = timed(boto_get, reps, warmup=1)
        tier = open_shared_tier(SharedTier(url="s3://kvpool-bench/tier", endpoint_url=url,
                                           region="us-east-1", addressing_style="path"))
        try:
            digest = checksum(data)
            recs = [ChunkRecord(bench_key(i), data, digest) for i in range(reps + 1)]
            tp = timed(lambda i: tier.write(recs[i]), reps, warmup=1)

            def tier_get(i: int) -> None:
                got = tier.read(recs[i].key)
                if got is None or got.size != nbytes:
                    raise RuntimeError("G4 bench chunk missing")

            tg = timed(tier_get, reps, warmup=1)
        finally:
            tier.close()
    out: dict[str, Any] = {
        **gbps(nbytes, tp).fields("put_gbps"), **gbps(nbytes, tg).fields("get_gbps"),
        **gbps(nbytes, bp).fields("boto3_put_gbps"), **gbps(nbytes, bg).fields("boto3_get_gbps"),
    }
    out["put_vs_boto3"] = round(out["put_gbps"] / out["boto3_put_gbps"], 3)
    out["get_vs_boto3"] = round(out["get_gbps"] / out["boto3_get_gbps"], 3)
    out["chunk_bytes"] = nbytes
    return out
