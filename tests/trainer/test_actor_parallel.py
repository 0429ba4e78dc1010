"""The actor's update under data and tensor parallelism equals the single-process update.

Each data-parallel rank gets its rows of one global batch; the loss denominators are the global
token / sequence counts (all-reduced), gradients are summed over ranks, so after two PPO epochs
(ratios move off 1, clipping engages) the weights must equal the single-process actor's, for each
loss aggregation mode.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

from relayrl.algorithms import AlgoConfig
from relayrl.models import CausalLM, ModelConfig
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig

from dist_harness import run_distributed
from helpers import random_rows

pytestmark = pytest.mark.equivalence

AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LAYOUTS = {"fsdp2": dict(dp_shard=2), "ddp2": dict(dp_replicate=2), "tp2": dict(tp=2)}


def _model() -> CausalLM:
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=True,
                      tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    m = CausalLM(cfg)
    m.reset_parameters(std=0.2, seed=0)
    return m


def _cfgs(agg):
    # adam_eps well above fp32 noise in tiny gradients: otherwise Adam turns rounding into +-lr steps
    return (TrainerConfig(lr=1e-3, adam_eps=1e-3, micro_batch_size=3, ppo_epochs=2, shuffle=False),
            AlgoConfig(agg=agg, kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0))


def _batch() -> TrainBatch:
    ids, attn, resp = build_rows(*random_rows(seed=3))
    g = torch.Generator().manual_seed(4)
    model = _model()
    actor = Actor(model, *_cfgs("token-mean"), total_steps=1)
    old = actor.compute_logprobs(TrainBatch(ids, attn, resp))
    noise = 0.05 * torch.randn(old.shape, generator=g) * resp
    return TrainBatch(ids, attn, resp, advantages=torch.randn(8, generator=g), old_logp=old,
                      rollout_logp=old + noise, ref_logp=old - 0.1 * resp)


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _rank_update(rank, world, layout, batch):
    out = {}
    for agg in AGGS:
        dims = ParallelDims(world_size=world, **LAYOUTS[layout])
        mesh = dims.build_mesh("cpu")
        model = parallelize_model(_model(), dims, mesh, dp_mode="ddp" if layout == "ddp2" else "fsdp")
        actor = Actor(model, *_cfgs(agg), total_steps=1, dims=dims)
        rows = batch.split(len(batch) // dims.dp)[dims.dp_rank] if dims.dp > 1 else batch
        stats = actor.update(rows)
        out[agg] = ({n: _full(p) for n, p in model.named_parameters()}, stats)
    return out


@functools.cache
def _parallel(layout):
    return run_distributed(_rank_update, 2, layout, _batch())


@functools.cache
def _reference():
    out = {}
    for agg in AGGS:
        model = _model()
        stats = Actor(model, *_cfgs(agg), total_steps=1).update(_batch())
        out[agg] = ({n: p.detach().clone() for n, p in model.named_parameters()}, stats)
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("agg", AGGS)
def test_parallel_update_equals_single_process(layout, agg):
    want, want_stats = _reference()[agg]
    for rank_result in _parallel(layout):
        got, stats = rank_result[agg]
        init = _model().state_dict()
        for name, w in want.items():
            update = float((w - init[name]).abs().max())
            assert update > 1e-4, name  # the update really moved every tensor
            # fp32 agreement: 1e-5 of the tensor's scale plus 1e-4 of the update's (Adam divides by
            # sqrt(v) + eps, which amplifies gradient rounding in relative terms). A wrong denominator
            # or a double-counted gradient is off by ~100% of the update.
            tol = 1e-5 * float(w.abs().max()) + 1e-4 * update
            torch.testing.assert_close(got[name], w, atol=tol, rtol=0, msg=name)
        for key in ("loss", "grad_norm", "clip_frac", "entropy", "kl", "ratio_max"):
            assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), key
