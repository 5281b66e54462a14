"""`kvpool bench --part vllm`: vLLM engines (the vLLM environment, tests/install-vllm) timing
the first token of a kvpool hit against a recompute; and, without that environment, one
error line saying how to get it.

No timing thresholds (figures depend on the machine; docs/benchmarks.md discusses them):
the shape of the result, and that engine B's hit was one (tokens came from the pool).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.bench.needs import vllm_python
from kvpool.bench.vllm_ttft import QUICK_TOKENS

ROW = {"recompute_ttft_s", "hit_ttft_s", "speedup", "hit_tokens", "prompt_tokens", "lookup_s",
       "load_s", "rest_s", "loaded_mib", "copy_s", "overhead_of_load", "best_load_s",
       "overhead_of_best_load", "cold_copy_s", "overhead_of_best_load_cold",
       "sum_copy_s", "best_load_copy_calls_s", "best_load_outside_copy_calls",
       "best_load_chunks_without_lease", "best_load_copy_calls_cpu_s", "arena_copy_s",
       "overhead_of_best_load_arena", "median_load_outside_copy_calls", "best_load_copies_s",
       "best_load_outside_copies", "median_load_outside_copies"}


def bench(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.agent", "bench", *args],
                          capture_output=True, text=True, timeout=840,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL)


@pytest.mark.alone  # three vLLM engines, each a process that takes a core or more
@pytest.mark.timeout(900)
def test_quick_vllm_part_times_a_hit_against_a_recompute_with_its_breakdown() -> None:
    if not vllm_python().exists():
        pytest.fail(f"no vLLM environment at {vllm_python()}: run tests/install "
                    "(tests/install-vllm)")
    run = bench("--quick", "--json", "--part", "vllm")
    assert run.returncode == 0, run.stderr[-5000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result) == {"meta", "vllm"}
    assert result["meta"]["parts"] == ["vllm"]
    v = result["vllm"]
    assert set(v["sizes"]) == {str(n) for n in QUICK_TOKENS}
    for n, row in v["sizes"].items():
        assert set(row) == ROW, row
        chunk = v["chunk_tokens"]
        # B loaded every whole chunk before the prompt's last token from the pool
        assert row["hit_tokens"] == (int(n) - 1) // chunk * chunk, row
        assert row["loaded_mib"] > 0 and row["load_s"] > 0 and row["lookup_s"] > 0, row
        assert row["recompute_ttft_s"] > 0 and row["hit_ttft_s"] > 0, row
        assert 0 <= row["overhead_of_load"] <= 1, row
        assert 0 < row["best_load_s"] <= row["load_s"], row
        assert row["overhead_of_best_load"] <= row["overhead_of_load"], row
        # the load's copies went through the compiled loop, and took part of the load
        assert 0 < row["best_load_copy_calls_s"] <= row["best_load_s"], row
        assert row["best_load_copy_calls_cpu_s"] > 0, row
        assert 0 < row["median_load_outside_copy_calls"] < 1, row
        # the copies alone, counted inside the compiled read: part of its call
        assert 0 < row["best_load_copies_s"] <= row["best_load_copy_calls_s"], row
        assert row["best_load_outside_copies"] >= row["best_load_outside_copy_calls"], row
        assert 0 < row["median_load_outside_copies"] < 1, row
        assert 0 < row["sum_copy_s"] < 1, row  # the compiled loop is in the vLLM environment
        # the load's source bytes copied again from the arena it read them from
        assert 0 < row["arena_copy_s"] < 1, row
        # every chunk of the fastest load was read without a lease (all in DRAM, one extent)
        assert row["best_load_chunks_without_lease"] == row["hit_tokens"] // chunk, row
        assert row["hit_ttft_s"] >= row["lookup_s"] + row["load_s"] - 1e-3, row
    assert "vLLM time to first token" in run.stderr


def test_without_a_vllm_environment_the_part_is_one_error_line_saying_how_to_get_it(
        tmp_path: Path) -> None:
    run = bench("--quick", "--part", "vllm", KVPOOL_VLLM_PYTHON=str(tmp_path / "no-python"))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: --part vllm needs a vLLM environment with kvpool in it (tests/install-vllm "
        "from a checkout, or KVPOOL_VLLM_PYTHON=its python)"], run.stderr
