"""The planner on MoE models: the presets' parameter counts against the published totals, expert parallelism's
share of the state, its all-to-all, the MoE layer's activations, FLOPs and the engine's weights, by hand."""

from __future__ import annotations

import json

import pytest

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape, MoEShape
from relayrl.models.flops import train_flops
from relayrl.planner import Layout, Workload, make_plan, train_memory
from relayrl.planner.activations import layer_terms
from relayrl.planner.comm import Network, step_collectives
from relayrl.planner.compute import flops_per_token
from relayrl.planner.kv import engine_weight_bytes
from relayrl.planner.memory import stage_summary, stage_tensors
from relayrl.planner.moe import MOE_PRESETS, moe_shape_from_hf
from relayrl.planner.search import layouts, preset_shape
from relayrl.sync.presets import preset

MIXTRAL = MOE_PRESETS["mixtral-8x7b"]
QWEN3_MOE = MOE_PRESETS["qwen3-30b-a3b"]
BF16 = Workload(seq=4096, micro_batch=1)
# Mixtral-8x7B by hand: 32 layers of attention 2 x 4096^2 + 2 x 4096 x 1024, 8 experts of 3 x 4096 x 14336, a
# router 8 x 4096 and two norms; untied embedding and lm_head of 32000 x 4096; the final norm
MIXTRAL_EXPERTS = 32 * 8 * 3 * 4096 * 14336
MIXTRAL_TOTAL = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336 + 8 * 4096 + 2 * 4096) \
    + 2 * 32000 * 4096 + 4096


def _elements(shape) -> int:
    n = 0
    for _, shp, _ in stage_tensors(shape, Layout(), BF16, 0, 0):
        k = 1
        for d in shp:
            k *= d
        n += k
    return n


@pytest.mark.unit
def test_presets_hold_the_published_parameter_counts():
    assert _elements(MIXTRAL) == MIXTRAL_TOTAL == 46_702_792_704  # "46.7B"
    # Qwen3-30B-A3B: 48 layers, q 32 x 128, kv 4 x 128 over h 2048, q/k norms of 128, 128 experts of 3 x 2048 x 768
    layer = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 128 * 3 * 2048 * 768 + 128 * 2048 + 2 * 2048 + 2 * 128
    assert _elements(QWEN3_MOE) == 48 * layer + 2 * 151936 * 2048 + 2048 == 30_532_122_624  # "30.5B"
    # active per token (Qwen's "A3B"): 8 of 128 experts; the FLOPs' N counts matmul weights (no embedding lookup)
    active_matmul = 48 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 8 * 3 * 2048 * 768 + 128 * 2048) \
        + 151936 * 2048
    assert active_matmul + 151936 * 2048 == 3_352_821_760  # "3.3B activated"


@pytest.mark.unit
def test_ep_keeps_each_ranks_experts_only_under_zero2():
    """ZeRO-2 keeps params whole: without EP every rank holds all 8 experts; with ep 8, one per layer."""
    dense = MIXTRAL_TOTAL - MIXTRAL_EXPERTS
    for ep, experts in ((1, MIXTRAL_EXPERTS), (2, MIXTRAL_EXPERTS // 2), (8, MIXTRAL_EXPERTS // 8)):
        m = train_memory(MIXTRAL, Layout(dp_shard=8, dp_mode="zero2", ep=ep), BF16, rank=3)
        assert m.params == (dense + experts) * 2


@pytest.mark.unit
def test_ep_under_fsdp_shards_experts_over_the_ranks_holding_the_same_ones():
    """FSDP: ep 2 of 8 keeps 4 experts per layer, sharded over 4 ranks; the same 1/8 of them as ep 1 — EP
    changes the traffic (below), not the experts' share of the state."""
    a = train_memory(MIXTRAL, Layout(dp_shard=8, ep=1), BF16, rank=5)
    b = train_memory(MIXTRAL, Layout(dp_shard=8, ep=2), BF16, rank=5)
    # the experts' rows divide evenly (14336 / 4, 4096 / 4): no padding, the same bytes, but for AdamW's 0-d
    # step of each of the 4 x 3 expert tensors per layer the rank no longer holds
    assert a.params == b.params and a.grads == b.grads
    assert a.optim - b.optim == 32 * 4 * 3 * 4
    # 4 experts of 3 x 4096 x 14336 per layer on the rank's EP half, in quarters, plus the dense part in eighths
    experts = 32 * 4 * 3 * 4096 * 14336 // 4
    dense_chunks = sum(-(-shp[0] // 8) * (1 if len(shp) == 1 else shp[1])
                       for name, shp, _ in stage_tensors(MIXTRAL, Layout(dp_shard=8, ep=2), BF16, 0, 0)
                       if ".experts." not in name)
    assert b.params == (experts + dense_chunks) * 2


@pytest.mark.unit
def test_ep_all_to_all_and_expert_fsdp_traffic_by_hand():
    lay = Layout(dp_shard=8, ep=8)
    whole, _, _, experts = stage_summary(MIXTRAL, lay, BF16, 0)
    assert experts == (32 * 3 * 4096 * 14336,) * 2  # one expert per layer on each rank, all trained
    colls = {c.name: c for c in step_collectives(MIXTRAL, lay, BF16, Network(8), whole, 32, experts)}
    # 4 all-to-alls per layer per micro-batch (dispatch, combine; forward, backward), m = 8: 7/8 x 2 x 4096 x 2 x 4096
    a2a = colls["ep all-to-all"]
    assert a2a.bytes == 32 * 8 * 4 * 7 * 2 * 4096 * 2 * 4096 // 8 == 60_129_542_144
    assert (a2a.size, a2a.overlapped, a2a.crosses_nodes) == (8, False, False)
    # ep = the shard group: no rank holds another's experts, so the experts are never gathered
    assert not any("expert param" in n for n in colls)
    # the shard group's all-gather moves the dense part only: 2 m 7/8 x its bf16 bytes
    dense = whole[0] - experts[0]
    assert colls["fsdp param all-gather"].bytes == int(2 * 8 * 7 / 8 * dense * 2)
    # ep 2: the experts gathered over the 4 ranks holding the same ones, at stride 2
    lay2 = Layout(dp_shard=8, ep=2)
    whole2, _, _, experts2 = stage_summary(MIXTRAL, lay2, BF16, 0)
    c2 = {c.name: c for c in step_collectives(MIXTRAL, lay2, BF16, Network(8), whole2, 32, experts2)}
    assert experts2[0] == 32 * 4 * 3 * 4096 * 14336
    assert c2["fsdp expert param all-gather"].size == 4
    assert c2["fsdp expert param all-gather"].bytes == int(2 * 8 * 3 / 4 * experts2[0] * 2)
    assert c2["ep all-to-all"].bytes == 32 * 8 * 4 * 2 * 4096 * 2 * 4096 // 2
    # full recompute runs the forward's two again
    full = Workload(seq=4096, micro_batch=1, recompute="full")
    c3 = {c.name: c for c in step_collectives(MIXTRAL, lay, full, Network(8), whole, 32, experts)}
    assert c3["ep all-to-all"].bytes == a2a.bytes * 6 // 4


TINY = MoEShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=24)


@pytest.mark.unit
def test_moe_layer_activations_by_hand():
    """fp32, s b = 12: the SwiGLU of the dense layer is replaced by the router, routed copies and experts."""
    w = Workload(seq=6, micro_batch=2, dtype="float32", mixed_precision=False)
    dense = dict((n, b) for n, b, _ in layer_terms(ModelShape.of(TINY), Layout(), w))
    moe = dict((n, b) for n, b, _ in layer_terms(TINY, Layout(), w))
    assert "swiglu" not in moe and dense["swiglu"] == 4 * 4 * 12 * 48
    assert moe["router"] == 4 * 12 * 4 + 4 * 12 * 2  # fp32 softmax over 4 experts, top-2 weights
    assert moe["dispatched tokens"] == moe["expert outputs"] == 4 * 12 * 2 * 32
    assert moe["expert swiglu"] == 4 * 4 * 12 * 2 * 16
    assert moe["shared expert"] == 4 * 4 * 12 * 24 + 4 * 12
    assert {k: v for k, v in moe.items() if k in dense} == {k: v for k, v in dense.items() if k != "swiglu"}
    # TP 2 halves the experts' SwiGLU (expert TP = TP), not the routed copies
    tp = dict((n, b) for n, b, _ in layer_terms(TINY, Layout(tp=2), w))
    assert tp["expert swiglu"] == moe["expert swiglu"] / 2 and tp["dispatched tokens"] == moe["dispatched tokens"]


@pytest.mark.unit
def test_moe_flops_count_the_active_experts_and_the_routers():
    w = Workload(seq=4096, micro_batch=1)
    model, _ = flops_per_token(MIXTRAL, w)
    # 2 of 8 experts: the dense count with an MLP 2 x 14336 wide, plus 6 h E per layer for the routers
    active = ModelShape(vocab_size=32000, hidden_size=4096, intermediate_size=2 * 14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    assert model == train_flops(active, 1, 4096) + 6 * 32 * 4096 * 8
    n_active = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 3 * 4096 * 14336) + 32000 * 4096
    assert train_flops(active, 1, 4096) == 6 * n_active + 12 * 32 * 32 * 128 * 4096


@pytest.mark.unit
def test_engine_holds_every_expert_sharded_by_its_tp():
    assert engine_weight_bytes(MIXTRAL, 1, "bfloat16") == MIXTRAL_TOTAL * 2
    # TP 2: experts and attention (8 KV heads: 4 each) halved; the engine keeps embedding, lm_head, routers and
    # norms whole
    halved = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336)
    whole = 2 * 32000 * 4096 + 32 * (8 * 4096 + 2 * 4096) + 4096
    assert engine_weight_bytes(MIXTRAL, 2, "bfloat16") == (halved // 2 + whole) * 2


@pytest.mark.unit
def test_ep_is_for_moe_models_and_comes_from_the_shard_group():
    with pytest.raises(ConfigError, match="sharding dp_mode"):
        Layout(dp_replicate=8, dp_mode="ddp", ep=2)
    with pytest.raises(ConfigError, match="dividing dp_shard x cp"):
        Layout(dp_shard=6, ep=4)
    with pytest.raises(ConfigError, match="dense"):
        train_memory(preset("qwen2.5-7b"), Layout(dp_shard=4, ep=2), BF16)
    with pytest.raises(ConfigError, match="num_experts"):
        train_memory(MIXTRAL, Layout(dp_shard=16, ep=16), BF16)  # 8 experts
    assert all(lay.ep == 1 for lay in layouts(preset("qwen2.5-7b"), 16, 8, 4096))
    eps = {lay.ep for lay in layouts(MIXTRAL, 16, 8, 4096)}
    assert eps == {1, 2, 4, 8}  # the divisors of 8 experts that divide a shard group of 16 GPUs
    with pytest.raises(ConfigError, match="LoRA on an MoE"):
        make_plan(MIXTRAL, "m", Workload(seq=512, micro_batch=1, lora_rank=8), gpus=8, gpu_mem_gib=80)


@pytest.mark.e2e  # the planner's whole search (make_plan), as `relayrl plan` runs it: seconds
def test_plan_ranks_ep_layouts_of_an_moe_model():
    plan = make_plan(QWEN3_MOE, "q", Workload(seq=4096, micro_batch=1, recompute="full"), gpus=16, nodes=2,
                     gpu_mem_gib=80)
    fit = [o for o in plan.train if o.fits]
    assert any(o.degrees["ep"] > 1 for o in fit)
    assert [o.time.mfu for o in fit] == sorted((o.time.mfu for o in fit), reverse=True)
    assert any(a.startswith("MoE: 128 experts of 768, top-8") for a in plan.assumptions)
    assert preset_shape("qwen3-30b-a3b") is QWEN3_MOE
    with pytest.raises(ConfigError, match="mixtral-8x7b"):
        preset_shape("nope")


@pytest.mark.unit
def test_hf_configs_of_moe_models():
    qwen3 = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
             "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "tie_word_embeddings": False, "attention_bias": False}
    assert moe_shape_from_hf(qwen3) == QWEN3_MOE
    mixtral = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False}
    assert moe_shape_from_hf(mixtral) == MIXTRAL
    with pytest.raises(ConfigError, match="dense layers"):
        moe_shape_from_hf({**qwen3, "decoder_sparse_step": 2})
    with pytest.raises(ConfigError, match="not an MoE"):
        moe_shape_from_hf({k: v for k, v in qwen3.items() if k != "num_experts"})


@pytest.mark.e2e
def test_cli_plans_an_moe_model_directory(tmp_path, capsys):
    from relayrl.cli.main import main

    d = tmp_path / "moe"
    d.mkdir()
    tiny = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    (d / "config.json").write_text(json.dumps(tiny))
    assert main(["plan", "--model", str(d), "--gpus", "4", "--gpu-mem", "1", "--seq", "128", "--micro-batch", "1",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {o["degrees"]["ep"] for o in plan["train"]} == {1, 2, 4}
    (d / "config.json").write_text(json.dumps({k: v for k, v in tiny.items() if k != "num_experts_per_tok"}))
    assert main(["plan", "--model", str(d), "--gpus", "4", "--gpu-mem", "1", "--seq", "128",
                 "--micro-batch", "1"]) != 0
    assert "num_experts_per_tok" in capsys.readouterr().err


@pytest.mark.unit
def test_the_unused_dense_width_of_an_moe_config_does_not_constrain_tp():
    """Qwen-MoE configs keep an intermediate_size no layer uses; TP need only divide the experts' width."""
    import dataclasses

    odd = dataclasses.replace(TINY, intermediate_size=49)  # 49 % 2 != 0; the experts' 16 and shared 24 divide
    w = Workload(seq=6, micro_batch=2, dtype="float32", mixed_precision=False)
    assert train_memory(odd, Layout(tp=2), w, rank=0).params == train_memory(TINY, Layout(tp=2), w, rank=0).params
    assert any(lay.tp == 2 for lay in layouts(odd, 2, 2, 128))
