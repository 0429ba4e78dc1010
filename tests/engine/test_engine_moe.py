"""The engine on MoE models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against transformers' own models:
greedy tokens, sampled-token logprobs, engine TP 2 with the experts placed by TP and by EP; and the routing it
records for routing replay against the trainer-side model's record."""

import dataclasses

import pytest
import torch
import transformers

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.errors import ConfigError, TensorParallelError
from relayrl.models import load_config, load_state_dict
from relayrl.models.moe import Routing
from relayrl.models.transformer import CausalLM

from helpers import HF_MOE_COMMON, HF_QWEN_MOE

COMMON, QWEN_MOE = HF_MOE_COMMON, HF_QWEN_MOE

FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, **QWEN_MOE, norm_topk_prob=True),
    # a dense layer (1) between MoE layers, unnormalised top-k weights, biased attention
    "qwen3_moe_dense_layer": lambda: transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, **QWEN_MOE, mlp_only_layers=[1], attention_bias=True),
    "qwen2_moe_shared": lambda: transformers.Qwen2MoeConfig(**COMMON, **QWEN_MOE, shared_expert_intermediate_size=24),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=4,
                                                  num_experts_per_tok=2),
}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33, 34, 35]]


def _hf_model(family):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32,
                                                          attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # routers far from uniform: top-k without near-ties
                p.normal_(0.0, 1.0)
            elif "embed" in name or "lm_head" in name:  # peaked next-token distributions
                p.normal_(0.0, 0.3)
    return model.eval()


_DIRS: dict[str, object] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, directory of its save_pretrained: one tensor per expert, published names)."""
    def get(family):
        if family not in _DIRS:
            hf = _hf_model(family)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            _DIRS[family] = (hf, path)
        return _DIRS[family]
    return get


def _engine(path, **kw):
    """An engine loaded from the checkpoint's own tensors by their published names."""
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    eng = LLMEngine(load_config(path), **kw)
    eng.load_weights(load_state_dict(path).items())
    return eng


def _ours(path) -> CausalLM:
    model = CausalLM(load_config(path))
    model.load_state_dict(load_state_dict(path), strict=False)
    return model.eval()


def _full_logp(model, prompt, tokens) -> torch.Tensor:
    """A model's logprob of each sampled token given everything before it (fp32, one forward); `model` is
    transformers' or relayrl's CausalLM."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        out = model(input_ids=ids)
        logp = getattr(out, "logits", out)[0].float().log_softmax(-1)
    n = len(prompt)
    return logp[n - 1:-1].gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.equivalence
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_transformers_generate(family, checkpoints):
    hf, path = checkpoints(family)
    eng = _engine(path, max_num_seqs=3)
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=2,
                              pad_token_id=0)[0, len(prompt):].tolist()
        if 2 in ref:
            ref = ref[: ref.index(2) + 1]
        assert out.samples[0].token_ids == ref
        torch.testing.assert_close(torch.tensor(out.samples[0].logprobs), _full_logp(hf, prompt, ref),
                                   atol=1e-5, rtol=0)


@pytest.mark.equivalence
@pytest.mark.parametrize("family", ["qwen2_moe_shared", "mixtral"])
def test_sampled_logprobs_equal_transformers_and_ours(family, checkpoints):
    hf, path = checkpoints(family)
    eng = _engine(path)
    outs = eng.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5))
    ours = _ours(path)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        for s in out.samples:
            got = torch.tensor(s.logprobs)
            torch.testing.assert_close(got, _full_logp(hf, prompt, s.token_ids), atol=1e-5, rtol=0)
            torch.testing.assert_close(got, _full_logp(ours, prompt, s.token_ids), atol=1e-5, rtol=0)


def _tokens_and_logp(outs):
    return [s.token_ids for o in outs for s in o.samples], torch.tensor(
        [lp for o in outs for s in o.samples for lp in s.logprobs])


# EP with the shared expert (routed experts whole per rank, the shared one TP-sharded, one all-reduce for both);
# TP on Mixtral (fp32 routing weights, every expert's width sharded)
@pytest.mark.equivalence
@pytest.mark.parametrize("family,placement", [("qwen2_moe_shared", "ep"), ("mixtral", "tp")])
def test_engine_tp2_equals_tp1(family, placement, checkpoints):
    _, path = checkpoints(family)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=9)
    one = _engine(path, record_routing=True)
    ref = one.generate(ROUTED_PROMPTS, sp)
    ref_tokens, ref_logp = _tokens_and_logp(ref)
    two = _engine(path, tensor_parallel_size=2, expert_placement=placement, record_routing=True)
    try:
        outs = two.generate(ROUTED_PROMPTS, sp)
        stats = two.stats()
    finally:
        two.close()
    assert stats["engine/expert_load_max_over_mean"] >= 1.0
    assert ("engine/ep_rank_load_max_over_mean" in stats) == (placement == "ep")
    tokens, logp = _tokens_and_logp(outs)
    assert tokens == ref_tokens
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    # the routing the TP ranks record (rank 0's; the router is replicated) is TP 1's
    for a, b in zip(outs, ref, strict=True):
        assert all(torch.equal(x.routing, y.routing) for x, y in zip(a.samples, b.samples, strict=True))


@pytest.mark.unit
def test_expert_placement_refused_when_it_does_not_divide(checkpoints):
    cfg = dataclasses.replace(load_config(checkpoints("qwen3_moe")[1]), num_experts=6, moe_intermediate_size=6)
    # refused before any rank starts, naming the size that does not divide
    with pytest.raises(TensorParallelError, match=r"does not divide the number of experts \(6\)"):
        LLMEngine(cfg, tensor_parallel_size=4, expert_placement="ep", num_blocks=4)
    with pytest.raises(TensorParallelError, match=r"does not divide the experts' width \(6\)"):
        LLMEngine(cfg, tensor_parallel_size=4, expert_placement="tp", num_blocks=4)
    with pytest.raises(TensorParallelError, match="expert_placement must be one of tp, ep"):
        LLMEngine(cfg, expert_placement="experts", num_blocks=4)


# ---- routing record (R3, the engine's side) ----
SHARED = list(range(40, 48))  # two full blocks of 4: a prefix-cache hit for every prompt after the first
ROUTED_PROMPTS = [SHARED + [50], SHARED + [60, 61, 62], [5, 6, 7], SHARED + [70, 71, 72, 73, 74]]


def _trainer_routing(model: CausalLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts relayrl's CausalLM chooses for every token of `ids` [q, n_moe, k], its logits [q, V]), fp32."""
    rec = Routing(record=True)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), routing=rec)[0]
    return rec.selected_experts()[0], logits


def _check_routing(model: CausalLM, outs) -> None:
    """Every sample's routing equals the trainer-side record of its full sequence, and replaying it there gives
    the same logits."""
    n_moe, k = len(model.config.moe_layers), model.config.num_experts_per_tok
    for out in outs:
        for s in out.samples:
            ids = out.prompt_token_ids + s.token_ids
            assert s.routing.dtype == torch.int16 and s.routing.shape == (len(ids), n_moe, k)
            want, logits = _trainer_routing(model, ids)
            assert torch.equal(s.routing.long(), want)
            with torch.no_grad():
                replayed = model(torch.tensor([ids]), routing=Routing(replay=s.routing[None].long(), record=False))[0]
            torch.testing.assert_close(replayed, logits, atol=0, rtol=0)


@pytest.mark.equivalence
@pytest.mark.parametrize("family", ["qwen3_moe_dense_layer", "qwen2_moe_shared", "mixtral"])
def test_recorded_routing_equals_the_trainer_record(family, checkpoints):
    _, path = checkpoints(family)
    eng = _engine(path, record_routing=True)
    outs = eng.generate(ROUTED_PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=2))
    stats = eng.stats()
    assert stats["engine/prefix_hit_rate"] > 0 and stats["engine/forked_samples"] == 8  # both paths ran
    _check_routing(_ours(path), outs)


@pytest.mark.equivalence
def test_routing_under_cache_hits_forks_and_preemption_equals_a_plain_run(checkpoints):
    """Tokens whose KV (and routing) came from the prefix cache or a forked sibling, or were recomputed after a
    preemption, record what a run computing every token itself records."""
    _, path = checkpoints("qwen2_moe_shared")
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=4)
    cached = _engine(path, record_routing=True)
    cached.generate(ROUTED_PROMPTS[:1], sp)  # warms the cache with the shared prefix
    hot = cached.generate(ROUTED_PROMPTS, sp)
    assert cached.stats()["engine/prefix_hit_rate"] > 0.3
    tight = _engine(path, record_routing=True, num_blocks=12)  # 12 blocks for 12 samples: preemptions
    squeezed = tight.generate(ROUTED_PROMPTS, sp)
    assert tight.stats()["engine/preemptions"] > 0
    plain = _engine(path, record_routing=True, enable_prefix_caching=False, fork_samples=False)
    ref = plain.generate(ROUTED_PROMPTS, sp)
    for a, b, c in zip(hot, squeezed, ref, strict=True):
        for x, y, z in zip(a.samples, b.samples, c.samples, strict=True):
            assert x.token_ids == y.token_ids == z.token_ids
            assert torch.equal(x.routing, z.routing) and torch.equal(y.routing, z.routing)
            assert x.routing.min() >= 0  # no token left unrouted
    _check_routing(_ours(path), ref)


@pytest.mark.unit
def test_record_routing_refused_for_a_dense_model(tiny_model):
    with pytest.raises(ConfigError, match="record_routing records the experts of an MoE model"):
        LLMEngine(tiny_model.config, record_routing=True, num_blocks=4)


@pytest.mark.equivalence
def test_aborted_routing_marks_the_token_not_run_and_a_resumed_sample_is_whole(checkpoints):
    _, path = checkpoints("qwen3_moe")
    ours = _ours(path)
    eng = _engine(path, record_routing=True)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3, ignore_eos=True)
    prompt = ROUTED_PROMPTS[1]
    rid = eng.add_request(prompt, sp)
    for _ in range(4):  # a prefill and three decodes: 4 tokens sampled, the newest not run yet
        assert eng.step() == []
    (out,) = eng.abort([rid])
    for s in out.samples:
        ids = prompt + s.token_ids
        assert len(s.token_ids) == 4 and s.routing.shape[0] == len(ids)
        assert bool((s.routing[-1] == -1).all()) and bool((s.routing[:-1] >= 0).all())
        assert torch.equal(s.routing[:-1].long(), _trainer_routing(ours, ids)[0][:-1])
    eng.add_request(prompt, sp, prior=[(s.token_ids, s.logprobs) for s in out.samples])
    done = []
    while eng.has_unfinished():
        done += eng.step()
    (resumed,) = done
    assert all(len(s.token_ids) == 10 for s in resumed.samples)
    _check_routing(ours, [resumed])  # the resumed prefill recomputes the routing of every token


@pytest.mark.equivalence
@pytest.mark.parametrize("family", ["qwen2_moe_shared", "mixtral"])
def test_engine_moe_block_is_bit_equal_to_the_trainers_in_bf16(family, checkpoints):
    """The engine's block (fused gate|up, stacked experts) rounds as relayrl's SparseMoeBlock does in bf16, for a
    decode-sized and a prefill-sized batch: a bf16 engine and trainer differ only where their inputs do."""
    _, path = checkpoints(family)
    ours = _ours(path).to(torch.bfloat16)
    eng = LLMEngine(load_config(path), dtype=torch.bfloat16, num_blocks=8)
    eng.load_weights(load_state_dict(path).items())
    layer, mine = ours.model.layers[0], eng.runner.model.layers[0]
    for n in (1, 37):
        x = torch.randn(n, 32, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        with torch.no_grad():
            want = getattr(layer, layer.ffn_name)(x[None])[0]
            got, _ = getattr(mine, mine.ffn_name)(x)
        assert torch.equal(got, want)


@pytest.mark.equivalence
@pytest.mark.slow
@pytest.mark.parametrize("placement", ["tp", "ep"])
def test_engine_tp4_equals_tp1(placement, checkpoints):
    """TP 4 (4 experts: one whole expert per rank under EP; width 16 / 4 under TP), KV heads replicated."""
    _, path = checkpoints("qwen2_moe_shared")
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=9)
    ref = _engine(path, record_routing=True).generate(ROUTED_PROMPTS, sp)
    four = _engine(path, tensor_parallel_size=4, expert_placement=placement, record_routing=True)
    try:
        outs = four.generate(ROUTED_PROMPTS, sp)
    finally:
        four.close()
    (t1, l1), (t4, l4) = _tokens_and_logp(ref), _tokens_and_logp(outs)
    assert t4 == t1
    torch.testing.assert_close(l4, l1, atol=1e-5, rtol=0)
    for a, b in zip(outs, ref, strict=True):
        assert all(torch.equal(x.routing, y.routing) for x, y in zip(a.samples, b.samples, strict=True))


@pytest.mark.equivalence
def test_expert_load_counts_every_routed_pair_the_engine_computed(checkpoints):
    """Without prefix caching and forks, each sample's every token is computed once: the engine's expert load is
    the count of its routing records, and the stat is max / mean over experts, the largest over layers."""
    _, path = checkpoints("qwen3_moe_dense_layer")
    eng = _engine(path, record_routing=True, enable_prefix_caching=False, fork_samples=False)
    outs = eng.generate(ROUTED_PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1))
    rows = torch.cat([s.routing for o in outs for s in o.samples]).long()  # [tokens, n_moe, k]
    load = torch.stack([torch.bincount(rows[:, j].reshape(-1), minlength=4) for j in range(rows.shape[1])])
    assert torch.equal(eng._routing.load, load)
    want = float((load.amax(-1) / load.float().mean(-1)).max())
    assert eng.stats()["engine/expert_load_max_over_mean"] == pytest.approx(want, rel=1e-6)
    # over 2 EP ranks (experts 0-1, 2-3): their summed loads
    ranks = load.view(2, 2, 2).sum(-1)
    assert eng._routing.load_max_over_mean(2) == pytest.approx(float((ranks.amax(-1) / ranks.float().mean(-1)).max()))
    eng.reset_stats()
    assert eng.stats()["engine/expert_load_max_over_mean"] == 0.0
