"""The `kvpool` command as a user runs it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent import __version__
from kvpool.agent.client import KVPoolClient, default_socket
from kvpool.agent.units import human_size
from kvpool.bench.local import LocalAgent, free_port

from ..support import REPO_ROOT
from .conftest import wait_until
from .test_tenants import TENANTS, TenantAgent


def kvpool(*args: str, timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.agent", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)


def test_demo_json_reports_all_three_tiers_and_hit_ratios() -> None:
    run = kvpool("demo", "--json", "--requests", "150")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["requests"] == 150
    assert report["wrong_bytes"] == 0
    assert 0 < report["local_hit_ratio"] <= report["block_hit_ratio"]
    # Write-through, every upload landed before the next request: the shared tier serves
    # every block an unbounded cache would, however loaded the machine (docs/shared-tier.md).
    assert report["uploads_dropped"] == 0
    assert report["block_hit_ratio"] == report["unbounded_hit_ratio"] <= 1
    assert report["bytes_read"] > 0 and report["bytes_written"] > 0
    assert report["block_bytes"] == 16 * 1024
    assert report["events_published"] > 0  # the demo publishes KV events by default
    tiers = report["tiers"]
    assert set(tiers) == {"dram", "nvme", "shared"}
    assert tiers["dram"]["capacity_bytes"] > 0 and tiers["dram"]["hits"] > 0
    assert tiers["nvme"]["capacity_bytes"] > 0
    assert tiers["shared"]["capacity_bytes"] == 0  # the store's, unbounded for the agent
    hits = sum(t["hits"] for t in tiers.values())
    assert hits == round(report["block_hit_ratio"] * report["blocks"])
    local = tiers["dram"]["hits"] + tiers["nvme"]["hits"]
    assert local == round(report["local_hit_ratio"] * report["blocks"])


def test_demo_with_two_nodes_says_how_many_hits_came_from_the_peer() -> None:
    run = kvpool("demo", "--json", "--nodes", "2", "--requests", "120", "--no-events")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["nodes"] == 2 and report["requests_per_node"] == 60
    assert report["wrong_bytes"] == 0 and report["inventory_synced"]
    node1, node2 = report["node1"], report["node2"]
    # Node 1 ran first: its peer, node 2, held nothing then.
    assert node1["tiers"]["peer"]["hits"] == 0 and node1["bytes_written"] > 0
    # Node 2 replayed the same requests: what node 1 still held came from it, the rest of
    # what node 1 had stored from the shared tier (write-through), so every block node 1
    # hit or stored was a hit on node 2 (a block node 1's small DRAM refused is a miss on
    # both). Its agent counted the same peer hits as the replay.
    assert report["peer_hits"] == node2["tiers"]["peer"]["hits"] > 0
    node1_had = sum(t["hits"] for t in node1["tiers"].values()) \
        + node1["bytes_written"] // node1["block_bytes"]
    assert sum(t["hits"] for t in node2["tiers"].values()) == node1_had
    assert node2["tiers"]["shared"]["hits"] > 0  # what node 1 evicted
    assert f"node 2: {report['peer_hits']} of its" in run.stderr  # the line for a reader


def test_demo_runs_one_or_two_nodes() -> None:
    run = kvpool("demo", "--nodes", "3", timeout=60)
    assert run.returncode == 2
    assert "invalid value for '--nodes': 3" in run.stderr


def test_demo_without_a_shared_tier() -> None:
    run = kvpool("demo", "--json", "--requests", "100", "--shared", "none")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(report["tiers"]) == {"dram", "nvme"}
    assert report["local_hit_ratio"] == report["block_hit_ratio"]


def test_demo_removes_its_directory_after_it_reports(tmp_path: Path) -> None:
    """The chunk files go in a detached process (tens of thousands of unlinks for the full
    trace): the report does not wait for them, but nothing is left behind."""
    run = kvpool("demo", "--json", "--requests", "50", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["wrong_bytes"] == 0
    wait_until(lambda: not list(tmp_path.glob("kvpool-demo-*")), what="the demo's directory to go")


def test_demo_runs_from_the_repository_root() -> None:
    """`python -m kvpool.agent demo` from a checkout's root: `python -m` puts the working
    directory first on sys.path, so nothing at the root may shadow a module the agent (or the
    standard library) imports, and the processes the demo starts run there too."""
    run = subprocess.run([sys.executable, "-m", "kvpool.agent", "demo", "--json",
                          "--requests", "20", "--shared", "none"], capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["wrong_bytes"] == 0


def test_stats_command_prints_json(agent: LocalAgent, client: KVPoolClient) -> None:
    client.put(b"k" * 16, b"v" * 100)
    run = kvpool("stats", "--socket", str(agent.socket_path), "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["tiers"]["dram"]["chunks"] == 1


def test_agent_rejects_a_bad_config_with_the_field_named(tmp_path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("tiers:\n  dram:\n    size: huge\n")
    run = kvpool("agent", "--config", str(cfg), timeout=60)
    assert run.returncode == 2
    assert "tiers.dram.size" in run.stderr and "'huge' is not a size" in run.stderr


def test_stats_on_a_missing_socket_fails_clearly(tmp_path) -> None:
    run = kvpool("stats", "--socket", str(tmp_path / "nope.sock"), timeout=60)
    assert run.returncode == 2 and "cannot reach the agent" in run.stderr


def test_gc_all_deletes_every_chunk_of_a_file_shared_tier(tmp_path) -> None:
    from kvpool.agent.config import SharedTier
    from kvpool.agent.protocol import checksum
    from kvpool.agent.tiers.base import ChunkRecord
    from kvpool.agent.tiers.factory import open_shared_tier

    url = f"file://{tmp_path / 'shared'}"
    tier = open_shared_tier(SharedTier(url=url))
    for i in range(3):
        data = bytes([i]) * 1000
        tier.write(ChunkRecord(bytes([i]) * 16, data, checksum(data)))
    assert len(list(tier.keys())) == 3
    run = kvpool("gc", "--shared", url, "--all", "--json", timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["deleted"] == 3
    assert list(tier.keys()) == []
    tier.close()


# --------------------------------------------------------------------------- errors a user sees


def error_line(run: subprocess.CompletedProcess[str]) -> str:
    """The command's stderr, which must be exactly one `error: ...` line."""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    return lines[0]


def shm_arena(tmp_path: Path) -> Path:
    """An arena path of this test's own under /dev/shm (the agent's journal goes beside it)."""
    digest = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    return Path("/dev/shm") / f"kvpool-cli-test-{digest}.arena"


@pytest.fixture
def arena_path(tmp_path: Path) -> Iterator[Path]:
    path = shm_arena(tmp_path)
    yield path
    for p in (path, *(path.with_suffix(x) for x in (".journal", ".stores", ".lock"))):
        p.unlink(missing_ok=True)


def left_in_shm(arena: Path) -> list[Path]:
    """What an agent with this arena has in /dev/shm: the arena, its journal, its record of
    shared stores and its lock."""
    return [p for p in (arena, *(arena.with_suffix(x) for x in (".journal", ".stores", ".lock")))
            if p.exists()]


def test_version_prints_the_package_version() -> None:
    run = kvpool("--version", timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"kvpool {__version__}"


def test_demo_with_a_missing_trace_names_the_flag_and_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    run = kvpool("demo", "--trace", str(missing), timeout=60)
    assert run.returncode == 2
    line = error_line(run)
    assert "--trace" in line and str(missing) in line and "No such file" in line


def test_bench_with_an_unknown_part_names_the_flag_and_the_parts() -> None:
    run = kvpool("bench", "--part", "hit-ratio", "--part", "hitratio", timeout=60)
    assert run.returncode == 2  # before any part runs
    line = error_line(run)
    assert "--part hitratio" in line and "hit-ratio" in line and "scale" in line


def test_demo_with_a_bad_size_names_the_flag() -> None:
    run = kvpool("demo", "--block-bytes", "10XB", timeout=60)
    assert run.returncode == 2
    assert "'--block-bytes'" in error_line(run) and "'10XB' is not a size" in run.stderr


def test_agent_with_a_bad_dram_size_names_the_flag_not_the_config_field() -> None:
    run = kvpool("agent", "--dram", "10XB", timeout=60)
    assert run.returncode == 2
    line = error_line(run)
    assert "'--dram'" in line and "'10XB' is not a size" in line
    assert "tiers.dram.size" not in line and "pydantic" not in line


def test_agent_with_a_bad_flag_value_names_that_flag() -> None:
    run = kvpool("agent", "--metrics-addr", "nowhere", timeout=60)
    assert run.returncode == 2
    assert "'--metrics-addr'" in error_line(run)


@pytest.mark.parametrize(("args", "said"), [
    (("agent", "--no-such-flag"), "No such option: --no-such-flag"),
    (("demo", "--trace"), "Option '--trace' requires an argument"),
    (("no-such-command",), "No such command 'no-such-command'"),
    (("render", "--no-such-flag"), "No such option: --no-such-flag"),  # the operator's app
])
def test_click_usage_errors_are_one_line_like_every_other_error(
        args: tuple[str, ...], said: str) -> None:
    run = kvpool(*args, timeout=60)
    assert run.returncode == 2
    assert error_line(run).startswith(f"error: {said}")


def test_agent_that_cannot_make_its_socket_says_so_and_leaves_nothing(
        tmp_path: Path, arena_path: Path) -> None:
    """`--socket /etc/hostname/agent.sock`: the socket's directory is a file. The start fails
    in one line naming --socket, and the arena and journal it opened are gone again."""
    not_a_dir = tmp_path / "hostname"
    not_a_dir.write_text("node-1\n")
    sock = not_a_dir / "agent.sock"
    run = kvpool("agent", "--socket", str(sock), "--arena", str(arena_path), "--dram", "16Mi",
                 "--no-lock", "--metrics-addr", f"127.0.0.1:{free_port()}", timeout=120)
    assert run.returncode == 2
    line = error_line(run)
    assert "--socket" in line and str(sock) in line
    assert left_in_shm(arena_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostname"]


def test_agent_that_cannot_make_its_state_dir_names_the_flag_and_leaves_nothing(
        tmp_path: Path, arena_path: Path) -> None:
    """`--state-dir` below a file: the start fails in one line naming --state-dir, and the
    arena, journal and socket it had made are gone again."""
    not_a_dir = tmp_path / "state"
    not_a_dir.write_text("")
    state = not_a_dir / "pool"
    run = kvpool("agent", "--socket", str(tmp_path / "agent.sock"), "--arena", str(arena_path),
                 "--dram", "16Mi", "--no-lock", "--state-dir", str(state),
                 "--metrics-addr", f"127.0.0.1:{free_port()}", timeout=120)
    assert run.returncode == 2
    line = error_line(run)
    assert "--state-dir" in line and str(state) in line
    assert left_in_shm(arena_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_agent_whose_metrics_port_is_taken_leaves_no_file_or_directory(
        tmp_path: Path, arena_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        run = kvpool("agent", "--socket", str(tmp_path / "run" / "kvpool" / "agent.sock"),
                     "--arena", str(arena_path), "--dram", "16Mi", "--no-lock",
                     "--nvme-dir", str(tmp_path / "nvme"), "--nvme", "16Mi",
                     "--state-dir", str(tmp_path / "var" / "state"),
                     "--metrics-addr", f"127.0.0.1:{port}", timeout=120)
    assert run.returncode == 1
    assert "--metrics-addr" in error_line(run)
    assert left_in_shm(arena_path) == []
    assert list(tmp_path.iterdir()) == []


def test_a_failed_start_removes_the_record_of_the_shared_store_it_made(
        tmp_path: Path, arena_path: Path) -> None:
    """The start opened a file:// shared tier, so it recorded (and initialised) the store
    before its metrics port failed: the record goes with the arena; the store stays one."""
    store = tmp_path / "store"
    store.mkdir()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        run = kvpool("agent", "--socket", str(tmp_path / "agent.sock"), "--arena",
                     str(arena_path), "--dram", "16Mi", "--no-lock", "--shared",
                     store.as_uri(), "--metrics-addr", f"127.0.0.1:{taken.getsockname()[1]}",
                     timeout=120)
    assert run.returncode == 1, run.stderr
    assert left_in_shm(arena_path) == []
    assert [p.name for p in store.iterdir()] == [".kvpool-store"]  # other nodes may use it


def test_agent_refuses_a_file_shared_tier_whose_directory_is_missing(
        tmp_path: Path, arena_path: Path) -> None:
    """`--shared file:///mistyped/dir` is one error line naming the flag, and nothing is
    made: an absent mount never becomes an empty store (as `kvpool gc` refuses it too)."""
    missing = tmp_path / "mistyped" / "dir"
    common = ("--socket", str(tmp_path / "agent.sock"), "--arena", str(arena_path), "--dram",
              "16Mi", "--no-lock", "--metrics-addr", f"127.0.0.1:{free_port()}")
    run = kvpool("agent", *common, "--shared", missing.as_uri(), timeout=120)
    assert run.returncode == 2
    line = error_line(run)
    assert f"--shared {missing.as_uri()}: {missing} is not a directory" in line
    assert not (tmp_path / "mistyped").exists() and left_in_shm(arena_path) == []
    config = tmp_path / "agent.yaml"  # the same from a config file names its field
    config.write_text(f"tiers: {{shared: {{url: '{missing.as_uri()}'}}}}\n")
    run = kvpool("agent", *common, "--config", str(config), timeout=120)
    assert run.returncode == 2 and "tiers.shared.url file://" in error_line(run)
    assert not (tmp_path / "mistyped").exists()


def test_agent_whose_used_store_directory_is_gone_starts_with_the_tier_unhealthy(
        tmp_path: Path) -> None:
    """Not a typo but an absent mount of a store this agent has used (its record says so):
    it starts, serves the local tiers, and waits for the mount, making nothing there."""
    store = tmp_path / "mnt" / "store"
    store.mkdir(parents=True)
    first = LocalAgent("--no-lock", "--shared", store.as_uri(), workdir=tmp_path,
                       dram="16Mi").start()
    first.stop(remove_arena=False)
    try:
        for p in store.iterdir():
            p.unlink()
        store.rmdir()
        with LocalAgent("--no-lock", "--shared", store.as_uri(), workdir=tmp_path,
                        dram="16Mi") as again, KVPoolClient(again.socket_path) as c:
            assert c.put(b"u" * 16, b"local") and c.get(b"u" * 16) == b"local"
            assert c.stats()["tiers"]["shared"]["healthy"] is False
        assert not store.exists()
    finally:
        first.stop()


def test_a_socket_path_over_the_kernel_limit_is_one_line_naming_socket_and_the_limit(
        tmp_path: Path) -> None:
    too_long = tmp_path / ("s" * 120) / "agent.sock"
    for command in (("agent", "--no-lock", "--dram", "16Mi"), ("stats",), ("events",),
                    ("cleanup",)):
        run = kvpool(*command, "--socket", str(too_long), timeout=60)
        assert run.returncode == 2, run.stderr
        line = error_line(run)
        assert "--socket" in line and "at most 107 bytes" in line, line
    run = kvpool("stats", env={**os.environ, "KVPOOL_SOCKET": str(too_long)}, timeout=60)
    assert run.returncode == 2 and "$KVPOOL_SOCKET" in error_line(run)
    # A tenant's socket is longer than the pool's: it is checked too.
    pool_socket = tmp_path / ("p" * max(1, 90 - len(str(tmp_path)))) / "a.sock"
    run = kvpool("agent", "--no-lock", "--socket", str(pool_socket), "--tenant", "t" * 20,
                 timeout=60)
    assert run.returncode == 2 and "tenant tttttttttttttttttttt's socket" in error_line(run)
    assert "at most 107 bytes" in run.stderr


def test_stats_on_a_socket_below_a_regular_file_names_the_flag(tmp_path: Path) -> None:
    (tmp_path / "hostname").write_text("node-1\n")
    run = kvpool("stats", "--socket", str(tmp_path / "hostname" / "agent.sock"), timeout=60)
    assert run.returncode == 2
    assert error_line(run).startswith(f"error: --socket {tmp_path}/hostname/agent.sock: ")
    assert "Not a directory" in run.stderr


def test_crds_into_a_path_that_is_a_file_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    taken = tmp_path / "crds"
    taken.write_text("not a directory\n")
    run = kvpool("crds", "-o", str(taken), timeout=60)
    assert run.returncode == 2
    assert error_line(run) == f"error: --output-dir {taken}: exists and is not a directory"
    run = kvpool("crds", "-o", str(taken / "below"), timeout=60)
    assert run.returncode == 2 and "--output-dir" in error_line(run)
    assert taken.read_text() == "not a directory\n"


def test_failed_start_keeps_the_arena_a_previous_run_left(tmp_path: Path) -> None:
    """What existed before a start is not the start's to remove: a warm arena survives a
    start that fails, and the next good start serves its chunks."""
    key, data = b"w" * 16, b"warm" * 1000
    first = LocalAgent("--no-lock", workdir=tmp_path, dram="16Mi").start()
    with KVPoolClient(first.socket_path) as c:
        c.put(key, data)
    first.stop(remove_arena=False)
    try:
        assert first.arena_path.exists()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = taken.getsockname()[1]
            run = kvpool("agent", "--socket", str(first.socket_path), "--arena",
                         str(first.arena_path), "--dram", "16Mi", "--no-lock",
                         "--metrics-addr", f"127.0.0.1:{port}", timeout=120)
        assert run.returncode == 1, run.stderr
        assert first.arena_path.exists() and first.arena_path.with_suffix(".journal").exists()
        with LocalAgent("--no-lock", workdir=tmp_path, dram="16Mi") as again, \
                KVPoolClient(again.socket_path) as c:
            assert c.get(key) == data
    finally:
        first.stop()


# --------------------------------------------------------------------------- stats, help


def test_stats_reads_the_socket_from_the_environment(agent: LocalAgent,
                                                      client: KVPoolClient) -> None:
    client.put(b"e" * 16, b"v" * 100)
    run = kvpool("stats", "--json", env={**os.environ, "KVPOOL_SOCKET": str(agent.socket_path)})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["tiers"]["dram"]["chunks"] == 1


def test_stats_and_the_client_default_to_the_socket_the_agent_serves_by_default() -> None:
    """One default everywhere: --socket, else $KVPOOL_SOCKET, else where `kvpool agent`
    serves when given no --socket. Without either, stats tries the agent's default and says
    how to name another."""
    from kvpool.agent.config import AgentConfig

    default = str(AgentConfig().socket_path)
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_SOCKET"}
    for command in (("stats",), ("events", "--count", "1")):
        run = kvpool(*command, env=env, timeout=60)
        assert run.returncode == 2
        line = error_line(run)
        assert f"cannot reach the agent at {default}:" in line, line
        assert "the agent's default" in line and "--socket" in line and "KVPOOL_SOCKET" in line
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVPOOL_SOCKET", raising=False)
        assert default_socket() == default
        mp.setenv("KVPOOL_SOCKET", "/elsewhere/agent.sock")
        assert default_socket() == "/elsewhere/agent.sock"
        assert default_socket("/given.sock") == "/given.sock"


def test_a_client_without_arguments_connects_to_the_socket_in_the_environment(
        agent: LocalAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_SOCKET", str(agent.socket_path))
    with KVPoolClient() as c:
        assert c.socket_path == str(agent.socket_path) and c.put(b"d" * 16, b"v")
    monkeypatch.delenv("KVPOOL_SOCKET")
    # No agent serves the default here: the client tries it (an OSError), where it used to
    # refuse to start without a socket (a ValueError).
    with pytest.raises(FileNotFoundError) as missing:
        KVPoolClient(reconnect_timeout=0)
    assert missing.value.filename == default_socket()
    assert str(missing.value).endswith(f"No such file or directory: '{default_socket()}'")


def test_stats_prints_sizes_for_people_and_no_python_structures(
        agent: LocalAgent, client: KVPoolClient) -> None:
    client.put(b"h" * 16, b"v" * 100)
    run = kvpool("stats", "--socket", str(agent.socket_path),
                 env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    assert "32.0 MiB" in run.stdout and "4.0 KiB" in run.stdout  # capacity, one page used
    assert "read leases 0" in run.stdout and "write leases 0" in run.stdout
    for python_syntax in ("{", "}", "[", "]", "'"):
        assert python_syntax not in run.stdout, run.stdout


def test_stats_of_every_tier_prints_no_python_structures(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    shared = (tmp_path / "shared").as_uri()
    with LocalAgent("--no-lock", "--nvme-dir", str(tmp_path / "nvme"), "--nvme", "64Mi",
                    "--shared", shared, workdir=tmp_path, dram="16Mi") as a:
        with KVPoolClient(a.socket_path) as c:
            for i in range(8):  # more than DRAM holds: some go down to NVMe
                c.put(bytes([i]) * 16, b"x" * (3 << 20))
        run = kvpool("stats", "--socket", str(a.socket_path),
                     env={**os.environ, "COLUMNS": "250"})
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    assert "nvme │ 64.0 MiB" in text and "shared │ unbounded" in text
    assert shared in text and "uploads:" in text and "in flight" in text
    for python_syntax in ("{", "}", "[", "]", "'"):
        assert python_syntax not in run.stdout, run.stdout


def not_a_terminal_env() -> dict[str, str]:
    """The environment of a pipe or a capture: no terminal width given."""
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}


def test_output_piped_or_captured_is_printed_in_whole_lines(tmp_path: Path) -> None:
    """Not a terminal: no line is cut at 80 columns (the demo's hint for `kvpool events`,
    a stats table's notes, the demo's headline)."""
    run = kvpool("demo", "--requests", "20", env=not_a_terminal_env())
    assert run.returncode == 0, run.stderr
    hint = next(line for line in run.stdout.splitlines() if line.startswith("KV events on"))
    assert "in another terminal, kvpool events --endpoint tcp://127.0.0.1:" in hint, hint
    headline = next(line for line in run.stdout.splitlines() if line.startswith("block hit"))
    assert headline.rstrip().endswith(tuple("0123456789")) and "wrong bytes: 0" in headline

    store = tmp_path / ("a-long-directory-name-for-the-shared-store" * 2)
    store.mkdir()
    with LocalAgent("--no-lock", "--shared", store.as_uri(), workdir=tmp_path,
                    dram="16Mi") as a:
        run = kvpool("stats", "--socket", str(a.socket_path), env=not_a_terminal_env())
    assert run.returncode == 0, run.stderr
    row = next(line for line in run.stdout.splitlines() if "shared" in line)
    assert store.as_uri() in row and "uploads: 0 pending, 0 in flight" in row, run.stdout


def test_human_size_is_one_format_for_every_size() -> None:
    cases = {0: "0 B", 100: "100 B", 1023: "1023 B", 1024: "1.0 KiB", 4096: "4.0 KiB",
             35136 * 1024: "34.3 MiB", 64 << 20: "64.0 MiB", (1 << 20) - 1: "1.0 MiB",
             3 << 29: "1.5 GiB", 1 << 40: "1.0 TiB"}
    assert {n: human_size(n) for n in cases} == cases


def test_help_shows_defaults_and_no_type_noise() -> None:
    run = kvpool("agent", "--help", timeout=60)
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())  # as wrapped for any terminal width
    assert "--dram SIZE DRAM arena size (G2). [default: 1Gi]" in text
    assert "--socket PATH Unix socket to serve on. [default: /run/kvpool/agent.sock]" in text
    assert "--no-lock Do not mlock the arena." in text
    assert "<bool>" not in text and "<str>" not in text and "<path>" not in text, run.stdout


COMMANDS = ("agent", "cleanup", "stats", "events", "demo", "bench", "gc", "crds", "render",
            "operator")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_help_shows_what_a_flag_takes_not_its_python_type(command: str) -> None:
    """The operator's commands too (`kvpool operator --help` showed `<str>`)."""
    run = kvpool(command, "--help", timeout=60)
    assert run.returncode == 0, run.stderr
    types = re.findall(r"<(?:bool|str|text|int|integer|float|path|list[^>]*|dict[^>]*)>",
                       run.stdout)
    assert types == [], run.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_unknown_flag_is_one_error_line(command: str) -> None:
    run = kvpool(command, "--no-such-flag", timeout=60)
    assert run.returncode == 2
    assert error_line(run).startswith("error: No such option: --no-such-flag")


# --------------------------------------------------------------------------- cleanup


def test_cleanup_frees_the_arena_a_stopped_agent_left(tmp_path: Path) -> None:
    a = LocalAgent("--no-lock", workdir=tmp_path, dram="16Mi").start()
    a.stop(remove_arena=False)
    journal = a.arena_path.with_suffix(".journal")
    try:
        assert a.arena_path.exists() and journal.exists()
        run = kvpool("cleanup", "--socket", str(a.socket_path), "--arena", str(a.arena_path),
                     timeout=60)
        assert run.returncode == 0, run.stderr
        assert left_in_shm(a.arena_path) == []
        assert f"removed {a.arena_path} (16.0 MiB)" in run.stdout
    finally:
        a.stop()


def test_cleanup_removes_the_record_of_the_shared_stores_a_stopped_agent_used(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    a = LocalAgent("--no-lock", "--shared", store.as_uri(), workdir=tmp_path,
                   dram="16Mi").start()
    a.stop(remove_arena=False)
    record = a.arena_path.with_suffix(".stores")
    try:
        assert record.exists()
        run = kvpool("cleanup", "--socket", str(a.socket_path), "--arena", str(a.arena_path),
                     timeout=60)
        assert run.returncode == 0, run.stderr
        assert left_in_shm(a.arena_path) == []
        assert f"removed {record} (" in run.stdout
    finally:
        a.stop()


def test_cleanup_frees_every_tenants_arena(tmp_path: Path) -> None:
    a = TenantAgent(tmp_path, "--no-lock", dram="32Mi").start()
    a.stop(remove_arena=False)
    try:
        arenas = [a.arena_of(t) for t in TENANTS]
        assert all(arena.exists() for arena in arenas)
        run = kvpool("cleanup", "--socket", str(a.pool_socket), "--arena", str(a.arena_path),
                     *(f"--tenant={t}" for t in TENANTS), timeout=60)
        assert run.returncode == 0, run.stderr
        assert [left_in_shm(arena) for arena in arenas] == [[], []]
        assert all(f"removed {arena} (16.0 MiB)" in run.stdout for arena in arenas)
    finally:
        a.stop()


def test_cleanup_refuses_while_the_agent_serves(agent: LocalAgent) -> None:
    run = kvpool("cleanup", "--socket", str(agent.socket_path), "--arena",
                 str(agent.arena_path), timeout=60)
    assert run.returncode == 1
    assert "serving" in error_line(run) and str(agent.socket_path) in run.stderr
    assert agent.arena_path.exists()
    with KVPoolClient(agent.socket_path) as c:
        assert c.put(b"s" * 16, b"still here")
        assert c.get(b"s" * 16) == b"still here"


def test_cleanup_refuses_while_an_agent_holds_the_arena_lock(agent: LocalAgent) -> None:
    """An agent whose socket file was removed no longer answers, but still holds its lock."""
    agent.socket_path.unlink()
    run = kvpool("cleanup", "--socket", str(agent.socket_path), "--arena",
                 str(agent.arena_path), timeout=60)
    assert run.returncode == 1
    assert "holds" in error_line(run) and agent.arena_path.exists()


def test_cleanup_refuses_while_a_client_still_maps_the_arena(tmp_path: Path) -> None:
    """The agent is gone but a zero-copy client keeps its mapping: removing the file would
    free nothing, and a restarted agent could not find its chunks again."""
    a = LocalAgent("--no-lock", workdir=tmp_path, dram="16Mi").start()
    c = KVPoolClient(a.socket_path, reconnect_timeout=0)
    try:
        c.put(b"m" * 16, b"mapped")
        a.stop(remove_arena=False)
        run = kvpool("cleanup", "--socket", str(a.socket_path), "--arena", str(a.arena_path),
                     timeout=60)
        assert run.returncode == 1
        assert str(os.getpid()) in error_line(run) and a.arena_path.exists()
    finally:
        c.close()
        a.stop()


def test_gc_errors_name_the_flag_and_make_no_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    run = kvpool("gc", "--shared", f"file://{missing}", "--all", timeout=60)
    assert run.returncode == 2
    assert "--shared" in error_line(run) and not (tmp_path / "no").exists()
    run = kvpool("gc", "--shared", "http://bucket/prefix", "--all", timeout=60)
    assert run.returncode == 2 and "'--shared'" in error_line(run)
    run = kvpool("gc", "--shared", f"file://{tmp_path}", "--ttl", "7x", timeout=60)
    assert run.returncode == 2 and "'--ttl'" in error_line(run)


def test_gc_on_an_unreachable_store_fails_in_one_line() -> None:
    run = kvpool("gc", "--shared", "s3://bucket/prefix", "--all", "--endpoint-url",
                 f"http://127.0.0.1:{free_port()}", timeout=120,
                 env={**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"})
    assert run.returncode == 1
    assert "Could not connect" in error_line(run)
