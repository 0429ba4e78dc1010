"""Checkpoint save/load: round trip, atomicity under a crash, retention, RNG reproduction; the data-only
run-state format (every kind round-trips with its type, anything else is refused by key path); the COMPLETE
manifest (sizes and CRC-32) and the fallback to the newest checkpoint that passes it."""

import json
import math
import random
import zlib
from collections import OrderedDict

import numpy as np
import pytest
import torch

from relayrl.checkpoint import (
    CheckpointError,
    SkippedCheckpoint,
    capture_rng_state,
    latest_checkpoint,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)
from relayrl.checkpoint import io as ckpt_io
from relayrl.checkpoint import layout as ckpt_layout
from relayrl.errors import UserError

pytestmark = pytest.mark.unit


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
    loaded = state["rng"]
    # random.setstate needs a tuple holding a tuple; numpy's state holds a uint32 ndarray
    assert type(loaded["python"]) is tuple and type(loaded["python"][1]) is tuple
    assert loaded["python"] == captured["python"]
    assert type(loaded["numpy"][1]) is np.ndarray and loaded["numpy"][1].dtype == np.uint32
    assert all(_same(a, b) for a, b in zip(loaded["numpy"], captured["numpy"], strict=True))
    restore_rng_state(loaded)
    assert _draws() == expected
    with pytest.raises(CheckpointError, match="RNG state is malformed"):
        restore_rng_state({**loaded, "python": [3, list(loaded["python"][1]), None]})


# ---------------------------------------------------------------- the run-state format


def _same(a, b) -> bool:
    """Equal values of identical types, all the way down (nan equals nan; tensors by dtype and value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_state_format_round_trips_every_kind(tmp_path):
    value = {
        "scalars": [None, True, False, 0, -7, 2**70, 0.1, -0.0, float("nan"), float("inf"), float("-inf"), "ü$"],
        "nested": (1, (2, [3, {"k": (4,)}]), ()),
        "int_keys": {0: "a", 5: {"deep": [1.5]}, (1, 2): None},
        "$dollar": {"$tensor": "not a tag"},  # a key that looks like a tag must stay data
        "tensors": [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor(3, dtype=torch.int64),
                    torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.tensor([True, False]),
                    torch.zeros(0, 4), torch.Generator().manual_seed(5).get_state()],
        "arrays": [np.arange(12, dtype=np.uint32).reshape(3, 4), np.array([0.25, -1e300]), np.zeros((0,), np.int8)],
    }
    path = save_checkpoint(tmp_path, 1, {"s": value, "od": OrderedDict(a=1, b=torch.ones(2))})
    state, _ = load_checkpoint(path)
    assert _same(state["s"], value)
    assert _same(state["od"], {"a": 1, "b": torch.ones(2)})  # a dict subclass comes back as a dict
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "meta.json", "od.json", "od.safetensors",
                                                       "s.json", "s.safetensors"]


@pytest.mark.parametrize(("bad", "path", "kind"), [
    ({"a": [1, lambda: 0]}, r"state\['a'\]\[1\]", "builtins.function"),
    ({"a": {"b": object()}}, r"state\['a'\]\['b'\]", "builtins.object"),
    ({"n": np.float64(1.0)}, r"state\['n'\]", "numpy.float64"),
    ({"b": b"raw"}, r"state\['b'\]", "builtins.bytes"),
    ({"s": {1, 2}}, r"state\['s'\]", "builtins.set"),
    ({"c": torch.zeros(2, dtype=torch.complex64)}, r"state\['c'\]", "complex64"),
    ({"o": np.array([object()])}, r"state\['o'\]", "dtype object"),
])
def test_state_format_refuses_what_is_not_data(tmp_path, bad, path, kind):
    with pytest.raises(TypeError, match=rf"^{path}: cannot store a .*{kind}"):
        save_checkpoint(tmp_path, 1, {"state": bad})
    assert not (tmp_path / "checkpoints").exists()  # refused before any file or directory


def test_run_extra_round_trips_and_continues(tmp_path):
    """The run's extra (step, prompt sampler, RNG, LambdaLR, generator) resumes the same streams."""
    from relayrl.data import Example
    from relayrl.data.sampler import PromptSampler
    from relayrl.trainer.config import TrainerConfig
    from relayrl.trainer.optim import build_optimizer

    cfg = TrainerConfig(lr=1e-2, warmup_steps=2, schedule="cosine")

    def parts():
        model = torch.nn.Linear(2, 2)
        sampler = PromptSampler([Example(str(i), str(i)) for i in range(5)], seed=3)
        return model, *build_optimizer(model, cfg, total_steps=10), sampler, torch.Generator().manual_seed(9)

    model, opt, sched, sampler, gen = parts()
    for _ in range(3):
        opt.step()
        sched.step()
        sampler.next_batch(2)
        torch.randperm(4, generator=gen)
    extra = {"step": 3, "sampler": sampler.state_dict(), "rng": capture_rng_state(),
             "scheduler": sched.state_dict(), "shuffle": gen.get_state()}
    path = save_checkpoint(tmp_path, 3, {"extra": extra})
    loaded = load_checkpoint(path)[0]["extra"]
    assert _same(loaded, extra)

    model2, opt2, sched2, sampler2, gen2 = parts()
    sched2.load_state_dict(loaded["scheduler"])
    sampler2.load_state_dict(loaded["sampler"])
    gen2.set_state(loaded["shuffle"])
    for _ in range(4):  # the resumed parts continue exactly like the originals
        opt.step(), sched.step(), opt2.step(), sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()
        assert [e.prompt for e in sampler2.next_batch(2)] == [e.prompt for e in sampler.next_batch(2)]
        assert torch.equal(torch.randperm(8, generator=gen2), torch.randperm(8, generator=gen))


@pytest.mark.parametrize(("file", "text", "reason"), [
    ("x.json", b"\x80\x04\x95 not json", "x.json is not valid JSON"),
    ("x.json", b'{"format": "other", "value": 1}', "x.json is not a relayrl state file"),
    ("x.json", b'{"format": "relayrl-state", "version": 1, "value": {"$eval": "1"}}', "unknown tagged object"),
    ("x.json", b'{"format": "relayrl-state", "version": 1, "value": {"$tensor": "7"}}', "tensor '7'"),
    ("x.json", b'{"format": "relayrl-state", "version": 1, "value": {"$ndarray": {"dtype": "|O", "shape": [1], '
               b'"tensor": "0"}}}', "unsupported dtype '|O'"),
    ("x.safetensors", b"\x80\x04\x95 pickle", "x.safetensors is not a valid safetensors file"),
])
def test_state_format_refuses_malformed_files(tmp_path, file, text, reason):
    path = save_checkpoint(tmp_path, 1, {"x": {"t": torch.ones(1)}})
    (path / file).write_bytes(text)
    (path / "COMPLETE").write_bytes(_manifest_of(path))  # as a crafter would: sizes and checksums match
    with pytest.raises(CheckpointError, match=reason) as err:
        load_checkpoint(path)
    assert "\n" not in str(err.value) and str(path / "x.") in str(err.value)


# ---------------------------------------------------------------- the COMPLETE manifest


def _manifest_of(path):
    files = {p.name: {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())}
             for p in path.iterdir() if p.name != "COMPLETE"}
    return json.dumps({"format": "relayrl-manifest", "version": 1, "files": files}).encode()


def test_manifest_lists_every_file_with_size_and_crc32(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"m": {"w": torch.randn(100)}}, {"note": "x"})
    assert json.loads((path / "COMPLETE").read_bytes()) == json.loads(_manifest_of(path))
    assert set(json.loads((path / "COMPLETE").read_bytes())["files"]) == {"m.json", "m.safetensors", "meta.json"}


def test_verify_finds_each_kind_of_damage(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"m": {"w": torch.randn(100)}})
    assert set(verify_checkpoint(path)) == {"m.json", "m.safetensors", "meta.json"}
    blob = path / "m.safetensors"
    good = blob.read_bytes()
    blob.write_bytes(good[:-10])
    with pytest.raises(CheckpointError, match=r"m.safetensors has \d+ bytes, COMPLETE says \d+: it was truncated"):
        verify_checkpoint(path, checksums=False)
    flipped = bytearray(good)
    flipped[-5] ^= 1
    blob.write_bytes(bytes(flipped))
    verify_checkpoint(path, checksums=False)  # same size: only the checksum can tell
    with pytest.raises(CheckpointError, match="m.safetensors fails its checksum"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="m.safetensors fails its checksum"):
        load_checkpoint(path, verify=True)
    blob.write_bytes(good)
    (path / "extra.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="extra.pt is not listed in COMPLETE"):
        load_checkpoint(path)
    (path / "extra.pt").unlink()
    blob.unlink()
    with pytest.raises(CheckpointError, match="m.safetensors is missing"):
        load_checkpoint(path)
    for marker, reason in [(b"", "is empty: .* older relayrl"), (b"{not json", "COMPLETE is not valid JSON")]:
        (path / "COMPLETE").write_bytes(marker)
        with pytest.raises(CheckpointError, match=reason):
            load_checkpoint(path)


def test_latest_valid_checkpoint_skips_damaged_ones_with_reasons(tmp_path):
    paths = [save_checkpoint(tmp_path, s, {"x": {"t": torch.full((50,), float(s))}}) for s in (1, 2, 3, 4, 5)]
    assert latest_valid_checkpoint(tmp_path) == (paths[-1], [])
    t = paths[4] / "x.safetensors"
    t.write_bytes(t.read_bytes()[:-8])  # 5: truncated
    data = bytearray((paths[3] / "x.safetensors").read_bytes())
    data[-1] ^= 0xFF  # 4: bit rot
    (paths[3] / "x.safetensors").write_bytes(bytes(data))
    (paths[2] / "meta.json").write_text("{")  # 3: bad JSON, with a manifest that matches it
    (paths[2] / "COMPLETE").write_bytes(_manifest_of(paths[2]))
    (paths[1] / "COMPLETE").unlink()  # 2: no marker
    found, skipped = latest_valid_checkpoint(tmp_path)
    assert found == paths[0]
    assert [s.path for s in skipped] == paths[:0:-1]
    reasons = [s.reason for s in skipped]
    assert "x.safetensors has" in reasons[0] and "truncated" in reasons[0]
    assert "x.safetensors fails its checksum" in reasons[1]
    assert "meta.json is not valid JSON" in reasons[2]
    assert "no COMPLETE marker" in reasons[3]
    assert all("\n" not in r for r in reasons)
    assert load_checkpoint(found)[0]["x"]["t"][0].item() == 1.0
    (paths[0] / "x.json").write_bytes(b"")
    assert latest_valid_checkpoint(tmp_path)[0] is None
    assert isinstance(latest_valid_checkpoint(tmp_path)[1][-1], SkippedCheckpoint)
