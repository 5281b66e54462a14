"""`kvpool bench --part vllm`: vLLM's time to first token with a kvpool hit vs recomputed.

Three fresh engines (`vllm_engine`, each a process of the vLLM environment, as pods would
be) start together on a model written here (random weights, a Llama shape with few layers
but a wide hidden size, so prefill dominates): engine A with kvpool's connector serves each
prompt once (the pool stores it), then a reference engine with no connector recomputes each
prompt, then engine B with the connector (same tenant, never served these prompts) loads it
from the pool. Only one engine works at a time (the others wait on their pipes), so the
timings do not contend with each other. Each engine serves a warm-up prompt first.

Per prompt size: both times to first token, their ratio, and B's breakdown: the
connector's lookup, its loads, the rest (the prefill of the tail, the output token, vLLM);
and the connector's own overhead, the load time less what a plain copy of the same bytes
takes, as a fraction of the load time: of B's first run, and of the fastest of its
`HIT_RUNS` runs of the prompt; and the connector's own time (the load less its copy calls)
as a share of the load, of the fastest load and the median of every run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import kvpool

from .engine_process import EngineProcess
from .local import LocalAgent
from .needs import vllm_python

FULL_TOKENS = [2048, 8192, 16384]
QUICK_TOKENS = [512]
FULL_SHAPE = {"layers": 2, "hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128,
              "intermediate": 8192}
"""~130M parameters in 2 layers: the width of a 1B model, prefill-bound on a CPU."""
QUICK_SHAPE = {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64,
               "intermediate": 1024}
"""--quick (CI): the same shape, narrow, so that three engine starts stay cheap."""
CONNECTOR = {"kv_connector": "KVPoolConnector",
             "kv_connector_module_path": "kvpool.agent.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
WARM_UP = 256
"""Tokens of the prompt each engine serves first (its one-time costs are not timed)."""
HIT_RUNS = 3
"""Times engine B serves each prompt (its prefix cache emptied each time, so each run loads
from the pool again): the first run is the hit as a pod meets it; the fastest load of the
runs is compared, as `copy_s` is, best against best (one run of each on a shared machine
compares a moment's load with the machine's best copy)."""
HIT_RUNS_FULL = 7
"""`HIT_RUNS` of the full form (not --quick): enough loads for a median that one slow or
one lucky load does not move (each costs one time to first token of a hit)."""


def prompt(seed: int, n: int) -> list[int]:
    """`n` token ids of the model's vocabulary (1000; ids 0-2 are special)."""
    return [(i * 7919 + seed * 104729 + seed * i * 31) % 990 + 5 for i in range(n)]


def _engine(name: str, model: Path, max_len: int, workdir: Path, env: dict[str, str],
            connector: dict[str, Any] | None) -> EngineProcess:
    args = [str(vllm_python()), "-m", "kvpool.bench.vllm_engine", "serve", str(model),
            str(max_len)] + ([json.dumps(connector)] if connector else [])
    return EngineProcess(name, args, env, workdir)


def run_vllm(quick: bool) -> dict[str, Any]:
    sizes, shape = (QUICK_TOKENS, QUICK_SHAPE) if quick else (FULL_TOKENS, FULL_SHAPE)
    chunk = 64 if quick else 256
    runs = HIT_RUNS if quick else HIT_RUNS_FULL
    max_len = max(sizes) + 64
    kv_bytes_per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 4
    stored = (sum(sizes) + 2 * WARM_UP) * kv_bytes_per_token
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-") as tmp:
        work = Path(tmp)
        root = str(Path(next(iter(kvpool.__path__))).parent)  # this kvpool, in the engines
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CPU_KVCACHE_SPACE=str(1 + 3 * max_len * kv_bytes_per_token // 2**30),
                   KVPOOL_CHUNK_TOKENS=str(chunk), KVPOOL_TENANT="bench",
                   PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        model = work / "model"
        subprocess.run([str(vllm_python()), "-m", "kvpool.bench.vllm_engine", "model",
                        str(model), json.dumps({**shape, "max_len": max_len})],
                       check=True, env=env, cwd=work, stdout=subprocess.DEVNULL)
        dram = f"{2 * stored // 2**20 + 64}Mi"
        (work / "agent").mkdir()
        with LocalAgent(workdir=work / "agent", dram=dram) as agent:
            env["KVPOOL_SOCKET"] = str(agent.socket_path)
            engines = {name: _engine(name, model, max_len, work, env,
                                     None if name == "reference" else CONNECTOR)
                       for name in ("A", "reference", "B")}
            try:
                starts = {name: e.read()["start_s"] for name, e in engines.items()}
                for seed, e in enumerate(engines.values()):  # one-time costs, untimed
                    e("ttft", prompt=prompt(100 + seed, WARM_UP))
                prompts = {n: prompt(n, n) for n in sizes}
                for p in prompts.values():
                    engines["A"]("ttft", prompt=p)  # stored when it returns
                reference = {n: engines["reference"]("ttft", prompt=p)
                             for n, p in prompts.items()}
                hit = {n: [engines["B"]("ttft", prompt=p) for _ in range(runs)]
                       for n, p in prompts.items()}
            finally:
                for e in engines.values():
                    e.quit()
    return {"model": {**shape, "dtype": "float32", "weights": "random"},
            "chunk_tokens": chunk, "engine_start_s": round(max(starts.values()), 1),
            "sizes": {str(n): _row(n, reference[n], hit[n]) for n in sizes}}


def _row(tokens: int, reference: dict[str, Any], hits: list[dict[str, Any]]) -> dict[str, Any]:
    hit, fastest = hits[0], min(hits, key=lambda h: float(h["load_s"]))
    load, best = hit["load_s"], fastest["load_s"]
    copy = min(h["copy_s"] for h in hits)  # the fastest plain copy of every run's
    cold = min(h["cold_copy_s"] for h in hits)  # one a run
    arena = min(h["arena_copy_s"] for h in hits)
    return {
        "recompute_ttft_s": round(reference["ttft_s"], 4),
        "hit_ttft_s": round(hit["ttft_s"], 4),
        "speedup": round(reference["ttft_s"] / hit["ttft_s"], 2),
        "hit_tokens": hit["cached_tokens"],
        "prompt_tokens": tokens,
        "lookup_s": round(hit["lookup_s"], 4),
        "load_s": round(load, 4),
        "rest_s": round(hit["ttft_s"] - hit["lookup_s"] - load, 4),
        "loaded_mib": round(hit["loaded_bytes"] / 2**20, 1),
        "copy_s": round(copy, 4),
        "overhead_of_load": _overhead(load, copy),
        "best_load_s": round(best, 4),
        "overhead_of_best_load": _overhead(best, copy),
        "cold_copy_s": round(cold, 4),
        "overhead_of_best_load_cold": _overhead(best, cold),
        "sum_copy_s": round(min(h["sum_copy_s"] for h in hits), 4),
        "arena_copy_s": round(arena, 4),
        "overhead_of_best_load_arena": _overhead(best, arena),
        "best_load_copy_calls_s": round(fastest["copy_call_s"], 4),
        "best_load_outside_copy_calls": _overhead(best, fastest["copy_call_s"]),
        "best_load_copy_calls_cpu_s": round(fastest["copy_call_cpu_s"], 4),
        "best_load_chunks_without_lease": int(fastest.get("chunks_without_lease", 0)),
        "median_load_outside_copy_calls": _median_share(
            [(h["load_s"], h["copy_call_s"]) for h in hits]),
        # the copies alone, counted inside the compiled read (None without it)
        "best_load_copies_s": _round(fastest.get("copies_s")),
        "best_load_outside_copies": None if fastest.get("copies_s") is None
        else _overhead(best, fastest["copies_s"]),
        "median_load_outside_copies": None if any(h.get("copies_s") is None for h in hits)
        else _median_share([(h["load_s"], h["copies_s"]) for h in hits]),
    }


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _median_share(loads: list[tuple[float, float]]) -> float | None:
    """The median over the runs of the connector's own share of each load (the load less
    its copy calls, of the load): what one run's luck or one slow wake-up does not move."""
    shares = sorted(s for load, copy in loads if (s := _overhead(load, copy)) is not None)
    return shares[len(shares) // 2] if shares else None


def _overhead(load: float, copy: float) -> float | None:
    """The connector's own overhead, all but the copies, as a fraction of the load."""
    return round((load - copy) / load, 3) if load > 0 else None
