"""Fault injection into checkpoints: crafted, truncated and corrupt files, and a full disk.

    world 2 (FSDP 2): save steps 1 and 2 (two shard files each), then a save whose rank 1 hits a
    file-size limit, and one whose rank 0 finds too little free space              → run_dir, references
    each test: a copy of step 2 with one file replaced, then load_distributed / export_hf

A crafted file is a pickle whose __reduce__ runs `touch MARKER` (the attack that worked on the old
checkpoints: test_payload_is_live shows it runs under pickle / torch.load(weights_only=False)). It is
put in every position of a checkpoint, with COMPLETE rewritten to match (as an attacker would, so the
parser meets it) and without (so the manifest meets it): each must be refused with one line naming the
file, and MARKER must not exist. Corrupt and truncated files give the same one line, never an EOFError /
UnpicklingError / JSONDecodeError, and latest_valid_checkpoint falls back past them. Disk-full runs in
a subprocess (and in the world-2 ranks) under RLIMIT_FSIZE with SIGXFSZ ignored, so writes fail with
EFBIG: one line naming the directory and the bytes needed, and no partial checkpoint left visible.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import resource
import shutil
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from relayrl.checkpoint import (
    CheckpointError,
    CheckpointSpaceError,
    capture_rng_state,
    export_hf,
    latest_checkpoint,
    latest_valid_checkpoint,
    list_checkpoints,
    load_distributed,
    save_checkpoint,
    save_distributed,
)
from relayrl.models import CausalLM, ModelConfig, load_pretrained, save_pretrained
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model

from dist_harness import run_distributed

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]


def tiny_model(seed: int) -> CausalLM:
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = CausalLM(cfg)
    model.reset_parameters(std=0.2, seed=seed)
    return model


def train_step(model, opt):
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    model(ids).float().log_softmax(-1)[..., 0].mean().backward()
    opt.step()


def full_params(model):
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {n: t.detach().clone() for n, t in sd.items()}


class Evil:
    """Unpickling this runs a shell command: what a crafted checkpoint file carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(Evil(marker))


def evil_torch_save(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(Evil(marker), buf)
    return buf.getvalue()


# ---------------------------------------------------------------- rank side


def _space_fault(rank: int, run_dir: str, model, opt, limit_rank: int | None, free: int | None) -> str:
    """Try to save step 3 with rank `limit_rank` under a 50 kB file-size limit, or rank 0 seeing `free` bytes."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    real_usage = shutil.disk_usage
    if rank == limit_rank:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, old_limit[1]))
    if free is not None and rank == 0:
        shutil.disk_usage = lambda p: real_usage(p)._replace(free=free)
    try:
        save_distributed(run_dir, 3, model, opt, {"step": 3})
        return "no error"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        shutil.disk_usage = real_usage


def _save_on_fsdp2(rank, world_size, run_dir, model_dir):
    dims = ParallelDims(dp_shard=2, world_size=world_size)
    model = parallelize_model(tiny_model(seed=0), dims, dims.build_mesh("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = {}
    for step in (1, 2):
        train_step(model, opt)
        extra = {"step": step, "sampler": {"epoch": 0, "position": 4 * step}, "rng": capture_rng_state()}
        save_distributed(run_dir, step, model, opt, extra, meta={"model_dir": model_dir})
        params[step] = full_params(model)
    efbig = _space_fault(rank, run_dir, model, opt, limit_rank=1, free=None)
    precheck = _space_fault(rank, run_dir, model, opt, limit_rank=None, free=1000)
    return {"params": params if rank == 0 else None, "efbig": efbig, "precheck": precheck}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from relayrl.models.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("ckpt_faults")
    build_char_tokenizer(root / "tok", "0123456789+-= ", "llama")
    model_dir = save_pretrained(tiny_model(seed=0), root / "base", tokenizer_dir=root / "tok")
    run_dir = root / "run"
    ranks = run_distributed(_save_on_fsdp2, 2, str(run_dir), str(model_dir), timeout=120)
    return {"run_dir": run_dir, "ranks": ranks, "params": ranks[0]["params"]}


# ---------------------------------------------------------------- crafting


def rewrite_manifest(ckpt: Path) -> None:
    """What an attacker who rewrites a file also does: make COMPLETE match it."""
    files = {p.name: {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())}
             for p in ckpt.iterdir() if p.name != "COMPLETE"}
    (ckpt / "COMPLETE").write_text(json.dumps({"format": "relayrl-manifest", "version": 1, "files": files}))


def craft_shard(ckpt: Path, shard: str, payload: bytes, only_bytes_items: bool) -> None:
    """Put `payload` in place of each item (or each non-tensor item) of `shard`, and point .metadata at it.
    The metadata is ours (written by the fixture), so reading it with pickle here is safe."""
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    old, new = (ckpt / shard).read_bytes(), bytearray()
    mine = sorted((i for i in meta.storage_data.items() if i[1].relative_path == shard), key=lambda i: i[1].offset)
    for index, info in mine:
        is_bytes = isinstance(meta.state_dict_metadata[index.fqn], BytesStorageMetadata)
        chunk = payload if is_bytes or not only_bytes_items else old[info.offset:info.offset + info.length]
        info.offset, info.length = len(new), len(chunk)
        new += chunk
    (ckpt / shard).write_bytes(bytes(new))
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))


def craft_metadata(ckpt: Path, marker: Path) -> None:
    """A real DCP index with the payload inside (where a path is expected)."""
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    meta.storage_meta.checkpoint_id = Evil(marker)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))


def bytes_shard(ckpt: Path) -> str:
    """The shard file holding non-tensor items (the optimizer's param_groups values)."""
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    return next(info.relative_path for index, info in meta.storage_data.items()
                if isinstance(meta.state_dict_metadata[index.fqn], BytesStorageMetadata))


def copy_step2(saved, tmp_path) -> Path:
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    shutil.copytree(saved["run_dir"] / "checkpoints" / "step_00000002", ckpt)
    return ckpt


def load(ckpt: Path, tmp_path: Path):
    model = tiny_model(seed=5)
    return load_distributed(ckpt, model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def export(ckpt: Path, tmp_path: Path):
    return export_hf(ckpt, tmp_path / "hf")


def assert_one_line_naming(err: pytest.ExceptionInfo, file: Path) -> None:
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert str(file) in msg, msg


# ---------------------------------------------------------------- tests


def test_payload_is_live(tmp_path):
    """The payload does run under the loaders the old code used, so its absence below means something."""
    pickle.loads(evil_pickle(tmp_path / "a"))
    torch.load(io.BytesIO(evil_torch_save(tmp_path / "b")), weights_only=False)
    assert (tmp_path / "a").exists() and (tmp_path / "b").exists()


POSITIONS = ["extra.json", "extra.safetensors", ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "COMPLETE"]


# (position, manifest rewritten to match?): a crafted COMPLETE is itself the manifest
CRAFTED = [(p, m) for p in POSITIONS for m in (True, False) if p != "COMPLETE" or m]


@pytest.mark.parametrize("op", [load, export])
@pytest.mark.parametrize(("position", "matching_manifest"), CRAFTED,
                         ids=[f"{p}-{'manifest-rewritten' if m else 'manifest-stale'}" for p, m in CRAFTED])
def test_crafted_file_is_refused_and_nothing_runs(saved, tmp_path, position, op, matching_manifest):
    ckpt, marker = copy_step2(saved, tmp_path), tmp_path / "MARKER"
    if position == ".metadata":
        craft_metadata(ckpt, marker)
    elif position.endswith(".distcp") and matching_manifest:
        craft_shard(ckpt, position, evil_torch_save(marker), only_bytes_items=False)
    elif position.endswith(".distcp"):
        (ckpt / position).write_bytes(evil_torch_save(marker))
    else:
        (ckpt / position).write_bytes(evil_pickle(marker))
    if matching_manifest and position != "COMPLETE":
        rewrite_manifest(ckpt)
    with pytest.raises(CheckpointError) as err:
        op(ckpt, tmp_path)
    assert_one_line_naming(err, ckpt / position)
    assert not marker.exists()
    assert not (tmp_path / "hf").exists()


def test_crafted_optimizer_values_are_loaded_weights_only(saved, tmp_path):
    """DCP stores the optimizer's param_groups values as torch.save bytes, which its own planner loads with
    weights_only=False: only those items are replaced here, every tensor stays intact."""
    ckpt, marker = copy_step2(saved, tmp_path), tmp_path / "MARKER"
    shard = bytes_shard(ckpt)
    craft_shard(ckpt, shard, evil_torch_save(marker), only_bytes_items=True)
    rewrite_manifest(ckpt)
    with pytest.raises(CheckpointError, match="cannot be loaded as data .*refused by the weights-only loader") as err:
        load(ckpt, tmp_path)
    assert_one_line_naming(err, ckpt / shard)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
@pytest.mark.parametrize("position", POSITIONS)
def test_damaged_file_is_one_line(saved, tmp_path, position, damage):
    ckpt = copy_step2(saved, tmp_path)
    file = ckpt / position
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else bytes(range(256)) * 3)
    if position != "COMPLETE":
        rewrite_manifest(ckpt)  # so the parser, not the manifest, meets the damage
    with pytest.raises(CheckpointError) as err:
        load(ckpt, tmp_path)
    assert_one_line_naming(err, file)


def test_resume_falls_back_to_newest_valid_checkpoint(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved["run_dir"], run)
    step1, step2 = list_checkpoints(run)
    assert latest_valid_checkpoint(run) == (step2, [])
    shard = step2 / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # bit rot inside a tensor: same size, only the checksum can tell
    shard.write_bytes(bytes(data))
    found, skipped = latest_valid_checkpoint(run)
    assert found == step1 and [s.path for s in skipped] == [step2]
    assert str(shard) in skipped[0].reason and "fails its checksum" in skipped[0].reason
    model = tiny_model(seed=5)
    extra = load_distributed(found, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert extra["step"] == 1 and extra["sampler"] == {"epoch": 0, "position": 4}
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), saved["params"][1][n]), n
    with pytest.raises(CheckpointError, match="fails its checksum"):
        export_hf(step2, tmp_path / "hf")  # export verifies checksums itself


def test_export_of_sound_checkpoint_matches_training(saved, tmp_path):
    out = export_hf(latest_checkpoint(saved["run_dir"]), tmp_path / "hf")
    for n, p in load_pretrained(out).named_parameters():
        assert torch.equal(p.detach(), saved["params"][2][n]), n


# ---------------------------------------------------------------- disk full


def test_disk_full_on_one_rank_is_one_line_everywhere(saved):
    for rank, r in enumerate(saved["ranks"]):
        msg = r["efbig"]
        assert msg.startswith("CheckpointSpaceError: ran out of disk space writing a checkpoint in "), (rank, msg)
        assert str(saved["run_dir"] / "checkpoints") in msg and "needs about" in msg and "\n" not in msg
        msg = r["precheck"]
        assert msg.startswith("CheckpointSpaceError: not enough disk space for a checkpoint in "), (rank, msg)
        assert str(saved["run_dir"] / "checkpoints") in msg and "1000 bytes are free" in msg and "\n" not in msg
    assert sorted(p.name for p in (saved["run_dir"] / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]


DISK_FULL = r'''
import json, resource, signal, sys
import torch
from relayrl.checkpoint import CheckpointSpaceError, save_checkpoint, save_distributed
from relayrl.models import CausalLM, ModelConfig

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
model = CausalLM(ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.ones(1, 4, dtype=torch.long)).sum().backward()
opt.step()  # AdamW state exists: the shard holds parameters, exp_avg and exp_avg_sq
cases = {  # name: (limit, save); the shard is about 420 kB, the extra's tensor 800 kB
    "dcp_shard": (100_000, lambda d, s: save_distributed(d, s, model, opt, {"step": s})),
    "own_write": (600_000, lambda d, s: save_distributed(d, s, model, opt, {"step": s, "t": torch.zeros(200_000)})),
    "single_process": (50_000, lambda d, s: save_checkpoint(d, s, {"model": model.state_dict()})),  # ~90 kB
}
out = {}
for name, (limit, save) in cases.items():
    run = f"{sys.argv[1]}/{name}"
    save(run, 1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        save(run, 2)
        out[name] = "no error"
    except CheckpointSpaceError as e:
        out[name] = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps(out))
'''


def test_disk_full_mid_write_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", DISK_FULL, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("dcp_shard", "own_write", "single_process"):
        root = tmp_path / name / "checkpoints"
        assert out[name].startswith(f"ran out of disk space writing a checkpoint in {root} (it needs about "), out
        assert "\n" not in out[name]
        assert [p.name for p in root.iterdir()] == ["step_00000001"], name  # no temp dir, no step 2
        assert latest_valid_checkpoint(tmp_path / name) == (root / "step_00000001", [])


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    model = tiny_model(0)
    good = save_distributed(tmp_path, 1, model, None, {"step": 1})
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    needed = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(CheckpointSpaceError, match=rf"in {tmp_path / 'checkpoints'}: it needs about (\d+) bytes") as e:
        save_distributed(tmp_path, 2, model, None, {"step": 2})
    assert int(re.search(r"about (\d+) bytes", str(e.value)).group(1)) >= needed
    assert "10000 bytes are free" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointSpaceError, match="not enough disk space"):
        save_checkpoint(tmp_path, 2, {"model": model.state_dict()})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]
