"""Routing replay (R3) and the MoE terms of the update, against hand-built references:

- a replayed routing with unknown rows (-1) routes those rows itself and replays the rest;
- packed rows (padding-free, shared prompts) equal padded rows under replay: logprobs and the record in rows;
- a bf16 engine's record differs from the fp32 trainer's own top-k on some tokens, and with replay the trainer's
  recomputed logprobs are those of a forward through the engine's experts (its selected experts equal the record);
- the update's gradient with replay equals a hand-built forward with Routing(replay=...) and the same objective,
  on padded rows and on packed shared-prompt micro-batches; the update over shuffled mini-batches, regrouped by
  prompt, equals the padded one;
- the routers' auxiliary losses in the loss equal relayrl.models.router_losses on the forward's logits, and the
  load-balancing value transformers' own function; moe/routing_mismatch and the expert load by hand;
- the refusals: a dense model, an environment, parallel.ep that does not fit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from relayrl.algorithms import AlgoConfig, policy_objective
from relayrl.controller.config import RunConfig
from relayrl.errors import ConfigError
from relayrl.jobs.preflight import check_fits_experts
from relayrl.models import CausalLM
from relayrl.models.config import MoEConfig
from relayrl.models.moe import Routing
from relayrl.models.router_losses import load_balancing_loss, router_z_loss
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.logprobs import token_logprobs
from relayrl.trainer.routing import load_metrics, routing_mismatch

from helpers import small_config

CFG = MoEConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
K = CFG.num_experts_per_tok


def _model(router_std: float = 1.0, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(CFG)
    model.reset_parameters(std=0.2, seed=seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
    return model


def _grouped_batch(G: int = 3, seed: int = 0) -> TrainBatch:
    """Two prompts with G samples each (contiguous), responses of 1-5 tokens, advantages, rollout logprobs."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (4, 3)]
    rows_p = [p for p in prompts for _ in range(G)]
    rows_r = [torch.randint(3, 60, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
              for _ in rows_p]
    ids, attn, resp = build_rows(rows_p, rows_r)
    return TrainBatch(ids, attn, resp, advantages=torch.randn(len(rows_p), generator=g),
                      rollout_logp=-torch.rand(ids.shape, generator=g) * resp)


def _random_record(batch: TrainBatch, G: int = 3, seed: int = 1) -> torch.Tensor:
    """A valid routing for every real token (k distinct experts), the same for the tokens of a shared prompt,
    -1 on padding: what an engine with prefix caching records."""
    g = torch.Generator().manual_seed(seed)
    B, T = batch.input_ids.shape
    n = len(CFG.moe_layers)
    rec = torch.stack([torch.randperm(CFG.num_experts, generator=g)[:K] for _ in range(B * T * n)]).view(B, T, n, K)
    for i in range(B):  # a prompt's tokens: its first sample's record, as a prefix cache gives
        first = i // G * G
        p = int((batch.response_mask[i] == 0).long().cumprod(0).sum())
        rec[i, :p] = rec[first, :p]
    rec[batch.attention_mask == 0] = -1
    return rec.to(torch.int16)


@pytest.mark.unit
def test_replay_routes_the_unknown_rows_itself():
    model = _model().eval()
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    own = Routing()
    model(ids, routing=own)
    other = (own.selected_experts() + 1) % CFG.num_experts  # every token on other experts
    other[0, 2:5] = -1  # unknown rows: the router's own choice
    rec = Routing(replay=other)
    model(ids, routing=rec)
    sel = rec.selected_experts()
    assert torch.equal(sel[0, 2:5], own.selected_experts()[0, 2:5])
    known = torch.ones(2, 7, dtype=torch.bool)
    known[0, 2:5] = False
    assert torch.equal(sel[known], other[known])


@pytest.mark.equivalence
@torch.no_grad()
def test_packed_and_shared_prompt_rows_equal_padded_rows_under_replay():
    model, batch = _model().eval(), _grouped_batch()
    rec = _random_record(batch)
    real = batch.attention_mask.bool()
    prompts = [int((r == 0).long().cumprod(0).sum()) for r in batch.response_mask]
    outs = {}
    for name, kw in {"padded": {}, "packed": {"padding_free": True},
                     "shared": {"padding_free": True, "prefix_lens": prompts}}.items():
        routing = Routing(replay=rec.long())
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, **kw, routing=routing)
        outs[name] = (logp * batch.response_mask, routing)
        assert torch.equal(routing.selected_experts()[real], rec.long()[real]), name  # the record comes back in rows
    for name in ("packed", "shared"):
        torch.testing.assert_close(outs[name][0], outs["padded"][0], atol=1e-5, rtol=0)
        for j in (0, 1):
            torch.testing.assert_close(outs[name][1].logits[j][real], outs["padded"][1].logits[j][real],
                                       atol=1e-5, rtol=0)
    # and replay is not a no-op: the router's own choices give other logprobs
    own, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    assert (own * batch.response_mask - outs["padded"][0]).abs().max() > 1e-3


@pytest.mark.unit
def test_bf16_engine_routing_is_replayed_where_the_trainers_own_top_k_differs():
    from relayrl.engine import LLMEngine, SamplingParams

    model = _model(router_std=0.05).eval()  # routers near uniform: the bf16 engine's top-k flips on near-ties
    eng = LLMEngine(CFG, dtype=torch.bfloat16, record_routing=True, num_blocks=64, block_size=8)
    eng.load_weights(model.state_dict().items())
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    outs = eng.generate(prompts, [SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=i) for i in range(2)])
    samples = [(o.prompt_token_ids, s) for o in outs for s in o.samples]
    ids, attn, resp = build_rows([p for p, _ in samples], [s.token_ids for _, s in samples])
    rec = torch.full((*ids.shape, len(CFG.moe_layers), K), -1, dtype=torch.int16)
    for i, (_, s) in enumerate(samples):
        rec[i, :len(s.routing)] = s.routing
    batch = TrainBatch(ids, attn, resp, routing=rec)
    with torch.no_grad():
        own = Routing()
        token_logprobs(model, ids, attn, routing=own)
    share = routing_mismatch(own, rec, resp, K)
    assert share > 0  # the case exists: the fp32 trainer routes some response tokens elsewhere

    cfg = TrainerConfig(micro_batch_size=4, padding_free=True)  # packed, shared prompts, micro-batches
    replayed = Actor(model, cfg, AlgoConfig(routing_replay=True), total_steps=1).compute_logprobs(batch)
    plain = Actor(model, cfg, AlgoConfig(), total_steps=1).compute_logprobs(batch)
    with torch.no_grad():
        hand = Routing(replay=rec.long())
        ref, _ = token_logprobs(model, ids, attn, routing=hand)
    real = attn.bool()
    assert torch.equal(hand.selected_experts()[real], rec.long()[real])  # the engine's experts ran
    torch.testing.assert_close(replayed, ref * resp, atol=1e-5, rtol=0)
    assert (plain - replayed).abs().max() > 1e-4  # without replay the trainer scores through its own experts
    torch.testing.assert_close(plain, token_logprobs(model, ids, attn)[0].detach() * resp, atol=1e-5, rtol=0)


def _hand_grads(model: CausalLM, batch: TrainBatch, algo: AlgoConfig) -> dict[str, torch.Tensor]:
    """One forward on padded rows with Routing(replay=batch.routing), the objective over the whole batch."""
    m = copy.deepcopy(model).train()
    logp, ent = token_logprobs(m, batch.input_ids, batch.attention_mask, with_entropy=True, entropy_grad=False,
                               routing=Routing(replay=batch.routing.long()))
    loss, _ = policy_objective(logp, logp.detach(), batch.advantages, batch.response_mask, algo,
                               rollout_logp=batch.rollout_logp, entropy=ent,
                               num_tokens=batch.response_mask.sum(), num_seqs=float(len(batch)))
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", [dict(padding_free=False, micro_batch_size=6),
                                    dict(padding_free=True, micro_batch_size=3)])
def test_update_gradient_with_replay_equals_a_hand_built_replayed_forward(layout):
    model, batch = _model(), _grouped_batch()
    batch.routing = _random_record(batch)
    algo = AlgoConfig(routing_replay=True)
    ref = _hand_grads(model, batch, algo)
    actor = Actor(copy.deepcopy(model), TrainerConfig(**layout), algo, total_steps=1)
    actor.model.train()
    actor.accumulate_grads(batch)
    for n, p in actor.model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-5, msg=n)
    assert ref["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the router learns through the replayed weights


@pytest.mark.equivalence
def test_update_over_shuffled_mini_batches_regrouped_by_prompt_equals_padded_rows():
    model, batch = _model(), _grouped_batch(G=4)
    batch.routing = _random_record(batch, G=4)
    algo = AlgoConfig(routing_replay=True)
    out = {}
    for name, layout in {"padded": dict(padding_free=False), "shared": dict(padding_free=True)}.items():
        actor = Actor(copy.deepcopy(model), TrainerConfig(lr=1e-2, mini_batches=2, ppo_epochs=2, micro_batch_size=2,
                                                          **layout), algo, total_steps=1, seed=3)
        batch.old_logp = actor.compute_logprobs(batch)
        stats = actor.update(batch)
        out[name] = (stats, dict(actor.model.named_parameters()))
    for k in ("loss", "grad_norm", "moe/routing_mismatch", "moe/load_max_over_mean"):
        assert out["shared"][0][k] == pytest.approx(out["padded"][0][k], rel=1e-4, abs=1e-6), k
    for n, p in out["padded"][1].items():
        torch.testing.assert_close(out["shared"][1][n], p, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.unit
def test_router_losses_in_the_loss_equal_router_losses_and_transformers():
    model, batch = _model(router_std=0.3), _grouped_batch()
    aux, z = 0.05, 0.002
    base = Actor(copy.deepcopy(model), TrainerConfig(padding_free=True), AlgoConfig(), total_steps=1)
    with_aux = Actor(copy.deepcopy(model), TrainerConfig(padding_free=True),
                     AlgoConfig(moe_aux_loss_coef=aux, moe_z_loss_coef=z), total_steps=1)
    n_tok, n_seq = batch.response_mask.sum(), float(len(batch))
    loss0, _ = base.loss(batch, n_tok, n_seq)
    loss1, st = with_aux.loss(batch, n_tok, n_seq)
    rec = Routing()
    with torch.no_grad():
        model(batch.input_ids, attention_mask=batch.attention_mask, routing=rec)
    lb = load_balancing_loss(rec.router_logits(), K, batch.attention_mask)
    zl = router_z_loss(rec.router_logits(), batch.attention_mask)
    assert float((loss1 - loss0).detach()) == pytest.approx(float(aux * lb + z * zl), rel=1e-5)
    assert st["moe/aux_loss"] == pytest.approx(float(lb), rel=1e-5)
    assert st["moe/z_loss"] == pytest.approx(float(zl), rel=1e-5)
    # transformers' load_balancing_loss_func over the same logits and real tokens (its coefficient aside)
    gate = tuple(lg.reshape(-1, CFG.num_experts) for lg in rec.router_logits())
    hf = load_balancing_loss_func(gate, CFG.num_experts, K, batch.attention_mask)
    assert st["moe/aux_loss"] == pytest.approx(float(hf), rel=1e-5)
    # and the update reports them with the load (real tokens, summed over micro-batches)
    stats = with_aux.update(batch)
    assert {"moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean"} <= stats.keys()


@pytest.mark.unit
def test_routing_mismatch_and_load_by_hand():
    # 1 row, 3 tokens (the first a prompt token), 1 MoE layer, k = 2 of 4 experts
    logits = torch.tensor([[[5.0, 4.0, 0.0, 0.0], [5.0, 4.0, 0.0, 0.0], [0.0, 1.0, 3.0, 2.0]]])
    routing = Routing()
    routing.logits[0] = logits  # own top-2: {0, 1}, {0, 1}, {2, 3}
    record = torch.tensor([[[[3, 2]], [[1, 0]], [[2, 1]]]])  # token 1 the same set in another order; 2 differs
    response = torch.tensor([[0.0, 1.0, 1.0]])
    assert routing_mismatch(routing, record, response, 2) == 0.5  # 1 of the 2 response tokens
    record[0, 2, 0] = -1  # a token the engine never ran is not compared
    assert routing_mismatch(routing, record, response, 2) == 0.0
    load = torch.tensor([[3.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # layers 0 and 2 of the model
    assert load_metrics(load, (0, 2)) == {"moe/load_max_over_mean/layer_0": 3.0,
                                          "moe/load_max_over_mean/layer_2": 1.0, "moe/load_max_over_mean": 3.0}


@pytest.mark.unit
def test_refusals_name_the_key():
    dense = small_config()
    for key, section in (("algo.routing_replay", {"algo": {"routing_replay": True}}),
                         ("algo.moe_aux_loss_coef", {"algo": {"moe_aux_loss_coef": 0.01}}),
                         ("parallel.ep", {"parallel": {"backend": "local", "dp_shard": 2, "ep": 2}})):
        with pytest.raises(ConfigError, match=f"^{key} needs an MoE model"):
            check_fits_experts(RunConfig.from_dict(section), dense)
    with pytest.raises(ConfigError, match="parallel.ep: parallel.ep=2 must divide the model's num_experts=3"):
        check_fits_experts(RunConfig.from_dict({"parallel": {"backend": "local", "dp_shard": 2, "ep": 2}}),
                           MoEConfig(**{**CFG.__dict__, "num_experts": 3}))
    with pytest.raises(ConfigError, match="rollout.expert_placement: tensor_parallel_size 2 does not divide the "
                                          "number of experts"):
        check_fits_experts(RunConfig.from_dict({"rollout": {"tp": 2, "expert_placement": "ep"},
                                                "parallel": {"backend": "local", "dp_shard": 2}}),
                           MoEConfig(**{**CFG.__dict__, "num_experts": 3}))
    with pytest.raises(ConfigError, match="parallel.ep=2 must divide parallel.dp_shard=3"):
        RunConfig.from_dict({"parallel": {"backend": "local", "dp_shard": 3, "ep": 2}})
    with pytest.raises(ConfigError, match="algo.routing_replay replays the engine's routing record, which multi-turn"):
        RunConfig.from_dict({"algo": {"routing_replay": True}, "data": {"chat_template": "always"},
                             "env": {"name": "guess"}})
    with pytest.raises(ValueError, match="need an MoE model"):
        Actor(CausalLM(dense), TrainerConfig(), AlgoConfig(routing_replay=True), total_steps=1)


@pytest.mark.unit
def test_expert_imbalance_advice_is_fed_by_the_trainers_load_and_names_the_worst_layer():
    from relayrl.observe import bottleneck as bn

    rec = {"step": 1, "time/step": 1.0, "moe/load_max_over_mean": 3.5, "moe/load_max_over_mean/layer_0": 1.2,
           "moe/load_max_over_mean/layer_3": 3.5}
    [found] = bn.findings([rec])
    assert found.name == "expert imbalance"
    assert found.what.startswith("the busiest expert carries 3.50x the mean load in MoE layer 3 (threshold 3x")
    assert any("`algo.moe_aux_loss_coef`" in a for a in found.advice)
    assert bn.findings([{**rec, "moe/load_max_over_mean": 2.9}]) == []


@pytest.mark.unit
def test_step_cost_counts_an_moe_models_active_experts():
    from relayrl.controller.step_cost import StepCost

    shape = StepCost(RunConfig(), CFG, peaks={}).shape
    assert shape.intermediate_size == K * CFG.moe_intermediate_size  # top-2 experts of width 16, not the config's 64
