"""Forked samples (n > 1 from one prefill, copy-on-write of the shared last block) and length-grouped
prefill attention, against the previous engine (fork_samples=False, group_prefill=False), the plain model,
and the KV cache's own contents."""

import pytest
import torch

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.attention import GROUP_FILL, build_batch, group_rows
from relayrl.engine.model_runner import ModelRunner, prepare
from relayrl.engine.outputs import SampleCost
from relayrl.engine.sequence import Sequence
from relayrl.models import CausalLM

from conftest import tiny_config

# block size 4: prompts ending mid-block (9, 3, 6 tokens: a shared partial last block) and on a block's
# end (8 tokens: only full blocks shared); the last repeats the first (a prefix hit across requests)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [8, 9, 10], [20, 21, 22, 23, 24, 25, 26, 27], [30, 31, 32, 33, 34, 35],
           [5, 6, 7, 8, 9, 10, 11, 12, 13]]
PARAMS = SamplingParams(n=3, temperature=0.8, max_tokens=7, ignore_eos=True, seed=4)
PREVIOUS = dict(fork_samples=False, group_prefill=False)


def engine(model, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLMEngine.from_model(model, **kw)


def flat(outs, field):
    return [getattr(s, field) for o in outs for s in o.samples]


@pytest.mark.equivalence
def test_forked_samples_equal_the_previous_engine_and_the_plain_model(tiny_model):
    new, old = engine(tiny_model), engine(tiny_model, **PREVIOUS)
    a, b = new.generate(PROMPTS, PARAMS), old.generate(PROMPTS, PARAMS)
    assert new.stats()["engine/forked_samples"] == 2 * len(PROMPTS) and old.stats()["engine/forked_samples"] == 0
    assert flat(a, "token_ids") == flat(b, "token_ids")
    assert all(len({tuple(s.token_ids) for s in o.samples}) > 1 for o in a)  # a request's samples differ
    torch.testing.assert_close(torch.tensor(flat(a, "logprobs")), torch.tensor(flat(b, "logprobs")),
                               atol=1e-5, rtol=1e-5)
    # the plain model over prompt + completion: log_softmax(logits / T) of each sampled token
    with torch.no_grad():
        for o in a:
            P = len(o.prompt_token_ids)
            for s in o.samples:
                logits = tiny_model(torch.tensor([o.prompt_token_ids + s.token_ids]))[0, P - 1:-1]
                ref = (logits / PARAMS.temperature).log_softmax(-1).gather(1, torch.tensor(s.token_ids)[:, None])
                torch.testing.assert_close(torch.tensor(s.logprobs), ref[:, 0], atol=1e-5, rtol=1e-5)
    # the first tokens of a request's samples were drawn from one row of logits: their logprobs are
    # that row's values, bit for bit, wherever two samples drew the same token
    for o in a:
        firsts = {}
        for s in o.samples:
            assert firsts.setdefault(s.token_ids[0], s.logprobs[0]) == s.logprobs[0]


def _kv_of(eng, seq, upto):
    """Every layer's k and v at positions [0, upto) of a sequence, read back from the cache by its table."""
    kv = eng.runner._kv_storage
    bs = eng.block_size
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(upto)])
    return kv.index_select(2, slots).clone()


def _fresh_kv(model, tokens):
    """The KV a lone prefill of `tokens` writes (no fork, no prefix cache)."""
    eng = engine(model, enable_prefix_caching=False, **PREVIOUS)
    s = Sequence(0, tokens, SamplingParams(), eng.block_size)
    eng.block_manager.allocate(s)
    eng.ranks.group.call(ModelRunner.run, *prepare([s], True, eng.block_size, None))
    return _kv_of(eng, s, len(tokens))


@pytest.mark.unit
def test_copy_on_write_never_changes_a_siblings_kv(tiny_model):
    eng = engine(tiny_model)
    prompt = PROMPTS[0]  # 9 tokens: blocks [4][4][1], the third shared partly filled
    eng.add_request(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True, seed=2))
    eng.step()  # the prefill: one sequence computed, two forked
    seqs = list(eng.scheduler.running)
    bm = eng.block_manager
    shared = seqs[0].block_table[2]
    assert all(s.block_table == seqs[0].block_table for s in seqs) and bm.blocks[shared].ref_count == 3
    assert len({s.last_token for s in seqs}) > 1  # the samples drew different first tokens
    before = _kv_of(eng, seqs[0], 9)
    eng.step()  # the first decode writes each sample's first token at position 9, in the shared block
    assert [s.block_table[2] for s in seqs][2] == shared and len({s.block_table[2] for s in seqs}) == 3
    assert bm.blocks[shared].ref_count == 1
    for _ in range(2):
        eng.step()
    for s in seqs:  # the prompt's KV, copied where it was unshared, and each sample's own tokens' KV
        got = _kv_of(eng, s, s.num_tokens - 1)
        torch.testing.assert_close(got[:, :, :9], before, atol=0, rtol=0)
        torch.testing.assert_close(got, _fresh_kv(tiny_model, s.token_ids[:-1]), atol=1e-5, rtol=1e-5)
    while eng.has_unfinished():
        eng.step()
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def _prefill_then_peak(model, **kw):
    eng = engine(model, **kw)
    outs = eng.generate(PROMPTS, PARAMS)
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    return eng, outs


@pytest.mark.unit
def test_forks_compute_fewer_prefill_tokens_and_hold_fewer_blocks(tiny_model):
    # by hand, block size 4, n = 3. Previous engine: every sample looks its prompt up; the leading full
    # blocks of an earlier sample are hits, the last token's block never is:
    #   prompt 9: 9 + 1 + 1 | 3: 3 + 3 + 3 | 8: 8 + 4 + 4 | 6: 6 + 2 + 2 | 9 again: 1 + 1 + 1
    # forks: one prefill per prompt past its hits: 9 | 3 | 8 | 6 | 1
    new, _ = _prefill_then_peak(tiny_model)
    old, _ = _prefill_then_peak(tiny_model, **PREVIOUS)
    assert old.stats()["engine/prefill_tokens"] == 11 + 9 + 16 + 10 + 3
    assert new.stats()["engine/prefill_tokens"] == 9 + 3 + 8 + 6 + 1
    # blocks held right after the prefill: previous, full blocks once + each sample's own partial last
    # block (3 per prompt ending mid-block); forks, each prompt's blocks once, prompt 5 sharing prompt 1's
    # full blocks either way:  previous (2 + 3) + 3 + (1 + 3) + (1 + 3) + 3 = 19;  forks 3 + 1 + 2 + 2 + 1 = 9
    for eng, held in ((new, 9), (old, 19)):
        eng.sleep(1)
        eng.wake()
        for p in PROMPTS:
            eng.add_request(p, PARAMS)
        eng.step()
        assert eng.block_manager.num_blocks - eng.block_manager.num_free_blocks == held
        eng.abort(range(100))
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        assert all(b.ref_count == 0 for b in eng.block_manager.blocks)


@pytest.mark.unit
def test_a_forked_samples_cost_is_its_decodes_only(tiny_model):
    eng = engine(tiny_model, enable_prefix_caching=False)
    out = eng.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=1))[0]
    a, b = (s.cost for s in out.samples)
    # the first: 9 prompt tokens + 2 decodes at positions 0..10 (keys 1 + ... + 11 = 66), 3 logit positions;
    # the fork: the 2 decodes only (positions 9, 10: keys 10 + 11), 2 logit positions
    assert a == SampleCost(computed_tokens=11, attended=66, logit_positions=3, added_step=0, finished_step=3)
    assert b == SampleCost(computed_tokens=2, attended=21, logit_positions=2, added_step=0, finished_step=3)


@pytest.mark.equivalence
def test_forks_under_preemption_abort_and_resume_keep_the_outputs(tiny_model):
    # 12 blocks for 15 growing samples: copy-on-write needs blocks the pool lacks, so samples are
    # preempted (and recomputed alone, their tokens now their own); same outputs as a roomy previous engine
    small = engine(tiny_model, num_blocks=12)
    ref = engine(tiny_model, **PREVIOUS).generate(PROMPTS, PARAMS)
    got = small.generate(PROMPTS, PARAMS)
    assert small.scheduler.num_preemptions > 0 and small.stats()["engine/forked_samples"] > 0
    assert flat(got, "token_ids") == flat(ref, "token_ids")
    torch.testing.assert_close(torch.tensor(flat(got, "logprobs")), torch.tensor(flat(ref, "logprobs")),
                               atol=1e-5, rtol=1e-5)
    # abort right after the forked prefill, resume from what it returned: the same samples again
    eng = engine(tiny_model)
    rid = eng.add_request(PROMPTS[1], PARAMS)
    eng.step()
    part = eng.abort([rid])[0]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.add_request(PROMPTS[1], PARAMS, prior=[(s.token_ids, s.logprobs) for s in part.samples])
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step())
    assert [s.token_ids for s in next(iter(done.values())).samples] == [s.token_ids for s in ref[1].samples]


@pytest.mark.unit
def test_group_rows_bound_the_padding():
    q = [50, 48, 12, 10, 10, 9, 3, 1, 1]
    c = [50, 60, 52, 50, 10, 48, 45, 40, 3]
    groups = group_rows(q, c)
    assert sorted(b for g in groups for b in g) == list(range(len(q)))  # each sequence once
    for g in groups:
        Qg, Lg = max(q[b] for b in g), max(c[b] for b in g)
        assert all(q[b] * c[b] >= GROUP_FILL * Qg * Lg for b in g)
    assert len(groups) < len(q)
    # scores computed: grouped vs one padded rectangle
    grouped = sum(len(g) * max(q[b] for b in g) * max(c[b] for b in g) for g in groups)
    assert grouped < len(q) * max(q) * max(c) / 2


@pytest.mark.equivalence
@pytest.mark.parametrize("window", [None, 5])
def test_grouped_prefill_equals_the_padded_form(window):
    torch.manual_seed(0)
    model = CausalLM(tiny_config(sliding_window=window))
    model.reset_parameters(std=0.3, seed=1)
    eng = engine(model, num_blocks=64, enable_prefix_caching=True)
    lens = [23, 3, 9, 17, 1, 12, 5]
    seqs = [Sequence(i, [(7 * i + j) % 50 + 3 for j in range(n)], SamplingParams(), 4) for i, n in enumerate(lens)]
    seqs.append(Sequence(9, seqs[0].token_ids[:16] + [40, 41, 42], SamplingParams(), 4))  # 16 cached: 3 queries
    for s in seqs:
        eng.block_manager.allocate(s)
    assert seqs[-1].num_cached_tokens == 16
    ids, grouped = prepare(seqs, True, 4, window)
    assert len(grouped.groups) > 1
    padded = prepare(seqs, True, 4, window, group=False)[1]
    assert len(padded.groups) == 1
    for name in ("positions", "slot_mapping", "last_index"):
        assert torch.equal(getattr(grouped, name), getattr(padded, name))
    a, b = (eng.ranks.group.call(ModelRunner.run, ids, batch) for batch in (grouped, padded))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # and the plain model, prompt by prompt (no window in CausalLM's reference: compare the windowless one)
    if window is None:
        with torch.no_grad():
            ref = torch.stack([model(torch.tensor([s.token_ids]))[0, -1] for s in seqs])
        torch.testing.assert_close(a, ref, atol=1e-5, rtol=1e-5)
    # query rows padded: one rectangle vs the groups
    q = [s.num_tokens - s.num_cached_tokens for s in seqs]
    rows = sum(g.q_valid.numel() for g in grouped.groups)
    assert rows < padded.groups[0].q_valid.numel() == len(q) * max(q) and rows >= sum(q)


@pytest.mark.unit
def test_build_batch_of_decode_is_one_group_in_order():
    b = build_batch([5, 2, 8], [6, 3, 9], [[0, 1], [2], [3, 4, 5]], 4)
    assert b.decode and len(b.groups) == 1 and b.groups[0].out_index is None
    assert b.slot_mapping.tolist() == [1 * 4 + 1, 2 * 4 + 2, 5 * 4 + 0] and b.positions.tolist() == [5, 2, 8]


def _slots(runner, slots):
    """This rank's k and v of every layer at `slots` (its own KV heads)."""
    return runner._kv_storage.index_select(2, torch.tensor(slots)).clone()


@pytest.mark.equivalence
def test_copy_on_write_copies_every_tensor_parallel_ranks_cache():
    torch.manual_seed(0)
    model = CausalLM(tiny_config(num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32))
    model.reset_parameters(std=0.3, seed=1)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True, seed=2)
    par = engine(model, tensor_parallel_size=2)
    try:
        rid = par.add_request(PROMPTS[0], params)  # 9 tokens: position 8 opens the third block, shared
        par.step()
        par.step()  # the first decode: two samples copy the shared block, the third writes in place
        seqs = list(par.scheduler.running)
        third = [s.block_table[2] for s in seqs]
        assert len(set(third)) == 3 and par.block_manager.blocks[third[2]].ref_count == 1
        assert len({s.token_ids[9] for s in seqs}) > 1  # the samples drew different first tokens
        ranks = par.run_on_ranks(_slots, [b * 4 + o for b in third for o in (0, 1)])  # positions 8 and 9
        assert len(ranks) == 2 and not torch.equal(ranks[0], ranks[1])  # each rank holds its own KV head
        for kv in ranks:
            at8, at9 = kv[:, :, 0::2], kv[:, :, 1::2]
            assert torch.equal(at8[:, :, 0], at8[:, :, 1]) and torch.equal(at8[:, :, 0], at8[:, :, 2])
            for i in range(3):  # a different first token: different KV at position 9, never a sibling's
                for j in range(i):
                    if seqs[i].token_ids[9] != seqs[j].token_ids[9]:
                        assert not torch.equal(at9[:, :, i], at9[:, :, j])
        done = {}
        while par.has_unfinished():
            done.update((o.request_id, o) for o in par.step())
        ref = engine(model, **PREVIOUS).generate([PROMPTS[0]], params)[0]
        assert [s.token_ids for s in done[rid].samples] == [s.token_ids for s in ref.samples]
        torch.testing.assert_close(torch.tensor([s.logprobs for s in done[rid].samples]),
                                   torch.tensor([s.logprobs for s in ref.samples]), atol=1e-5, rtol=1e-5)
    finally:
        par.close()
