"""Sequence and BlockManager bookkeeping: ref counts, chained prefix hashes, LRU eviction, stats."""

import hashlib
import struct
from types import SimpleNamespace

import pytest

from relayrl.engine import block_manager as bm_module
from relayrl.engine.block_manager import BlockManager, block_hash
from relayrl.engine.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.unit

BS = 4
PARAMS = SimpleNamespace(max_tokens=16)


def seq(seq_id, tokens, **kw):
    return Sequence(seq_id, list(tokens), PARAMS, BS, **kw)


def refs(bm, s):
    return [bm.blocks[b].ref_count for b in s.block_table]


# -- Sequence ----------------------------------------------------------------------------------------

def test_sequence_sizes_and_append():
    s = seq(0, range(10, 19))  # 9 tokens: blocks of 4, 4, 1
    assert (s.num_tokens, s.num_prompt_tokens, s.num_completion_tokens) == (9, 9, 0)
    assert (s.num_blocks, s.last_block_num_tokens, s.last_token) == (3, 1, 18)
    assert s.block_tokens(1) == [14, 15, 16, 17] and s.block_tokens(2) == [18]
    with pytest.raises(IndexError):
        s.block_tokens(3)
    assert s.status is SequenceStatus.WAITING and not s.is_finished
    for t in (40, 41, 42):
        s.append_token(t, -0.5)
    assert s.completion_token_ids == [40, 41, 42] and s.logprobs == [-0.5] * 3
    assert (s.num_tokens, s.num_blocks, s.last_block_num_tokens) == (12, 3, 4)
    s.append_token(43, -1.0)
    assert (s.num_blocks, s.last_block_num_tokens) == (4, 1)


def test_sequence_with_partial_completion():
    s = seq(0, [1, 2, 3], completion_token_ids=[7, 8], completion_logprobs=[-0.1, -0.2])
    assert s.token_ids == [1, 2, 3, 7, 8] and s.num_prompt_tokens == 3
    assert s.completion_token_ids == [7, 8] and s.logprobs == [-0.1, -0.2]
    with pytest.raises(ValueError, match="one logprob per token"):
        seq(1, [1], completion_token_ids=[7], completion_logprobs=[])
    with pytest.raises(ValueError, match="empty"):
        seq(2, [])


# -- hashing -----------------------------------------------------------------------------------------

def test_block_hash_is_blake2b_of_int64_bytes():
    # pinned by hand, so every process (and machine) agrees on which blocks match
    expected = int.from_bytes(
        hashlib.blake2b(struct.pack("<5q", -1, 1, 2, 3, 4), digest_size=8).digest(), "little", signed=True
    )
    assert block_hash(-1, [1, 2, 3, 4]) == expected
    assert block_hash(expected, [1, 2, 3, 4]) != expected  # chained: same tokens, other prefix


# -- allocate / deallocate ---------------------------------------------------------------------------

def test_allocate_deallocate_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(0, range(9))                       # blocks 4 + 4 + 1
    b = seq(1, list(range(8)) + [99, 98])      # same two full blocks, own tail
    bm.allocate(a)
    assert len(a.block_table) == 3 and refs(bm, a) == [1, 1, 1] and bm.num_free_blocks == 5
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert refs(bm, a) == [2, 2, 1] and b.num_cached_tokens == 8 and bm.num_free_blocks == 4
    bm.deallocate(a)
    assert a.block_table == [] and a.num_cached_tokens == 0
    assert refs(bm, b) == [1, 1, 1] and bm.num_free_blocks == 5
    bm.deallocate(b)
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)
    bm.allocate(b)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate(b)


def test_chained_hash_gives_partial_hit():
    bm = BlockManager(num_blocks=16, block_size=BS)
    bm.allocate(seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other_second = seq(1, [1, 2, 3, 4, 50, 51, 52, 53, 9])
    bm.allocate(other_second)
    assert other_second.num_cached_tokens == 4          # first block only
    # the same second block after a different first block is a different prefix: no hit at all
    other_first = seq(2, [60, 61, 62, 63, 5, 6, 7, 8, 9])
    bm.allocate(other_first)
    assert other_first.num_cached_tokens == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (27, 4)


def test_hits_stop_at_the_first_miss(monkeypatch):
    # with an unchained hash, block 1 of `later` would match; it still must not be a hit, because
    # block 0 is computed again and a shared block after it would then be overwritten
    monkeypatch.setattr(bm_module, "block_hash", lambda prev, tokens: hash(tuple(tokens)))
    bm = BlockManager(num_blocks=16, block_size=BS)
    bm.allocate(seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    later = seq(1, [0, 0, 0, 0, 5, 6, 7, 8, 9])
    bm.allocate(later)
    assert later.num_cached_tokens == 0 and bm.prefix_hits == 0


def test_group_samples_share_full_blocks():
    # G = 4 samples of one 10-token prompt: blocks [4][4][2]; the first sample computes all, each
    # other one reuses the two full blocks -> hits 3 * 8 = 24 of 4 * 10 = 40 looked-up tokens
    bm = BlockManager(num_blocks=16, block_size=BS)
    group = [seq(i, range(100, 110), sample_index=i) for i in range(4)]
    for s in group:
        assert bm.can_allocate(s)
        bm.allocate(s)
    assert [s.num_cached_tokens for s in group] == [0, 8, 8, 8]
    assert all(s.block_table[:2] == group[0].block_table[:2] for s in group)
    assert len({s.block_table[2] for s in group}) == 4
    assert refs(bm, group[0]) == [4, 4, 1]
    assert bm.num_free_blocks == 16 - (2 + 4)
    assert (bm.prefix_queries, bm.prefix_hits) == (40, 24) and bm.hit_rate == pytest.approx(0.6)


def test_block_of_last_token_is_never_a_hit():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = seq(0, range(9))                  # caches blocks [0..3], [4..7]
    bm.allocate(first)
    exact = seq(1, range(8))                  # last token ends block 1: that block is computed again
    bm.allocate(exact)
    assert exact.num_cached_tokens == 4
    assert exact.block_table[0] == first.block_table[0] and exact.block_table[1] != first.block_table[1]
    one_block = seq(2, range(4))              # its only block holds the last token: nothing cached
    bm.allocate(one_block)
    assert one_block.num_cached_tokens == 0
    longer = seq(3, range(9))
    bm.allocate(longer)
    assert longer.num_cached_tokens == 8
    for s in (exact, one_block, longer):
        assert s.num_cached_tokens <= s.num_tokens - 1


def test_lru_eviction_takes_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Sequence(0, [1, 2, 3], PARAMS, 2)     # block [1 2] (cached) + [3]
    b = Sequence(1, [5, 6, 7], PARAMS, 2)     # block [5 6] (cached) + [7]
    bm.allocate(a)
    bm.allocate(b)
    (a_head, a_tail), b_head = a.block_table, b.block_table[0]
    assert bm.num_free_blocks == 0
    bm.deallocate(a)                          # free list: a tail, a head
    bm.deallocate(b)                          #            ..., b tail, b head
    fresh = Sequence(2, [9, 9, 9], PARAMS, 2)
    bm.allocate(fresh)                        # takes a's two blocks: a's head is evicted
    assert fresh.block_table == [a_tail, a_head]
    again_b = Sequence(3, [5, 6, 7], PARAMS, 2)
    bm.allocate(again_b)                      # b's head was only freed, not evicted: a hit
    assert again_b.num_cached_tokens == 2 and again_b.block_table[0] == b_head
    bm.deallocate(fresh)
    again_a = Sequence(4, [1, 2, 3], PARAMS, 2)
    bm.allocate(again_a)
    assert again_a.num_cached_tokens == 0     # a's head was evicted


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda prev, tokens: 7)
    bm = BlockManager(num_blocks=16, block_size=BS)
    bm.allocate(seq(0, [1, 2, 3, 4, 5]))
    other = seq(1, [9, 9, 9, 9, 5])           # same (constant) hash, different tokens
    assert bm.can_allocate(other)
    bm.allocate(other)
    assert other.num_cached_tokens == 0 and bm.prefix_hits == 0
    same = seq(2, [9, 9, 9, 9, 6])            # the newest block registered under 7 really matches
    bm.allocate(same)
    assert same.num_cached_tokens == 4 and same.block_table[0] == other.block_table[0]


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a, b = seq(0, range(9)), seq(1, range(9))
    bm.allocate(a)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert bm.hit_rate == 0.0 and bm.prefix_hits == 0
    assert all(blk.hash is None for blk in bm.blocks)


def test_can_allocate_counts_in_use_hits_as_free_and_free_hits_as_used():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq(0, range(9))                      # 3 blocks, 1 left
    bm.allocate(a)
    b = seq(1, list(range(8)) + [77])         # needs 3, but 2 are in-use hits -> 1 new block
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    bm.deallocate(a)
    bm.deallocate(b)                          # all 4 free, the 2 shared ones still cached
    hold = seq(2, [50])
    bm.allocate(hold)                         # takes the least recently freed block
    assert bm.num_free_blocks == 3
    # 13 tokens = 4 blocks; the 2 hits are on FREE blocks, so they still take 2 of the 3 free ones
    assert not bm.can_allocate(seq(3, list(range(8)) + [1, 1, 1, 1, 1]))
    # 12 tokens = 3 blocks (the full last block is computed, not hit) -> fits exactly
    c = seq(4, list(range(8)) + [1, 1, 1, 1])
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and bm.num_free_blocks == 0


def test_decode_appends_open_blocks_and_register_full_ones():
    bm = BlockManager(num_blocks=3, block_size=BS)
    s = seq(0, [1, 2, 3, 4])                  # one full block, registered at allocate
    bm.allocate(s)
    s.append_token(5, -0.1)                   # the newest token starts block 1: a block is needed
    assert bm.can_append(s)
    bm.may_append(s)
    bm.may_append(s)                          # idempotent
    assert len(s.block_table) == s.num_blocks == 2 and bm.num_free_blocks == 1
    for t in (6, 7, 8):                       # fill block 1; no new block
        s.append_token(t, -0.1)
        bm.may_append(s)
        assert len(s.block_table) == 2
    # block 1 is full but the KV of token 8 is not written yet: not in the cache yet
    probe = seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm._prefix_hits(probe, bm._full_block_hashes(probe)) == s.block_table[:1]
    s.append_token(9, -0.1)                   # opens block 2; block 1 (now written) is registered
    bm.may_append(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 0
    assert bm._prefix_hits(probe, bm._full_block_hashes(probe)) == s.block_table[:2]
    for t in (10, 11, 12):
        s.append_token(t, -0.1)
        assert bm.can_append(s)               # still room in block 2 although the pool is empty
        bm.may_append(s)
    s.append_token(13, -0.1)
    assert not bm.can_append(s)               # needs a 4th block, none free
    with pytest.raises(RuntimeError, match="can_append"):
        bm.may_append(s)
    for t in range(14, 18):                   # two blocks behind: the engine broke the protocol
        s.append_token(t, -0.1)
    with pytest.raises(RuntimeError, match="one token per decode step"):
        bm.may_append(s)


def test_utilisation_and_used_fraction_by_hand():
    bm = BlockManager(num_blocks=10, block_size=BS)
    assert bm.utilisation() == 1.0 and bm.used_fraction() == 0.0
    a = seq(0, [1, 2, 3, 4, 5, 6])            # [4][2]: 6 live of 8
    bm.allocate(a)
    assert bm.utilisation() == pytest.approx(6 / 8) and bm.used_fraction() == pytest.approx(0.2)
    b = seq(1, [1, 2, 3, 4, 9])               # shares [1 2 3 4], own [9]: 3 blocks, 4 + 2 + 1 live
    bm.allocate(b)
    assert bm.utilisation() == pytest.approx(7 / 12) and bm.used_fraction() == pytest.approx(0.3)
    b.append_token(10, -0.1)
    bm.may_append(b)                          # [9 10]: 8 live of 12
    assert bm.utilisation() == pytest.approx(8 / 12)
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.utilisation() == 1.0 and bm.used_fraction() == 0.0


def test_resumed_sequence_allocates_prompt_and_completion():
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = seq(0, [1, 2, 3, 4, 5], completion_token_ids=[6, 7, 8, 9], completion_logprobs=[-1.0] * 4)
    assert bm.can_allocate(first)
    bm.allocate(first)
    assert len(first.block_table) == 3 and first.num_cached_tokens == 0
    first_blocks = list(first.block_table)
    bm.deallocate(first)
    # resumed again after an abort: the blocks of its prompt AND completion are still cached
    again = seq(1, [1, 2, 3, 4, 5], completion_token_ids=[6, 7, 8, 9], completion_logprobs=[-1.0] * 4)
    bm.allocate(again)
    assert again.num_cached_tokens == 8 and again.block_table[:2] == first_blocks[:2]
