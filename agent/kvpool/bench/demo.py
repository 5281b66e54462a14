"""`kvpool demo`: a local agent, a real trace, per-tier hit ratios and throughput."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpool.agent.client import KVPoolClient
from kvpool.agent.commandline import console as new_console
from kvpool.agent.config import SharedTier
from kvpool.agent.constants import PAGE_BYTES as PAGE
from kvpool.agent.constants import PEER_TIER
from kvpool.agent.tiers.base import HEADER_BYTES
from kvpool.agent.units import human_size, parse_size

from . import sim
from .local import LocalAgent, free_port
from .replay import ReplayResult, replay
from .trace import TraceRequest, bundled_trace_path, distinct_blocks, load_trace


class DemoError(ValueError):
    """What the user gave the demo cannot be used; the message names the flag or file."""


def capacity(spec: str, distinct: int, block_bytes: int) -> int:
    """A tier size from `512Mi` or from a fraction of the trace's distinct blocks (`5%`)."""
    spec = spec.strip()
    if spec.endswith("%"):
        try:
            fraction = float(spec[:-1]) / 100
        except ValueError:
            raise ValueError(f"{spec!r} is not a size or a percentage like 5%") from None
        if not 0 < fraction <= 10:
            raise ValueError(f"{spec!r}: a percentage must be above 0% and at most 1000%")
        blocks = max(1, round(distinct * fraction))
        pages_per_block = -(-block_bytes // PAGE)
        return blocks * pages_per_block * PAGE
    return parse_size(spec)


def _flag(flag: str, parse: Callable[..., int], *args: Any) -> int:
    """parse(*args), its ValueError told as the flag's."""
    try:
        return parse(*args)
    except ValueError as e:
        raise DemoError(f"invalid value for '{flag}': {e}") from e


def _load(trace: Path | None, requests: int | None) -> tuple[Path, list[TraceRequest]]:
    if requests is not None and requests < 1:
        raise DemoError(f"invalid value for '--requests': {requests} is not a positive number")
    if trace is None:
        return bundled_trace_path(), load_trace(None, limit=requests)
    try:
        return trace, load_trace(trace, limit=requests)
    except OSError as e:
        raise DemoError(f"--trace {trace}: {e.strerror or e}") from e
    except ValueError as e:  # the message names the file and line
        raise DemoError(f"--trace {e}") from e


def _shared_url(shared: str, tmp: Path) -> str:
    if shared.startswith("file:///") and not Path(unquote(shared[7:])).is_dir():
        raise DemoError(f"invalid value for '--shared': {shared}: no such directory (the "
                        "agent never makes a shared store's directory)")
    if shared in ("", "none") or shared.startswith(("s3://", "file:///")):
        return shared or (tmp / "shared").as_uri()
    raise DemoError(f"invalid value for '--shared': {shared!r}: use s3://bucket/prefix, "
                    "file:///path or none")


def shared_settings(url: str, longest_request: int) -> dict[str, Any]:
    """The demo agent's shared tier. The demo measures what the tiers hold, not how well a
    loaded machine keeps up with them: a LOOKUP may wait for the store (a presence check
    slowed by load past the 50 ms default would be a miss), and the replay lets each
    request's uploads land before the next (`wait_for_uploads`), so that, with
    write-through, the shared tier holds every chunk written before, as
    docs/shared-tier.md says, however loaded the machine. The queue holds the longest
    request's uploads at once (1024 by default, more for a longer request)."""
    return {"url": url, "lookupBudget": "5s",
            "writeQueueDepth": max(DEFAULT_WRITE_QUEUE_DEPTH, longest_request)}


def run_demo(trace: Path | None, as_json: bool, block_bytes: str, dram: str, nvme: str,
             shared: str, requests: int | None, events: bool = True, nodes: int = 1) -> None:
    """Raises DemoError, naming the flag, when a flag's value or the trace cannot be used.

    With `nodes=2`, two agents as two nodes of one pool, peers of each other (`_two_nodes`)."""
    console = new_console(stderr=as_json)
    if nodes not in (1, 2):
        raise DemoError(f"invalid value for '--nodes': {nodes}: the demo runs 1 or 2 nodes")
    bb = _flag("--block-bytes", parse_size, block_bytes)
    _shared_url(shared, Path("/"))  # checked before the trace is read
    trace_path, reqs = _load(trace, requests)
    distinct = distinct_blocks(reqs)
    dram_bytes = _flag("--dram", capacity, dram, distinct, bb)
    # An NVMe chunk file carries a header beside the block's bytes.
    nvme_bytes = _flag("--nvme", capacity, nvme, distinct, bb + HEADER_BYTES)
    blocks = [r.blocks for r in reqs]
    refs = sum(len(b) for b in blocks)
    total_blocks = dram_bytes // (-(-bb // PAGE) * PAGE) + nvme_bytes // (bb + HEADER_BYTES)
    lru_baseline = sim.lru(blocks, total_blocks)
    ideal = sim.unbounded(blocks)
    console.print(
        f"[bold]kvpool demo[/]: {len(reqs)} requests, {refs} block references, "
        f"{distinct} distinct blocks of {human_size(bb)} from {trace_path.name}; "
        f"DRAM {human_size(dram_bytes)}, NVMe {human_size(nvme_bytes)}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="kvpool-demo-"))
    if nodes == 2:
        try:
            _two_nodes(tmp, _shared_url(shared, tmp), shared == "", reqs, bb, dram_bytes,
                       nvme_bytes, events, console, as_json)
        finally:
            remove_in_background(tmp)
        return
    try:
        shared_url = _shared_url(shared, tmp)
        if not shared:
            (tmp / "shared").mkdir()  # the agent never makes a file:// store's directory
        tiers = ["--no-lock", "--nvme-dir", str(tmp / "nvme"), "--nvme", str(nvme_bytes)]
        config: dict[str, Any] = {}
        if shared_url != "none":
            config["tiers"] = {"shared": shared_settings(shared_url, max(map(len, blocks)))}
            console.print(f"shared tier {shared_url}")
        if events:
            port, replay_port = free_port(), free_port()
            config["events"] = {"enabled": True, "address": "127.0.0.1", "port": port,
                                "replayPort": replay_port, "topic": "node"}
            console.print(f"KV events on tcp://127.0.0.1:{port}: in another terminal, "
                          f"kvpool events --endpoint tcp://127.0.0.1:{port}")
        if config:
            (tmp / "agent.yaml").write_text(json.dumps(config) + "\n")  # JSON is YAML
            tiers += ["--config", str(tmp / "agent.yaml")]
        result, stats, published, waited = _replay(tiers, dram_bytes, reqs, bb, console, as_json,
                                           events, shared=shared_url != "none")
    finally:
        remove_in_background(tmp)
    report = _report(result, stats, bb, published, waited)
    report["lru_hit_ratio"] = round(lru_baseline.hit_ratio, 6)
    report["unbounded_hit_ratio"] = round(ideal.hit_ratio, 6)
    console.print(_tier_table("per tier", report))
    console.print(
        f"block hit ratio {report['block_hit_ratio']:.3f}, of which DRAM + NVMe "
        f"{report['local_hit_ratio']:.3f} (plain LRU over the same DRAM + NVMe capacity: "
        f"{report['lru_hit_ratio']:.3f}; unbounded cache: {report['unbounded_hit_ratio']:.3f}); "
        f"{report['requests_per_second']} requests/s, read {report['read_gbps']} GB/s, "
        f"write {report['write_gbps']} GB/s; wrong bytes: {result.wrong_bytes}"
        + (f"; uploads dropped: {report['uploads_dropped']}, {waited:.1f} s of it waiting "
           "for uploads to land" if shared_url != "none" else "")
        + (f"; KV events published: {published}" if events else "")
    )
    if as_json:
        print(json.dumps(report))


def _report(result: ReplayResult, stats: dict[str, Any], bb: int, published: int,
            waited: float) -> dict[str, Any]:
    """The JSON report of one agent's replay (its stats taken after it)."""
    local_hits = sum(n for t, n in result.hits_by_tier.items() if t in ("dram", "nvme"))
    return {
        "requests": result.requests,
        "blocks": result.blocks,
        "block_hit_ratio": round(result.block_hit_ratio, 6),
        "local_hit_ratio": round(local_hits / result.blocks if result.blocks else 0.0, 6),
        "bytes_read": result.bytes_read,
        "bytes_written": result.bytes_written,
        "block_bytes": bb,
        "wrong_bytes": result.wrong_bytes,
        "events_published": published,
        "uploads_dropped": (stats["tiers"].get("shared", {}).get("queue") or {}).get(
            "dropped", 0),
        "upload_wait_seconds": round(waited, 3),
        "seconds": round(result.seconds, 3),
        "requests_per_second": round(result.requests / result.seconds, 1),
        "read_gbps": round(result.bytes_read / result.seconds / 1e9, 4),
        "write_gbps": round(result.bytes_written / result.seconds / 1e9, 4),
        "tiers": {
            name: {
                "capacity_bytes": t.get("capacity_bytes", 0),  # the peer tier: the peers'
                "hits": result.hits_by_tier.get(name, 0),
                "misses": t["misses"],
            }
            for name, t in sorted(stats["tiers"].items(), key=lambda kv: _ORDER.index(kv[0]))
        },
    }


_ORDER = ("dram", "nvme", PEER_TIER, "shared")
"""The tiers in the order LOOKUP asks them."""


def _tier_table(title: str, report: dict[str, Any]) -> Table:
    table = Table(title=title)
    for col in ("tier", "capacity", "hits", "misses", "hit ratio"):
        table.add_column(col)
    for name, t in report["tiers"].items():
        seen = t["hits"] + t["misses"]
        cap = (human_size(t["capacity_bytes"]) if t["capacity_bytes"] else
               "the peers'" if name == PEER_TIER else "unbounded")
        table.add_row(name, cap, str(t["hits"]), str(t["misses"]),
                      f"{t['hits'] / seen:.3f}" if seen else "-")
    return table


def remove_in_background(path: Path) -> None:
    """Remove the demo's directory (tens of thousands of chunk files: seconds of unlinks)
    in a detached process, so the report does not wait for it; inline if that fails."""
    try:
        subprocess.Popen(
            [sys.executable, "-c", "import shutil, sys; shutil.rmtree(sys.argv[1], True)",
             str(path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


DEFAULT_WRITE_QUEUE_DEPTH = SharedTier.model_fields["write_queue_depth"].default

UPLOAD_POLL_S = 0.001
"""How often the demo asks its agent whether the uploads of a request have landed."""


def uploads_left(stats: dict[str, Any]) -> int:
    """Uploads the agent's shared tier has pending or in flight (0 without one)."""
    queue = stats["tiers"].get("shared", {}).get("queue") or {}
    return int(queue.get("pending", 0)) + int(queue.get("in_flight", 0))


def wait_for_uploads(client: KVPoolClient) -> float:
    """Wait until the agent's write-behind queue is empty; the seconds waited.

    Its uploads then never fall behind the replay (a queue more than `writeQueueDepth`
    behind drops the oldest: under load, the demo lost a tenth of its shared-tier hits
    so), and each chunk is in the store before a later request can look for it there."""
    started = time.perf_counter()
    while uploads_left(client.stats()):
        time.sleep(UPLOAD_POLL_S)
    return time.perf_counter() - started


def _replay(tier_args: list[str], dram_bytes: int, reqs: list[TraceRequest], block_bytes: int,
            console: Console, as_json: bool, events: bool, shared: bool
            ) -> tuple[ReplayResult, dict[str, Any], int, float]:
    """Replay through a fresh agent with a progress bar (and the events it published so
    far); with a shared tier, each request's uploads land before the next request.
    (result, the agent's stats, events published, seconds waited for uploads)."""
    with LocalAgent(*tier_args, dram=str(dram_bytes), start_timeout=60) as agent, \
            KVPoolClient(agent.socket_path) as client:
        result, waited = _replay_on(agent, client, reqs, block_bytes, console, as_json,
                                    events, shared)
        return result, client.stats(), published(agent) if events else 0, waited


def _replay_on(agent: LocalAgent, client: KVPoolClient, reqs: list[TraceRequest],
               block_bytes: int, console: Console, as_json: bool, events: bool, shared: bool,
               label: str = "replaying") -> tuple[ReplayResult, float]:
    """`reqs` replayed through a running agent with a progress bar; (result, seconds waited
    for uploads)."""
    columns = [TextColumn(label), BarColumn(), MofNCompleteColumn(),
               TextColumn("hit ratio {task.fields[ratio]:.3f}")]
    if events:
        columns.append(TextColumn("events {task.fields[events]}"))
    progress = Progress(*columns, TimeElapsedColumn(), console=console, transient=as_json)
    with progress:
        task = progress.add_task("replay", total=len(reqs), ratio=0.0, events=0)
        waited = 0.0

        def tick(r: ReplayResult) -> None:
            nonlocal waited
            if shared:
                waited += wait_for_uploads(client)
            if r.requests % 25 == 0 or r.requests == len(reqs):
                progress.update(task, completed=r.requests, ratio=r.block_hit_ratio,
                                events=published(agent) if events else 0)

        result = replay(client, reqs, block_bytes, on_request=tick)
    return result, waited


PEER_TIMEOUT = "5s"
"""The demo's peer reads may take this long (the default, 0.25 s, is a serving deadline; the
demo counts what the tiers hold, as its shared tier's lookup budget does, however loaded
the machine)."""
SYNC_TIMEOUT = 60.0
"""Seconds node 2 may take to have node 1's inventory in its directory."""


def _two_nodes(tmp: Path, shared_url: str, make_shared: bool, reqs: list[TraceRequest],
               bb: int, dram_bytes: int, nvme_bytes: int, events: bool, console: Console,
               as_json: bool) -> None:
    """Two agents as two nodes of one pool, on this machine: each its own arena, NVMe
    directory, socket and peer port on 127.0.0.1 (loopback: no root needed; the peer
    tests and `kvpool bench --part peer` put nodes in network namespaces), one pool
    secret, the same shared tier. Node 1 replays the trace's first half; once node 2's
    directory holds node 1's inventory, node 2 replays the same requests (a router sending
    them to another node): what node 1 still holds, node 2 reads from it (peer hits), what
    node 1 evicted from the shared tier."""
    if make_shared:
        (tmp / "shared").mkdir()  # the agent never makes a file:// store's directory
    secret = tmp / "peers.secret"
    secret.write_text(os.urandom(32).hex())
    part = reqs[: max(1, len(reqs) // 2)]
    longest = max(len(r.blocks) for r in part)
    ports = [free_port(), free_port()]
    console.print(f"two nodes on 127.0.0.1, peer ports {ports[0]} and {ports[1]}; node 1 "
                  f"replays {len(part)} requests, then node 2 the same ones"
                  + (f"; shared tier {shared_url}" if shared_url != "none" else ""))
    with contextlib.ExitStack() as stack:
        agents: list[LocalAgent] = []
        clients: list[KVPoolClient] = []
        for i in range(2):
            home = tmp / f"node{i + 1}"
            home.mkdir()
            config: dict[str, Any] = {"peers": {
                "enabled": True, "port": ports[i], "address": "127.0.0.1",
                "advertise": "127.0.0.1", "secretFile": str(secret),
                "addresses": [f"127.0.0.1:{ports[1 - i]}"], "timeout": PEER_TIMEOUT}}
            if shared_url != "none":
                config["tiers"] = {"shared": shared_settings(shared_url, longest)}
            if events:
                config["events"] = {"enabled": True, "address": "127.0.0.1",
                                    "port": free_port(), "replayPort": free_port(),
                                    "topic": "node"}
            (home / "agent.yaml").write_text(json.dumps(config) + "\n")  # JSON is YAML
            agent = stack.enter_context(LocalAgent(
                "--no-lock", "--nvme-dir", str(home / "nvme"), "--nvme", str(nvme_bytes),
                "--config", str(home / "agent.yaml"), workdir=home, dram=str(dram_bytes),
                start_timeout=60))
            agents.append(agent)
            clients.append(stack.enter_context(KVPoolClient(agent.socket_path)))
        shared = shared_url != "none"
        first, waited1 = _replay_on(agents[0], clients[0], part, bb, console, as_json, events,
                                    shared, "node 1")
        synced = _wait_for_inventory(clients[0], clients[1])
        second, waited2 = _replay_on(agents[1], clients[1], part, bb, console, as_json,
                                     events, shared, "node 2")
        reports = [_report(r, c.stats(), bb, published(a) if events else 0, w)
                   for r, c, a, w in zip((first, second), clients, agents, (waited1, waited2),
                                         strict=True)]
    peer_hits = second.hits_by_tier.get(PEER_TIER, 0)
    report: dict[str, Any] = {
        "nodes": 2, "requests_per_node": len(part), "peer_hits": peer_hits,
        "peer_hit_ratio": round(peer_hits / second.blocks if second.blocks else 0.0, 6),
        "wrong_bytes": first.wrong_bytes + second.wrong_bytes,
        "inventory_synced": synced, "node1": reports[0], "node2": reports[1]}
    console.print(_tier_table(f"node 1: {len(part)} requests", reports[0]))
    console.print(_tier_table("node 2: the same requests", reports[1]))
    console.print(
        f"node 2: {peer_hits} of its {second.hit_blocks} block hits came from node 1 over "
        f"the peer tier ({report['peer_hit_ratio']:.3f} of its {second.blocks} blocks), "
        + ", ".join(f"{second.hits_by_tier.get(t, 0)} from its {t}"
                    for t in ("dram", "nvme", "shared") if t in reports[1]["tiers"])
        + f"; block hit ratio node 1 {first.block_hit_ratio:.3f}, node 2 "
        f"{second.block_hit_ratio:.3f}; wrong bytes: {report['wrong_bytes']}"
        + ("" if synced else "; node 2 did not have node 1's whole inventory in "
           f"{SYNC_TIMEOUT:.0f} s"))
    if as_json:
        print(json.dumps(report))


def _wait_for_inventory(holder: KVPoolClient, reader: KVPoolClient) -> bool:
    """Wait until `reader`'s peer directory holds as many chunks as `holder` has in DRAM and
    NVMe (its announcements are on their way while it replays); False after SYNC_TIMEOUT."""
    deadline = time.monotonic() + SYNC_TIMEOUT
    while time.monotonic() < deadline:
        tiers = holder.stats()["tiers"]
        held = sum(tiers[t]["chunks"] for t in ("dram", "nvme") if t in tiers)
        if reader.stats()["tiers"][PEER_TIER]["chunks"] >= held:
            return True
        time.sleep(0.05)
    return False


def published(agent: LocalAgent) -> int:
    """The agent's kvpool_events_published_total, from its /metrics."""
    with urllib.request.urlopen(f"{agent.metrics_url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvpool_events_published_total"):
                return int(float(line.rpartition(" ")[2]))
    return 0
