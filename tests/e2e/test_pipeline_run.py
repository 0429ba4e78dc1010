"""A GRPO run with pipeline parallelism (parallel.pp = 2: the actor's and the reference's layers split into stages,
micro-batches run by the schedule) takes the one-process run's steps, for one stage per rank (1f1b), two (interleaved
1F1B) and the V placement (zbv: the tied embedding and its lm_head copy both on rank 0); with FSDP beside it (pp 2 x
dp_shard 2); the weight sync reads each tensor from the stage holding it (canary gap 0); the final model is the
one-process run's; a run saved on pp 2 resumes on one process and one saved on one process resumes on pp 2; and the
settings it does not combine with are refused in one line naming parallel.pp."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from relayrl.errors import ConfigError
from relayrl.jobs.base_model import base_model_dir
from relayrl.jobs.preflight import check_fits_model
from relayrl.jobs.train import train
from relayrl.models import load_config

from helpers import SMALL, assert_same_metrics, cfg_for, step_metrics

# the tiny qwen2 (tied embeddings) with 4 layers: two stages per rank at pp 2
TINY = {**SMALL["model"]["tiny"], "num_hidden_layers": 4}


def _cfg(tmp_path, name, steps=2, save_every=0, trainer=None, **parallel):
    # a KL term (the reference's pass goes through the pipeline too) and a reward with spread (real advantages)
    return cfg_for(tmp_path, name, algo={"kl_coef": 0.05}, run={"steps": steps, "save_every": save_every},
                   model={"tiny": TINY}, reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
                   trainer={"padding_free": False, **(trainer or {})}, parallel=parallel)


def _final(run_dir) -> dict[str, torch.Tensor]:
    return load_file(f"{run_dir}/final_model/model.safetensors")


def _same_final(a, b) -> None:
    fa, fb = _final(a), _final(b)
    assert fa.keys() == fb.keys()
    for n, t in fa.items():
        assert (t - fb[n]).abs().max() <= 1e-5 * max(fb[n].abs().max(), 1.0), n


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = train(_cfg(tmp_path_factory.mktemp("pp"), "single", steps=3), show_progress=False)["run_dir"]
    return run_dir, step_metrics(run_dir)


@pytest.mark.e2e
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv"])
def test_a_pp2_run_takes_the_one_process_steps(tmp_path, single, schedule):
    got = train(_cfg(tmp_path, schedule, steps=3, backend="local", pp=2, pp_schedule=schedule),
                show_progress=False)["run_dir"]
    metrics = step_metrics(got)
    assert_same_metrics(metrics, single[1])
    assert all(m["sync/canary_gap"] <= 1e-5 for m in metrics)  # each tensor read from the stage holding it
    _same_final(got, single[0])  # gathered over the pipeline (the tied lm_head copy equal to the embedding)


@pytest.mark.e2e
def test_pp2_with_fsdp2_takes_the_one_process_steps(tmp_path, single):
    got = train(_cfg(tmp_path, "pp2_fsdp2", steps=3, backend="local", pp=2, dp_shard=2), show_progress=False)
    metrics = step_metrics(got["run_dir"])
    assert_same_metrics(metrics, single[1])
    assert all(m["sync/canary_gap"] <= 1e-5 for m in metrics)


@pytest.mark.e2e
def test_a_bf16_pp2_run_computes_under_the_trainers_autocast(tmp_path):
    """trainer.bf16: the pipeline's passes run under the trainer's autocast, as one process's do. The first sync's
    canary (the trainer's bf16 logprobs of the start weights against the fp32 engine) shows the same gap, and the
    update's loss agrees to bf16 rounding (the micro-batches' shapes differ)."""
    one = step_metrics(train(_cfg(tmp_path, "one", steps=1, trainer={"bf16": True}), show_progress=False)["run_dir"])
    pp = step_metrics(train(_cfg(tmp_path, "pp", steps=1, trainer={"bf16": True}, backend="local", pp=2),
                            show_progress=False)["run_dir"])
    assert one[0]["sync/canary_gap"] > 1e-3  # bf16 against the fp32 engine: a real gap
    assert pp[0]["sync/canary_gap"] == pytest.approx(one[0]["sync/canary_gap"], rel=1e-5)
    assert pp[0]["loss"] == pytest.approx(one[0]["loss"], rel=2e-2)


@pytest.mark.e2e
@pytest.mark.slow
def test_pp2_with_tp2_takes_the_one_process_steps(tmp_path, single):
    got = train(_cfg(tmp_path, "pp2_tp2", steps=3, backend="local", pp=2, tp=2), show_progress=False)
    metrics = step_metrics(got["run_dir"])
    assert_same_metrics(metrics, single[1])
    assert all(m["sync/canary_gap"] <= 1e-5 for m in metrics)


@pytest.mark.e2e
@pytest.mark.parametrize("saved, resumed", [(dict(backend="local", pp=2), {}),
                                            ({}, dict(backend="local", pp=2, pp_schedule="zbv"))],
                         ids=["pp2_to_one_process", "one_process_to_pp2_zbv"])
def test_resume_on_another_pp_degree(tmp_path, saved, resumed):
    """Two steps saved on one layout, two more on another: they are the never-stopped run's (weights, AdamW state,
    the LR schedule and the sampler's state carried over). Step 4's canary reads the trainer's last stage, whose tied
    lm_head copy took step 3's update from its own AdamW state, against the engine's embedding: had the copy's state
    not come from the checkpoint, the two would differ."""
    ref = step_metrics(train(_cfg(tmp_path, "ref", steps=4), show_progress=False)["run_dir"])
    train(_cfg(tmp_path, "run", steps=2, save_every=2, **saved), show_progress=False)
    got = train(_cfg(tmp_path, "run", steps=4, save_every=2, **resumed), resume=True, show_progress=False)
    metrics = step_metrics(got["run_dir"])
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert_same_metrics(metrics[2:], ref[2:])
    assert all(m["sync/canary_gap"] <= 1e-5 for m in metrics[2:])
    _same_final(got["run_dir"], tmp_path / "ref")


@pytest.mark.unit
def test_refusals_name_parallel_pp(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel.pp=2: its stages run padded rows; set trainer.padding_free"):
        _cfg(tmp_path, "packed", trainer={"padding_free": True}, backend="local", pp=2)
    with pytest.raises(ConfigError, match=r"parallel.pp=2: its stages are data-parallel by FSDP"):
        _cfg(tmp_path, "ddp", backend="local", pp=2, dp_replicate=2, dp_mode="ddp")
    with pytest.raises(ConfigError, match=r"parallel.pp=2: LoRA is not wired with it"):
        _cfg(tmp_path, "lora", trainer={"lora": {"rank": 4}}, backend="local", pp=2)
    with pytest.raises(ConfigError, match=r"need parallel.backend=local"):
        _cfg(tmp_path, "none", pp=2)
    # every stage needs a layer: 4 layers take pp 2 x 2 stages per rank, not pp 4 x 2
    cfg = _cfg(tmp_path, "stages", backend="local", pp=4, pp_schedule="interleaved_1f1b")
    model = load_config(base_model_dir(None, cfg.model.tiny, cfg.data, tmp_path / "m"))
    with pytest.raises(ConfigError, match=r"^parallel.pp=4: interleaved_1f1b cuts the model into 8 stages, but it "
                                          r"has 4 decoder layers"):
        check_fits_model(cfg, model)
    check_fits_model(_cfg(tmp_path, "fits", backend="local", pp=4), model)  # 1f1b: 4 stages of one layer
