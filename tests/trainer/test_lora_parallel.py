"""LoRA under FSDP, DDP and TP (and TP x FSDP) equals one process: adapter gradients, the update's adapters and
stats, and the frozen base never moves. A bf16 base with fp32 adapters runs under FSDP2 (one group holding
both dtypes) and equals the same model in one process."""

from __future__ import annotations

import functools
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from relayrl.algorithms import AlgoConfig
from relayrl.models import CausalLM, ModelConfig
from relayrl.models.lora import LoRALinear, apply_lora, is_lora_param, lora_state
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.parallel.tensor_parallel import LORA_SHARD_DIM
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig

from dist_harness import run_distributed
from helpers import random_rows

pytestmark = pytest.mark.equivalence

LAYOUTS = {
    "fsdp2": (2, dict(dp_shard=2), {}),
    "ddp2": (2, dict(dp_replicate=2), dict(dp_mode="ddp")),
    "tp2": (2, dict(tp=2), {}),
    "tp2_sp": (2, dict(tp=2), dict(sequence_parallel=True)),
    "tp2_fsdp2": (4, dict(tp=2, dp_shard=2), {}),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(base_dtype=torch.float32) -> CausalLM:
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=True,
                      tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)
    m = CausalLM(cfg)
    m.reset_parameters(std=0.2, seed=0)
    m.to(base_dtype)
    apply_lora(m, 4, 8.0, targets=TARGETS, seed=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B != 0: A gets gradient from the first step on
        for p in lora_state(m).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def _cfgs():
    return (TrainerConfig(lr=1e-2, adam_eps=1e-3, micro_batch_size=3, ppo_epochs=2, shuffle=False),
            AlgoConfig(kl_coef=0.1, entropy_coef=0.01))


@functools.cache
def _batch() -> TrainBatch:
    ids, attn, resp = build_rows(*random_rows(seed=3))
    g = torch.Generator().manual_seed(4)
    actor = Actor(_model(), *_cfgs(), total_steps=1)
    old = actor.compute_logprobs(TrainBatch(ids, attn, resp))
    return TrainBatch(ids, attn, resp, advantages=torch.randn(8, generator=g), old_logp=old,
                      rollout_logp=old, ref_logp=old - 0.1 * resp)


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _run(actor: Actor, rows: TrainBatch) -> dict:
    model = actor.model
    grads_stats = actor.accumulate_grads(rows)
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    actor.optimizer.zero_grad(set_to_none=True)
    stats = actor.update(rows)
    return {"grads": grads, "grad_loss": grads_stats["loss"], "stats": stats,
            "params": {n: _full(p) for n, p in model.named_parameters()},
            "placements": {n: str(p.placements) for n, p in model.named_parameters()
                           if isinstance(p, DTensor) and is_lora_param(n)},
            "optim_params": sum(len(g["params"]) for g in actor.optimizer.param_groups)}


def _ranks(rank, world, cases, batch):
    """Every (layout, base dtype) of this world size, one after the other in the same processes."""
    out = {}
    for case in cases:
        layout, base_dtype = case[:2]
        _, kw, par = LAYOUTS[layout]
        dims = ParallelDims(world_size=world, **kw)
        mesh = dims.build_mesh("cpu")
        model = parallelize_model(_model(base_dtype), dims, mesh, **par)
        actor = Actor(model, *_cfgs(), total_steps=1, dims=dims)
        rows = batch.split(len(batch) // dims.dp)[dims.dp_rank] if dims.dp > 1 else batch
        with mock.patch.object(LoRALinear, "forward", _cast_then_linear) if "cast" in case else nullcontext():
            out[case] = {**_run(actor, rows), "dp_rank": dims.dp_rank}
    return out


def _cast_then_linear(self, x):
    """LoRALinear's update as plain autograd computes it in fp32: x cast up (a full-size copy of x per target,
    which LoRALinear avoids) then two linears."""
    h = x.to(self.lora_A.dtype)
    return F.linear(x, self.weight, self.bias) + (F.linear(F.linear(h, self.lora_A), self.lora_B)
                                                  * self.scaling).to(x.dtype)


@functools.cache
def _by_world(world):
    cases = [(name, torch.float32) for name, (w, _, _) in LAYOUTS.items() if w == world]
    if world == 2:
        cases += [("fsdp2", torch.bfloat16), ("tp2", torch.bfloat16), ("tp2", torch.bfloat16, "cast")]
    return run_distributed(_ranks, world, cases, _batch(), timeout=300.0)


def _parallel(layout, base_dtype=torch.float32, *variant):
    return [r[(layout, base_dtype, *variant)] for r in _by_world(LAYOUTS[layout][0])]


@functools.cache
def _reference(base_dtype=torch.float32):
    return _run(Actor(_model(base_dtype), *_cfgs(), total_steps=1), _batch())


def _check_loss(want, results, tol_scale):
    """accumulate_grads' loss is each data-parallel rank's share of the global loss: they sum to it."""
    shares = {r["dp_rank"]: r["grad_loss"] for r in results}
    assert sum(shares.values()) == pytest.approx(want["grad_loss"], rel=tol_scale * 1e-5)


def _check(want, got, tol_scale):
    init = {n: p.detach() for n, p in _model(next(iter(want["params"].values())).dtype).named_parameters()}
    assert set(got["grads"]) == set(want["grads"]) == set(lora_state(_model()))  # adapters only
    for name, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, atol=tol_scale * 1e-5 * float(g.abs().max()), rtol=0,
                                   msg=name)
    for name, w in want["params"].items():
        if is_lora_param(name):
            update = float((w - init[name]).abs().max())
            assert update > 1e-3, name  # the update really moved every adapter
            torch.testing.assert_close(got["params"][name], w, atol=tol_scale * 1e-4 * update, rtol=0, msg=name)
        else:  # the frozen base is bit-identical to its start, on every layout
            assert torch.equal(got["params"][name], init[name]), name
    for key in ("loss", "grad_norm", "kl", "entropy"):
        assert got["stats"][key] == pytest.approx(want["stats"][key], rel=tol_scale * 1e-5), key


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if LAYOUTS[k][0] > 2 else k
                                    for k in sorted(LAYOUTS)])
def test_lora_parallel_equals_single_process(layout):
    want = _reference()
    _check_loss(want, _parallel(layout), 1)
    for got in _parallel(layout):
        _check(want, got, 1)
        assert got["optim_params"] == len(want["grads"])  # the optimizer holds the adapters only
        if layout.startswith("tp"):  # colwise: B sharded on rows, A replicated; rowwise: A on columns
            for name, placements in got["placements"].items():
                style = "rowwise" if any(t in name for t in ("o_proj", "down_proj")) else "colwise"
                dim = LORA_SHARD_DIM[style][name.rsplit(".", 1)[1]]
                shard = f"Shard(dim={dim})" if dim is not None else "Replicate()"
                assert shard in placements, (name, placements)


# the same bf16 products on both sides needs kernels whose bf16 rounding does not depend on the rows in a call: CPUs
# with native bf16 dot products (AVX512_BF16: Zen 4 and later, Sapphire Rapids). Without them (a Zen 3 host) torch
# emulates bf16 through fp32 kernels whose blocking follows the row count, so a rank's half batch rounds apart from
# the whole one by up to a bf16 ulp (the loss by 1.9e-3 of itself there): another test than this one
@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(),
                    reason="bf16 products equal across batch splits only with native bf16 (AVX512_BF16)")
def test_bf16_base_fp32_adapters_under_fsdp():
    want = _reference(torch.bfloat16)
    _check_loss(want, _parallel("fsdp2", torch.bfloat16), 50)
    for got in _parallel("fsdp2", torch.bfloat16):
        assert {p.dtype for n, p in got["params"].items() if not is_lora_param(n)} == {torch.bfloat16}
        assert {g.dtype for g in got["grads"].values()} == {torch.float32}
        # the same bf16 products, summed over ranks in another order
        _check(want, got, 50)


def test_bf16_base_under_tp_equals_cast_then_linear():
    """Under TP a bf16 base's rowwise partial sums round in bf16 (no one-process parity at fp32 tolerances), so
    TP 2 is checked against itself: the fp32 down projection that keeps x in bf16 (a custom autograd function,
    here on DTensors) gives what plain autograd's cast-then-linear gives, up to the fp32 summation order of A's
    gradient (measured: 1 ulp)."""
    for got, want in zip(_parallel("tp2", torch.bfloat16), _parallel("tp2", torch.bfloat16, "cast"), strict=True):
        assert got["stats"] == pytest.approx(want["stats"], rel=1e-6)
        for part in ("grads", "params"):
            assert set(got[part]) == set(want[part])
            for name, t in want[part].items():
                torch.testing.assert_close(got[part][name], t, atol=1e-6 * float(t.abs().max()), rtol=0, msg=name)
