"""Sharded checkpoints (torch.distributed.checkpoint): every rank writes its own shard, and a load
repartitions to whatever layout the model has now (FSDP 4 → FSDP 2, TP 2, or one plain process).

    run_dir/checkpoints/step_00000040/
      __0_0.distcp ... __{N-1}_0.distcp   rank r's shard of the model and optimizer state
      .metadata                           DCP's index: every tensor's global shape and which chunk
                                          (offsets x sizes) lives in which file
      extra.pt                            rank 0's `extra` (scheduler, sampler, RNG, ...), torch.save
      meta.json                           {"step": 40, "format": "dcp", "model_dir": ..., ...}
      COMPLETE                            written last, by rank 0 after every shard is on disk

Why names stay layout-independent: the state dicts come from get_state_dict(model, optimizer), which
names every tensor by its fully-qualified parameter name (`model.layers.0.self_attn.q_proj.weight`,
no FSDP / TP wrapper prefixes) and keys optimizer state by that name instead of by position. The
tensors are DTensors under FSDP / TP, and DCP records each shard as a box in the global tensor; a
load asks for the boxes of the current layout and DCP reads the intersecting chunks from the files.

The write, and who does what (ranks of the default process group):

    rank 0: clean crash leftovers, mkdir .tmp_step_X ── tell every rank ok / error ──┐
    all:    dcp.save into .tmp_step_X (each rank its shard; rank 0 .metadata)  <────┘
    rank 0: extra.pt, meta.json, COMPLETE, fsync, rename → step_X, keep_last ── tell every rank

Each rank-0-only phase ends by broadcasting its outcome, so a failure there raises on every rank
instead of leaving the others waiting in the next collective. The rename is the commit point, as in
relayrl.checkpoint.io (same directory names, `list_checkpoints` / `latest_checkpoint` see these
checkpoints too): a run killed at any moment leaves the previous checkpoint as the latest one.
All ranks must see the same filesystem (one machine, or a shared file system across nodes).

RNG state is per process, but only rank 0's `extra` is kept: put capture_rng_state() in it and
restore that on every rank. A resumed run then draws from rank 0's streams everywhere — exact for
everything that uses identical draws on all ranks (the usual seeded sampling / shuffling), but not
for rank-specific randomness (e.g. dropout under data parallelism); derive such generators from
(seed, step, rank) rather than from the global RNG if a resume must reproduce them bit for bit.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from relayrl.checkpoint.io import (  # the private helpers too: one on-disk protocol for both writers
    _TMP_PREFIX,
    CHECKPOINTS_DIR,
    COMPLETE_MARKER,
    FORMAT_VERSION,
    META_FILE,
    _remove_leftovers,
    _step_dir_name,
    _write_synced,
    list_checkpoints,
    publish,
)
from relayrl.errors import UserError

DCP_FORMAT = "dcp"
EXTRA_FILE = "extra.pt"
MODEL_KEY = "model"  # top-level keys of the DCP state dict: "model.<fqn>", "optimizer.state.<fqn>..."
OPTIMIZER_KEY = "optimizer"

# ---------------------------------------------------------------- process-group helpers


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _dcp(fn: Callable, state: dict, **kw) -> None:
    """dcp.save / dcp.load; without a process group, one process holds every shard (DCP says so in a
    warning on each call, which is the intended case here, so it is silenced)."""
    no_dist = not _distributed()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        fn(state, no_dist=no_dist, **kw)


def _is_rank0() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _on_rank0(fn: Callable[[], Any]) -> None:
    """Run fn on rank 0 only; every rank then raises if it failed (none waits in a later collective)."""
    error: BaseException | None = None
    if _is_rank0():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the peers are told
            error = e
    if _distributed():
        outcome = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(outcome, src=0)
        if error is None and outcome[0] is not None:
            raise RuntimeError(f"checkpoint write failed on rank 0: {outcome[0]}")
    if error is not None:
        raise error


# ---------------------------------------------------------------- save


def save_distributed(
    run_dir: str | os.PathLike[str],
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: Mapping[str, Any] | None = None,
    *,
    meta: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Collective: every rank calls it with its own (sharded) model and optimizer.

    `extra`: picklable run state (scheduler, sampler position, RNG, ...); rank 0's is kept.
    `meta`: JSON-serializable; store the base model directory as meta["model_dir"] so that
    `relayrl export` finds the config and tokenizer (a relative path is made absolute).
    `keep_last`: after the new checkpoint is in place, delete all but the newest `keep_last`.
    Returns the final checkpoint directory (the same path on every rank).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    meta = dict(meta or {})
    if meta.get("step", step) != step:
        raise ValueError(f"meta['step']={meta['step']} disagrees with step={step}")
    if meta.get("model_dir") is not None:
        meta["model_dir"] = str(Path(meta["model_dir"]).resolve())
    world = dist.get_world_size() if _distributed() else 1
    full_meta = {**meta, "step": step, "format_version": FORMAT_VERSION, "format": DCP_FORMAT,
                 "world_size": world, "has_optimizer": optimizer is not None, "entries": ["extra"]}
    # Serialized before any shard is written: a non-JSON meta fails on every rank right here.
    meta_bytes = (json.dumps(full_meta, indent=2, sort_keys=True) + "\n").encode()

    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / _step_dir_name(step)
    tmp = root / f"{_TMP_PREFIX}{final.name}"  # no pid suffix: every rank must agree on the name
    extra_buf = io.BytesIO()

    def prepare() -> None:
        torch.save(dict(extra or {}), extra_buf)  # an unpicklable extra fails before the shards
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp.mkdir()

    _on_rank0(prepare)

    if optimizer is None:
        state = {MODEL_KEY: get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {MODEL_KEY: model_sd, OPTIMIZER_KEY: optim_sd}
    try:
        _dcp(dcp.save, state, storage_writer=FileSystemWriter(tmp, sync_files=True))
    except BaseException:
        # DCP gathers write errors to every rank, so all ranks are here together.
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    del state

    def commit() -> None:
        try:
            _write_synced(tmp / EXTRA_FILE, lambda f: f.write(extra_buf.getvalue()))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish(tmp, final, meta_bytes, keep_last)

    _on_rank0(commit)
    return final


# ---------------------------------------------------------------- load


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """meta.json of a complete distributed checkpoint; a clear UserError for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint {path} does not exist; pick one under RUN_DIR/{CHECKPOINTS_DIR}/")
    if not ((path / COMPLETE_MARKER).is_file() and (path / META_FILE).is_file()):
        raise UserError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} or {META_FILE}); it was "
                        "interrupted while being written: use an earlier one")
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format") != DCP_FORMAT:
        raise UserError(f"checkpoint {path} is a single-process checkpoint (save_checkpoint), not a sharded "
                        "one: read it with relayrl.checkpoint.load_checkpoint")
    return meta


def check_model_entries(path: Path, model_sd: Mapping[str, Any]) -> None:
    """Every tensor the model wants is in the checkpoint, with the same global shape (else UserError)."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    for fqn, tensor in model_sd.items():
        entry = saved.get(f"{MODEL_KEY}.{fqn}")
        if not isinstance(entry, TensorStorageMetadata):
            have = sorted(k[len(MODEL_KEY) + 1:] for k in saved if k.startswith(MODEL_KEY + "."))
            raise UserError(f"checkpoint {path} has no tensor {fqn!r} (it has {len(have)} model tensors, e.g. "
                            f"{have[:3]}): it was saved from a different model")
        if tuple(entry.size) != tuple(tensor.shape):
            raise UserError(f"checkpoint {path}: {fqn!r} has shape {tuple(entry.size)}, the model's is "
                            f"{tuple(tensor.shape)}: the model config differs from the saved run's")


def load_distributed(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Collective when a process group exists: load model (and optimizer) state into the CURRENT
    layout, whatever layout wrote it; return the `extra` dict rank 0 saved.

    Optimizer hyperparameters (lr, betas, ...) come from the checkpoint, as with load_state_dict.
    extra.pt is unpickled (weights_only=False: it holds RNG states): load only your own runs'.
    """
    path = Path(path)
    meta = read_meta(path)
    if optimizer is not None and not meta.get("has_optimizer", True):
        raise UserError(f"checkpoint {path} holds no optimizer state; load it without an optimizer")
    if optimizer is None:
        state = {MODEL_KEY: get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {MODEL_KEY: model_sd, OPTIMIZER_KEY: optim_sd}
    check_model_entries(path, state[MODEL_KEY])
    # DCP reads, for each tensor, the saved chunks that overlap this rank's shard, into it in place.
    _dcp(dcp.load, state, storage_reader=FileSystemReader(path))
    if optimizer is None:
        set_model_state_dict(model, state[MODEL_KEY])
    else:
        set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY],
                       optim_state_dict=state[OPTIMIZER_KEY])
    return torch.load(path / EXTRA_FILE, map_location="cpu", weights_only=False)
