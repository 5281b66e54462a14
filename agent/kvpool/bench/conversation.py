"""A synthetic conversation workload: multi-turn chats whose reuse is long and recency-driven.

The bundled Mooncake trace is dominated by shared prefixes reused by many
requests (frequency pays). Chat traffic is different: each turn of a
conversation resends the whole conversation so far, so the blocks a turn
reuses are the ones its *own* previous turn wrote, minutes earlier, and
most blocks are reused by one session only, a few times, at long and
growing distances (recency pays). No such trace is bundled (Mooncake's
conversation trace is not redistributable here), so `conversation_trace`
generates one, deterministically from a seed, with these properties:

- sessions arrive at random over `duration_s`; a session has a geometric
  number of turns (mean `mean_turns`), the next turn after an exponential
  think time (mean `mean_gap_s`), so reuse distances are long and spread;
- a turn's blocks are the previous turn's blocks but the last (a partial
  block, which the answer and the next message fill: a new hash), then the
  previous answer and the new user message (1 to 6 new blocks); the first turn is a system
  prompt (one of `system_prompts`, Zipf-popular, 2 to 8 blocks, shared
  across sessions) and a first message (1 to 40 blocks: a pasted document);
- turns stop growing past `max_blocks` (the context window): the
  conversation is then truncated to the system prompt and its newest
  blocks, which breaks the prefix as real truncation does.

Blocks are 512-token ids like the Mooncake trace's `hash_ids`.
"""

from __future__ import annotations

import heapq
import random

from .trace import TraceRequest

BLOCK_TOKENS = 512


def conversation_trace(requests: int = 4000, *, seed: int = 20, duration_s: float = 1800.0,
                       mean_turns: float = 3.0, mean_gap_s: float = 120.0,
                       system_prompts: int = 40, max_blocks: int = 128) -> list[TraceRequest]:
    """`requests` chat turns in arrival order (see the module docstring)."""
    if requests < 1:
        raise ValueError("requests must be >= 1")
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prompts = [fresh(rng.randint(2, 8)) for _ in range(system_prompts)]
    weights = [1.0 / (i + 1) for i in range(system_prompts)]  # Zipf, s = 1
    # Events (time, tie, session blocks, turns left); sessions start at a steady rate
    # chosen so that `requests` turns fit in about `duration_s`.
    events: list[tuple[float, int, list[int], int]] = []
    tie = 0
    sessions = max(1, round(1.2 * requests / mean_turns))  # some are cut at `requests`
    for _ in range(sessions):
        turns = 1
        while rng.random() > 1.0 / mean_turns:
            turns += 1
        system = prompts[rng.choices(range(system_prompts), weights)[0]]
        first = list(system) + fresh(rng.randint(1, 40))
        heapq.heappush(events, (rng.uniform(0, duration_s), tie, first, turns))
        tie += 1
    out: list[TraceRequest] = []
    while events and len(out) < requests:
        t, _, blocks, left = heapq.heappop(events)
        out.append(TraceRequest(round(t * 1000), len(blocks) * BLOCK_TOKENS,
                                rng.randint(50, 500), tuple(blocks)))
        if left > 1:
            system_len = next(len(p) for p in prompts if blocks[:len(p)] == p)
            # The last block was partial: the answer and the next message fill it, so
            # it is a new block next turn (its hash covers different tokens).
            kept = blocks[:-1] if len(blocks) > system_len else blocks
            grown = kept + fresh(rng.randint(1, 6))
            if len(grown) > max_blocks:  # context window: keep the system prompt, the newest
                grown = grown[:system_len] + grown[len(grown) - (max_blocks // 2):]
            heapq.heappush(events, (t + rng.expovariate(1.0 / mean_gap_s), tie, grown, left - 1))
            tie += 1
    return out
