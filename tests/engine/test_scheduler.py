"""Scheduler policy, driven by a fake engine: prefill first, budgets, preemption by recompute, abort.

The fake engine stands in for the model runner and postprocess. Its "KV cache" maps a slot to the
fingerprint of the token it holds (the whole prefix up to that token), so any shared, evicted or
recycled block that would give attention wrong KV fails an assertion — a forked sample writing into
the block it shares with a sibling included (the copies copy-on-write asks for are done first, as the
model runner does them).
"""

from types import SimpleNamespace

import pytest

from relayrl.engine.block_manager import BlockManager
from relayrl.engine.scheduler import Scheduler
from relayrl.engine.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.unit


def make_seq(seq_id, prompt, max_tokens=8, block_size=4, **kw):
    return Sequence(seq_id, list(prompt), SimpleNamespace(max_tokens=max_tokens), block_size, **kw)


def next_token(seq):
    # deterministic in the sequence's content alone, so runs with and without preemption must agree
    return (sum((i + 1) * t for i, t in enumerate(seq.token_ids)) + 7 * seq.sample_index) % 50 + 3


class FakeEngine:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.kv = {}
        self.prefills_with_completion = 0  # re-prefills of preempted (or resumed) sequences

    @staticmethod
    def slot(seq, pos):
        bs = seq.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def step(self):
        seqs, is_prefill = self.scheduler.schedule()
        bs = self.scheduler.block_manager.block_size
        for src, dst in self.scheduler.block_manager.take_copies():
            for o in range(bs):
                self.kv[dst * bs + o] = self.kv.get(src * bs + o)
        for s in seqs:
            assert s.status is SequenceStatus.RUNNING
            assert len(s.block_table) == s.num_blocks  # a slot for every token, the newest included
            if is_prefill and s.fork_parent is not None:  # a fork computes nothing: its parent does, now
                assert s.fork_parent in seqs and s.fork_parent.fork_parent is None
                assert s.block_table == s.fork_parent.block_table and s.num_cached_tokens == s.num_tokens
                continue
            assert s.num_cached_tokens <= s.num_tokens - 1
            start = s.num_cached_tokens if is_prefill else s.num_tokens - 1
            self.prefills_with_completion += is_prefill and s.num_completion_tokens > 0
            for p in range(start, s.num_tokens):
                self.kv[self.slot(s, p)] = tuple(s.token_ids[:p + 1])
        for s in seqs:  # attention reads only after the whole batch has written
            for p in range(s.num_tokens):
                assert self.kv[self.slot(s, p)] == tuple(s.token_ids[:p + 1]), (s, p)
        for s in seqs:  # postprocess
            t = next_token(s)
            s.append_token(t, -t / 100)
            if s.num_completion_tokens >= s.params.max_tokens:
                self.scheduler.finish(s, "length")
        return seqs, is_prefill

    def run(self, max_steps=10_000):
        kinds = []
        while self.scheduler.has_unfinished():
            assert len(kinds) < max_steps, "the engine loop does not terminate"
            seqs, is_prefill = self.step()
            assert seqs, "an unfinished scheduler returned an empty batch"
            kinds.append(is_prefill)
        return kinds


def test_prefill_token_budget_and_huge_prompt():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=20)
    seqs = [make_seq(i, range(10 * i, 10 * i + 8)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == seqs[:2]   # 8 + 8 fits, + 8 more would be 24 > 20
    assert list(sched.waiting) == seqs[2:] and list(sched.running) == seqs[:2]

    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    huge, small = make_seq(0, range(30)), make_seq(1, [1, 2])
    sched.add(huge)
    sched.add(small)
    assert sched.schedule() == ([huge], True)  # alone over budget, admitted anyway
    assert sched.schedule() == ([small], True)


def test_group_samples_charge_only_uncached_tokens():
    # without forks: 4 samples of a 9-token prompt, blocks of 4: the first costs 9 new tokens, the others
    # 1 each (8 are prefix hits); budget 20 admits all 4 (9, 9+9 <= 20 -> 10, 10+9 -> 11, 11+9 -> 12)
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=20, fork_samples=False)
    group = [make_seq(i, range(100, 109), sample_index=i) for i in range(4)]
    for s in group:
        sched.add(s)
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == group
    assert [s.num_cached_tokens for s in group] == [0, 8, 8, 8]
    assert sched.block_manager.hit_rate == pytest.approx(24 / 36)
    assert sched.num_prefill_tokens == 12 and sched.block_manager.num_free_blocks == 64 - 2 - 4


def test_forked_samples_share_every_block_and_cost_nothing():
    # the same 4 samples forked: the first costs 9 tokens and 3 blocks; the others share all 3 (the partial
    # third too), with all 9 tokens computed; no lookup, so no hit; a budget of 9 still admits them all
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=9)
    group = [make_seq(i, range(100, 109), sample_index=i) for i in range(4)]
    other = make_seq(9, range(100, 109), request_id=1)  # the same prompt in another request: not forked
    for s in group + [other]:
        sched.add(s)
    batch, _ = sched.schedule()
    assert batch == group and list(sched.waiting) == [other]  # 9 + 9 > 9: the next request waits
    assert [s.num_cached_tokens for s in group] == [0, 9, 9, 9]
    assert [s.fork_parent for s in group] == [None] + [group[0]] * 3
    assert all(s.block_table == group[0].block_table for s in group)
    assert [bm.blocks[b].ref_count for b in group[0].block_table] == [4, 4, 4]
    assert bm.num_free_blocks == 61 and sched.num_prefill_tokens == 9 and sched.num_forks == 3
    assert bm.hit_rate == 0 and bm.forked_tokens == 27
    batch, _ = sched.schedule()  # the other request: its full blocks are prefix hits, not a fork
    assert batch == [other] and other.fork_parent is None and other.num_cached_tokens == 8


@pytest.mark.parametrize("prompt_len", [9, 8])  # a shared partial last block, or only full ones
def test_copy_on_write_on_the_first_decode(prompt_len):
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    group = [make_seq(i, range(prompt_len), max_tokens=6, sample_index=i) for i in range(3)]
    for s in group:
        sched.add(s)
    engine = FakeEngine(sched)
    engine.step()                              # one prefill; 3 samples, 3 different first tokens
    full, last = group[0].block_table[:2], group[0].block_table[-1]
    batch, is_prefill = sched.schedule()       # decode: each writes its first token's KV
    assert batch == group and not is_prefill
    copies = bm.take_copies()
    if prompt_len == 9:                        # the first two get copies of the shared block, the third keeps it
        assert [s.block_table[:2] for s in group] == [full] * 3 and group[2].block_table[-1] == last
        assert copies == [(last, group[0].block_table[-1]), (last, group[1].block_table[-1])]
        assert len({s.block_table[-1] for s in group}) == 3 and bm.blocks[last].ref_count == 1
    else:                                      # the newest token opens a block: nothing to copy
        assert copies == [] and [s.block_table[:2] for s in group] == [group[0].block_table[:2]] * 3
        assert len({s.block_table[-1] for s in group}) == 3
    assert bm.may_append(group[0]) is None and bm.take_copies() == []  # idempotent
    sched.abort({s.seq_id for s in group})
    assert bm.num_free_blocks == 16 and all(b.ref_count == 0 for b in bm.blocks)


def test_copy_on_write_needs_a_free_block_or_preempts():
    # 3 blocks: a 5-token prompt (2 blocks) forked twice leaves 1 free; the first decode needs 2 copies:
    # the first sample takes the free block, the last running one (a sibling) is preempted, the middle
    # one is then its shared block's last holder and writes in place
    bm = BlockManager(3, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    group = [make_seq(i, range(5), max_tokens=3, sample_index=i) for i in range(3)]
    for s in group:
        sched.add(s)
    engine = FakeEngine(sched)
    engine.step()
    assert bm.num_free_blocks == 1 and bm.can_append(group[0])
    assert engine.step() == (group[:2], False)
    assert sched.num_preemptions == 1 and list(sched.waiting) == [group[2]]
    assert engine.run() and all(s.is_finished for s in group) and bm.num_free_blocks == 3


def test_max_num_seqs_bounds_running_and_prefill_comes_first():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    engine = FakeEngine(sched)
    a, b = make_seq(0, [1, 2, 3], max_tokens=2), make_seq(1, [4, 5, 6], max_tokens=4)
    c = make_seq(2, [7, 8, 9], max_tokens=2)
    for s in (a, b, c):
        sched.add(s)
    assert engine.step() == ([a, b], True)    # c waits: running is full
    assert engine.step() == ([a, b], False)   # a finishes (2 tokens)
    assert a.is_finished and a.finish_reason == "length" and a.block_table == []
    assert engine.step() == ([c], True)       # room again: prefill before decode
    assert engine.step() == ([b, c], False)
    assert engine.run() == [False]
    assert [s.num_completion_tokens for s in (a, b, c)] == [2, 4, 2]
    assert sched.block_manager.num_free_blocks == 64


def test_decode_opens_a_block_for_the_newest_token():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=100)
    s = make_seq(0, [1, 2, 3, 4], max_tokens=6)
    sched.add(s)
    assert sched.schedule() == ([s], True) and len(s.block_table) == 1
    s.append_token(9, -0.1)                   # postprocess; token 5 starts block 1
    assert len(s.block_table) == 1            # ... which the scheduler opens, not postprocess
    assert sched.schedule() == ([s], False)
    assert len(s.block_table) == 2 == s.num_blocks


def _preempt_fixture(num_blocks, num_seqs=2):
    # blocks of 2; 3-token prompts = 2 blocks each
    sched = Scheduler(BlockManager(num_blocks, 2), max_num_seqs=4, max_num_batched_tokens=100)
    seqs = [make_seq(i, [10 + i, 20 + i, 30 + i], max_tokens=5, block_size=2) for i in range(num_seqs)]
    for s in seqs:
        sched.add(s)
    assert sched.schedule() == (seqs, True)
    for s in seqs:
        s.append_token(40, -0.4)              # 4 tokens: still 2 blocks
    assert sched.schedule() == (seqs, False)
    for s in seqs:
        s.append_token(41, -0.5)              # 5 tokens: each needs a 3rd block
    return sched, seqs


def test_preempt_the_last_running_sequence():
    sched, (a, b) = _preempt_fixture(num_blocks=4)  # no free block: b makes room for a
    assert sched.schedule() == ([a], False)
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b] and list(sched.running) == [a]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_cached_tokens == 0
    assert b.completion_token_ids == [40, 41] and b.logprobs == [-0.4, -0.5]  # kept, to recompute


def test_preempted_sequence_goes_to_the_front_of_waiting():
    sched, (a, b, c) = _preempt_fixture(num_blocks=6, num_seqs=3)
    late = make_seq(9, [1, 2, 3], max_tokens=5, block_size=2)
    sched.add(late)                           # cannot be allocated: the pool is full
    assert sched.schedule() == ([a, b], False)  # c (the last) freed 2 blocks: one for a, one for b
    assert sched.num_preemptions == 1 and list(sched.waiting) == [c, late]


def test_preempt_itself_when_batch_mates_hold_the_pool():
    sched, (a, b) = _preempt_fixture(num_blocks=5)  # one free block: a takes it, b has nothing to evict
    assert sched.schedule() == ([a], False)
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b] and b.block_table == []


@pytest.mark.parametrize("prefix_caching,fork", [(True, True), (False, True), (True, False)])
def test_tiny_pool_preempts_yet_everything_finishes_unchanged(prefix_caching, fork):
    def run(num_blocks):
        sched = Scheduler(BlockManager(num_blocks, 4, prefix_caching), max_num_seqs=4, max_num_batched_tokens=64,
                          fork_samples=fork)
        # 2 prompts x 3 samples; 5 prompt + 12 completion tokens -> up to 16 with KV = 4 blocks each
        seqs = [
            make_seq(3 * p + g, range(10 * p, 10 * p + 5), max_tokens=12, sample_index=g, request_id=p)
            for p in range(2) for g in range(3)
        ]
        for s in seqs:
            sched.add(s)
        engine = FakeEngine(sched)
        kinds = engine.run()
        assert all(s.is_finished and s.finish_reason == "length" for s in seqs)
        assert all(s.num_completion_tokens == 12 == len(s.logprobs) for s in seqs)
        assert sched.block_manager.num_free_blocks == num_blocks
        return seqs, sched, engine, kinds

    roomy, roomy_sched, _, _ = run(num_blocks=64)
    tight, tight_sched, engine, kinds = run(num_blocks=8)
    assert roomy_sched.num_preemptions == 0
    assert tight_sched.num_preemptions > 0 and engine.prefills_with_completion > 0
    assert kinds.count(True) > 1              # preempted sequences came back through prefill
    # recompute, never drop: the same tokens and logprobs as without memory pressure
    assert [s.token_ids for s in tight] == [s.token_ids for s in roomy]
    assert [s.logprobs for s in tight] == [s.logprobs for s in roomy]


def test_abort_waiting_and_running():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    run_, wait_, keep = make_seq(0, range(6)), make_seq(1, range(7)), make_seq(2, range(3))
    for s in (run_, wait_, keep):
        sched.add(s)
    assert sched.schedule() == ([run_], True)
    aborted = sched.abort({0, 1, 99})         # unknown ids are ignored
    assert sorted(s.seq_id for s in aborted) == [0, 1]
    for s in aborted:
        assert s.is_finished and s.finish_reason == "abort" and s.block_table == []
    assert list(sched.waiting) == [keep] and not sched.running and bm.num_free_blocks == 16
    assert FakeEngine(sched).run() and keep.is_finished and not sched.has_unfinished()


def test_resumed_sequence_prefills_all_its_tokens():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=100)
    s = make_seq(0, [1, 2, 3, 4, 5], max_tokens=5, completion_token_ids=[6, 7, 8], completion_logprobs=[-1.0] * 3)
    sched.add(s)
    engine = FakeEngine(sched)
    assert engine.step() == ([s], True)
    assert engine.prefills_with_completion == 1
    assert len(s.block_table) == 2 and s.num_cached_tokens == 0
    assert engine.run() == [False]            # 3 resumed + 2 new = max_tokens
    assert s.completion_token_ids[:3] == [6, 7, 8] and s.num_completion_tokens == 5
    assert s.logprobs[:3] == [-1.0] * 3 and len(s.logprobs) == 5


def test_add_rejects_a_sequence_that_can_never_fit():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=100)
    sched.add(make_seq(0, range(8), max_tokens=9))  # 8 + 9 - 1 = 16 tokens with KV = 4 blocks: ok
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add(make_seq(1, range(8), max_tokens=10))
