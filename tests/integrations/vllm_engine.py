"""One vLLM engine (vLLM's own CPU build), driven by a test over a pipe.

Runs in the vLLM test environment (tests/install-vllm), as a pod's vLLM would::

    python vllm_engine.py model DIR [SEED]   # write the test model into DIR, then exit
    python vllm_engine.py serve DIR [CONNECTOR_JSON]

`serve` starts `vllm.LLM` on the model in DIR (with `kv_transfer_config` = CONNECTOR_JSON,
if given, and more keyword arguments from $KVPOOL_TEST_LLM_ARGS's JSON, e.g.
{"kv_cache_dtype": "fp8"}) in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: scheduler
and worker in one process, so one start costs one set of imports), says {"ready": ...},
then answers one JSON command per stdin line with one JSON line on the stdout it was
started with (everything else vLLM prints goes to stderr):

- {"op": "generate", "prompts": [[ids]], "max_tokens": N, "kv_transfer_params": {...}}
  (the last optional: each request's, as a router sets them): greedy outputs, vLLM's cached
  token counts, and the change of vLLM's prefix-cache counters (its own and the
  connector's: `vllm:prefix_cache_hits`, `vllm:external_prefix_cache_hits`) across the
  call. vLLM's own prefix cache is emptied first, so what is not computed came from the
  connector.
- {"op": "fault", "kind": "corrupt" | "evict" | "pause", "chunk": i} (kvpool's connector
  only): before the next load
  the connector starts (its `fault_hook`, between the scheduler's lookup and the load),
  flip a byte of that load's chunk i in the arena, delete it from the pool, or say
  {"event": "loading"} and wait for a "go" line (the test kills the agent meanwhile).
- {"op": "drain"}: wait until the connector's queued loads and saves are done.
- {"op": "block_hashes", "prompt": [ids]}: vLLM's block hashes of the prompt, as its KV
  events publish them.
- {"op": "quit"}.

The model is Llama-shaped with random weights and a tokenizer trained here
(`kvpool.bench.vllm_engine.write_model`, which `kvpool bench --part vllm` writes its model
with): nothing comes from a model hub (HF_HUB_OFFLINE=1). SEED (0 by default) picks its
weights: another seed is another model of the same shape.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from kvpool.bench.engine_process import reply_channel, run_main

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4, 256, 4, 2, 64
BLOCK = 32
"""vLLM's CPU attention takes block sizes that are multiples of 32."""
ENV_LLM_ARGS = "KVPOOL_TEST_LLM_ARGS"
"""More of `vllm.LLM`'s keyword arguments, as JSON (e.g. another `kv_cache_dtype`)."""


def make_model(path: str, seed: int = 0) -> None:
    from kvpool.bench.vllm_engine import write_model

    # Large weights: greedy outputs that depend on the whole context, so wrong KV shows in
    # them (small ones repeat one token).
    write_model(path, LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, intermediate=2 * HIDDEN,
                max_len=4096, initializer_range=0.5, seed=seed)


def llm(model: str, connector: dict[str, Any] | None) -> Any:
    """vLLM's engine on the test model, as every engine test runs it."""
    from vllm import LLM

    args = json.loads(os.environ.get(ENV_LLM_ARGS) or "{}")
    return LLM(model=model, **{"dtype": "float32", **args}, enforce_eager=True,
               block_size=BLOCK, max_model_len=4096, max_num_seqs=8, disable_log_stats=False,
               seed=0, kv_transfer_config=connector)


def spoil(kind: str, key: bytes, tenant: str) -> None:
    """Delete the pool's chunk `key` ("evict"), or flip a byte of it in the arena, under the
    agent's nose ("corrupt": its checksum no longer matches)."""
    from kvpool.agent import protocol as p
    from kvpool.agent.client import KVPoolClient

    with KVPoolClient(tenant=tenant) as kv:
        if kind == "evict":
            assert kv.delete(key)
            return
        conn = kv._live().conn
        lease = conn.call(p.Acquire(conn.rid(), key))
        assert isinstance(lease, p.AcquireReply)
        offset, nbytes = lease.extents[0]
        arena = kv._arena
        assert arena is not None
        arena[offset + nbytes // 2] ^= 0xFF
        conn.call(p.Release(conn.rid(), lease.lease))


class Engine:
    def __init__(self, model: str, connector: dict[str, Any] | None, reply: Any) -> None:
        t0 = time.monotonic()
        import vllm  # noqa: F401

        self.imported_s = time.monotonic() - t0
        self.reply = reply
        self.llm = llm(model, connector)
        self.started_s = time.monotonic() - t0
        self.fault: dict[str, Any] | None = None
        self.worker: Any = None
        self.steps = 0
        self.paused_s = 0.0
        engine = self.llm.llm_engine
        step = engine.step

        def counted() -> Any:  # vLLM's engine loop, counted
            self.steps += 1
            return step()
        engine.step = counted
        if connector is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            # kvpool's connector's worker side (None for another connector, e.g. LMCache's)
            self.worker = getattr(get_kv_transfer_group(), "worker", None)
            if self.worker is not None:
                self.worker.fault_hook = self._fault

    def say(self, obj: dict[str, Any]) -> None:
        self.reply.write(json.dumps(obj) + "\n")
        self.reply.flush()

    def counters(self) -> dict[str, float]:
        return {m.name: float(m.value) for m in self.llm.get_metrics()
                if m.name in ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits",
                              "vllm:prompt_tokens")}

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
        from vllm import SamplingParams

        for _ in range(200):  # blocks kept for pending saves make a reset wait
            if self.llm.reset_prefix_cache():
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("vLLM's prefix cache could not be reset")
        before = self.counters()
        self.steps, self.paused_s = 0, 0.0
        t0 = time.monotonic()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True, detokenize=False,
                                                extra_args={"kv_transfer_params":
                                                            kv_transfer_params}
                                                if kv_transfer_params else None),
                                 use_tqdm=False)
        seconds = time.monotonic() - t0
        steps, paused_s = self.steps, self.paused_s
        self.settle()
        after = self.counters()
        return {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                "finish": [o.outputs[0].finish_reason for o in outs],
                "cached": [o.num_cached_tokens for o in outs], "seconds": seconds,
                "steps": steps, "paused_s": paused_s,
                **{k.removeprefix("vllm:"): after.get(k, 0) - before.get(k, 0) for k in after}}

    def settle(self) -> None:
        """Let the connector's saves finish and vLLM free the blocks it kept for them: a
        server's engine loop steps while finished requests hold blocks; `LLM.generate`
        returns as soon as the outputs are done, so step here until nothing is held."""
        if self.llm.llm_engine.vllm_config.kv_transfer_config is None:
            return
        if self.worker is not None:
            assert self.worker.drain(120.0), "the connector's saves did not finish"
        core = self.llm.llm_engine.engine_core.engine_core
        for _ in range(1000):
            if not core.scheduler.has_requests():
                return
            self.llm.llm_engine.step()
            time.sleep(0.001)
        raise RuntimeError("vLLM still holds finished requests' blocks")

    def _fault(self, keys: list[bytes]) -> None:
        fault, self.fault = self.fault, None
        if fault is None:
            return
        key = keys[fault["chunk"]]
        if fault["kind"] == "pause":
            t0 = time.monotonic()
            self.say({"event": "loading"})
            assert sys.stdin.readline().strip() == "go"
            self.paused_s += time.monotonic() - t0
            return
        spoil(fault["kind"], key, self.worker.layout.tenant)

    def block_hashes(self, prompt: list[int]) -> list[int]:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

        from kvpool.agent.integrations.vllm.layout import engine_hash

        algo = self.llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo
        fn = get_hash_fn_by_name(algo)
        init_none_hash(fn)
        out, parent = [], None
        for i in range(len(prompt) // BLOCK):
            parent = hash_block_tokens(fn, parent, prompt[i * BLOCK : (i + 1) * BLOCK])
            out.append(engine_hash(parent))
        return out

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The reply to one command."""
        op = cmd["op"]
        if op == "generate":
            return self.generate(cmd["prompts"], cmd.get("max_tokens", 8),
                                 cmd.get("kv_transfer_params"))
        if op == "fault" and self.worker is not None:
            self.fault = cmd
            return {"armed": cmd["kind"]}
        if op == "drain":
            self.settle()
            return {"drained": True}
        if op == "block_hashes":
            return {"hashes": self.block_hashes(cmd["prompt"])}
        return {"error": f"unknown op {op!r}"}

    def serve(self) -> None:
        self.say({"ready": True, "import_s": self.imported_s, "start_s": self.started_s})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            self.say(self.handle(cmd))


def main(argv: list[str]) -> int:
    if argv[0] == "model":
        make_model(argv[1], int(argv[2]) if len(argv) > 2 else 0)
        return 0
    connector = json.loads(argv[2]) if len(argv) > 2 else None
    engine = Engine(argv[1], connector, reply_channel())
    engine.serve()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run_main(main)
