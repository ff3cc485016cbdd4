"""Refill arithmetic: quota_deferred, interleaving, tenants' shares (pure)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.store._refill import (
    EQUAL,
    TenantWeights,
    fair_pick,
    first_reads,
    firsts_by_group,
    interleave,
    split_quota,
)

pytestmark = pytest.mark.unit


def test_split_quota_gives_deferred_its_floor_and_lends_what_a_side_lacks() -> None:
    assert split_quota(20, 100, 100, 10) == (2, 18)
    assert split_quota(20, 3, 100, 10) == (17, 3)
    assert split_quota(20, 100, 0, 10) == (0, 20)
    assert split_quota(0, 5, 5, 10) == (0, 0)


def test_interleave_alternates_new_and_deferred() -> None:
    assert interleave("abc", "XY") == ["a", "X", "b", "Y", "c"]


def test_a_small_tenant_behind_a_large_backlog_gets_half_with_equal_weights() -> None:
    cands = {"a": [f"a{i}" for i in range(500)], "b": [f"b{i}" for i in range(10)]}
    got = fair_pick(cands, EQUAL, 20)
    assert sorted(got) == sorted([f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)])
    assert got[:4] == ["a0", "b0", "a1", "b1"]


def test_weights_three_to_one_split_the_batch_three_to_one() -> None:
    cands = {"a": [f"a{i}" for i in range(500)], "b": [f"b{i}" for i in range(500)]}
    got = fair_pick(cands, TenantWeights({"a": 3.0}), 20)
    assert sum(x.startswith("a") for x in got) == 15
    # and a prefix already follows the weights
    assert sum(x.startswith("a") for x in got[:8]) == 6


def test_a_tenant_without_enough_candidates_lends_its_turns() -> None:
    cands = {"a": list(range(100)), "b": [1000, 1001], "c": []}
    got = fair_pick(cands, EQUAL, 10)
    assert got.count(1000) + got.count(1001) == 2 and len(got) == 10


def test_a_heavy_tenant_last_in_line_is_not_cut_short_by_the_batch_end() -> None:
    # the whole-quantum circle would give the heavy tenant nothing here
    cands: dict[str, list[str]] = {f"light{i}": [f"l{i}-{j}" for j in range(50)] for i in range(10)}
    cands["heavy"] = [f"h{j}" for j in range(50)]
    got = fair_pick(cands, TenantWeights({"heavy": 10.0}), 10)
    assert sum(x.startswith("h") for x in got) >= 4  # share 10 * 10/20 = 5, less one


def test_not_fair_keys_every_tenant_alike() -> None:
    w = TenantWeights(fair=False)
    assert w.key("acme") == "" and EQUAL.key("acme") == "acme"
    with pytest.raises(ValueError):
        TenantWeights({"a": 0.0})


tenants = st.dictionaries(
    st.sampled_from("abcdef"),
    st.tuples(st.integers(0, 40), st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0, 7.5])),
    max_size=6)


@given(tenants, st.integers(0, 120))
def test_every_tenant_gets_its_weighted_share_of_every_prefix_within_one(
        spec: dict[str, tuple[int, float]], limit: int) -> None:
    cands = {t: [(t, i) for i in range(n)] for t, (n, _) in spec.items()}
    weights = TenantWeights({t: w for t, (_, w) in spec.items()})
    got = fair_pick(cands, weights, limit)
    total = sum(n for n, _ in spec.values())
    assert len(got) == min(limit, total)  # never more than limit, none left idle
    assert len(set(got)) == len(got)  # nothing twice
    for t in spec:
        mine = [i for tt, i in got if tt == t]
        assert mine == list(range(len(mine)))  # order within a tenant kept
    active = {t: w for t, (n, w) in spec.items() if n}
    for k in range(1, len(got) + 1):
        prefix = got[:k]
        for t, w in active.items():
            share = k * w / sum(active.values())
            taken = sum(1 for tt, _ in prefix if tt == t)
            assert taken >= min(spec[t][0], math.ceil(share - 1 - 1e-9)), (t, k, prefix)


@given(tenants, st.integers(1, 120))
def test_lists_cut_at_first_reads_still_give_every_tenant_its_share(
        spec: dict[str, tuple[int, float]], limit: int) -> None:
    # What the SQL stores do: read each tenant's share plus one; read up to
    # the limit only when the tenants together have fewer than it.
    weights = TenantWeights({t: w for t, (_, w) in spec.items()})
    active = [t for t, (n, _) in spec.items() if n]
    ask = first_reads(limit, active, weights)
    assert all(1 <= k <= limit for k in ask.values())
    cut = {t: [(t, i) for i in range(min(spec[t][0], ask[t]))] for t in active}
    if sum(map(len, cut.values())) < limit:
        cut = {t: [(t, i) for i in range(min(spec[t][0], limit))] for t in active}
    got = fair_pick(cut, weights, limit)
    assert len(got) == min(limit, sum(n for n, _ in spec.values()))
    total_w = sum(spec[t][1] for t in active)
    for t in active:
        taken = sum(1 for tt, _ in got if tt == t)
        share = len(got) * spec[t][1] / total_w
        assert taken >= min(spec[t][0], math.ceil(share - 1 - 1e-9)), (t, got)


def test_a_tenant_is_read_once_per_message_and_the_memo_starts_over_when_full() -> None:
    from sluice.store._refill import TenantMemo

    reads: list[str] = []

    def reader(spid: str, tenant: str):  # type: ignore[no-untyped-def]
        return lambda: reads.append(spid) or tenant

    memo = TenantMemo(kept=2)
    assert memo.get("S1", reader("S1", "a")) == "a"
    assert memo.get("S1", reader("S1", "changed")) == "a"  # remembered, not read again
    assert memo.get("S2", reader("S2", "b")) == "b"
    assert reads == ["S1", "S2"]
    assert memo.get("S3", reader("S3", "c")) == "c"  # full: starts over
    assert memo.get("S1", reader("S1", "a")) == "a"
    assert reads == ["S1", "S2", "S3", "S1"]


@given(st.lists(st.tuples(st.integers(0, 50), st.sampled_from("abcd")), max_size=300),
       st.integers(1, 12))
def test_firsts_by_group_are_each_group_s_smallest_in_order(
        items: list[tuple[int, str]], k: int) -> None:
    cands = [((n, g), f"{g}/{i}") for i, (n, g) in enumerate(items)]

    def group(c: tuple[tuple[int, str], str]) -> str:
        return c[0][1]

    got = firsts_by_group(cands, k, group)
    want = sorted(c for g in "abcd" for c in sorted(x for x in cands if group(x) == g)[:k])
    assert got == want
