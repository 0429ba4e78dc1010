"""Non-finite state is never saved as a complete checkpoint, and never loaded (relayrl.checkpoint.finite; issue
36: NaN weights were saved as COMPLETE and `--resume` picked that checkpoint every time)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from relayrl.algorithms import AlgoConfig
from relayrl.checkpoint import distributed as ckpt_dist
from relayrl.checkpoint import latest_valid_checkpoint, load_distributed, save_distributed
from relayrl.checkpoint.errors import CheckpointError
from relayrl.checkpoint.finite import first_nonfinite
from relayrl.checkpoint.layout import COMPLETE_MARKER, META_FILE, SkippedCheckpoint
from relayrl.checkpoint.manifest import manifest_bytes
from relayrl.trainer.actor import Actor
from relayrl.trainer.checkpointing import load_actor, save_actor
from relayrl.trainer.config import TrainerConfig

from helpers import random_train_batch

pytestmark = pytest.mark.unit


def _actor(model):
    actor = Actor(copy.deepcopy(model), TrainerConfig(lr=1e-3, micro_batch_size=8), AlgoConfig(), total_steps=5)
    actor.update(random_train_batch(8, seed=0))  # an optimizer state to save
    return actor


def test_first_nonfinite_names_the_tensor():
    state = {"model": {"a": torch.ones(2), "b": torch.tensor([1.0, math.inf])},
             "optimizer": {"state": {"a": {"step": torch.tensor(3.0), "exp_avg": torch.tensor([math.nan])}}},
             "ints": torch.tensor([1, 2])}
    assert first_nonfinite(state) == "model.b"
    state["model"]["b"][1] = 0.0
    assert first_nonfinite(state) == "optimizer.state.a.exp_avg"
    state["optimizer"]["state"]["a"]["exp_avg"][0] = 1.0
    assert first_nonfinite(state) is None
    assert first_nonfinite({"x": [torch.zeros(0), (torch.tensor([-math.inf]),)]}) == "x.1.0"


def test_nan_weights_are_refused_before_anything_is_written(tiny_model, tmp_path):
    actor = _actor(tiny_model)
    first = save_actor(actor, tmp_path, 1, extra={"step": 1}, meta={}, keep_last=None)
    with torch.no_grad():
        actor.model.model.layers[1].mlp.up_proj.weight[3, 2] = math.nan
    with pytest.raises(CheckpointError) as e:
        save_actor(actor, tmp_path, 2, extra={"step": 2}, meta={}, keep_last=None)
    assert str(e.value) == ("refusing to save checkpoint step_00000002: its weights are not finite (NaN or inf in "
                            "model.layers.1.mlp.up_proj.weight); the last complete checkpoint in "
                            f"{tmp_path / 'checkpoints'} stays the resume point")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]  # no temp dir either
    assert latest_valid_checkpoint(tmp_path) == (first, [])


def test_a_nan_optimizer_state_is_refused_too(tiny_model, tmp_path):
    actor = _actor(tiny_model)
    p = actor.model.model.norm.weight
    actor.optimizer.state[p]["exp_avg_sq"][0] = math.inf
    with pytest.raises(CheckpointError, match=r"^refusing to save checkpoint step_00000004: its optimizer state is "
                                              r"not finite \(NaN or inf in state\.model\.norm\.weight\.exp_avg_sq\)"):
        save_actor(actor, tmp_path, 4, extra={}, meta={}, keep_last=None)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_nan_checkpoint_written_before_the_check_is_not_loaded(tiny_model, tmp_path, monkeypatch):
    actor = _actor(tiny_model)
    good = save_actor(actor, tmp_path, 1, extra={}, meta={}, keep_last=None)
    saved = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    with torch.no_grad():
        actor.model.model.embed_tokens.weight[0, 0] = math.nan
    with monkeypatch.context() as m:  # as an older relayrl wrote them: no check
        m.setattr(ckpt_dist, "first_nonfinite", lambda state: None)
        bad = save_actor(actor, tmp_path, 2, extra={}, meta={}, keep_last=None)
    fresh = Actor(copy.deepcopy(tiny_model), TrainerConfig(lr=1e-3, micro_batch_size=8), AlgoConfig(), total_steps=5)
    with pytest.raises(CheckpointError) as e:
        load_actor(fresh, bad)
    assert str(e.value) == (f"checkpoint {bad} cannot be resumed: its weights are not finite (NaN or inf in "
                            "model.embed_tokens.weight); move it out of checkpoints/ to resume from the one before it")
    load_actor(fresh, good)  # the one before loads, exactly as it was saved
    assert all(torch.equal(p, saved[n]) for n, p in fresh.model.named_parameters())


def test_plain_module_save_and_load_refuse_the_same_way(tmp_path):
    m = torch.nn.Linear(3, 2)
    save_distributed(tmp_path, 1, m, None, {})
    with torch.no_grad():
        m.bias[1] = -math.inf
    with pytest.raises(CheckpointError, match=r"^refusing to save checkpoint step_00000002: its weights are not "
                                              r"finite \(NaN or inf in bias\)"):
        save_distributed(tmp_path, 2, m, None, {})
    load_distributed(tmp_path / "checkpoints" / "step_00000001", m)
    assert torch.isfinite(m.bias).all()


def as_older_relayrl_saved_it(path):
    """meta.json without "finite" (saves were not checked), and the COMPLETE manifest over it, as an older relayrl
    wrote both."""
    meta = json.loads((path / META_FILE).read_text())
    del meta["finite"]
    (path / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    (path / COMPLETE_MARKER).write_bytes(manifest_bytes(path))


def test_resume_passes_over_nan_weights_an_older_relayrl_saved(tiny_model, tmp_path, monkeypatch):
    actor = _actor(tiny_model)
    good = save_actor(actor, tmp_path, 1, extra={}, meta={}, keep_last=None)
    assert json.loads((good / META_FILE).read_text())["finite"] is True
    older_good = save_actor(actor, tmp_path, 2, extra={}, meta={}, keep_last=None)
    as_older_relayrl_saved_it(older_good)
    assert latest_valid_checkpoint(tmp_path) == (older_good, [])  # read, and finite: taken
    with torch.no_grad():
        actor.model.model.layers[0].self_attn.q_proj.weight[1, 1] = math.inf
    with monkeypatch.context() as m:
        m.setattr(ckpt_dist, "first_nonfinite", lambda state: None)
        bad = save_actor(actor, tmp_path, 3, extra={}, meta={}, keep_last=None)
    as_older_relayrl_saved_it(bad)
    assert latest_valid_checkpoint(tmp_path) == (older_good, [SkippedCheckpoint(
        bad, "its weights are not finite (NaN or inf in model.layers.0.self_attn.q_proj.weight): an older relayrl "
             "saved them as complete")])
