"""Where a load copies a chunk on the CPU: vLLM's blocks as host memory ranges
(`kvpool.agent.integrations.vllm.worker.host_blocks`, a `kvpool.agent.hostcopy.HostBlocks`;
no vLLM: KV-cache layers as vLLM 0.32's CPU worker makes them, a block a slice of the first
dimension)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvpool.agent.hostcopy import HostBlocks
from kvpool.agent.integrations.vllm.worker import host_blocks

BLOCKS, PER_BLOCK, PER_CHUNK = 12, 4, 2


def of(kv: list[torch.Tensor]) -> HostBlocks:
    host = host_blocks(kv, PER_BLOCK, BLOCKS, PER_CHUNK, b"meta", lambda m: m == b"meta", 0)
    assert host is not None
    return host


def layers(n: int = 2) -> list[torch.Tensor]:
    return [torch.arange(BLOCKS * PER_BLOCK * 6, dtype=torch.float32).reshape(
        BLOCKS * PER_BLOCK, 2, 3) + 10_000 * i for i in range(n)]


def filled(host: HostBlocks, block_ids: list[int], scratch: int = 0) -> bytes:
    return b"".join(ctypes.string_at(a, n) for a, n in host.ranges(block_ids, scratch).ranges)


@pytest.mark.parametrize("block_ids", [[3, 4, 5, 6], [0], [3, 5, 6, 2], [11, 10]])
def test_a_chunks_ranges_are_each_layers_blocks_in_order(block_ids: list[int]) -> None:
    kv = layers()
    host = of(kv)
    expected = b"".join(layer[b * PER_BLOCK : (b + 1) * PER_BLOCK].numpy().tobytes()
                        for layer in kv for b in block_ids)
    assert filled(host, block_ids) == expected


def test_consecutive_blocks_are_one_range_a_layer_and_scratch_blocks_go_to_scratch() -> None:
    kv = layers()
    host = of(kv)
    block = PER_BLOCK * 6 * 4
    assert host.ranges([3, 4, 5, 6]).ranges == [(t.data_ptr() + 3 * block, 4 * block)
                                                for t in kv]
    ranges = host.ranges([3, 4, 5, 6], scratch_blocks=2).ranges
    assert ranges == [(host.scratch_address, block), (host.scratch_address, block),
                      (kv[0].data_ptr() + 5 * block, 2 * block),
                      (host.scratch_address, block), (host.scratch_address, block),
                      (kv[1].data_ptr() + 5 * block, 2 * block)]


def test_block_ids_outside_the_cache_are_refused() -> None:
    host = of(layers())
    host.check([[0, 1], [BLOCKS - 1]])
    for bad in ([BLOCKS], [2, -1]):
        with pytest.raises(ValueError, match="out of the KV cache"):
            host.check([[0, 1], bad])


def test_runs_of_consecutive_blocks_are_one_range_and_adjacent_layers_merge() -> None:
    # Two layers that are halves of one tensor: layer 0's last block ends where layer 1's
    # first begins, so a chunk ending on the one and starting on the other merges there.
    whole = torch.arange(2 * BLOCKS * PER_BLOCK * 6, dtype=torch.float32).reshape(
        2, BLOCKS * PER_BLOCK, 2, 3)
    kv = [whole[0], whole[1]]
    host = of(kv)
    block = PER_BLOCK * 6 * 4
    base0, base1 = kv[0].data_ptr(), kv[1].data_ptr()
    assert host.ranges([3, 5, 6, 2]).ranges == [
        (base0 + 3 * block, block), (base0 + 5 * block, 2 * block), (base0 + 2 * block, block),
        (base1 + 3 * block, block), (base1 + 5 * block, 2 * block), (base1 + 2 * block, block)]
    assert host.ranges([0, 10, 11]).ranges == [
        (base0, block), (base0 + 10 * block, 3 * block), (base1 + 10 * block, 2 * block)]
    expected = b"".join(layer[b * PER_BLOCK : (b + 1) * PER_BLOCK].numpy().tobytes()
                        for layer in kv for b in [0, 10, 11])
    assert filled(host, [0, 10, 11]) == expected


@pytest.mark.parametrize("chunks", [[[3, 4], [5, 6], [9, 1], [11, 10]],
                                    [[7, 8], [0, 1], [2, 3]], [[4, 5], [6, 7], [8, 9]]],
                         ids=["mixed", "consecutive", "one run"])
def test_a_loads_target_gives_each_chunk_its_ranges(chunks: list[list[int]]) -> None:
    """What a load hands the client (`BlockTargets`: the block ids) gives, for each chunk,
    its `ranges` (the first chunk's skipped blocks into scratch): what the Python path
    copies into, and what the compiled read plans from the ids (tests/agent/test_lease_free
    reads both into these blocks). Ids outside the KV cache are refused before any read."""
    host = of(layers())
    for skip in (0, 1):
        target = host.targets(chunks, skip)
        assert len(target) == len(chunks)
        assert [target(i, host.size, b"meta") for i in range(len(chunks))] == \
            [host.ranges(bids, skip if i == 0 else 0) for i, bids in enumerate(chunks)]
        assert target(0, host.size, b"other") is None  # another layout: declined
        assert target(0, host.size - 4, b"meta") is None
    for bad in ([[0, 1], [BLOCKS, 2]], [[0, 1], [-1, 0]], [[BLOCKS - 2, BLOCKS - 1], [BLOCKS, 0]]):
        with pytest.raises(ValueError, match="out of the KV cache"):
            host.targets(bad, 0)
    with pytest.raises(ValueError, match="chunks of 2 blocks"):
        host.targets([[0, 1], [2]], 0)
