"""`kvpool bench --gpu`: what runs without a GPU (the one-line refusal, the pure parts, the
time-to-first-token experiment's code path on a tiny model on the CPU against a real agent).
No figure measured here is a GPU figure, and none is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvpool.bench import gpu
from kvpool.bench.local import LocalAgent

TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
              "max_position_embeddings": 2048}


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.agent", "bench", "--gpu", *args],
                          capture_output=True, text=True, timeout=300, env=os.environ.copy())


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_0() -> None:
    run = _bench()
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines() == [gpu.NO_CUDA]

    run = _bench("--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"gpu": None,
                                                               "skipped": gpu.NO_CUDA}


def test_a_chunk_is_k_of_every_layer_then_v_as_contiguous_slices() -> None:
    layers = [(torch.arange(8 * 2).view(8, 2) + 100 * n, -torch.arange(8 * 2).view(8, 2) - 1)
              for n in range(3)]
    segs = gpu.chunk_segments(layers, 1, chunk_tokens=4)
    assert len(segs) == 6 and all(s.is_contiguous() for s in segs)
    assert torch.equal(segs[0], layers[0][0][4:8]) and torch.equal(segs[5], layers[2][1][4:8])


def test_logits_agree_needs_the_same_argmax_and_the_cosine() -> None:
    a = torch.tensor([0.1, 3.0, 0.2])
    assert gpu.logits_agree(a, a * 1.01)["ok"]
    assert not gpu.logits_agree(a, torch.tensor([3.1, 3.0, 0.2]))["same_argmax"]


def test_targets_are_judged_from_the_measured_ratios() -> None:
    result = {"pool": {"32MiB": {"get_vs_h2d": 0.95, "put_vs_d2h": 0.5}},
              "ttft": {"8192": {"speedup": 9.0}, "32768": {"speedup": 12.0}}}
    judged = gpu.against_targets(result)
    assert judged["get_vs_h2d"]["met"] and not judged["put_vs_d2h"]["met"]
    assert judged["ttft_speedup_8k"]["met"] and not judged["ttft_speedup_32k"]["met"]


def test_the_ttft_experiment_loads_the_prefix_kv_from_the_pool_and_matches_the_prefill(
) -> None:
    """The GPU run's code path on a tiny Llama on the CPU: store the prefix's KV as
    per-layer segments, hit through LOOKUP + get_many_into, check the last-token logits."""
    pytest.importorskip("transformers")
    with LocalAgent("--no-lock", dram="32Mi") as agent:
        result = gpu.ttft(agent.socket_path, [2 * gpu.CHUNK_TOKENS], reps=1,
                          shape=TINY_LLAMA, device="cpu")
    row = result[str(2 * gpu.CHUNK_TOKENS)]
    assert row["same_argmax"] and row["cosine"] >= gpu.COSINE_MIN and row["ok"]
    assert set(row["hit_breakdown_s"]) == {"lookup", "load", "layout", "forward"}
