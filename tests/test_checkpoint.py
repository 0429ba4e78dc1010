"""Checkpoint save/load: round trip, atomicity under a crash, retention, RNG reproduction."""

import json
import random

import numpy as np
import pytest
import torch

from relayrl.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from relayrl.checkpoint import io as ckpt_io
from relayrl.checkpoint import layout as ckpt_layout
from relayrl.errors import UserError


def _trained_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):  # a few steps so AdamW has exp_avg / exp_avg_sq / step state to save
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _save_small(run_dir, step, **kwargs):
    return save_checkpoint(run_dir, step, {"x": torch.tensor([float(step)])}, {}, **kwargs)


def test_round_trip_model_and_adamw(tmp_path):
    model, opt = _trained_model_and_optimizer()
    path = save_checkpoint(
        tmp_path, 7, {"model": model.state_dict(), "optimizer": opt.state_dict()}, {"seed": 3}
    )
    assert path == tmp_path / "checkpoints" / "step_00000007"
    assert latest_checkpoint(tmp_path) == path

    state, meta = load_checkpoint(path)
    assert meta["step"] == 7 and meta["seed"] == 3 and meta["entries"] == ["model", "optimizer"]

    torch.manual_seed(123)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1["state"][k][field], s2["state"][k][field])


def test_load_selected_entries(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"a": 1, "b": 2}, {})
    state, _ = load_checkpoint(path, names=["b"])
    assert state == {"b": 2}
    with pytest.raises(UserError, match="no entries"):
        load_checkpoint(path, names=["c"])


def test_crash_in_write_keeps_previous_latest(tmp_path, monkeypatch):
    good = _save_small(tmp_path, 1)
    calls = {"n": 0}
    real_write = ckpt_io.write_synced

    def failing_write(path, data):
        calls["n"] += 1
        if calls["n"] == 3:  # the second entry: the first entry's two files are already on disk
            raise OSError("disk full")
        real_write(path, data)

    monkeypatch.setattr(ckpt_io, "write_synced", failing_write)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, {"a": torch.zeros(2), "b": torch.ones(2)}, {})
    assert latest_checkpoint(tmp_path) == good
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]


def test_crash_at_rename_leaves_only_complete_checkpoints(tmp_path, monkeypatch):
    good = _save_small(tmp_path, 1)

    def killed_rename(src, dst):
        raise KeyboardInterrupt  # stands in for a kill between writing and publishing

    monkeypatch.setattr(ckpt_layout.os, "rename", killed_rename)
    with pytest.raises(KeyboardInterrupt):
        _save_small(tmp_path, 2)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == good
    assert list_checkpoints(tmp_path) == [good]


def test_leftover_temp_and_incomplete_dirs_are_ignored_then_cleaned(tmp_path):
    good = _save_small(tmp_path, 1)
    root = tmp_path / "checkpoints"
    # What a hard kill leaves: a temp dir with a partial file, and (hand-made) a visible step dir
    # lacking its marker, e.g. copied by a user halfway.
    (root / ".tmp_step_00000002.999").mkdir()
    (root / ".tmp_step_00000002.999" / "model.pt").write_bytes(b"partial")
    (root / "step_00000003").mkdir()
    (root / "step_00000003" / "meta.json").write_text(json.dumps({"step": 3, "entries": []}))
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(UserError, match="incomplete"):
        load_checkpoint(root / "step_00000003")

    new = _save_small(tmp_path, 4)
    assert latest_checkpoint(tmp_path) == new
    assert not (root / ".tmp_step_00000002.999").exists()


def test_load_missing_checkpoint_is_user_error(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(UserError, match="does not exist"):
        load_checkpoint(tmp_path / "checkpoints" / "step_00000001")


def test_keep_last(tmp_path):
    for step in (10, 20, 30, 40):
        _save_small(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000030", "step_00000040"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000030",
        "step_00000040",
    ]
    with pytest.raises(ValueError):
        _save_small(tmp_path, 50, keep_last=0)
    # Re-saving an earlier step (resumed from it) never deletes the checkpoint just written.
    _save_small(tmp_path, 35, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000035"]


def test_resave_same_step_replaces_it(tmp_path):
    _save_small(tmp_path, 5)
    path = save_checkpoint(tmp_path, 5, {"x": torch.tensor([99.0])}, {})
    state, _ = load_checkpoint(path)
    assert state["x"].item() == 99.0
    assert list_checkpoints(tmp_path) == [path]


def test_bad_entry_name_and_meta_step(tmp_path):
    with pytest.raises(ValueError, match="entry name"):
        save_checkpoint(tmp_path, 1, {"../model": 1}, {})
    with pytest.raises(ValueError, match="disagrees"):
        save_checkpoint(tmp_path, 1, {"a": 1}, {"step": 2})


def _draws():
    return (
        random.random(),
        float(np.random.rand()),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


def test_rng_capture_restore_reproduces_draws(tmp_path):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    _draws()
    captured = capture_rng_state()
    expected = _draws()
    _draws()  # move every generator on
    # Through a checkpoint, as a resumed run would get it.
    path = save_checkpoint(tmp_path, 1, {"rng": captured}, {})
    state, _ = load_checkpoint(path)
    restore_rng_state(state["rng"])
    assert _draws() == expected
