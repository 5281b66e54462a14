"""A shared file system that turns read-only is reported as read-only, by a real agent.

The health probe used to ask access(W_OK), which cannot tell a read-only mount from a
directory the agent may not write, and reported "permission denied".
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kvpool.agent.client import KVPoolClient
from kvpool.bench.local import LocalAgent

from ..support import wait_until

CHUNK = 64 * 1024


def shared_reason(c: KVPoolClient) -> str:
    reason: str = c.stats()["tiers"]["shared"]["reason"]
    return reason


def test_a_read_only_shared_mount_is_reported_as_read_only(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    with LocalAgent("--no-lock", "--shared", root.as_uri(), workdir=tmp_path,
                    dram="16Mi") as agent, KVPoolClient(agent.socket_path) as c:
        # First an outage the probe does not cause (the directory goes), so that the
        # reason seen next is the probe's own.
        shutil.rmtree(root)
        assert c.put(b"\x01" * 16, b"\x01" * CHUNK)  # its upload finds the directory gone
        wait_until(lambda: shared_reason(c).startswith("shared filesystem directory missing"),
                   "the tier to be unhealthy for the missing directory")
        # The directory comes back as a read-only mount (tests run as root, as in CI).
        root.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(root)],
                       check=True, capture_output=True)
        try:
            wait_until(lambda: not shared_reason(c).startswith(
                "shared filesystem directory missing"), "the probe to see the mount")
            reason = shared_reason(c)
            assert reason.startswith("shared filesystem read-only file system"), reason
            assert "permission denied" not in reason
        finally:
            subprocess.run(["umount", str(root)], check=True, capture_output=True)
