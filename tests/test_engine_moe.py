"""The engine on MoE models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against transformers' own models:
greedy tokens, sampled-token logprobs, engine TP 2 with the experts placed by TP and by EP; and the routing it
records for routing replay against the trainer-side model's record."""

import dataclasses

import pytest
import torch
import transformers

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.errors import TensorParallelError
from relayrl.models import load_config, load_state_dict
from relayrl.models.transformer import CausalLM

COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
QWEN_MOE = dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)

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
@pytest.mark.parametrize("family,placement", [("qwen2_moe_shared", "ep"), ("mixtral", "tp")])
def test_engine_tp2_equals_tp1(family, placement, checkpoints):
    _, path = checkpoints(family)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=9)
    one = _engine(path)
    ref_tokens, ref_logp = _tokens_and_logp(one.generate(PROMPTS, sp))
    two = _engine(path, tensor_parallel_size=2, expert_placement=placement)
    try:
        tokens, logp = _tokens_and_logp(two.generate(PROMPTS, sp))
    finally:
        two.close()
    assert tokens == ref_tokens
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)


def test_expert_placement_refused_when_it_does_not_divide(checkpoints):
    cfg = dataclasses.replace(load_config(checkpoints("qwen3_moe")[1]), num_experts=6, moe_intermediate_size=6)
    # refused before any rank starts, naming the size that does not divide
    with pytest.raises(TensorParallelError, match=r"does not divide the number of experts \(6\)"):
        LLMEngine(cfg, tensor_parallel_size=4, expert_placement="ep", num_blocks=4)
    with pytest.raises(TensorParallelError, match=r"does not divide the experts' width \(6\)"):
        LLMEngine(cfg, tensor_parallel_size=4, expert_placement="tp", num_blocks=4)
    with pytest.raises(TensorParallelError, match="expert_placement must be one of tp, ep"):
        LLMEngine(cfg, expert_placement="experts", num_blocks=4)
