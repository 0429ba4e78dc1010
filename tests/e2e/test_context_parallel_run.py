"""A GRPO run with context parallelism (parallel.cp = 2: the actor's and the reference's rows split over the
sequence, FSDP over dp_shard x cp) takes the one-process run's steps, by ring and by Ulysses attention; and the
settings it does not combine with are refused in one line naming parallel.cp."""

from __future__ import annotations

import dataclasses

import pytest

from relayrl.errors import ConfigError
from relayrl.jobs.base_model import base_model_dir
from relayrl.jobs.preflight import check_fits_model
from relayrl.jobs.train import train
from relayrl.models import load_config

from helpers import assert_same_metrics, cfg_for, step_metrics


def _cfg(tmp_path, name, trainer=None, **parallel):
    # a KL term (the reference model's pass goes through cp too) and a reward with spread (real advantages)
    return cfg_for(tmp_path, name, algo={"kl_coef": 0.05}, run={"steps": 2, "save_every": 0},
                   reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
                   trainer={"padding_free": False, **(trainer or {})}, parallel=parallel)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return step_metrics(train(_cfg(tmp_path_factory.mktemp("cp"), "single"), show_progress=False)["run_dir"])


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_a_cp2_run_takes_the_one_process_steps(tmp_path, single, mode):
    got = train(_cfg(tmp_path, f"cp2_{mode}", backend="local", cp=2, cp_mode=mode), show_progress=False)
    metrics = step_metrics(got["run_dir"])
    # the loss (~1e-3) is a mean of per-token terms of order 1 that cancel (advantages of both signs), so its error
    # is theirs, not a share of its small value: Ulysses' attention over half the heads per rank rounds the
    # logprobs apart by ~1e-7, which moved the loss by 1.25e-6 on a Zen 3 host (ring: 3e-7; the grad norm agreed to
    # 5e-6 of itself there)
    assert_same_metrics(metrics, single, abs_tol={"loss": 5e-6} if mode == "ulysses" else None)
    assert all(m["sync/canary_gap"] <= 1e-5 for m in metrics)  # the sync read the dp_shard x cp shards right


@pytest.mark.unit
def test_refusals_name_parallel_cp(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel.cp=2: it shards padded rows over the sequence; set "
                                         r"trainer.padding_free=false"):
        _cfg(tmp_path, "packed", trainer={"padding_free": True}, backend="local", cp=2)
    with pytest.raises(ConfigError, match=r"parallel.cp=2: its gradients are summed by FSDP"):
        _cfg(tmp_path, "ddp", backend="local", cp=2, dp_mode="ddp")
    with pytest.raises(ConfigError, match=r"need parallel.backend=local"):
        _cfg(tmp_path, "none", cp=2)
    # Ulysses over cp 4: the tiny model's 4 heads one per rank (its 2 KV heads replicated twice) fit; 3 do not
    cfg = _cfg(tmp_path, "heads", backend="local", cp=4, cp_mode="ulysses")
    model = load_config(base_model_dir(None, cfg.model.tiny, cfg.data, tmp_path / "m"))
    check_fits_model(cfg, model)  # 4 heads over 4 ranks, each KV head replicated twice: fine
    with pytest.raises(ConfigError, match=r"^parallel.cp_mode: .*3 query heads"):
        check_fits_model(cfg, dataclasses.replace(model, num_attention_heads=3, num_key_value_heads=3))
