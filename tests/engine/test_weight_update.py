"""The engine under asynchronous RL: weight updates with requests in flight (keep_kv, reprefill, refused),
per-token policy versions, version-salted prefix caching, and generate() beside step()-driven requests."""

import pytest
import torch

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.block_manager import block_hash, version_salt
from relayrl.errors import ConfigError
from relayrl.models import CausalLM

from conftest import tiny_config

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]  # block_size 4: the first spans 2 full blocks + 1
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
BEFORE = 4  # steps before the update: one prefill and three decodes, so 4 tokens per sample


def engine(model, **kw):
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLMEngine.from_model(model, **kw)


@pytest.fixture
def new_model():
    """Different weights of the same shapes: the trainer's next policy."""
    m = CausalLM(tiny_config())
    m.reset_parameters(std=0.3, seed=1)
    return m.eval()


def drain(eng) -> list:
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return sorted(outs, key=lambda o: o.request_id)


def run_with_update(old, new, partial):
    """PROMPTS under `old` for BEFORE steps, then `new` loaded with the requests in flight, run to the end."""
    eng = engine(old, partial=partial)
    for p in PROMPTS:
        eng.add_request(p, PARAMS)
    for _ in range(BEFORE):
        assert eng.step() == []
    assert eng.load_weights(new.state_dict().items()) == 1
    return drain(eng), eng


def samples(outs):
    return [s for o in outs for s in o.samples]


@pytest.mark.unit
def test_tokens_record_the_version_that_sampled_them(tiny_model, new_model):
    plain = engine(tiny_model).generate(PROMPTS, PARAMS)
    assert all(s.versions == [0] * 12 for s in samples(plain))
    for partial in ("keep_kv", "reprefill"):
        outs, _ = run_with_update(tiny_model, new_model, partial)
        assert all(s.versions == [0] * BEFORE + [1] * (12 - BEFORE) for s in samples(outs)), partial
        assert all(o.weights_version == 1 for o in outs)


@pytest.mark.unit
def test_abort_and_prior_carry_versions(tiny_model, new_model):
    eng = engine(tiny_model, partial="keep_kv")
    rid = eng.add_request(PROMPTS[0], PARAMS)
    for _ in range(BEFORE):
        eng.step()
    eng.load_weights(new_model.state_dict().items())
    eng.step()
    eng.step()
    (cut,) = eng.abort([rid])
    assert [s.versions for s in cut.samples] == [[0] * BEFORE + [1, 1]] * 2
    # resumed with versions: kept; without: unknown (-1); the tokens sampled now are of version 1
    eng.add_request(PROMPTS[0], PARAMS, prior=[(s.token_ids, s.logprobs, s.versions) for s in cut.samples])
    eng.add_request(PROMPTS[0], PARAMS, prior=[(s.token_ids, s.logprobs) for s in cut.samples])
    with_v, without_v = drain(eng)
    assert [s.versions for s in with_v.samples] == [[0] * BEFORE + [1] * (12 - BEFORE)] * 2
    assert [s.versions for s in without_v.samples] == [[-1] * (BEFORE + 2) + [1] * (12 - BEFORE - 2)] * 2
    assert [s.token_ids for s in with_v.samples] == [s.token_ids for s in without_v.samples]


@pytest.mark.equivalence
def test_keep_kv_and_reprefill_against_references(tiny_model, new_model):
    base = engine(tiny_model).generate(PROMPTS, PARAMS)  # no update: the old policy throughout
    keep, _ = run_with_update(tiny_model, new_model, "keep_kv")
    re, re_eng = run_with_update(tiny_model, new_model, "reprefill")
    assert re_eng.stats()["engine/reprefills"] == 4 and re_eng.stats()["engine/preemptions"] == 0
    # reference for reprefill: an engine that only ever held the new weights, resuming from the old tokens
    fresh = engine(new_model)
    for p, o in zip(PROMPTS, base, strict=True):
        fresh.add_request(p, PARAMS, prior=[(s.token_ids[:BEFORE], s.logprobs[:BEFORE]) for s in o.samples])
    ref = drain(fresh)
    for b, k, r, f in zip(samples(base), samples(keep), samples(re), samples(ref), strict=True):
        # (c) before the update, all runs sampled the same tokens with the same logprobs
        assert k.token_ids[:BEFORE] == r.token_ids[:BEFORE] == b.token_ids[:BEFORE]
        assert k.logprobs[:BEFORE] == r.logprobs[:BEFORE] == b.logprobs[:BEFORE]
        # (b) reprefill = new weights over the prompt and the tokens so far
        assert r.token_ids == f.token_ids
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(f.logprobs), atol=1e-6, rtol=0)
        # (a) keep_kv's first token after the update is scored neither by the old policy nor by a
        # recompute under the new one: the new weights read the old weights' KV
        assert abs(k.logprobs[BEFORE] - r.logprobs[BEFORE]) > 1e-3
        assert abs(k.logprobs[BEFORE] - b.logprobs[BEFORE]) > 1e-3


@pytest.mark.equivalence
def test_same_weights_reloaded_leave_generation_unchanged(tiny_model):
    base = engine(tiny_model).generate(PROMPTS, PARAMS)
    keep, _ = run_with_update(tiny_model, tiny_model, "keep_kv")
    re, _ = run_with_update(tiny_model, tiny_model, "reprefill")
    for b, k, r in zip(samples(base), samples(keep), samples(re), strict=True):
        assert k.token_ids == b.token_ids and k.logprobs == b.logprobs  # the same KV, the same steps: exact
        assert r.token_ids == b.token_ids  # recomputed KV: equal to fp32 rounding
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


LONG = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=1)


def new_request_hits(eng, prompt) -> tuple[int, int]:
    """(request id, prompt tokens its prefill served from the prefix cache); it is the only one waiting."""
    before = eng.block_manager.prefix_hits
    rid = eng.add_request(prompt, LONG)
    eng.step()
    return rid, eng.block_manager.prefix_hits - before


def chain(prev: int, tokens: list[int], block_size: int = 4) -> list[int]:
    out = []
    for i in range(len(tokens) // block_size):
        prev = block_hash(prev, tokens[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out


@pytest.mark.unit
def test_prefix_cache_without_update_hits(tiny_model):
    assert version_salt(0) == -1  # a never-updated engine hashes as before versions existed
    eng = engine(tiny_model)
    first = eng.add_request(PROMPTS[0], LONG)
    for _ in range(3):
        eng.step()
    _, hits = new_request_hits(eng, PROMPTS[0])
    assert hits == 8
    seq = eng.requests.samples[first][0]
    assert [eng.block_manager.blocks[b].hash for b in seq.block_table[:2]] == chain(-1, PROMPTS[0])


@pytest.mark.unit
def test_keep_kv_never_shares_stale_blocks(tiny_model, new_model):
    eng = engine(tiny_model, partial="keep_kv")
    old_rid = eng.add_request(PROMPTS[0], LONG)
    for _ in range(3):
        eng.step()
    eng.load_weights(new_model.state_dict().items())
    for _ in range(8):  # the old sequence fills blocks after the update: still registered under version 0
        eng.step()
    old = eng.requests.samples[old_rid][0]
    assert old.kv_version == 0 and old.num_tokens == 9 + 11
    full = old.num_tokens // 4 - 1  # full blocks whose successor has opened (hashed by may_append)
    assert [eng.block_manager.blocks[b].hash for b in old.block_table[:full]] == chain(-1, old.token_ids[:4 * full])
    # the old sequence's prefix, prompt included: its cached KV is the old weights' (or was computed
    # over it, for the blocks filled after the update), so none of it is shared
    new_rid, hits = new_request_hits(eng, old.token_ids[:16] + [3])
    assert hits == 0
    new = eng.requests.samples[new_rid][0]
    assert new.kv_version == 1
    assert [eng.block_manager.blocks[b].hash for b in new.block_table[:4]] == chain(version_salt(1), new.token_ids[:16])
    third_rid, hits = new_request_hits(eng, PROMPTS[0])
    assert hits == 8  # blocks computed under version 1 are shared under version 1
    third = eng.requests.samples[third_rid][0]
    assert third.block_table[:2] == new.block_table[:2] and not set(third.block_table) & set(old.block_table)


@pytest.mark.unit
def test_reprefill_recomputes_under_the_new_version_and_shares_it(tiny_model, new_model):
    eng = engine(tiny_model, partial="reprefill")
    old_rid = eng.add_request(PROMPTS[0], LONG)
    for _ in range(3):
        eng.step()
    queries = eng.block_manager.prefix_queries
    eng.load_weights(new_model.state_dict().items())
    old = eng.requests.samples[old_rid][0]
    assert old.block_table == [] and list(eng.scheduler.waiting) == [old]
    eng.step()  # its recompute: nothing of version 0 to hit
    assert eng.block_manager.prefix_queries - queries == 9 + 3 and old.num_tokens == 9 + 4
    assert old.kv_version == 1
    assert [eng.block_manager.blocks[b].hash for b in old.block_table[:3]] == chain(version_salt(1), old.token_ids[:12])
    rid, hits = new_request_hits(eng, PROMPTS[0])
    assert hits == 8 and eng.requests.samples[rid][0].block_table[:2] == old.block_table[:2]
    assert eng.stats()["engine/reprefills"] == 1 and eng.stats()["engine/preemptions"] == 0


@pytest.mark.unit
def test_generate_keeps_earlier_requests_outputs_for_step(tiny_model):
    short = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=1)
    longer = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=2)
    ref = engine(tiny_model)
    ref_short, ref_long = ref.generate([PROMPTS[0]], short)[0], ref.generate([PROMPTS[1]], longer)[0]

    # the earlier request ends inside generate(): the next step() returns it, before that step's own
    eng = engine(tiny_model)
    early = eng.add_request(PROMPTS[0], short)
    (mine,) = eng.generate([PROMPTS[1]], longer)
    assert mine.samples[0].token_ids == ref_long.samples[0].token_ids
    assert eng.has_unfinished() and not eng.scheduler.has_unfinished()
    (held,) = eng.step()
    assert held.request_id == early and held.samples[0].token_ids == ref_short.samples[0].token_ids
    assert held.samples[0].logprobs == pytest.approx(ref_short.samples[0].logprobs, abs=1e-5)
    assert not eng.has_unfinished()

    # generate() returns when its own requests are done, with the earlier one still running
    eng = engine(tiny_model)
    early = eng.add_request(PROMPTS[1], longer)
    (mine,) = eng.generate([PROMPTS[0]], short)
    assert mine.samples[0].token_ids == ref_short.samples[0].token_ids
    assert eng.scheduler.has_unfinished()
    (rest,) = drain(eng)
    assert rest.request_id == early and rest.samples[0].token_ids == ref_long.samples[0].token_ids


@pytest.mark.unit
def test_abort_returns_a_held_output_once(tiny_model):
    eng = engine(tiny_model)
    early = eng.add_request(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=1))
    eng.generate([PROMPTS[1]], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=2))
    (out,) = eng.abort([early])
    assert out.request_id == early and out.samples[0].finish_reason == "length" and len(out.samples[0].token_ids) == 2
    assert not eng.has_unfinished() and eng.step() == []


@pytest.mark.unit
def test_update_with_requests_in_flight_is_refused_without_partial(tiny_model, new_model):
    eng = engine(tiny_model)
    assert eng.partial is None
    eng.add_request(PROMPTS[0], PARAMS)
    eng.step()
    with pytest.raises(RuntimeError, match="requests in flight"):
        eng.load_weights(new_model.state_dict().items())
    assert eng.weights_version == 0
    with pytest.raises(ConfigError, match="rollout.partial"):
        eng.partial = "keep"
    with pytest.raises(ConfigError, match="rollout.partial"):
        engine(tiny_model, partial="recompute")


@pytest.mark.unit
def test_reset_prefix_cache_forgets_prefixes_and_keeps_the_version(tiny_model):
    """What an evaluation cached must not serve the next step (whose sync is skipped): reset_prefix_cache drops
    every cached prefix without a new weights version, and is refused with requests in flight."""
    eng = engine(tiny_model)
    eng.generate([PROMPTS[0]], SamplingParams(max_tokens=2, ignore_eos=True))
    _, hits = new_request_hits(eng, PROMPTS[0])
    assert hits == 8  # cached: the prompt's two full blocks
    drain(eng)
    eng.reset_prefix_cache()
    _, hits = new_request_hits(eng, PROMPTS[0])
    assert hits == 0 and eng.weights_version == 0
    with pytest.raises(RuntimeError, match="in flight"):
        eng.reset_prefix_cache()
