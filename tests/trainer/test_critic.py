"""PPO's critic: the clipped value loss and explained variance by hand, values aligned like the logprobs, and
the critic's update under FSDP, DDP and TP equal to the single-process update."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

from relayrl.algorithms import AlgoConfig
from relayrl.algorithms.value_loss import explained_variance, value_loss
from relayrl.models import ModelConfig
from relayrl.models.score import ScoreModel
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.critic import Critic, token_values

from dist_harness import run_distributed
from helpers import random_rows

LAYOUTS = {"fsdp2": dict(dp_shard=2), "ddp2": dict(dp_replicate=2), "tp2": dict(tp=2)}


@pytest.mark.unit
def test_clipped_value_loss_by_hand():
    v = torch.tensor([[0.0, 1.0, 3.0]])
    old = torch.tensor([[0.0, 0.5, 2.0]])
    ret = torch.tensor([[0.0, 2.0, 1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, st = value_loss(v, old, ret, mask, clip=0.2)
    # token 1: v 1.0 moved +0.5 from 0.5, clipped to 0.7: max((1-2)^2, (0.7-2)^2) = 1.69 (clip binds)
    # token 2: v 3.0 moved +1.0 from 2.0, clipped to 2.2: max((3-1)^2, (2.2-1)^2) = max(4, 1.44) = 4
    assert float(loss) == pytest.approx(0.5 * (1.69 + 4) / 2)
    assert float(st["clip_frac"]) == 0.5
    unclipped, _ = value_loss(v, old, ret, mask, clip=None)
    assert float(unclipped) == pytest.approx(0.5 * (1 + 4) / 2)


@pytest.mark.unit
def test_explained_variance_by_hand():
    ret = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the masked 9 is no token
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 2.0), ret, mask) == pytest.approx(0.0)
    v = torch.tensor([[1.5, 2.0, 2.5, 0.0]])  # residuals [-.5, 0, .5]: var .25 against var(R) = 1
    assert explained_variance(v, ret, mask) == pytest.approx(0.75)


def _model() -> ScoreModel:
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=True,
                      tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)
    m = ScoreModel(cfg)
    m.reset_parameters(std=0.2, seed=0)
    return m


@pytest.mark.unit
def test_values_are_aligned_like_logprobs():
    m = _model()
    ids = torch.tensor([[5, 6, 7, 8]])
    v = token_values(m, ids, torch.ones_like(ids)).detach()
    for t in range(1, 4):  # the value of choosing token t is read from the prefix before it
        assert float(v[0, t]) == pytest.approx(float(m(ids[:, :t])[0, -1, 0].detach()), abs=1e-5)
    assert float(v[0, 0]) == 0.0


def _cfgs():
    return (TrainerConfig(lr=1e-3, adam_eps=1e-3, micro_batch_size=3, ppo_epochs=2, shuffle=False),
            AlgoConfig(value_clip=0.2))


def _batch() -> TrainBatch:
    ids, attn, resp = build_rows(*random_rows(seed=3))
    values = Critic(_model(), *_cfgs(), total_steps=1).compute_values(TrainBatch(ids, attn, resp))
    returns = (torch.randn(resp.shape, generator=torch.Generator().manual_seed(4)) + 1.0) * resp
    return TrainBatch(ids, attn, resp, values=values, returns=returns)


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _rank_update(rank, world, layout, batch):
    dims = ParallelDims(world_size=world, **LAYOUTS[layout])
    mesh = dims.build_mesh("cpu")
    model = parallelize_model(_model(), dims, mesh, dp_mode="ddp" if layout == "ddp2" else "fsdp")
    critic = Critic(model, *_cfgs(), total_steps=1, dims=dims)
    rows = batch.split(len(batch) // dims.dp)[dims.dp_rank] if dims.dp > 1 else batch
    values = critic.compute_values(rows)
    stats = critic.update(rows)
    return {n: _full(p) for n, p in model.named_parameters()}, stats, values


@functools.cache
def _reference():
    model = _model()
    critic = Critic(model, *_cfgs(), total_steps=1)
    values = critic.compute_values(_batch())
    stats = critic.update(_batch())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, stats, values


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_critic_update_under_every_layout_equals_single_process(layout):
    want, want_stats, want_values = _reference()
    assert 0 < want_stats["clip_frac"] < 1  # the value clip engages on some tokens, not all
    init = _model().state_dict()
    for rank, (got, stats, values) in enumerate(run_distributed(_rank_update, 2, layout, _batch())):
        dp = LAYOUTS[layout].get("dp_shard", 1) * LAYOUTS[layout].get("dp_replicate", 1)
        rows = slice(rank * 4, rank * 4 + 4) if dp > 1 else slice(None)
        torch.testing.assert_close(values, want_values[rows], atol=1e-5, rtol=0)
        for name, w in want.items():
            update = float((w - init[name]).abs().max())
            assert update > 1e-4, name  # every tensor moved, the head included
            tol = 1e-5 * float(w.abs().max()) + 1e-4 * update
            torch.testing.assert_close(got[name], w, atol=tol, rtol=0, msg=name)
        for key in ("loss", "grad_norm", "value_loss", "clip_frac"):
            assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), key
