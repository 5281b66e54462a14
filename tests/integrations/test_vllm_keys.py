"""The vLLM connector's keys and chunk rules (pure: no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from kvpool.agent.integrations.vllm.layout import (
    ChunkTokensError,
    KeyChain,
    Layout,
    check_chunk_tokens,
    engine_hash,
)
from kvpool.agent.keys import chunk_keys

LAYOUT = Layout(model="org/model", dtype="bfloat16", layers=32, kv_heads=8, head_size=128,
                head_size_v=128, block_size=16, chunk_tokens=256, tp_size=2, tenant="team-a")
TOKENS = list(range(1000, 1000 + 3 * 256 + 7))


def test_a_chunk_must_be_whole_vllm_blocks() -> None:
    assert check_chunk_tokens(256, 16) == 256
    with pytest.raises(ChunkTokensError, match=r"chunk size .* = 48\) must be a positive "
                                               r"multiple of vLLM's block size \(32\)"):
        check_chunk_tokens(48, 32)
    with pytest.raises(ChunkTokensError):
        check_chunk_tokens(0, 16)


def test_keys_are_kvpools_chained_keys_extended_as_tokens_arrive() -> None:
    chain = KeyChain(LAYOUT.fingerprint())
    assert chain.upto(TOKENS, 1) == chunk_keys(LAYOUT.fingerprint(), TOKENS)[:1]
    assert chain.upto(TOKENS, 3) == chunk_keys(LAYOUT.fingerprint(), TOKENS)


def test_keys_are_the_same_in_another_process() -> None:
    probe = ("from kvpool.agent.integrations.vllm.layout import Layout, KeyChain;"
             f"l = {LAYOUT!r};"
             f"print(KeyChain(l.fingerprint(1, 0)).upto({TOKENS!r}, 3)[-1].hex())")
    other = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           check=True, timeout=60).stdout.strip()
    assert other == KeyChain(LAYOUT.fingerprint(1, 0)).upto(TOKENS, 3)[-1].hex()


@pytest.mark.parametrize("change", [
    {"tenant": "team-b"}, {"model": "org/other"}, {"dtype": "float16"}, {"layers": 16},
    {"kv_heads": 4}, {"head_size": 64}, {"head_size_v": 64}, {"chunk_tokens": 512},
    {"tp_size": 4}, {"pp_size": 2}])
def test_another_tenant_model_or_kv_layout_never_shares_a_key(change: dict[str, object]) -> None:
    mine = KeyChain(LAYOUT.fingerprint()).upto(TOKENS, 1)
    theirs = KeyChain(replace(LAYOUT, **change).fingerprint()).upto(TOKENS, 1)  # type: ignore[arg-type]
    assert mine != theirs


def test_each_tensor_parallel_rank_has_its_own_keys() -> None:
    keys = {KeyChain(LAYOUT.fingerprint(*rank)).upto(TOKENS, 1)[0] for rank in LAYOUT.ranks()}
    assert len(keys) == LAYOUT.tp_size == 2


def test_engine_hashes_are_vllms_int_block_hashes() -> None:
    """vLLM's `maybe_convert_block_hash`: the last 8 bytes, big-endian (its KV events)."""
    digest = bytes(range(32))
    assert engine_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert engine_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert engine_hash(-1) == 2**64 - 1
