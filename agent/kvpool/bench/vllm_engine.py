"""The engine side of `kvpool bench --part vllm`: one vLLM engine, timed, over a pipe.

Runs in a vLLM environment (tests/install-vllm makes one; `kvpool.bench.vllm_ttft` starts
it), as a pod's vLLM would::

    python -m kvpool.bench.vllm_engine model DIR SHAPE_JSON   # write a model into DIR
    python -m kvpool.bench.vllm_engine serve DIR MAX_LEN [CONNECTOR_JSON]

`serve` starts `vllm.LLM` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), says
{"ready": ...}, then answers one JSON line per stdin line on the stdout it was started with
(vLLM's own output goes to stderr): {"op": "ttft", "prompt": [ids]} times one request of
one output token (vLLM's prefix cache emptied first, so what is not computed came from the
connector) and waits for the connector's saves; {"op": "quit"}.

With kvpool's connector the reply breaks the time down: `lookup_s` (from the scheduler's
first question to the connector to its answer), `load_s` (the worker's loads, socket and
copies, each from its start to its report to vLLM) and `copy_s` (the fastest plain copy
of the bytes loaded, in this process: what the copies alone cost), so `load_s - copy_s` is
the connector's own overhead; and `cold_copy_s`, the same copy with the caches swept
first; and `copy_call_s`, the time the load spent in its copy calls (the compiled loop
that copies and sums), `copy_call_cpu_s` the CPU its thread spent in them; and
`arena_copy_s`, the fastest plain copy of the load's own source bytes, from the arena
mapping the load read, into a buffer of this process.

`write_model` is also the vLLM engine tests' model (tests/integrations/vllm_engine.py):
Llama-shaped, random weights, a tokenizer trained here; nothing comes from a model hub.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .engine_process import reply_channel, run_main

BLOCK = 32
"""vLLM's CPU attention takes block sizes that are multiples of 32."""


def write_model(path: str, layers: int, hidden: int, heads: int, kv_heads: int,
                head_dim: int, intermediate: int, max_len: int,
                initializer_range: float = 0.02, seed: int = 0) -> None:
    """A Llama-shaped model with random weights (from `seed`) and its tokenizer, into `path`."""
    import importlib

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    # The vLLM environment's transformers, not this one's (their APIs differ: e.g. its
    # LlamaConfig takes `torch_dtype`): untyped here.
    transformers: Any = importlib.import_module("transformers")
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
    PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i}" for i in range(3000)]
    tok.train_from_iterator([" ".join(words[i : i + 50]) for i in range(0, 3000, 7)],
                            trainers.BpeTrainer(vocab_size=1000,
                                                special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=fast.vocab_size, hidden_size=hidden,
                         intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=max_len, bos_token_id=1,
                         eos_token_id=2, torch_dtype="float32",
                         initializer_range=initializer_range)
    LlamaForCausalLM(config).save_pretrained(path)


def _last_level_cache_bytes() -> int:
    """The CPU's largest cache, from sysfs (256 MiB where it does not say)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        best = max(best, int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size))
    return best or 256 * 2**20


_sweeps: list[Any] = []


def _sweep() -> Any:
    """A tensor twice the last-level cache (made once): writing it evicts what was cached."""
    import torch

    if not _sweeps:
        _sweeps.append(torch.ones(2 * _last_level_cache_bytes(), dtype=torch.uint8))
    return _sweeps[0]



class TimedEngine:
    def __init__(self, model: str, max_len: int, connector: dict[str, Any] | None,
                 reply: Any) -> None:
        t0 = time.monotonic()
        from vllm import LLM

        self.reply = reply
        self.llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK,
                       max_model_len=max_len, max_num_batched_tokens=max_len, max_num_seqs=1,
                       seed=0, kv_transfer_config=connector)
        self.start_s = time.monotonic() - t0
        self.times: dict[str, float] = {"lookup_s": 0.0, "load_s": 0.0, "loaded_bytes": 0,
                                        "copy_call_s": 0.0, "copy_call_cpu_s": 0.0,
                                        "chunks_without_lease": 0}
        self.pieces: list[int] = []
        """The sizes of the load's contiguous copies (`copy_s`)."""
        self.sources: list[tuple[int, int]] = []
        """The load's copies' sources as its copy calls read them: (address, bytes) in the
        arena mapping (`arena_copy_s`)."""
        self.planned: list[tuple[float, float, int, bytes]] = []
        """Each compiled lease-free read call's time, CPU time, parameter block and keys
        (`_planned_sources`)."""
        self.tick_s = 0.0
        """Seconds a tick of the CPU's cycle counter (0: none), for `copies_s`."""
        self.cycles_at = 0
        """Where the compiled read's parameters count its copies' ticks."""
        self.worker: Any = None
        if connector is not None:
            self._instrument()

    def _instrument(self) -> None:
        """Time the connector's lookup and loads where vLLM calls them (wrappers on these
        instances only: the connector's code runs as is)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.worker = get_kv_transfer_group().worker
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
        asked: list[float] = []
        matched, load, report, loaded = (scheduler.matched_tokens, self.worker._load,
                                         self.worker._report_load, self.worker._report_loaded)
        reported: list[float] = []

        def timed_matched(request: Any, computed: int) -> tuple[int | None, bool]:
            now = time.perf_counter()
            if not asked:
                asked.append(now)
            answer: tuple[int | None, bool] = matched(request, computed)
            if answer[0] is not None:  # None: the socket was asked, vLLM asks again
                self.times["lookup_s"] += time.perf_counter() - asked.pop()
            return answer

        def timed_report(job: Any, sizes: list[int]) -> None:
            report(job, sizes)
            reported.append(time.perf_counter())

        def timed_loaded(job: Any) -> None:  # (the report of a load of every chunk)
            loaded(job)
            reported.append(time.perf_counter())

        def timed_load(job: Any) -> None:
            # to the load's report to vLLM (what vLLM waits for; its leases' RELEASEs go
            # out after it)
            reported.clear()
            client = self.worker.link.client
            before = client.reads_without_lease if client is not None else 0
            t0 = time.perf_counter()
            load(job)
            self.times["load_s"] += (reported[0] if reported else time.perf_counter()) - t0
            client = self.worker.link.client
            if client is not None:
                self.times["chunks_without_lease"] += client.reads_without_lease - before
            # every chunk's bytes are read, a first chunk's skipped blocks into scratch
            self.times["loaded_bytes"] += len(job.keys[self.worker.rank]) \
                * self.worker._chunk_bytes
            self.pieces += self._pieces(job)

        scheduler.matched_tokens = timed_matched
        self.worker._load = timed_load
        self.worker._report_load = timed_report
        self.worker._report_loaded = timed_loaded
        # The load's copy calls (the compiled copy-and-sum loop), timed where the client
        # makes them: the connector's time outside them is `load_s - copy_call_s`.
        from kvpool.agent import hostcopy

        run = hostcopy._Batch.run

        def timed_run(batch: hostcopy._Batch) -> None:
            self.sources += zip(batch.pieces[0::3], batch.pieces[2::3], strict=True)
            c0, t0 = time.thread_time(), time.perf_counter()
            run(batch)
            self.times["copy_call_s"] += time.perf_counter() - t0
            # the calling thread's CPU in them: the wall time less what the thread waited
            # for a core (or, with the GIL released, nothing else)
            self.times["copy_call_cpu_s"] += time.thread_time() - c0
        hostcopy._Batch.run = timed_run  # type: ignore[method-assign, assignment]
        # A lease-free window whose destinations are known before the read is read in one
        # compiled call (`leasekernel.read`): the table's epoch and each key's slot read
        # first, the copies (with the sums, each chunk's checksum hashed from them), then
        # each slot and the epoch again; for block ids, the copies' ranges planned from
        # them first. All but the copies: for 7 chunks ~1 µs of the call warm, ~15 µs cold
        # (`copies_s` counts the copies alone).
        from kvpool.agent import leasekernel

        kernels = leasekernel.kernels()
        if kernels is not None:
            # The call's copies alone (with their checksums and the slots read again after
            # them) are counted inside it in the CPU's cycle counter's ticks: their rate,
            # against this clock's (`copies_s`).
            c0, t0 = kernels.cycles(), time.perf_counter()
            time.sleep(0.2)
            ticks = (kernels.cycles() - c0) / (time.perf_counter() - t0)
            self.tick_s = 1 / ticks if ticks > 0 else 0.0
            self.cycles_at = leasekernel.PARAMS.index("cycles")
            read, clock, cpu, planned = kernels.read, time.perf_counter, time.thread_time, \
                self.planned

            def timed_read(params: int, want: bytes, n: int, ids: int) -> int:
                # as little as can be around the call (what is here counts as the load's
                # time outside it): the sums are made after the request (`ttft`)
                c0 = cpu()
                t0 = clock()
                got = read(params, want, n, ids)
                t1 = clock()
                planned.append((t1 - t0, cpu() - c0, params, want))
                return got
            kernels.read = timed_read

    def _plan(self) -> Any:
        """The worker's compiled read's parameters (`leasekernel.Plan`), once it read."""
        host = self.worker._host if self.worker is not None else None
        return host.plan if host is not None else None

    def _planned_sources(self, params: int, want: bytes) -> list[tuple[int, int]]:
        """The arena bytes a compiled lease-free read call read (`arena_copy_s`), found
        after the request (not in the load's time): each chunk of the call where the
        lookup index says it lies (one extent; these chunks stay put in the bench's pool).
        `params`: the call's parameter block, the worker's blocks' `leasekernel.Plan`
        (which names the arena's address and the chunks' size)."""
        host = self.worker._host
        plan = host.plan if host is not None else None
        if plan is None or plan.address != params:
            return []
        arena, size = plan.mapping[1], plan.size
        client = self.worker.link.client
        index = getattr(client._transport, "index", None) if client is not None else None
        if index is None:
            return []
        out: list[tuple[int, int]] = []
        for k in range(0, len(want), 16):
            where = index.locate(want[k : k + 16])
            if where is not None and where[2][1] == size:
                out.append((arena + where[2][0], size))
        return out

    def _pieces(self, job: Any) -> list[int]:
        """The sizes of the contiguous copies a load of `job` makes: per chunk, per layer,
        each run of consecutive blocks (what any connector copying into vLLM's blocks
        copies at least)."""
        host = self.worker._host
        if host is None:  # copied into tensor pieces: one per layer and block
            block = self.worker._chunk_bytes // len(self.worker._layers) \
                // self.worker.layout.blocks_per_chunk
            return [block] * (len(job.block_ids) * len(self.worker._layers))
        return [n for i, bids in enumerate(job.chunks(host.per))
                for _, n in host.ranges(bids, job.skip_blocks if i == 0 else 0).ranges]

    @staticmethod
    def copy_s(pieces: list[int]) -> tuple[float, float, float]:
        """What copying the loaded bytes alone takes in this process: the fastest plain
        copy (libc's memmove, best of 3) between two buffers of that size (the source made
        like the arena, the destination like vLLM's KV cache: allocated and touched
        before), either piece by piece as the load copies them or in one piece (libc then
        streams the stores past the caches, the fastest copy this machine makes).

        Two figures: with both buffers as their making left them (warm: bytes just written
        may still be in the last-level cache, which can hold a whole load of a small
        prompt), and cold, the copy in one piece with the caches swept before it (a buffer
        twice the last-level cache written first; once a call), as a load's source is:
        chunks written by another engine, a prefill or more ago.

        Third, for comparison, the connector's own copy loop (`wsumkernel.copy_sums`, which
        sums the words as it copies) over the same pieces between the same warm buffers,
        best of 3 (inf without the compiled loop)."""
        import ctypes

        import torch

        from kvpool.agent import wsumkernel

        nbytes = sum(pieces)
        if not nbytes:
            return 0.0, 0.0, 0.0
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        s, d = src.data_ptr(), dst.data_ptr()
        sweep = _sweep()

        def whole() -> None:
            ctypes.memmove(d, s, nbytes)

        def by_piece() -> None:
            at = 0
            for n in pieces:
                ctypes.memmove(d + at, s + at, n)
                at += n
        triples: list[int] = []
        at = 0
        for n in pieces:
            triples += [s + at, d + at, n]
            at += n
        best = {False: float("inf"), True: float("inf")}
        summed = float("inf")
        for i in range(3):
            # one cold copy a call (a sweep writes twice the cache): the best of B's runs
            trials = [(False, whole), (False, by_piece)] + ([(True, whole)] if i == 0 else [])
            for cold, copy in trials:
                if cold:
                    sweep.fill_(1)  # evicts both buffers' lines
                t0 = time.perf_counter()
                copy()
                best[cold] = min(best[cold], time.perf_counter() - t0)
            t0 = time.perf_counter()
            if wsumkernel.copy_sums(triples) is not None:
                summed = min(summed, time.perf_counter() - t0)
        return best[False], best[True], summed

    @staticmethod
    def arena_copy_s(sources: list[tuple[int, int]]) -> float:
        """The fastest plain copy (libc's `memmove`, best of 3) of the bytes a load read,
        from where it read them (the arena, mapped by the connector's client: tmpfs pages
        shared with the agent) into a buffer made beforehand, adjacent sources in one
        piece (libc streams the stores of a large one): `copy_s` from the same memory as
        the load's. It only reads the arena (the chunks may have changed since: their
        bytes do not matter here)."""
        import ctypes

        import torch

        runs: list[list[int]] = []
        for address, n in sources:
            if runs and runs[-1][0] + runs[-1][1] == address:
                runs[-1][1] += n
            else:
                runs.append([address, n])
        nbytes = sum(n for _, n in runs)
        if not nbytes:
            return 0.0
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            at = dst.data_ptr()
            for address, n in runs:
                ctypes.memmove(at, address, n)
                at += n
            best = min(best, time.perf_counter() - t0)
        return best

    def ttft(self, prompt: list[int]) -> dict[str, Any]:
        from vllm import SamplingParams

        for _ in range(200):  # blocks kept for pending saves make a reset wait
            if self.llm.reset_prefix_cache():
                break
            time.sleep(0.05)
        self.times = {"lookup_s": 0.0, "load_s": 0.0, "loaded_bytes": 0, "copy_call_s": 0.0,
                      "copy_call_cpu_s": 0.0, "chunks_without_lease": 0}
        self.pieces = []
        self.sources = []
        self.planned.clear()  # (the list `timed_read` appends to)
        plan = self._plan()
        if plan is not None:  # (a plan made during the request starts at 0)
            plan.words[self.cycles_at] = 0
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}],
                                SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                                               detokenize=False), use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        times = dict(self.times)
        if self.worker is not None:  # the saves finish before the next measurement
            assert self.worker.drain(600.0), "the connector's saves did not finish"
            core = self.llm.llm_engine.engine_core.engine_core
            while core.scheduler.has_requests():
                self.llm.llm_engine.step()
        plan = self._plan()
        if plan is not None and self.tick_s:  # (else no `copies_s`: not counted)
            times["copies_s"] = plan.words[self.cycles_at] * self.tick_s
        for call_s, cpu_s, params, want in self.planned:
            times["copy_call_s"] += call_s
            times["copy_call_cpu_s"] += cpu_s
            self.sources += self._planned_sources(params, want)
        copy, cold, summed = self.copy_s(self.pieces)
        return {"ttft_s": seconds, "cached_tokens": out.num_cached_tokens, **times,
                "copy_s": copy, "cold_copy_s": cold, "sum_copy_s": summed,
                "arena_copy_s": self.arena_copy_s(self.sources)}

    def serve(self) -> None:
        self.reply.write(json.dumps({"ready": True, "start_s": self.start_s}) + "\n")
        self.reply.flush()
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            answer = self.ttft(cmd["prompt"]) if cmd["op"] == "ttft" else {"error": cmd["op"]}
            self.reply.write(json.dumps(answer) + "\n")
            self.reply.flush()


def main(argv: list[str]) -> int:
    if argv[0] == "model":
        write_model(argv[1], **json.loads(argv[2]))
        return 0
    TimedEngine(argv[1], int(argv[2]), json.loads(argv[3]) if len(argv) > 3 else None,
                reply_channel()).serve()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    run_main(main)
