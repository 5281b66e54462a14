"""A shared mount whose reads hang for good, against a real agent.

FIFOs where the objects should be make every read of those keys block in open() forever,
like a hung NFS server. Such reads used to take all the agent's read threads (another
client's NVMe read then timed out), leave the tier reported healthy, and keep SIGTERM
from stopping the agent.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.agent.tiers.shared import object_name
from kvpool.bench.local import LocalAgent

from ..support import wait_until

KiB = 1 << 10
CHUNK = 256 * KiB


def data_for(key: bytes) -> bytes:
    return (key * (CHUNK // len(key) + 1))[:CHUNK]


def test_stalled_shared_reads_leave_nvme_reads_alone_turn_the_tier_unhealthy_and_let_it_stop(
        tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    config = tmp_path / "agent.yaml"
    config.write_text(f"tiers:\n  shared:\n    url: {shared.as_uri()}\n"
                      "    requestTimeout: 1s\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text("prefetch: {enabled: false}\n")
    agent = LocalAgent("--no-lock", "--config", str(config), "--policy", str(policy),
                       "--nvme-dir", str(tmp_path / "nvme"), "--nvme", "64Mi",
                       workdir=tmp_path, dram="4Mi")
    with agent, KVPoolClient(agent.socket_path) as c:
        keys = [os.urandom(16) for _ in range(24)]  # 6 MiB into 4 MiB: some go to NVMe
        for k in keys:
            assert c.put(k, data_for(k))
        in_nvme = [k for k in keys if c.lookup_tiers([k]) == ["nvme"]]
        assert in_nvme

        hung = [os.urandom(16) for _ in range(8)]  # more than the agent has read threads
        for k in hung:
            name = object_name(k)
            (shared / name[:2]).mkdir(parents=True, exist_ok=True)
            os.mkfifo(shared / name[:2] / name)
        results: dict[bytes, bytes | None] = {}

        def read_hung(key: bytes) -> None:
            with KVPoolClient(agent.socket_path, timeout=120) as r:
                results[key] = r.get(key)
        readers = [threading.Thread(target=read_hung, args=(k,), daemon=True) for k in hung]
        for t in readers:
            t.start()

        def shared_reason() -> str:
            reason: str = c.stats()["tiers"]["shared"]["reason"]
            return reason
        wait_until(lambda: "reads stalled" in shared_reason(), "the tier to report stalled reads",
                   timeout=60)
        # Another client's NVMe reads are served meanwhile, their bytes checked.
        with KVPoolClient(agent.socket_path, timeout=60) as other:
            assert all(other.get(k, verify=True) == data_for(k) for k in in_nvme[:3])
        for t in readers:
            t.join(timeout=60)
        assert results == dict.fromkeys(hung)  # each a miss, none hangs
        # Probes keep it unhealthy while reads hang in the store, though statvfs answers.
        assert "reads stalled" in shared_reason()

        assert agent.proc is not None
        agent.proc.terminate()
        assert agent.proc.wait(timeout=60) == 0, agent.log()
