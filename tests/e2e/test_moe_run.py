"""MoE GRPO end to end through relayrl.jobs.train.train, on a tiny random Qwen3-MoE (built, nothing downloaded):
with routing replay and a reference model, 2 steps under expert parallelism (parallel.ep 2 over dp_shard 2, the
colocated engine's experts placed by EP over its 2 ranks) and under FSDP 2 (the engine's placed by TP) take the
one-process run's steps: the same samples, losses, gradient norms and MoE figures; every sync verified by the
canary on the way (a failed one stops the run)."""

from __future__ import annotations

import pytest

from helpers import assert_same_metrics, cfg_for, step_metrics, tiny_moe_dir

pytestmark = pytest.mark.e2e

# moe/aux_loss is left out: load balancing is a product of two means, taken per micro-batch (relayrl.trainer.routing),
# so its value depends on how the rows are cut; the z-loss, a mean, is exact in every layout
MOE_KEYS = ("moe/routing_mismatch", "moe/load_max_over_mean", "moe/load_max_over_mean/layer_0",
            "moe/load_max_over_mean/layer_1", "moe/z_loss")


def _run(tmp_path, name: str, src, rollout=None, steps=2, save_every=0, resume=False, **parallel) -> list[dict]:
    from relayrl.jobs.train import train

    cfg = cfg_for(tmp_path, name, model={"path": str(src)}, run={"steps": steps, "save_every": save_every},
                  algo={"routing_replay": True, "kl_coef": 0.05, "moe_z_loss_coef": 1e-4},
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
                  rollout=rollout or {}, parallel=parallel)
    train(cfg, resume=resume, show_progress=False)
    return step_metrics(cfg.run.out_dir)


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory):
    return tiny_moe_dir(tmp_path_factory.mktemp("moe") / "model")


@pytest.fixture(scope="module")
def one_process(moe_src, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), "one", moe_src)


def _same(a: list[dict], b: list[dict]) -> None:
    assert_same_metrics(a, b)
    for x, y in zip(a, b, strict=True):
        for k in MOE_KEYS:
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), k
        assert y["sync/canary_gap"] <= 1e-5  # fp32 on both sides: the engine holds the trainer's experts


def test_ep2_run_equals_one_process(moe_src, one_process, tmp_path):
    assert one_process[0]["reward/std"] > 0 and one_process[0]["grad_norm"] > 0  # a real update
    ep = _run(tmp_path, "ep2", moe_src, rollout={"tp": 2, "expert_placement": "ep"},
              backend="local", dp_shard=2, ep=2)
    _same(one_process, ep)


@pytest.mark.slow
def test_fsdp2_run_with_engine_experts_by_tp_equals_one_process(moe_src, one_process, tmp_path):
    fsdp = _run(tmp_path, "fsdp2", moe_src, rollout={"tp": 2, "expert_placement": "tp"},
                backend="local", dp_shard=2)
    _same(one_process, fsdp)


EP2 = dict(rollout={"tp": 2, "expert_placement": "ep"}, backend="local", dp_shard=2, ep=2)


# one direction in CI, both in `make bench` (the same reshard code either way)
@pytest.mark.parametrize("saved, resumed", [(EP2, {}), pytest.param({}, EP2, marks=pytest.mark.slow)],
                         ids=["ep2_to_one_process", "one_process_to_ep2"])
def test_resume_across_expert_parallelism(moe_src, tmp_path, saved, resumed):
    """Two steps saved with the experts split over 2 ep ranks (each holding its own whole experts and their AdamW
    state), two more in one process, and the other way round: steps 3 and 4 are the never-stopped run's, and their
    syncs pass the canary (the engine holds the experts the checkpoint gave back)."""
    ref = _run(tmp_path, "ref", moe_src, steps=4)
    _run(tmp_path, "run", moe_src, steps=2, save_every=2, **saved)
    got = _run(tmp_path, "run", moe_src, steps=4, save_every=2, resume=True, **resumed)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    _same(ref[2:], got[2:])


def test_tp2_moe_run_equals_one_process(moe_src, one_process, tmp_path):
    """Tensor parallelism over an MoE model takes the one-process steps, the routing figures included. TP's plan
    splits attention and the vocabulary; the MoE blocks (router and experts) stay whole on each TP rank (parallel.ep
    is what splits experts)."""
    tp = _run(tmp_path, "tp2", moe_src, backend="local", tp=2)
    _same(one_process, tp)
