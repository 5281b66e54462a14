"""`kvpool bench` on a machine without its baselines' extras: it runs what it can and says,
before it starts, what it left out and how to get it; with nothing left, one error line.

The packages are made absent the way Python itself knows (`sys.modules[name] = None` makes
`import name` fail) and `redis-server` by a PATH without it; kvpool runs unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvpool.bench.trace import bundled_trace_path

WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
sys.argv = ["kvpool", *sys.argv[2:]]
from kvpool.agent.cli import main
main()
"""


def bench_without(modules: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`kvpool bench ARGS` where `modules` cannot be imported and PATH has no redis-server."""
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": ":".join(sys.path[1:])}
    return subprocess.run([sys.executable, "-c", WITHOUT, modules, "bench", *args],
                          capture_output=True, text=True, timeout=600, env=env,
                          stdin=subprocess.DEVNULL)


def test_a_part_that_cannot_run_at_all_is_one_error_line_saying_what_to_install() -> None:
    run = bench_without("redis", "--quick", "--part", "data")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: --part data needs the redis-server program (apt-get install redis-server) "
        "and the redis package (pip install redis)"], run.stderr


def test_the_bench_runs_what_it_can_and_names_what_it_left_out_first(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(bundled_trace_path().read_text().splitlines(True)[:60]))
    out = tmp_path / "out"
    run = bench_without("redis,moto.server,libcachesim,matplotlib", "--quick", "--json",
                        "--part", "data", "--part", "tiers", "--part", "hit-ratio",
                        "--trace", str(trace), "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    told = run.stderr.splitlines()
    assert [line.split(":")[0] for line in told[:4]] == ["left out"] * 4, told[:6]
    assert "left out: data (the data part: G2 vs memcpy and Redis): needs the redis-server " \
        "program (apt-get install redis-server) and the redis package (pip install redis)" \
        in told
    assert "left out: g4 (the tiers part's G4 figures): needs a moto S3 server " \
        "(pip install 'moto[server]')" in told
    assert any(line.startswith("left out: libcachesim") and "pip install libcachesim" in line
               for line in told)
    assert any(line.startswith("left out: plots") and "pip install matplotlib" in line
               for line in told)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result["meta"]["skipped"]) == {"data", "g4", "libcachesim", "plots"}
    assert result["meta"]["parts"] == ["tiers", "hit-ratio"]
    assert result["g3"]["write_gbps"] > 0 and "g4" not in result  # G3 kept, G4 left out
    assert "g2" not in result and "redis" not in result
    assert all("libcachesim" not in cap for cap in result["trace"]["capacities"])
    assert json.loads((out / "bench.json").read_text())["g3"] == result["g3"]
    assert not list(out.glob("*.png"))
    # Captured, not a terminal: the tables are printed whole, no header cut to `capa…`.
    assert "…" not in run.stderr and "capacity" in run.stderr
    assert any("adaptive" in line and "MIN (sim)" in line for line in told), run.stderr
