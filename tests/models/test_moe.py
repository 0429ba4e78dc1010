"""relayrl's MoE decoders (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers' own models, both directions; the
routing by hand; routing replay and its record; the router losses against transformers' and by hand; gradients."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral_lb
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as qwen3_lb

from relayrl.errors import ConfigError
from relayrl.models import load_pretrained, save_pretrained
from relayrl.models.config import ModelConfig, MoEConfig, MoEShape
from relayrl.models.moe import Routing, SparseMoeBlock, unstack_experts
from relayrl.models.router_losses import expert_load, load_balancing_loss, moe_aux_loss, router_z_loss
from relayrl.models.transformer import CausalLM
from relayrl.planner.moe import plan_shape

from helpers import HF_MOE_COMMON, HF_QWEN_MOE, parity_inputs

COMMON, QWEN_MOE = HF_MOE_COMMON, HF_QWEN_MOE

FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, **QWEN_MOE, norm_topk_prob=True),
    # dense layer 1 between MoE layers 0 and 2, unnormalised top-k weights, biased attention, wider heads
    "qwen3_moe_dense_layer_bias": lambda: transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, **QWEN_MOE, mlp_only_layers=[1], attention_bias=True, head_dim=12),
    "qwen2_moe_shared_tied": lambda: transformers.Qwen2MoeConfig(
        **COMMON, **QWEN_MOE, shared_expert_intermediate_size=24, tie_word_embeddings=True),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=4,
                                                  num_experts_per_tok=2, sliding_window=5),
}


def _hf_model(cfg):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # a wrong bias or norm cannot hide behind zeros and ones
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # routers far from uniform: top-k without near-ties
                p.normal_(0.0, 1.0)
    return model.eval()


def _logits_match(ours, hf, ids, mask):
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), ref, atol=1e-5, rtol=0)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ref_m = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        real = mask.bool()
        torch.testing.assert_close(ours(ids, attention_mask=mask)[real], ref_m[real], atol=1e-5, rtol=0)
    return ref


@pytest.mark.equivalence
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_to_relayrl_and_back(family, tmp_path):
    hf = _hf_model(FAMILIES[family]())
    hf.save_pretrained(tmp_path / "hf")  # one tensor per expert, as the published checkpoints
    ours = load_pretrained(tmp_path / "hf").eval()
    assert isinstance(ours.config, MoEConfig)
    ids, mask = parity_inputs()
    ref = _logits_match(ours, hf, ids, mask)

    # transformers 5's in-memory layout on disk: stacked experts (and Mixtral's mlp.* names)
    hf.save_pretrained(tmp_path / "stacked", save_original_format=False)
    keys = json.dumps(sorted(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stacked").state_dict()))
    assert "experts.gate_up_proj" in keys
    stacked = load_pretrained(tmp_path / "stacked").eval()
    with torch.no_grad():
        torch.testing.assert_close(stacked(ids), ours(ids), atol=0, rtol=0)

    save_pretrained(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ref, atol=1e-5, rtol=0)
    # bf16: the first MoE block is bit-equal to transformers' eager experts (Qwen rounds the top-k weights to bf16
    # before the product, Mixtral keeps them fp32)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16,
                                                             experts_implementation="eager")
    ours16 = load_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    first = ours16.model.layers[0]
    x = torch.randn(3, 12, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(getattr(first, first.ffn_name)(x), hf16.model.layers[0].mlp(x))
    # the config survives its own round trip (extra: what we do not read, plus the dtype a save records)
    again = load_pretrained(tmp_path / "ours").config
    assert dataclasses.replace(again, extra={}) == dataclasses.replace(ours.config, extra={})


@pytest.mark.unit
def test_checkpoint_names_are_the_published_ones(tmp_path):
    names = {f: set(CausalLM(ModelConfig.from_hf_dict(FAMILIES[f]().to_dict())).state_dict()) for f in FAMILIES}
    assert {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w1.weight",
            "model.layers.1.block_sparse_moe.experts.3.w2.weight"} <= names["mixtral"]
    assert not any(".mlp." in n for n in names["mixtral"])
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.3.down_proj.weight",
            "model.layers.1.mlp.gate_proj.weight", "model.layers.2.mlp.experts.0.up_proj.weight"} \
        <= names["qwen3_moe_dense_layer_bias"]
    assert not any("layers.1.mlp.experts" in n for n in names["qwen3_moe_dense_layer_bias"])
    assert {"model.layers.1.mlp.shared_expert.up_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight"} \
        <= names["qwen2_moe_shared_tied"]


def _block(model_type: str, norm: bool) -> SparseMoeBlock:
    """h = 2, E = 3, k = 2: router logits (2 x0, x0 + x1, 0); expert j: gate = I, up = I, down = (j + 1) I."""
    cfg = MoEConfig(model_type=model_type, vocab_size=8, hidden_size=2, intermediate_size=2, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=2, num_experts=3, num_experts_per_tok=2,
                    moe_intermediate_size=2, norm_topk_prob=norm)
    block = SparseMoeBlock(cfg, 0)
    with torch.no_grad():
        block.gate.weight.copy_(torch.tensor([[2.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))
        for j, e in enumerate(block.experts):
            for lin, scale in zip((e.w1, e.w3, e.w2) if model_type == "mixtral" else
                                  (e.gate_proj, e.up_proj, e.down_proj), (1.0, 1.0, j + 1.0), strict=True):
                lin.weight.copy_(torch.eye(2) * scale)
    return block


@pytest.mark.unit
@pytest.mark.parametrize("model_type,norm", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)])
def test_routing_by_hand(model_type, norm):
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # logits (2, 1, 0) and (0, 1, 0)
    block = _block(model_type, norm)
    rec = Routing()
    y = block(x, rec)
    # token 0: p = e^(2, 1, 0) / (e^2 + e + 1), top-2 = experts 0 and 1
    z = math.exp(2) + math.e + 1
    w0 = [math.exp(2) / z, math.e / z]
    # token 1: p = (1, e, 1) / (e + 2); a tie between experts 0 and 2 at 1 / (e + 2): topk takes the lower index
    z1 = math.e + 2
    w1 = [math.e / z1, 1 / z1]
    if norm:
        w0, w1 = [w / sum(w0) for w in w0], [w / sum(w1) for w in w1]
    assert rec.selected[0].tolist() == [[[0, 1], [1, 0]]]
    silu_x = lambda v: v * v / (1 + math.exp(-v))  # noqa: E731  (silu(v) * v: gate and up are identities)
    # expert j scales by j + 1: token 0 = (1 w00 + 2 w01) silu(1) 1 in dim 0; token 1 = (2 w10 + 1 w11) silu(1) in dim 1
    want = torch.tensor([[[(w0[0] + 2 * w0[1]) * silu_x(1.0), 0.0], [0.0, (2 * w1[0] + w1[1]) * silu_x(1.0)]]])
    torch.testing.assert_close(y, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(rec.logits[0], torch.tensor([[[2.0, 1.0, 0.0], [0.0, 1.0, 0.0]]]))


@pytest.mark.unit
def test_routing_replay_reproduces_and_overrides(tmp_path):
    hf = _hf_model(FAMILIES["qwen3_moe_dense_layer_bias"]())
    hf.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf").eval()
    ids, mask = parity_inputs()
    with torch.no_grad():
        rec = Routing()
        base = model(ids, attention_mask=mask, routing=rec)
        sel = rec.selected_experts()
        assert sel.shape == (3, 12, 2, 2)  # [B, q, MoE layers 0 and 2, k]
        assert model.config.moe_layers == (0, 2) and sorted(rec.logits) == [0, 1]
        again = Routing(replay=sel)
        torch.testing.assert_close(model(ids, attention_mask=mask, routing=again), base, atol=0, rtol=0)
        assert torch.equal(again.selected_experts(), sel)
        # another routing: each token's experts shifted by one (still distinct) changes every position's output
        other = (sel + 1) % 4
        changed = model(ids, attention_mask=mask, routing=Routing(replay=other, record=False))
        assert (changed - base).abs().amax(-1).min() > 1e-5  # the same routing gives bit-equal outputs
        # a replay is per layer: only layer 2's routing changed is what both record and output show
        half = sel.clone()
        half[:, :, 1] = other[:, :, 1]
        rec_half = Routing(replay=half)
        out_half = model(ids, attention_mask=mask, routing=rec_half)
        assert torch.equal(rec_half.selected_experts(), half)
        torch.testing.assert_close(rec_half.logits[0], rec.logits[0], atol=0, rtol=0)  # layer 0 as routed
        assert (out_half - base).abs().amax(-1).min() > 1e-6  # small experts (std 0.02), but never bit-equal
        with pytest.raises(ValueError, match=r"routing replay has shape \(3, 12, 2\); this forward needs"):
            model(ids, routing=Routing(replay=sel[..., 0]))
        with pytest.raises(ValueError, match=r"routing replay names an expert outside 0\.\.3"):
            model(ids, routing=Routing(replay=sel + 3))


@pytest.mark.unit
def test_load_balancing_loss_equals_transformers():
    g = torch.Generator().manual_seed(3)
    logits = tuple(torch.randn(30, 6, generator=g) * 2 for _ in range(3))  # 3 layers, B q = 30 tokens, E = 6
    mask = (torch.rand(5, 6, generator=g) > 0.3).long()
    for ref_fn in (mixtral_lb, qwen3_lb):
        for top_k in (1, 2, 3):
            torch.testing.assert_close(load_balancing_loss(logits, top_k), ref_fn(logits, 6, top_k),
                                       atol=1e-6, rtol=0)
            torch.testing.assert_close(load_balancing_loss(logits, top_k, mask), ref_fn(logits, 6, top_k, mask),
                                       atol=1e-6, rtol=0)
    # [B, q, E] as our record holds them is the same as transformers' [B q, E]
    torch.testing.assert_close(load_balancing_loss([lg.view(5, 6, 6) for lg in logits], 2, mask),
                               qwen3_lb(logits, 6, 2, mask), atol=1e-6, rtol=0)
    # by hand, one layer of 2 tokens, E = 2, k = 1: both pick expert 0 with p = (0.75, 0.25), (0.5 + eps, 0.5 - eps)
    lg = torch.tensor([[math.log(3.0), 0.0], [1e-3, 0.0]])
    p1 = 1 / (1 + math.exp(-1e-3))
    f, P = (1.0, 0.0), ((0.75 + p1) / 2, (0.25 + 1 - p1) / 2)
    torch.testing.assert_close(load_balancing_loss([lg], 1), torch.tensor(2 * (f[0] * P[0] + f[1] * P[1])))
    # a replayed selection counts where the tokens went, not the logits' top-k
    torch.testing.assert_close(load_balancing_loss([lg], 1, selected=[torch.tensor([[1], [1]])]),
                               torch.tensor(2 * P[1]))


@pytest.mark.unit
def test_router_z_loss_by_hand():
    two = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # logsumexp: log 2, log 4
    ln2 = math.log(2.0)
    torch.testing.assert_close(router_z_loss([two]), torch.tensor((ln2**2 + 4 * ln2**2) / 2))
    torch.testing.assert_close(router_z_loss([two], torch.tensor([1, 0])), torch.tensor(ln2**2))
    # pooled over layers: (log 2)^2, (log 4)^2 and a third row of logsumexp(0, 0, ..) = log 2 in a second layer
    torch.testing.assert_close(router_z_loss([two, torch.zeros(2, 2)]), torch.tensor((3 * ln2**2 + 4 * ln2**2) / 4))


@pytest.mark.equivalence
def test_aux_loss_and_gradients_equal_transformers(tmp_path):
    """CE + a·load balancing + b·z-loss: the value and every parameter's gradient equal transformers' model's
    (its aux_loss, and our z-loss on its recorded router logits), experts unstacked to checkpoint names."""
    cfg = FAMILIES["qwen2_moe_shared_tied"]()
    cfg.router_aux_loss_coef, cfg.output_router_logits = 0.3, True
    hf = _hf_model(cfg).train()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").train()
    ours.config = dataclasses.replace(ours.config, router_z_loss_coef=0.05)
    assert ours.config.router_aux_loss_coef == 0.3
    ids, mask = parity_inputs()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)  # no prediction from a padding slot
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    out = hf(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
    z_hf = router_z_loss(out.router_logits, mask)
    (out.loss + 0.05 * z_hf).backward()

    rec = Routing()
    logits = ours(ids, attention_mask=mask, routing=rec)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    aux = moe_aux_loss(rec.router_logits(), ours.config, mask)
    torch.testing.assert_close(load_balancing_loss(rec.router_logits(), 2, mask), out.aux_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(ce + aux, out.loss + 0.05 * z_hf, atol=1e-5, rtol=0)
    (ce + aux).backward()

    hf_grads = unstack_experts({n: p.grad for n, p in hf.named_parameters()}, ours.config)
    own = dict(ours.named_parameters())
    assert set(own) <= set(hf_grads)
    for name, p in own.items():
        torch.testing.assert_close(p.grad, hf_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert own["model.layers.0.mlp.gate.weight"].grad.abs().max() > 1e-4
    assert own["model.layers.1.mlp.experts.2.down_proj.weight"].grad.abs().max() > 1e-4


@pytest.mark.unit
def test_unchosen_experts_get_zero_gradients():
    """Every expert runs (on no tokens if none chose it): its gradient is zero, not missing, as DDP / FSDP need."""
    cfg = ModelConfig.from_hf_dict(FAMILIES["mixtral"]().to_dict())
    model = CausalLM(cfg)
    model.reset_parameters(seed=0)
    ids, _ = parity_inputs()
    replay = torch.tensor([0, 1]).expand(3, 12, 2, 2)  # experts 2 and 3 never chosen
    model(ids, routing=Routing(replay=replay)).sum().backward()
    e = model.model.layers[1].block_sparse_moe.experts
    assert e[3].w1.weight.grad is not None and e[3].w1.weight.grad.abs().max() == 0
    assert e[0].w1.weight.grad.abs().max() > 0
    # the load-balancing loss of a replayed forward counts the replayed experts: every token sends a slot to experts
    # 0 and 1, f = (1, 1, 0, 0) (Σ f = k), so E Σ f P = 4 (P0 + P1)
    rec = Routing(replay=replay)
    model(ids, routing=rec)
    P = torch.cat([lg.reshape(-1, 4) for lg in rec.router_logits()]).softmax(-1).mean(0)
    torch.testing.assert_close(load_balancing_loss(rec.router_logits(), 2, selected=rec.selections()),
                               4 * (P[0] + P[1]))
    assert model.model.layers[1].block_sparse_moe.gate.weight.grad.abs().max() > 0  # through the replayed weights


@pytest.mark.unit
def test_expert_load_by_hand():
    sel = torch.tensor([[[[0, 1]], [[0, 2]]], [[[0, 1]], [[3, 0]]]])  # [B 2, q 2, 1 layer, k 2]
    assert expert_load(sel, 4).tolist() == [[4.0, 2.0, 1.0, 1.0]]
    assert expert_load(sel, 4, torch.tensor([[1, 1], [1, 0]])).tolist() == [[3.0, 2.0, 1.0, 0.0]]


@pytest.mark.unit
def test_moe_config_fields_and_refusals():
    d = FAMILIES["qwen3_moe"]().to_dict()
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.router_aux_loss_coef, cfg.router_z_loss_coef, cfg.qk_norm) == (4, 2, 16, True, 0.001, 0.0, True)
    # the published Qwen3-MoE spelling (num_experts), and a z-loss coefficient read by its Switch name
    pub = {k: v for k, v in d.items() if k != "num_local_experts"} | {"num_experts": 4, "router_z_loss_coef": 0.01}
    assert ModelConfig.from_hf_dict(pub).router_z_loss_coef == 0.01
    shape = MoEShape.of(cfg)
    assert type(shape) is MoEShape and hash(shape) == hash(plan_shape(cfg)) and shape.mlp_only_layers == ()
    mixed = ModelConfig.from_hf_dict(FAMILIES["qwen3_moe_dense_layer_bias"]().to_dict())
    assert mixed.moe_layers == (0, 2) and not mixed.every_layer_moe
    with pytest.raises(ConfigError, match="every layer is MoE"):
        plan_shape(mixed)
    mx = FAMILIES["mixtral"]().to_dict()
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 is not supported"):
        ModelConfig.from_hf_dict(mx | {"router_jitter_noise": 0.1})
    m = ModelConfig.from_hf_dict(mx)
    assert (m.moe_intermediate_size, m.norm_topk_prob, m.sliding_window) == (16, True, 5)
    with pytest.raises(ValueError, match="mixtral always renormalises"):
        dataclasses.replace(m, norm_topk_prob=False)
    with pytest.raises(ValueError, match="model_type 'qwen3_moe' needs MoEConfig"):
        ModelConfig(model_type="qwen3_moe", **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)
                                               if f.name != "model_type"})


@pytest.mark.equivalence
def test_activation_checkpointing_keeps_routing_and_gradients():
    """A recomputed layer routes (or replays) as its first forward did: record, loss and gradients are unchanged."""
    from relayrl.parallel.parallelize import apply_activation_checkpointing

    cfg = dataclasses.replace(ModelConfig.from_hf_dict(FAMILIES["qwen3_moe"]().to_dict()), router_z_loss_coef=0.1)
    ids, _ = parity_inputs()

    def run(checkpointed: bool, replay):
        model = CausalLM(cfg)
        model.reset_parameters(std=0.2, seed=0)
        if checkpointed:
            apply_activation_checkpointing(model)
        rec = Routing(replay=replay)
        loss = model(ids, routing=rec).square().mean() + moe_aux_loss(rec.router_logits(), cfg)
        loss.backward()
        return loss.detach(), rec.selected_experts(), {n: p.grad for n, p in model.named_parameters()}

    fixed = torch.tensor([2, 0]).expand(3, 12, 2, 2)
    for replay in (None, fixed):
        plain, ckpt = run(False, replay), run(True, replay)
        torch.testing.assert_close(ckpt[0], plain[0], atol=0, rtol=0)
        assert torch.equal(ckpt[1], plain[1])
        for name, g in plain[2].items():
            torch.testing.assert_close(ckpt[2][name], g, atol=1e-7, rtol=1e-6, msg=name)
