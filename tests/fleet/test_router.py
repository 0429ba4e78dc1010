"""The fleet's router (relayrl.rollout.router) on hand-computed cases: least outstanding work, prefix affinity at the
engine's block granularity, the load bound that overrides affinity, and forgetting on new weights."""

from __future__ import annotations

import pytest

from relayrl.rollout.router import Router, prefix_hashes

pytestmark = pytest.mark.unit

B = 4  # block size: a prompt of 8 tokens is 2 full blocks, one of 10 is 2 full blocks + 2 tokens


def ids(*blocks: int, tail: int = 0) -> list[int]:
    """A prompt of whole blocks: block value v is [v, v, v, v]; `tail` more tokens (99) after them."""
    return [v for v in blocks for _ in range(B)] + [99] * tail


def test_least_outstanding_work_with_no_prefix_in_common():
    r = Router(3, B)
    # distinct first blocks: nothing is cached anywhere, every request goes to the least loaded (ties: lowest index)
    assert r.route(ids(1), work=10) == 0  # loads 10 0 0
    assert r.route(ids(2), work=30) == 1  # loads 10 30 0
    assert r.route(ids(3), work=5) == 2  # loads 10 30 5
    assert r.route(ids(4), work=1) == 2  # 5 is the least: loads 10 30 6
    assert r.route(ids(5), work=1) == 2  # 6 < 10: loads 10 30 7
    assert [r.load(i) for i in range(3)] == [10, 30, 7]
    r.done(1, 30)
    assert r.route(ids(6), work=1) == 1  # replica 1 finished its work: now the least loaded
    assert [c.requests for c in r.counters] == [1, 2, 3]


def test_a_shared_prefix_goes_where_it_is_cached():
    r = Router(2, B, balance_abs=100)
    assert r.route(ids(7, 8, 9), work=20) == 0  # cold: least loaded (tie -> 0); replica 0 now holds blocks 7,8,9
    # the same first two blocks, a different third: 8 of 12 tokens cached on replica 0 (2/3 >= 0.5), and its load
    # (20) is within the bound of the least loaded (0) + 100: affinity wins over load
    assert r.route(ids(7, 8, 5), work=20) == 0
    c = r.counters[0]
    assert (c.prompt_tokens, c.matched_tokens, c.by_affinity) == (24, 8, 1)
    assert c.hit_rate == pytest.approx(8 / 24)
    # a prompt sharing only its first block (4 of 12 tokens: 1/3 < 0.5) is not worth the wait: least loaded
    assert r.route(ids(7, 1, 2), work=20) == 1


def test_the_match_is_in_whole_leading_blocks():
    r = Router(2, B)
    r.route(ids(1, 2), work=0)  # replica 0 holds blocks (1), (1,2)
    assert r.matched_tokens(prefix_hashes(ids(1, 2, tail=3), B), 0) == 8  # the partial tail block never counts
    assert r.matched_tokens(prefix_hashes(ids(2), B), 0) == 0  # block (2) after (1) is not block (2) first: chained
    assert r.matched_tokens(prefix_hashes(ids(1, 3), B), 0) == 4
    assert r.matched_tokens(prefix_hashes(ids(1, 2), B), 1) == 0
    assert prefix_hashes([5, 5, 5], B) == []  # shorter than a block: nothing to share


def test_the_load_bound_overrides_affinity():
    # over the bound <=> load[cached] - load[least] > balance_abs and load[cached] > balance_rel * load[least]
    r = Router(2, B, balance_abs=50, balance_rel=2.0)
    assert r.route(ids(1, 2), work=60) == 0  # loads 60 0
    # fully cached on 0, but 60 - 0 > 50 and 60 > 2 * 0: over the bound, so the least loaded takes it
    assert r.route(ids(1, 2), work=10) == 1  # loads 60 10
    # now both hold the prefix: the longest match ties, so the less loaded of the two, replica 1
    assert r.route(ids(1, 2), work=30) == 1  # loads 60 40
    # a prefix only replica 0 holds: 60 - 40 = 20 <= 50: within the bound, affinity wins
    r.route(ids(3, 4), work=0)  # (cold: least loaded is 1 -> replica 1 holds (3,4)); loads 60 40
    assert r.route(ids(3, 4), work=100) == 1  # cached on 1, loads 60 140
    # cached on 1 at 140: 140 - 60 = 80 > 50 and 140 > 2 * 60: over the bound, back to the least loaded, 0
    assert r.route(ids(3, 4), work=1) == 0
    # the relative test alone does not suffice: loads 61 140 -> 140 - 61 = 79 > 50 but 140 <= 2.5 * 61
    r2 = Router(2, B, balance_abs=50, balance_rel=2.5)
    r2.route(ids(9), work=61)  # -> 0
    r2.route(ids(3, 4), work=140)  # least loaded is 1 -> 1
    assert r2.route(ids(3, 4), work=1) == 1


def test_new_weights_forget_every_cached_prefix():
    r = Router(2, B)
    r.route(ids(1, 2), work=5)  # -> 0, loads 5 0
    assert r.route(ids(1, 2), work=5) == 0  # affinity
    r.forget()  # the engines salt their block hashes by weights version: nothing cached survives a sync
    assert r.route(ids(1, 2), work=5) == 1  # loads 10 0: cold again, least loaded
    assert r.counters[0].matched_tokens == 8 and r.counters[1].matched_tokens == 0


def test_a_replica_table_keeps_its_most_recent_blocks():
    r = Router(1, B, capacity_blocks=2)
    r.route(ids(1, 2), work=0)  # holds (1), (1,2)
    r.route(ids(3), work=0)  # (3) in: (1) is the least recently used, dropped
    assert r.matched_tokens(prefix_hashes(ids(1, 2), B), 0) == 0  # chained: without block (1), (1,2) is no hit
    assert r.matched_tokens(prefix_hashes(ids(3), B), 0) == 4
    assert len(r.tables[0]) == 2


def test_counters_reset_but_load_stays():
    r = Router(2, B)
    r.route(ids(1), work=7)
    r.reset_counters()
    assert r.counters[0].requests == 0 and r.counters[0].prompt_tokens == 0 and r.load(0) == 7


def test_only_the_replicas_named_may_take_a_request():
    r = Router(3, B)
    assert r.route(ids(1, 2), work=10, among=[1, 2]) == 1  # 0 is the least loaded (tie) but may not take it
    # the prefix is cached on 1; with 1 out of service the least loaded of the others takes it, cold
    assert r.route(ids(1, 2), work=10, among=[0, 2]) == 0
    assert r.counters[0].matched_tokens == 0 and r.counters[0].by_affinity == 0
    assert r.route(ids(1, 2), work=10, among=[1]) == 1 and r.counters[1].matched_tokens == 2 * B
    with pytest.raises(ValueError, match="no replica"):
        r.route(ids(3), work=1, among=[])


def test_a_replaced_replica_holds_nothing_and_an_added_one_is_numbered_last():
    r = Router(2, B)
    assert r.route(ids(4, 5), work=7) == 0
    r.clear(0)  # restarted: its cache and the lost engine's work are gone
    assert r.load(0) == 0 and r.matched_tokens(prefix_hashes(ids(4, 5), B), 0) == 0
    assert r.add() == 2 and r.replicas == 3
    assert r.route(ids(6), work=1, among=[2]) == 2 and r.counters[2].requests == 1
