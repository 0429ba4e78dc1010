"""The paged engine's equivalences: continuous batching, prefix caching, preemption, TP, lifecycle."""

import copy

import pytest
import torch

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.model_runner import ModelRunner, prepare
from relayrl.engine.sequence import Sequence
from relayrl.models import CausalLM

from conftest import tiny_config

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [8, 9, 10], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [30, 31]]
SAMPLING = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=14, seed=7)


def engine(model, **kw):
    kw.setdefault("num_blocks", 512)
    kw.setdefault("block_size", 4)
    return LLMEngine.from_model(model, **kw)


def tokens(outputs):
    return [[s.token_ids for s in o.samples] for o in outputs]


def logprobs(outputs):
    return torch.tensor([lp for o in outputs for s in o.samples for lp in s.logprobs])


def assert_logprobs_close(a, b):
    """Same tokens, logprobs equal to fp32 precision: the paths differ only in summation order
    (a prefill recomputation vs step-by-step decode, other batch neighbours), so allow 1e-5
    absolute plus 1e-5 relative (logprobs here reach magnitudes of ~10)."""
    assert tokens(a) == tokens(b)
    torch.testing.assert_close(logprobs(a), logprobs(b), atol=1e-5, rtol=1e-5)


@pytest.mark.equivalence
def test_continuous_batching_equals_one_at_a_time(tiny_model):
    together = engine(tiny_model, max_num_seqs=5, max_num_batched_tokens=16).generate(PROMPTS, SAMPLING)
    alone = [engine(tiny_model).generate([p], SAMPLING)[0] for p in PROMPTS]
    assert_logprobs_close(together, alone)


@pytest.mark.equivalence
def test_prefix_caching_same_outputs_and_hits(tiny_model):
    shared = [5, 6, 7, 8, 9, 10, 11, 12]  # a repeated "system prompt" of two full blocks
    prompts = [shared + [20 + i] for i in range(4)] + PROMPTS
    on = engine(tiny_model, enable_prefix_caching=True)
    off = engine(tiny_model, enable_prefix_caching=False)
    a, b = on.generate(prompts, SAMPLING), off.generate(prompts, SAMPLING)
    assert_logprobs_close(a, b)
    assert on.stats()["engine/prefix_hit_rate"] > 0.3 and off.stats()["engine/prefix_hit_rate"] == 0


@pytest.mark.equivalence
def test_preemption_under_tiny_pool_completes_with_same_outputs(tiny_model):
    # 12 blocks of 4 slots cannot hold 12 growing sequences: some are preempted and recomputed
    small = engine(tiny_model, num_blocks=12)
    big = engine(tiny_model)
    a, b = small.generate(PROMPTS, SAMPLING), big.generate(PROMPTS, SAMPLING)
    assert small.scheduler.num_preemptions > 0
    assert all(s.finish_reason in ("stop", "length") for o in a for s in o.samples)
    assert_logprobs_close(a, b)


@pytest.mark.equivalence
def test_sleep_load_wake_equals_fresh_engine(tiny_model):
    new = copy.deepcopy(tiny_model)
    new.reset_parameters(std=0.3, seed=99)
    eng = engine(copy.deepcopy(tiny_model))
    eng.generate(PROMPTS[:2], SAMPLING)
    for level in (1, 2):
        eng.sleep(level)
        with pytest.raises(RuntimeError):
            eng.generate(PROMPTS[:1], SAMPLING)
        version = eng.load_weights(new.state_dict().items())
        eng.wake()
        out = eng.generate(PROMPTS, SAMPLING)
        assert out[0].weights_version == version
        assert tokens(out) == tokens(engine(new).generate(PROMPTS, SAMPLING))


@pytest.mark.equivalence
def test_abort_then_resume_equals_uninterrupted(tiny_model):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    full = engine(tiny_model).generate(PROMPTS, params)
    eng = engine(tiny_model)
    rids = [eng.add_request(p, params) for p in PROMPTS]
    for _ in range(5):
        eng.step()
    partial = eng.abort(rids)
    assert all(s.finish_reason == "abort" and 0 < len(s.token_ids) < 12 for o in partial for s in o.samples)
    assert not eng.has_unfinished()
    for o in partial:
        eng.add_request(o.prompt_token_ids, params, prior=[(s.token_ids, s.logprobs) for s in o.samples])
    resumed = []
    while eng.has_unfinished():
        resumed += eng.step()
    resumed.sort(key=lambda o: o.request_id)
    assert_logprobs_close(resumed, full)


@pytest.mark.unit
def test_resuming_an_ended_sample_keeps_it_ended(tiny_model):
    params = SamplingParams(n=1, temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)
    eng = engine(tiny_model)
    done = eng.generate([PROMPTS[0]], params)[0]
    eng.add_request(PROMPTS[0], params, prior=[(done.samples[0].token_ids, done.samples[0].logprobs)])
    out = eng.step()
    assert len(out) == 1 and out[0].samples[0].token_ids == done.samples[0].token_ids
    assert out[0].samples[0].finish_reason == "length" and not eng.has_unfinished()


def _prefill_logits(eng, prompts):
    """Logits at the last prompt token of each prompt, through the engine's runner(s)."""
    seqs = [Sequence(i, p, SamplingParams(), eng.block_size) for i, p in enumerate(prompts)]
    for s in seqs:
        eng.block_manager.allocate(s)
    ids, batch = prepare(seqs, True, eng.block_size, eng.config.sliding_window)
    out = eng.ranks.group.call(ModelRunner.run, ids, batch)
    for s in seqs:
        eng.block_manager.deallocate(s)
    return out


@pytest.mark.equivalence
@pytest.mark.parametrize("heads,kv,tp", [(4, 2, 2), (8, 2, 4), (4, 4, 4)])
def test_tensor_parallel_logits_equal_tp1(heads, kv, tp):
    torch.manual_seed(0)
    model = CausalLM(tiny_config(num_attention_heads=heads, num_key_value_heads=kv, head_dim=8, hidden_size=32))
    model.reset_parameters(std=0.3, seed=1)
    ref = engine(model)
    par = engine(model, tensor_parallel_size=tp)
    try:
        torch.testing.assert_close(_prefill_logits(par, PROMPTS), _prefill_logits(ref, PROMPTS), atol=1e-5, rtol=0)
        params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5)
        a, b = par.generate(PROMPTS, params), ref.generate(PROMPTS, params)
        assert_logprobs_close(a, b)
    finally:
        par.close()


@pytest.mark.unit
@pytest.mark.parametrize("fork", [False, True])
def test_stats_report_hits_and_peak_block_fill(tiny_model, fork):
    eng = engine(tiny_model, fork_samples=fork)
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # 9 tokens: two full blocks of 4 and one token
    eng.generate([shared], SamplingParams(n=4, temperature=1.0, max_tokens=3, ignore_eos=True, seed=0))
    st = eng.stats()
    if fork:  # one prefill of 9 tokens, 3 samples forked from it (no lookup: no hit)
        assert st["engine/prefix_hit_rate"] == 0 and st["engine/prefill_tokens"] == 9
        assert st["engine/forked_samples"] == 3
    else:  # 4 samples x 9 prompt tokens queried; samples 2-4 reuse the 2 full blocks (8 tokens each)
        assert st["engine/prefix_hit_rate"] == pytest.approx(3 * 8 / 36)
        assert st["engine/prefill_tokens"] == 9 + 3 and st["engine/forked_samples"] == 0
    # at the peak (last decode step) 2 shared full blocks + 4 private blocks holding 3 of 4 slots
    # (token 9 plus two generated; the third is sampled but never written)
    assert st["engine/peak_blocks_used"] == pytest.approx(6 / 512)
    assert st["engine/block_utilisation_at_peak"] == pytest.approx((8 + 4 * 3) / (6 * 4))
    eng.reset_stats()
    assert eng.stats()["engine/prefix_hit_rate"] == 0
