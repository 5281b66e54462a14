"""Chunk keys are stable, chained, and fingerprint-scoped."""

import struct

import xxhash

from kvpool.agent.constants import KEY_BYTES
from kvpool.agent.keys import Fingerprint, block_keys, chunk_keys

FP = Fingerprint("meta-llama/Llama-3.1-8B", "bfloat16", 32, 8, 128, 4, tenant="acme")


def test_keys_are_pinned_values_across_releases() -> None:
    # Changing the hash scheme must be a new scheme name, never a silent change.
    keys = chunk_keys(FP, list(range(10)))
    assert [k.hex() for k in keys] == [
        "bd80cf00a967b32b513aca767de56845",
        "3f779b96033c09b0c9e1d4ae5cf77ba6",
    ]
    assert FP.digest().hex() == "20629cc75800dded98e8caaa9938bee9"


def test_keys_follow_the_documented_chain() -> None:
    # key_0 = XXH3-128(fingerprint || tokens_0 as u32 LE); key_i = XXH3-128(key_{i-1} || tokens_i)
    k0 = xxhash.xxh3_128_digest(FP.digest() + struct.pack("<4I", 0, 1, 2, 3))
    k1 = xxhash.xxh3_128_digest(k0 + struct.pack("<4I", 4, 5, 6, 7))
    assert chunk_keys(FP, list(range(8))) == [k0, k1]


def test_one_key_per_full_chunk_and_optional_tail() -> None:
    assert len(chunk_keys(FP, list(range(8)))) == 2
    assert len(chunk_keys(FP, list(range(9)))) == 2
    assert len(chunk_keys(FP, list(range(9)), include_partial=True)) == 3
    assert all(len(k) == KEY_BYTES for k in chunk_keys(FP, list(range(12))))


def test_key_names_the_whole_prefix_not_just_its_chunk() -> None:
    a = chunk_keys(FP, [1, 2, 3, 4, 5, 6, 7, 8])
    b = chunk_keys(FP, [9, 9, 9, 9, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second chunk, different prefix
    assert chunk_keys(FP, [1, 2, 3, 4])[0] == a[0]


def test_different_fingerprint_gives_different_keys() -> None:
    tokens = list(range(8))
    other_tenant = Fingerprint(FP.model, FP.dtype, FP.layers, FP.kv_heads, FP.head_dim,
                               FP.chunk_tokens, tenant="globex")
    other_dtype = Fingerprint(FP.model, "float16", FP.layers, FP.kv_heads, FP.head_dim,
                              FP.chunk_tokens, tenant="acme")
    base = chunk_keys(FP, tokens)
    assert not set(base) & set(chunk_keys(other_tenant, tokens))
    assert not set(base) & set(chunk_keys(other_dtype, tokens))


def test_block_keys_are_distinct_per_block_and_fingerprint() -> None:
    ks = block_keys(FP, [0, 1, 2, 0])
    assert ks[0] == ks[3] and len(set(ks)) == 3
    assert block_keys(FP, [0]) != block_keys(Fingerprint("m", "d", 1, 1, 1, 1), [0])
