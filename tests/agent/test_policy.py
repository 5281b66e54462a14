"""The policy engine's decisions, table by table (`agent/policy.py` is pure: no I/O, no clock).

Chunks are tiny `Chunk` records (test data with the fields of `policy.Entry`); a test names
them by a letter and the tables list candidates in the tier's eviction order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpool.agent import policy as pol
from kvpool.agent.config import TierPolicy, TierRules

from ..support import Chunk, chunk


def chunks(names: str, **kw: Any) -> list[Chunk]:
    """One chunk per letter, in eviction order."""
    return [chunk(n, **kw) for n in names]


def keys(victims: list[pol.Victim]) -> str:
    return "".join(v.key.decode() for v in victims)


def nothing_protected(_: bytes) -> bool:
    return False


def protect(names: str) -> Callable[[bytes], bool]:
    held = {n.encode() for n in names}
    return lambda key: key in held


NO_TENANTS = TierPolicy()
TWO_TENANTS = TierPolicy.model_validate({"tenants": [{"name": "a"}, {"name": "b"}]})

# --------------------------------------------------------------------------- choose_victims


@pytest.mark.parametrize(
    ("order", "used", "target", "protected", "want"),
    [
        pytest.param("abcd", 40, 20, "", "ab", id="eviction-order-respected"),
        pytest.param("dcba", 40, 20, "", "dc", id="other-order-other-victims"),
        pytest.param("abcd", 40, 35, "", "a", id="stops-once-at-target"),
        pytest.param("abcd", 40, 40, "", "", id="nothing-when-already-at-target"),
        pytest.param("abcd", 40, 0, "", "abcd", id="everything-when-target-is-zero"),
        pytest.param("abcd", 40, 20, "a", "bc", id="protected-skipped"),
        pytest.param("abcd", 40, 20, "abc", "d", id="only-unprotected-even-short-of-target"),
        pytest.param("abcd", 40, 0, "abcd", "", id="all-protected-nothing-chosen"),
    ],
)
@pytest.mark.parametrize("policy", [NO_TENANTS, TWO_TENANTS], ids=["no-tenants", "tenants"])
def test_choose_victims_walks_the_order_to_the_target_never_taking_protected_chunks(
        policy: TierPolicy, order: str, used: int, target: int, protected: str,
        want: str) -> None:
    # Tenants without quotas or priorities must not change the answer.
    candidates = [chunk(n, tenant="ab"[i % 2]) for i, n in enumerate(order)]
    victims = pol.choose_victims(candidates, tier="dram", policy=policy, used=used,
                                 target=target, reason="capacity", protected=protect(protected))
    assert keys(victims) == want
    assert {v.reason for v in victims} <= {"capacity"}


@pytest.mark.parametrize("policy", [NO_TENANTS, TWO_TENANTS], ids=["no-tenants", "tenants"])
def test_footprint_not_size_is_what_a_victim_frees(policy: TierPolicy) -> None:
    # 1-byte chunks that each hold a 100-byte page: two of them free 200 bytes.
    victims = pol.choose_victims(chunks("abcd", size=1, tenant="a"), tier="dram", policy=policy,
                                 used=400, target=200, reason="watermark",
                                 protected=nothing_protected, footprint=lambda e: 100)
    assert keys(victims) == "ab"


def test_without_tenants_the_walk_is_read_only_as_far_as_needed() -> None:
    read: list[bytes] = []

    def walk() -> Iterator[Chunk]:
        for c in chunks("abcdefgh"):
            read.append(c.key)
            yield c

    victims = pol.choose_victims(walk(), tier="dram", policy=NO_TENANTS, used=80, target=60,
                                 reason="watermark", protected=nothing_protected)
    assert keys(victims) == "ab"
    assert len(read) <= 3  # the two victims, and at most the one that showed enough was freed


def quota_policy(**quota: str) -> TierPolicy:
    return TierPolicy.model_validate({"tenants": [
        {"name": "a", "quota": quota}, {"name": "b"}]})


@pytest.mark.parametrize(
    ("candidates", "used", "target", "protected", "want"),
    [
        # a holds 30 bytes against a 20-byte DRAM quota: its oldest chunk goes even without
        # pressure on the tier, and b (under no quota) loses nothing.
        pytest.param("b1 a1 b2 a2 a3", 50, 50, "", [("a1", "quota")], id="over-quota-no-pressure"),
        # Then the tier's own pressure takes chunks in eviction order, whoever owns them.
        pytest.param("b1 a1 b2 a2 a3", 50, 30, "",
                     [("a1", "quota"), ("b1", "watermark")], id="over-quota-then-order"),
        # a is 20 bytes over: two of its chunks go, in eviction order, before b's older one.
        pytest.param("b1 a1 b2 a2 a3 a4", 60, 40, "",
                     [("a1", "quota"), ("a2", "quota")], id="quota-frees-enough-for-target"),
        # A protected chunk still counts against its tenant's quota (the tenant holds it)
        # but is never a victim: the next chunk of that tenant goes instead.
        pytest.param("b1 a1 b2 a2 a3", 50, 50, "a1", [("a2", "quota")],
                     id="protected-counted-never-chosen"),
        pytest.param("b1 a1 b2 a2 a3 a4", 60, 60, "a1", [("a2", "quota"), ("a3", "quota")],
                     id="protected-skipped-next-ones-go"),
    ],
)
def test_tenant_over_quota_loses_its_own_chunks_first(
        candidates: str, used: int, target: int, protected: str,
        want: list[tuple[str, str]]) -> None:
    entries = [Chunk(n.encode(), tenant=n[0]) for n in candidates.split()]
    held = {n.encode() for n in protected.split()}
    victims = pol.choose_victims(entries, tier="dram", policy=quota_policy(dram="20"),
                                 used=used, target=target, reason="watermark",
                                 protected=lambda k: k in held)
    assert [(v.key.decode(), v.reason) for v in victims] == want


def test_a_quota_applies_to_its_own_tier_only() -> None:
    entries = [Chunk(n.encode(), tenant=n[0]) for n in ["b1", "a1", "b2", "a2", "a3"]]
    victims = pol.choose_victims(entries, tier="dram", policy=quota_policy(nvme="20"),
                                 used=50, target=50, reason="watermark",
                                 protected=nothing_protected)
    assert victims == []


def test_quota_counts_footprint() -> None:
    # Three 1-byte chunks of a, each holding a 100-byte page, against a 250-byte quota.
    entries = [Chunk(n.encode(), size=1, tenant=n[0]) for n in ["a1", "a2", "a3", "b1"]]
    victims = pol.choose_victims(entries, tier="dram", policy=quota_policy(dram="250"),
                                 used=400, target=400, reason="watermark",
                                 protected=nothing_protected, footprint=lambda e: 100)
    assert [(v.key.decode(), v.reason) for v in victims] == [("a1", "quota")]


PRIORITIES = TierPolicy.model_validate({"tenants": [
    {"name": "hi", "priority": 10}, {"name": "lo", "priority": -10}]})


@pytest.mark.parametrize(
    ("candidates", "used", "target", "want"),
    [
        pytest.param("hi1 lo1 hi2 lo2", 40, 20, "lo1 lo2", id="low-priority-first"),
        pytest.param("hi1 lo1 hi2 lo2", 40, 10, "lo1 lo2 hi1", id="then-order-within-priority"),
        pytest.param("hi1 lo1 hi2 lo2", 40, 30, "lo1", id="stops-at-target"),
        # A tenant the policy does not list has priority 0: between the two.
        pytest.param("hi1 x1 lo1", 30, 0, "lo1 x1 hi1", id="unlisted-tenant-is-priority-0"),
    ],
)
def test_low_priority_tenants_chunks_go_before_high_priority_ones(
        candidates: str, used: int, target: int, want: str) -> None:
    entries = [Chunk(n.encode(), tenant=n[:-1]) for n in candidates.split()]
    victims = pol.choose_victims(entries, tier="dram", policy=PRIORITIES, used=used,
                                 target=target, reason="watermark", protected=nothing_protected)
    assert " ".join(v.key.decode() for v in victims) == want
    assert {v.reason for v in victims} <= {"watermark"}


def test_protected_chunks_of_a_low_priority_tenant_are_never_chosen() -> None:
    entries = [Chunk(n.encode(), tenant=n[:-1]) for n in ["hi1", "lo1", "hi2", "lo2"]]
    victims = pol.choose_victims(entries, tier="dram", policy=PRIORITIES, used=40, target=20,
                                 reason="watermark",
                                 protected=lambda k: k.startswith(b"lo"))
    assert " ".join(v.key.decode() for v in victims) == "hi1 hi2"


# --------------------------------------------------------------------------- watermarks


RULES = TierRules(high_watermark=0.9, low_watermark=0.5)


@pytest.mark.parametrize(
    ("capacity", "used", "want"),
    [
        pytest.param(1000, 0, None, id="empty"),
        pytest.param(1000, 899, None, id="below-high"),
        pytest.param(1000, 900, None, id="at-high-is-not-above"),
        pytest.param(1000, 901, 500, id="above-high-down-to-low"),
        pytest.param(1000, 1000, 500, id="full"),
        pytest.param(0, 10, None, id="no-capacity-no-target"),
    ],
)
def test_watermark_target(capacity: int, used: int, want: int | None) -> None:
    assert pol.watermark_target(RULES, capacity, used) == want


# --------------------------------------------------------------------------- admission, demotion


@pytest.mark.parametrize(
    ("rules", "hits", "want"),
    [
        pytest.param({"admission": "always"}, 0, True, id="always-unhit"),
        pytest.param({"admission": "always", "minHits": 5}, 0, True, id="always-ignores-minHits"),
        pytest.param({"admission": "minHits", "minHits": 2}, 0, False, id="minHits-unhit"),
        pytest.param({"admission": "minHits", "minHits": 2}, 1, False, id="minHits-below"),
        pytest.param({"admission": "minHits", "minHits": 2}, 2, True, id="minHits-reached"),
        pytest.param({"admission": "minHits", "minHits": 2}, 7, True, id="minHits-above"),
    ],
)
def test_admits(rules: dict[str, Any], hits: int, want: bool) -> None:
    assert pol.admits(TierRules.model_validate(rules), hits) is want


@pytest.mark.parametrize(("on_evict", "want"), [("demote", True), ("drop", False)])
def test_demotes(on_evict: str, want: bool) -> None:
    assert pol.demotes(TierRules.model_validate({"onEvict": on_evict})) is want


@pytest.mark.parametrize(
    ("promotion", "hits_below", "want"),
    [
        pytest.param({}, 1, True, id="default-promotes-on-first-hit"),
        pytest.param({"minHits": 3}, 2, False, id="below-minHits"),
        pytest.param({"minHits": 3}, 3, True, id="at-minHits"),
        pytest.param({"enabled": False}, 100, False, id="disabled"),
    ],
)
def test_should_promote(promotion: dict[str, Any], hits_below: int, want: bool) -> None:
    policy = TierPolicy.model_validate({"promotion": promotion})
    assert pol.should_promote(policy, hits_below) is want


# --------------------------------------------------------------------------- prefetch

K = [bytes([i]) * 16 for i in range(8)]


@pytest.mark.parametrize(
    ("prefetch", "hit_count", "tiers", "want"),
    [
        pytest.param({}, 0, b"", [], id="miss-nothing"),
        pytest.param({}, 3, b"\x02\x02\x02", [], id="all-in-dram-nothing"),
        pytest.param({"lookaheadChunks": 2}, 5, b"\x02\x02\x03\x03\x03", [2, 3],
                     id="first-lookahead-below-dram"),
        pytest.param({"lookaheadChunks": 8}, 5, b"\x02\x02\x03\x03\x03", [2, 3, 4],
                     id="no-further-than-the-hit"),
        pytest.param({"lookaheadChunks": 4}, 4, b"\x03\x04\x02\x04", [0, 1, 3],
                     id="nvme-and-shared-count-dram-skipped"),
        pytest.param({"lookaheadChunks": 0}, 3, b"\x03\x03\x03", [], id="lookahead-zero"),
        pytest.param({"enabled": False}, 3, b"\x03\x03\x03", [], id="disabled"),
    ],
)
def test_prefetch_keys(prefetch: dict[str, Any], hit_count: int, tiers: bytes,
                       want: list[int]) -> None:
    policy = TierPolicy.model_validate({"prefetch": prefetch})
    assert pol.prefetch_keys(policy, K, hit_count, tiers) == [K[i] for i in want]


# --------------------------------------------------------------------------- TTL


@pytest.mark.parametrize(
    ("ttl", "ages", "protected", "want"),
    [
        pytest.param(None, {"a": 1e9}, "", "", id="no-ttl-never-expires"),
        pytest.param(60.0, {"a": 61, "b": 59, "c": 3600}, "", "ac", id="older-than-ttl"),
        pytest.param(60.0, {"a": 60}, "", "", id="exactly-ttl-is-not-older"),
        pytest.param(60.0, {"a": 61, "b": 61}, "a", "b", id="protected-never-expires"),
    ],
)
def test_expired(ttl: float | None, ages: dict[str, float], protected: str, want: str) -> None:
    now = 1_000_000.0
    entries = [chunk(n, last_access=now - age) for n, age in ages.items()]
    victims = pol.expired(entries, ttl, now, protect(protected))
    assert keys(victims) == want
    assert {v.reason for v in victims} <= {"ttl"}


def test_ttl_from_policy_yaml_is_seconds() -> None:
    rules = TierRules.model_validate({"ttl": "1h"})
    now = 10_000.0
    fresh, stale = chunk("f", last_access=now - 3599), chunk("s", last_access=now - 3601)
    assert keys(pol.expired([fresh, stale], rules.ttl, now, nothing_protected)) == "s"


# --------------------------------------------------------------------------- order keys


@pytest.mark.parametrize(
    ("order", "facts", "want"),
    [
        # (hits, last_seq, depth) per chunk; want: eviction order.
        pytest.param("lru", {"a": (9, 3, 0), "b": (0, 1, 0), "c": (5, 2, 0)}, "bca", id="lru"),
        pytest.param("lfu", {"a": (2, 1, 0), "b": (1, 5, 0), "c": (1, 4, 0)}, "cba", id="lfu"),
        pytest.param("prefix", {"a": (0, 7, 0), "b": (0, 7, 1), "c": (0, 7, 2), "d": (0, 3, 0)},
                     "dcba", id="prefix-oldest-request-deepest-first"),
    ],
)
def test_order_key(order: str, facts: dict[str, tuple[int, int, int]], want: str) -> None:
    from kvpool.agent.config import EvictionOrder

    entries = [chunk(n, hits=h, last_seq=s, depth=d) for n, (h, s, d) in facts.items()]
    ordered = sorted(entries, key=pol.order_key(EvictionOrder(order)))
    assert "".join(e.key.decode() for e in ordered) == want
