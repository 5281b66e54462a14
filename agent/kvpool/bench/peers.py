"""libCacheSim's online policies as peers of the agent's orders, under the bench's prefix semantics.

libCacheSim (the simulator used across the caching literature, PyPI
`libcachesim`) is a tools-only dependency: only this module imports it, and
only when a bench asks for peers. Each policy is driven the way the issue
that introduced it fixed, so figures compare across runs: `cache.get` per
block in request order (a miss inserts), one object of size 1 per block, a
hit counted only while every earlier block of the request hit (the prefix a
KV-cache can use). Where the agent's `queue_sim` touches only a request's
leading hits (what LOOKUP sees), `cache.get` also touches cached blocks
after the first miss; that is libCacheSim's own access model, kept as is.
"""

from __future__ import annotations

from .sim import SimResult, Trace

ONLINE_POLICIES = (
    "ARC", "Cacheus", "Clock", "Clock2QPlus", "FIFO", "GDSF", "Hyperbolic", "LFU", "LFUDA",
    "LHD", "LIRS", "LRU", "LRUK", "LeCaR", "MQ", "S3FIFO", "SLRU", "Sieve", "TwoQ", "WTinyLFU",
    "GLCache", "LRB", "ThreeLCache",
)
"""libCacheSim's online policies that run on block ids alone (Belady needs the future, the
`*Prob` ones are admission experiments; GLCache, LRB and ThreeLCache are learned)."""


def available() -> bool:
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        return False
    return True


def peer_sim(trace: Trace, capacity: int, policy: str) -> SimResult:
    """libCacheSim's `policy` holding `capacity` blocks, under prefix semantics."""
    import libcachesim

    if capacity < 1:
        raise ValueError("capacity must be >= 1")
    cache = getattr(libcachesim, policy)(cache_size=capacity)
    req = libcachesim.Request()
    req.obj_size = 1
    refs = prefix_hits = ref_hits = 0
    for blocks in trace:
        leading = True
        for b in blocks:
            req.obj_id = b
            refs += 1
            if cache.get(req):
                ref_hits += 1
                prefix_hits += leading
            else:
                leading = False
    return SimResult(refs, prefix_hits, ref_hits)


def peers(trace: Trace, capacity: int,
          policies: tuple[str, ...] = ONLINE_POLICIES) -> dict[str, float]:
    """Prefix hit ratio of each libCacheSim policy at `capacity` blocks."""
    return {p: round(peer_sim(trace, capacity, p).hit_ratio, 4) for p in policies}
