"""The first engine against the plain model: greedy tokens, logprobs, seeds, stops."""

import copy

import pytest
import torch

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.sampler import filter_logits
from relayrl.trainer.batch import build_rows, scatter_per_token
from relayrl.trainer.logprobs import token_logprobs

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33]]


@torch.no_grad()
def _greedy_reference(model, prompt, n):
    ids = list(prompt)
    out, lps = [], []
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1]
        tok = int(logits.argmax())
        lps.append(float(logits.log_softmax(-1)[tok]))
        out.append(tok)
        ids.append(tok)
        if tok == 2:
            break
    return out, lps


def engine(model, tokenizer=None, **kw):
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)  # small blocks: every prompt spans several, so paging is exercised
    return LLMEngine.from_model(model, tokenizer, **kw)


@pytest.mark.unit
def test_greedy_matches_full_recompute(tiny_model):
    eng = engine(tiny_model, max_num_seqs=3)  # 3 slots for 4 prompts: one joins as another finishes
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    with torch.no_grad():
        for prompt, o in zip(PROMPTS, outs, strict=True):
            ref_tokens, ref_lps = _greedy_reference(tiny_model, prompt, 12)
            assert o.samples[0].token_ids == ref_tokens
            torch.testing.assert_close(torch.tensor(o.samples[0].logprobs), torch.tensor(ref_lps), atol=1e-5, rtol=0)


@pytest.mark.equivalence
def test_engine_and_trainer_logprobs_agree_fp32(tiny_model):
    eng = engine(tiny_model)
    sp = SamplingParams(n=4, temperature=0.7, top_p=0.9, max_tokens=16, seed=3)
    outs = eng.generate(PROMPTS, sp)
    prompts = [o.prompt_token_ids for o in outs for _ in o.samples]
    responses = [s.token_ids for o in outs for s in o.samples]
    ids, attn, resp = build_rows(prompts, responses)
    rollout = scatter_per_token([s.logprobs for o in outs for s in o.samples], prompts, ids.shape[1])
    with torch.no_grad():
        for padding_free in (False, True):
            logp, _ = token_logprobs(tiny_model, ids, attn, temperature=0.7, padding_free=padding_free)
            gap = ((logp - rollout) * resp).abs().max()
            assert gap < 1e-5, (padding_free, gap)


@pytest.mark.equivalence
def test_bf16_engine_shows_mismatch(tiny_model):
    eng = engine(copy.deepcopy(tiny_model).to(torch.bfloat16))
    outs = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=1))
    prompts = [o.prompt_token_ids for o in outs for _ in o.samples]
    responses = [s.token_ids for o in outs for s in o.samples]
    ids, attn, resp = build_rows(prompts, responses)
    rollout = scatter_per_token([s.logprobs for o in outs for s in o.samples], prompts, ids.shape[1])
    with torch.no_grad():
        logp, _ = token_logprobs(tiny_model, ids, attn)
    gap = ((logp - rollout) * resp).abs().max()
    assert 1e-4 < gap < 0.5  # bf16 rounding is visible, yet the same policy


@pytest.mark.equivalence
def test_seeded_sampling_independent_of_batch(tiny_model):
    sp = SamplingParams(n=3, temperature=1.0, top_k=20, max_tokens=10, seed=11)
    eng = engine(tiny_model)
    together = eng.generate(PROMPTS, sp)
    alone = [eng.generate([p], sp)[0] for p in PROMPTS]
    for a, b in zip(together, alone, strict=True):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        assert len({tuple(s.token_ids) for s in a.samples}) > 1  # the n samples differ
    other = eng.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, top_k=20, max_tokens=10, seed=12))
    assert [s.token_ids for s in other[1].samples] != [s.token_ids for s in together[1].samples]


@pytest.mark.unit
def test_max_tokens_eos_and_stop_ids(tiny_model):
    eng = engine(tiny_model)
    o = eng.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].samples[0]
    assert len(o.token_ids) == 5 and o.finish_reason == "length"
    stop_tok = o.token_ids[2]
    o2 = eng.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_tok]))[0].samples[0]
    assert o2.token_ids == o.token_ids[: o.token_ids.index(stop_tok) + 1] and o2.finish_reason == "stop"


@pytest.mark.unit
def test_filters_hand_computed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.8]), torch.tensor([0.0, 0.0]))
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False]  # top-k 2
    assert torch.isfinite(kept[1]).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = filter_logits(logits[:1], torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.35]))
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False]  # 0.15 < 0.35 * 0.5


@pytest.mark.unit
def test_load_weights_bumps_version_and_takes_effect(tiny_model):
    eng = engine(copy.deepcopy(tiny_model))
    other = copy.deepcopy(tiny_model)
    other.reset_parameters(std=0.3, seed=7)
    v = eng.load_weights(other.state_dict().items())
    assert v == 1
    out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.weights_version == 1
    ref, _ = _greedy_reference(other, PROMPTS[0], 6)
    assert out.samples[0].token_ids == ref


@pytest.mark.equivalence
def test_a_weight_update_drops_kv_the_old_weights_computed(tiny_model):
    """A prompt whose full blocks are cached from before a weight update must be recomputed after it:
    reading the old KV gives tokens and logprobs of neither model (a shared system prompt, a tool
    list or an episode's earlier turns would hit it every step)."""
    eng = engine(copy.deepcopy(tiny_model))
    prompt = PROMPTS[1]  # 7 tokens: one full block of 4 is cached after the first request
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=6))
    other = copy.deepcopy(tiny_model)
    other.reset_parameters(std=0.3, seed=7)
    eng.load_weights(other.state_dict().items())
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].samples[0]
    ref, ref_lps = _greedy_reference(other, prompt, 6)
    assert out.token_ids == ref
    assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(ref_lps), atol=1e-5)
    # the cache still works within a weights version
    eng.reset_stats()
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=6))
    assert eng.stats()["engine/prefix_hit_rate"] > 0


@pytest.mark.unit
def test_sampler_frequencies_match_filtered_distribution():
    from relayrl.engine.sampler import sample

    torch.manual_seed(0)
    logits = torch.randn(1, 12).repeat(40000, 1)
    u = torch.rand(40000, generator=torch.Generator().manual_seed(1))
    temp = torch.full((40000,), 0.8)
    top_k = torch.full((40000,), 6)
    tokens, logps = sample(logits, temp, top_k, torch.ones(40000), torch.zeros(40000), u)
    scaled = logits[0] / 0.8
    keep = scaled.topk(6).indices
    want = torch.zeros(12)
    want[keep] = scaled[keep].softmax(-1)
    freq = torch.bincount(tokens, minlength=12).float() / 40000
    assert (freq - want).abs().max() < 0.01
    # the reported logprob is the full-vocabulary temperature-scaled one (not renormalised)
    torch.testing.assert_close(logps, scaled.log_softmax(-1)[tokens])


@pytest.mark.unit
def test_stop_strings_cut_text_and_keep_completing_token(tiny_model, tmp_path):
    from relayrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(tmp_path, "abcdefghijklmnopqrstuvwxyz0123456789+-=")
    model = copy.deepcopy(tiny_model)
    assert len(tok) <= model.config.vocab_size
    eng = engine(model, tok)
    base = eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].samples[0]
    text = tok.decode(base.token_ids, skip_special_tokens=True)
    stop = text[3:5]
    assert stop and stop not in text[:4]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    out = eng.generate([[5, 6, 7]], sp)[0].samples[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert tok.decode(out.token_ids, skip_special_tokens=True).endswith(stop)


@pytest.mark.unit
def test_top_logprobs_follow_the_same_definition(tiny_model):
    eng = engine(tiny_model)
    s = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.5, max_tokens=4, logprobs=3, seed=1))[0].samples[0]
    assert len(s.top_logprobs) == len(s.token_ids)
    with torch.no_grad():
        ids = PROMPTS[0] + s.token_ids
        logits = tiny_model(torch.tensor([ids]))[0, len(PROMPTS[0]) - 1:-1] / 0.5
    for step, top in zip(logits.log_softmax(-1), s.top_logprobs, strict=True):
        want = step.topk(3)
        assert list(top) == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(list(top.values())), want.values, atol=1e-5, rtol=0)


@pytest.mark.equivalence
def test_checkpoint_of_tied_model_loads_into_engine(tiny_model, tmp_path):
    from relayrl.models import load_config, load_state_dict, save_pretrained

    assert tiny_model.config.tie_word_embeddings  # so the checkpoint holds no lm_head.weight
    save_pretrained(tiny_model, tmp_path / "m")
    eng = LLMEngine(load_config(tmp_path / "m"), num_blocks=64, block_size=4)  # what from_pretrained does
    eng.load_weights(load_state_dict(tmp_path / "m").items())
    out = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    for p, o in zip(PROMPTS, out, strict=True):
        assert o.samples[0].token_ids == _greedy_reference(tiny_model, p, 8)[0]
