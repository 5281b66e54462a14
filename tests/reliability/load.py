"""One client process of the reliability tests' load: mixed ops over derived chunks.

    python load.py '<json settings>'

Each worker mutates only its own slice of the key space (put, delete, pin, unpin), so it
knows exactly which of its chunks were acknowledged, and reads everybody's (lookup, get),
checking every byte it gets against `chunks.chunk_bytes`. It runs until `max_ops` ops
or until the stop file exists, writing its counters to the status file as it goes (the
tests poll it: a worker that saw an error, one that is making progress again) and once
more at the end, with `"done": true`.

Errors are counted, not raised: a fault test decides which errors its fault may cause.
A mutation that failed, or that succeeded only through a reconnect (the client retried
it; the first attempt may still run later on the old connection), leaves its key
"uncertain": the durability checks skip it.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from chunks import chunk_bytes, chunk_key

from kvpool.agent import protocol as p
from kvpool.agent.client import KVPoolClient

MUTATIONS = {"put", "delete", "pin", "unpin"}
DEFAULT_MIX = {"lookup": 3, "get": 4, "put": 4, "delete": 1, "pin": 1, "unpin": 1}
PINNED_PER_WORKER = 4
"""Pins only the first few keys of a slice: pinned chunks are never evicted, and a
worker pinning its whole slice could fill DRAM with chunks nobody may evict."""


class Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.space: str = cfg["space"]
        self.worker: int = cfg["worker"]
        self.workers: int = cfg["workers"]
        self.per_worker: int = cfg["keys_per_worker"]
        self.status = Path(cfg["status"])
        self.stop = Path(cfg["stop"])
        self.rng = random.Random(cfg.get("seed", self.worker))
        mix = cfg.get("mix") or DEFAULT_MIX
        self.ops, self.weights = list(mix), list(mix.values())
        self.ok: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.misses = 0
        self.wrong: list[str] = []
        self.reconnects = 0
        self.errors_then_ok = 0
        """Calls that succeeded after an error (recovery)."""
        self.last_failed = False
        self.state: dict[int, str] = {}
        """Own key index -> "put" or "deleted", from acknowledged mutations."""
        self.uncertain: set[int] = set()
        self.pinned: set[int] = set()
        self.client = KVPoolClient(cfg["socket"], mode=cfg.get("mode", "zero_copy"),
                                   timeout=cfg.get("timeout", 30.0),
                                   reconnect_timeout=cfg.get("reconnect_timeout", 10.0),
                                   name=f"load-{self.worker}")

    def own(self) -> int:
        return self.worker * self.per_worker + self.rng.randrange(self.per_worker)

    def any_key(self) -> int:
        return self.rng.randrange(self.workers * self.per_worker)

    def run(self) -> None:
        for n in range(int(self.cfg["max_ops"])):
            if self.stop.exists():  # every op: against a dead agent one op takes seconds
                break
            self.step(self.rng.choices(self.ops, self.weights)[0])
            if n % 50 == 0:
                self.report(done=False)
        for i in sorted(self.pinned):  # leave no pins behind: the end state is checked
            self.step("unpin", i)
        self.report(done=True)

    def step(self, op: str, index: int | None = None) -> None:
        if index is None:
            index = self.own() if op in MUTATIONS else self.any_key()
        if op == "pin" or op == "unpin":
            index = self.worker * self.per_worker + index % PINNED_PER_WORKER
        key = chunk_key(self.space, index)
        c = self.client
        hello = c.hello
        try:
            self.call(op, index, key)
        except (p.ProtocolError, OSError) as e:
            name = p.ErrorCode(e.code).name if isinstance(e, p.ProtocolError) else \
                type(e).__name__
            self.errors[name] += 1
            self.last_failed = True
            if op in MUTATIONS:
                self.uncertain.add(index)
            self.report(done=False)
            return
        self.ok[op] += 1
        if self.last_failed:
            self.errors_then_ok += 1
            self.last_failed = False
        if c.hello is not hello:
            self.reconnects += 1
            if op in MUTATIONS:
                self.uncertain.add(index)

    def call(self, op: str, index: int, key: bytes) -> None:
        c = self.client
        if op == "lookup":
            base = index - index % 8  # a run of consecutive keys, like a prompt's chunks
            keys = [chunk_key(self.space, i) for i in range(base, base + 8)]
            tiers = c.lookup_tiers(keys)
            if not set(tiers) <= {"dram", "nvme", "shared"}:
                self.wrong.append(f"lookup tiers {tiers}")
        elif op == "get":
            got = c.get(key)  # no verify=: our own check must see whatever came back
            if got is None:
                self.misses += 1
            elif got != chunk_bytes(key):
                self.wrong.append(key.hex())
            elif self.state.get(index) == "deleted" and index not in self.uncertain:
                # Only this worker writes its own keys: what it deleted stays deleted.
                self.wrong.append(f"{key.hex()} deleted and readable again")
        elif op == "put":
            c.put(key, chunk_bytes(key))
            self.state[index] = "put"
        elif op == "delete":
            c.delete(key)
            self.state[index] = "deleted"
        elif op == "pin":
            try:
                c.pin(key)
                self.pinned.add(index)
            except p.ProtocolError as e:
                if e.code != p.ErrorCode.NOT_FOUND:
                    raise
                self.misses += 1  # nothing stored to pin: not an error
        elif op == "unpin":
            c.unpin(key)
            self.pinned.discard(index)

    def report(self, done: bool) -> None:
        acked = sorted(i for i, s in self.state.items() if s == "put" and i not in self.uncertain)
        deleted = sorted(i for i, s in self.state.items()
                         if s == "deleted" and i not in self.uncertain)
        out = {
            "worker": self.worker, "done": done, "ok": dict(self.ok),
            "errors": dict(self.errors), "misses": self.misses, "wrong": self.wrong,
            "reconnects": self.reconnects, "errors_then_ok": self.errors_then_ok,
            "acked": acked, "deleted": deleted, "uncertain": sorted(self.uncertain),
        }
        tmp = self.status.with_name(self.status.name + ".tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, self.status)


if __name__ == "__main__":
    w = Worker(json.loads(sys.argv[1]))
    try:
        w.run()
    finally:
        w.client.close()
