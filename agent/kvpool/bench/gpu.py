"""`kvpool bench --gpu`: the GPU data path against the machine's pinned-memory limits, and
time to first token with a cache hit against a full prefill, in one run.

Parts:
- `pinned_limits`: torch copies between a pinned host buffer and the GPU (1 GiB): the
  PCIe ceiling every other figure is a ratio of.
- `pool_rates`: `put_many` GPU → pool and `get_many_into` pool → GPU through the public
  client API (registered arena, WSUM checksum on), at 1, 16 and 32 MiB chunks, as GB/s
  and as ratios of the pinned limits (targets: get ≥ 0.9, put ≥ 0.8 of the limit).
  `meta.copies` says how the client made the windows' copies (one `cuMemcpyBatchAsync`
  a window, or one `copy_` a piece and why); `meta.copies_all` the same, the `ttft`
  part's included.
- `ttft`: a Llama-3-8B-shaped model with random weights built from a `LlamaConfig`
  (nothing downloaded), bf16: a full prefill of prefix + 1 token against a hit (LOOKUP,
  load every 256-token chunk of the prefix's KV from the pool into per-layer buffers, one
  forward step of the last token), at 4k/8k/16k/32k tokens, with the hit's last-token
  logits checked against the prefill's (same argmax, cosine ≥ 0.998) and the hit's time
  broken down. Needs `transformers`.

Where torch sees no CUDA device it says so in one line and exits 0: nothing here is ever
measured on a CPU and reported as a GPU figure.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from .local import LocalAgent
from .stats import MiB

GiB = 1 << 30
CHUNK_SIZES = [1 * MiB, 16 * MiB, 32 * MiB]
TTFT_TOKENS = [4096, 8192, 16384, 32768]
QUICK_TTFT_TOKENS = [4096, 8192]
CHUNK_TOKENS = 256
COSINE_MIN = 0.998
TARGETS = {"get_vs_h2d": 0.9, "put_vs_d2h": 0.8, "ttft_speedup_8k": 8.0,
           "ttft_speedup_32k": 15.0}
LLAMA_3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 65536, "rope_theta": 500000.0}
NO_CUDA = "kvpool bench --gpu: no CUDA device here (torch sees none); nothing measured."


# --------------------------------------------------------------------------- pure parts


def ratio(value: float, limit: float) -> float:
    return round(value / limit, 3) if limit > 0 else 0.0


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def chunk_segments(layer_kv: Sequence[tuple[Any, Any]], chunk: int,
                   chunk_tokens: int = CHUNK_TOKENS) -> list[Any]:
    """The segments of chunk `chunk` of a paged-layout cache: per layer a (K, V) pair of
    [tokens, kv_heads, head_dim] buffers; K of every layer, then V (contiguous slices)."""
    rows = slice(chunk * chunk_tokens, (chunk + 1) * chunk_tokens)
    return [k[rows] for k, _ in layer_kv] + [v[rows] for _, v in layer_kv]


def logits_agree(full: Any, hit: Any) -> dict[str, Any]:
    """Same argmax and the cosine of two last-token logit vectors (bf16 kernels differ, so
    bit equality is not expected)."""
    import torch

    a, b = full.float().flatten(), hit.float().flatten()
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    same = bool(int(a.argmax()) == int(b.argmax()))
    return {"same_argmax": same, "cosine": round(cosine, 5),
            "ok": same and cosine >= COSINE_MIN}


def against_targets(result: dict[str, Any]) -> dict[str, Any]:
    """Each target with the figure measured for it and whether it is met."""
    out: dict[str, Any] = {}
    rates = result.get("pool", {}).get("32MiB")
    if rates:
        out["get_vs_h2d"] = {"target": TARGETS["get_vs_h2d"], "measured": rates["get_vs_h2d"],
                             "met": rates["get_vs_h2d"] >= TARGETS["get_vs_h2d"]}
        out["put_vs_d2h"] = {"target": TARGETS["put_vs_d2h"], "measured": rates["put_vs_d2h"],
                             "met": rates["put_vs_d2h"] >= TARGETS["put_vs_d2h"]}
    for tokens, name in ((8192, "ttft_speedup_8k"), (32768, "ttft_speedup_32k")):
        row = result.get("ttft", {}).get(str(tokens))
        if row:
            out[name] = {"target": TARGETS[name], "measured": row["speedup"],
                         "met": row["speedup"] >= TARGETS[name]}
    return out


# --------------------------------------------------------------------------- GPU parts


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], reps: int, device: str = "cuda") -> float:
    """Median seconds of `fn` with the device synchronised around each run."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def pinned_limits(nbytes: int = GiB, reps: int = 5) -> dict[str, float]:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), reps)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), reps)
    return {"h2d_gbps": gbps(nbytes, h2d), "d2h_gbps": gbps(nbytes, d2h)}


def pool_rates(socket_path: Path, limits: dict[str, float], total: int,
               reps: int) -> dict[str, Any]:
    """put_many / get_many_into between GPU tensors and the pool, per chunk size."""
    import torch

    from kvpool.agent.client import KVPoolClient

    cuda: Any = torch.cuda  # its Stream is untyped
    out: dict[str, Any] = {}
    with KVPoolClient(socket_path) as kv:
        for size in CHUNK_SIZES:
            n = max(1, total // size)
            src = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
                   for _ in range(n)]
            dst = [torch.empty_like(t) for t in src]
            stream = cuda.Stream()
            keys: list[bytes] = []
            put_times = []
            for rep in range(reps + 1):  # fresh keys each round (no dedup); the first warms up
                for k in keys:
                    kv.delete(k)
                keys = [os.urandom(16) for _ in range(n)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                results = kv.put_many(keys, src, stream=stream)  # returns after its fences
                if rep:
                    put_times.append(time.perf_counter() - t0)
                assert all(r is True for r in results), results
            t_put = sorted(put_times)[len(put_times) // 2]

            t_get = _timed(partial(_get_all, kv, keys, dst, stream), reps)
            exact = all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
            put_rate, get_rate = gbps(n * size, t_put), gbps(n * size, t_get)
            out[f"{size // MiB}MiB"] = {
                "chunks": n, "put_gbps": put_rate, "get_gbps": get_rate,
                "put_vs_d2h": ratio(put_rate, limits["d2h_gbps"]),
                "get_vs_h2d": ratio(get_rate, limits["h2d_gbps"]), "byte_exact": exact}
            for k in keys:
                kv.delete(k)
    return out


def _get_all(kv: Any, keys: list[bytes], dst: list[Any], stream: object) -> None:
    sizes = kv.get_many_into(keys, lambda i, s, m: dst[i], stream=stream)
    assert all(sizes), sizes


def _cache_layers(cache: Any) -> list[tuple[Any, Any]]:
    """(K, V) per layer of a transformers cache, each [batch, kv_heads, tokens, dim]."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


class TtftModel:
    """A Llama-shaped model with random weights and the pool it stores its KV in."""

    def __init__(self, kv: Any, shape: dict[str, Any], device: str) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from kvpool.agent.keys import Fingerprint

        torch.manual_seed(0)
        self.kv, self.device = kv, device
        self.config: Any = LlamaConfig(**shape)
        with torch.device(device):
            model: Any = LlamaForCausalLM(self.config)
            self.model: Any = model.to(torch.bfloat16).eval()
        c: Any = self.config
        self.fingerprint = Fingerprint("llama-random", "bfloat16", int(c.num_hidden_layers),
                                       int(c.num_key_value_heads),
                                       int(c.hidden_size // c.num_attention_heads),
                                       CHUNK_TOKENS)

    def last_logits(self, ids: Any, cache: Any = None) -> Any:
        out = self.model(ids, past_key_values=cache, use_cache=cache is not None,
                         logits_to_keep=1)
        return out.logits[0, -1]

    def store_prefix(self, prefix: Any) -> tuple[list[bytes], list[tuple[Any, Any]]]:
        """Prefill the prefix, put its KV in the pool as an engine with a paged cache holds
        it ([tokens, kv_heads, head_dim] per layer, K and V); the keys and empty buffers
        of the same layout to load it into."""
        import torch

        from kvpool.agent.keys import chunk_keys

        keys = chunk_keys(self.fingerprint, prefix[0].tolist())
        cache = self.model(prefix, use_cache=True, logits_to_keep=1).past_key_values
        paged = [(k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous())
                 for k, v in _cache_layers(cache)]
        results = self.kv.put_many(keys, [chunk_segments(paged, c) for c in range(len(keys))])
        assert all(r is not False and not isinstance(r, Exception) for r in results), results
        return keys, [(torch.empty_like(k), torch.empty_like(v)) for k, v in paged]

    def hit(self, keys: list[bytes], loaded: list[tuple[Any, Any]], last: Any,
            phases: dict[str, list[float]]) -> Any:
        """LOOKUP, load every chunk into `loaded`, one forward step of the last token."""
        import torch
        from transformers import DynamicCache

        stream = torch.cuda.current_stream() if self.device == "cuda" else None
        t0 = time.perf_counter()
        found = self.kv.lookup(keys)
        t1 = time.perf_counter()
        sizes = self.kv.get_many_into(keys[:found], lambda i, s, m: chunk_segments(loaded, i),
                                      stream=stream)
        _sync(self.device)
        t2 = time.perf_counter()
        cache = DynamicCache()
        for layer, (k, v) in enumerate(loaded):  # the paged layout as transformers wants it
            cache.update(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), layer)
        _sync(self.device)
        t3 = time.perf_counter()
        logits = self.last_logits(last, cache)
        _sync(self.device)
        t4 = time.perf_counter()
        if found != len(keys) or not all(sizes):
            raise RuntimeError(f"the pool held {found} of {len(keys)} chunks of the prefix")
        for name, dt in zip(("lookup", "load", "layout", "forward"),
                            (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases.setdefault(name, []).append(dt)
        return logits

    def measure(self, tokens: int, reps: int) -> dict[str, Any]:
        """Prefill of tokens + 1 against a hit on the first `tokens`, checked."""
        import torch

        ids = torch.randint(0, self.config.vocab_size, (1, tokens + 1), device=self.device)
        prefix, last = ids[:, :tokens], ids[:, tokens:]
        with torch.inference_mode():
            t_prefill = _timed(partial(self.last_logits, ids), reps, self.device)
            full = self.last_logits(ids)
            keys, loaded = self.store_prefix(prefix)
            phases: dict[str, list[float]] = {}
            t_hit = _timed(partial(self.hit, keys, loaded, last, phases), reps, self.device)
            check = logits_agree(full, self.hit(keys, loaded, last, {}))
        kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in loaded)
        for key in keys:
            self.kv.delete(key)
        return {"kv_gib": round(kv_bytes / GiB, 3), "prefill_s": round(t_prefill, 4),
                "hit_s": round(t_hit, 4), "speedup": round(t_prefill / t_hit, 2),
                "hit_breakdown_s": {k: round(sorted(v)[len(v) // 2], 4)
                                    for k, v in phases.items()},
                **check}


def ttft(socket_path: Path, token_counts: Sequence[int], reps: int,
         shape: dict[str, Any] | None = None, device: str = "cuda") -> dict[str, Any]:
    """Prefill vs hit at each prefix length (default shape: Llama-3-8B, random weights)."""
    from kvpool.agent.client import KVPoolClient

    with KVPoolClient(socket_path) as kv:
        bench = TtftModel(kv, shape or LLAMA_3_8B, device)
        return {str(t): bench.measure(t, reps) for t in token_counts}


def _copies() -> dict[str, object]:
    """How the client copied its tensor windows so far (one batch call a window, one
    copy_ a piece, or on the host) and whether the batch call works here."""
    from kvpool.agent import cudacopy

    return cudacopy.report()


def _machine() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"date": datetime.date.today().isoformat(), "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / GiB, 1), "cpus": os.cpu_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def run_gpu_bench(quick: bool, as_json: bool, out: Path | None) -> dict[str, Any] | None:
    """Run every GPU part; None (after one line saying why) when there is no CUDA device."""
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is None or not torch.cuda.is_available():
        print(json.dumps({"gpu": None, "skipped": NO_CUDA}) if as_json else NO_CUDA)
        return None
    from kvpool.agent.commandline import console as new_console

    console = new_console(stderr=as_json)
    reps = 3 if quick else 7
    result: dict[str, Any] = {"meta": {**_machine(), "quick": quick, "reps": reps}}
    console.print("pinned host <-> GPU limits")
    result["pinned"] = limits = pinned_limits()
    tokens = QUICK_TTFT_TOKENS if quick else TTFT_TOKENS
    dram = f"{max(8, (max(tokens) * 128 * 1024) // GiB + 4)}Gi"  # 128 KiB of KV per token
    with LocalAgent("--no-lock", "--max-chunk", "64Mi", dram=dram, start_timeout=120) as agent:
        console.print("put/get GPU <-> pool through the client API")
        result["pool"] = pool_rates(agent.socket_path, limits, 1 * GiB, reps)
        result["meta"]["copies"] = _copies()
        try:
            import transformers  # noqa: F401
        except ImportError:
            result["ttft"] = {"skipped": "transformers is not installed"}
        else:
            console.print("time to first token: prefill vs hit")
            result["ttft"] = ttft(agent.socket_path, tokens, max(3, reps // 2))
    result["meta"]["copies_all"] = _copies()
    result["targets"] = against_targets(result)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench-gpu.json").write_text(json.dumps(result, indent=2) + "\n")
        _plot(result, out / "ttft.png")
    _print_tables(console, result)
    if as_json:
        print(json.dumps(result))
    return result


def _plot(result: dict[str, Any], path: Path) -> None:
    rows = {int(k): v for k, v in result.get("ttft", {}).items() if isinstance(v, dict)}
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [rows[x]["prefill_s"] for x in xs], "o-", label="prefill (miss)")
    ax.plot(xs, [rows[x]["hit_s"] for x in xs], "o-", label="hit via kvpool")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("time to first token, s")
    ax.set_title(f"Llama-3-8B shape, random weights, {result['meta']['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_tables(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    p = r["pinned"]
    console.print(f"pinned limits: host→GPU {p['h2d_gbps']} GB/s, GPU→host {p['d2h_gbps']} GB/s")
    copies = r["meta"].get("copies_all", {})
    console.print(f"tensor windows copied: {copies.get('windows')}; batch call: "
                  f"{copies.get('batch_call')}")
    t = Table(title="GPU ↔ pool through put_many / get_many_into (ratio of the pinned limit)")
    for col in ("chunk", "put GB/s", "put/limit", "get GB/s", "get/limit", "byte-exact"):
        t.add_column(col)
    for label, row in r["pool"].items():
        t.add_row(label, str(row["put_gbps"]), str(row["put_vs_d2h"]), str(row["get_gbps"]),
                  str(row["get_vs_h2d"]), str(row["byte_exact"]))
    console.print(t)
    rows = {k: v for k, v in r.get("ttft", {}).items() if isinstance(v, dict)}
    if rows:
        t = Table(title="time to first token: prefill vs hit (LOOKUP + load + one step)")
        for col in ("tokens", "KV GiB", "prefill s", "hit s", "speed-up", "load s",
                    "forward s", "argmax", "cosine"):
            t.add_column(col)
        for tokens, row in rows.items():
            b = row["hit_breakdown_s"]
            t.add_row(tokens, str(row["kv_gib"]), str(row["prefill_s"]), str(row["hit_s"]),
                      f"{row['speedup']}x", str(b["load"]), str(b["forward"]),
                      "same" if row["same_argmax"] else "DIFFERS", str(row["cosine"]))
        console.print(t)
    for name, target in r.get("targets", {}).items():
        console.print(f"target {name}: ≥ {target['target']}, measured {target['measured']}: "
                      + ("met" if target["met"] else "MISSED"))
