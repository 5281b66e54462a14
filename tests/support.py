"""Helpers every test folder uses on real agents: bounded waits and metric scrapes."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvpool.bench.local import LocalAgent

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The checkout's root: where the README's commands run."""


def wait_until(cond: Callable[[], object], what: str = "condition",
               timeout: float = 30.0) -> None:
    """Poll `cond()` until true; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def scrape(agent: LocalAgent) -> dict[str, float]:
    """The agent's /metrics as {series: value}."""
    with urllib.request.urlopen(f"{agent.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


@dataclass
class Chunk:
    """A chunk as the policy engine sees it (the fields of `policy.Entry`): table-test data."""

    key: bytes
    size: int = 10
    tenant: str = ""
    hits: int = 0
    last_seq: int = 0
    depth: int = 0
    last_access: float = 0.0


def chunk(name: str, **fields: Any) -> Chunk:
    """A test chunk whose key is its name."""
    return Chunk(name.encode(), **fields)


def flip_last_byte(path: Path) -> None:
    """Damage a stored chunk file or object: its last byte (chunk data) flipped."""
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0x01]))


def shared_node(stack: ExitStack, root: Path, name: str, store: Path, pool: str) -> LocalAgent:
    """An agent of `pool` (its work dir `root/name`) whose shared tier is the `file://`
    directory `store`, with 2 s budgets: one node of a pool sharing a store."""
    workdir = root / name
    workdir.mkdir()
    store.mkdir(exist_ok=True)  # the agent never makes a file:// store's directory
    cfg = workdir / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"pool": pool, "tiers": {"shared": {
        "url": store.as_uri(), "lookupBudget": "2s", "requestTimeout": "2s"}}}))
    return stack.enter_context(
        LocalAgent("--no-lock", "--config", str(cfg), workdir=workdir, dram="16Mi"))
