"""Sharded checkpoints (torch.distributed.checkpoint): every rank writes its own shard, and a load
repartitions to whatever layout the model has now (FSDP 4 → FSDP 2, TP 2, or one plain process).

    run_dir/checkpoints/step_00000040/
      __0_0.distcp ... __{N-1}_0.distcp   rank r's shard of the model and optimizer state
      .metadata                           DCP's index: every tensor's global shape and which chunk
                                          (offsets x sizes) lives in which file
      extra.json  extra.safetensors       rank 0's `extra` (scheduler, sampler, RNG, ...) as data (statefile)
      meta.json                           {"step": 40, "format": "dcp", "model_dir": ..., ...}
      COMPLETE                            every file's size and CRC-32 (manifest), written last by rank 0

Why names stay layout-independent: the state dicts come from get_state_dict(model, optimizer), which
names every tensor by its fully-qualified parameter name (`model.layers.0.self_attn.q_proj.weight`,
no FSDP / TP wrapper prefixes) and keys optimizer state by that name instead of by position. The
tensors are DTensors under FSDP / TP, and DCP records each shard as a box in the global tensor; a
load asks for the boxes of the current layout and DCP reads the intersecting chunks from the files.
Two things are the layout's, not the checkpoint's: which parameters an optimizer param group holds (DCP keeps
one rank's list of names; a load keeps each rank's own, and takes each group's lr, betas, ... from the
checkpoint), and a tied model's lm_head copy on the last pipeline stage, which one process holds as the
embedding itself (one optimizer state): without entries of its own it reads the embedding's
(relayrl.checkpoint.tied). Anything the current model or optimizer wants that the checkpoint lacks is one
CheckpointError line naming it, before any shard is read.

The write, and who does what (ranks of the default process group):

    all:    any NaN or inf in any rank's state? then a CheckpointError on every rank, nothing written
            (relayrl.checkpoint.finite; a load refuses such a checkpoint the same way)
    all:    sum the state's tensor bytes over ranks (the checkpoint's expected size)
    rank 0: encode extra, clean crash leftovers, check free space, mkdir .tmp_step_X ── tell every rank ──┐
    all:    dcp.save into .tmp_step_X (each rank its shard; rank 0 .metadata)  <───────────────────────┘
    all:    CRC-32 of the own shard file (still in the page cache), gathered to every rank
    rank 0: extra.*, meta.json, COMPLETE, fsync, rename → step_X, keep_last ── tell every rank

Each rank-0-only phase ends by broadcasting its outcome, so a failure there raises on every rank
instead of leaving the others waiting in the next collective; a UserError there (no space, say) is
the same one line on every rank. Running out of space anywhere removes the temp dir and raises a
CheckpointSpaceError naming the directory and the bytes needed. The rename is the commit point
(relayrl.checkpoint.layout, shared with the single-process writer): a run killed at any moment leaves
the previous checkpoint as the latest one. All ranks must see the same filesystem (one machine, or a
shared file system across nodes).

A load reads nothing as code: meta.json and COMPLETE are JSON, extra is JSON + safetensors, DCP's index
and shard values go through relayrl.checkpoint.safe_dcp. Every file is first checked against COMPLETE
(sizes; sizes and CRC-32 with verify=True), and any fault is a CheckpointError naming the file.

RNG state is per process, but only rank 0's `extra` is kept: put capture_rng_state() in it and
restore that on every rank. A resumed run then draws from rank 0's streams everywhere — exact for
everything that uses identical draws on all ranks (the usual seeded sampling / shuffling), but not
for rank-specific randomness (e.g. dropout under data parallelism); derive such generators from
(seed, step, rank) rather than from the global RNG if a resume must reproduce them bit for bit.

This module may import torch, relayrl.parallel, relayrl.models, relayrl.config and relayrl.errors; it
must never import the trainer, engine or controller.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from relayrl.checkpoint.errors import CheckpointError, CheckpointSpaceError
from relayrl.checkpoint.finite import first_nonfinite
from relayrl.checkpoint.layout import (
    CHECKPOINTS_DIR,
    FORMAT_VERSION,
    TMP_PREFIX,
    publish,
    read_meta_file,
    remove_leftovers,
    step_dir_name,
    write_synced,
)
from relayrl.checkpoint.manifest import file_digest, verify_checkpoint
from relayrl.checkpoint.safe_dcp import SHARD_FILE, dcp_load, load_dcp_metadata
from relayrl.checkpoint.space import check_free_space, expected_bytes, is_out_of_space, out_of_space_error, state_bytes
from relayrl.checkpoint.statefile import encode_state, read_state, state_file_names
from relayrl.checkpoint.tied import plan_reads
from relayrl.errors import UserError

DCP_FORMAT = "dcp"
EXTRA_ENTRY = "extra"
MODEL_KEY = "model"  # top-level keys of the DCP state dict: "model.<fqn>", "optimizer.state.<fqn>..."
OPTIMIZER_KEY = "optimizer"

# ---------------------------------------------------------------- process-group helpers


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _all_gather(obj: Any) -> list:
    if not _distributed():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _on_rank0(fn: Callable[[], Any]) -> None:
    """Run fn on rank 0 only; every rank then raises if it failed (none waits in a later collective).
    A UserError on rank 0 is the same one line on the others (a CheckpointSpaceError when it was one, else a
    CheckpointError)."""
    error: BaseException | None = None
    if _rank() == 0:
        try:
            fn()
        except BaseException as e:  # re-raised below, after the peers are told
            error = e
    if _distributed():
        kind = "space" if isinstance(error, CheckpointSpaceError) else "user" if isinstance(error, UserError) else ""
        outcome = [None if error is None else (kind, f"{type(error).__name__}: {error}", str(error))]
        dist.broadcast_object_list(outcome, src=0)
        if error is None and outcome[0] is not None:
            kind, described, message = outcome[0]
            if kind:
                raise (CheckpointSpaceError if kind == "space" else CheckpointError)(message)
            raise RuntimeError(f"checkpoint write failed on rank 0: {described}")
    if error is not None:
        raise error


def _space_guarded(fn: Callable[[], Any], root: Path, needed: int) -> Callable[[], Any]:
    """fn, with running out of disk space turned into a CheckpointSpaceError naming `root` and `needed`."""
    def run() -> Any:
        try:
            return fn()
        except BaseException as e:
            if is_out_of_space(e):
                raise out_of_space_error(root, needed) from e
            raise
    return run


# ---------------------------------------------------------------- save


def _refuse_nonfinite(state: dict[str, Any], what: str, instead: str) -> None:
    """Collective: a CheckpointError on every rank when any rank's model or optimizer state holds a NaN or inf."""
    found = _all_gather(first_nonfinite(state))
    bad = next(((r, name) for r, name in enumerate(found) if name is not None), None)
    if bad is not None:
        rank, name = bad
        kind = "weights are" if name.startswith(f"{MODEL_KEY}.") else "optimizer state is"
        raise CheckpointError(f"{what}: its {kind} not finite (NaN or inf in {name.split('.', 1)[1]}"
                              f"{f' on rank {rank}' if len(found) > 1 else ''}); {instead}")


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {MODEL_KEY: get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {MODEL_KEY: model_sd, OPTIMIZER_KEY: optim_sd}


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

    `extra`: run state as data — nested dict / list / tuple / str / int / float / bool / None /
    torch.Tensor / numpy.ndarray (e.g. step, sampler and scheduler state dicts, capture_rng_state(),
    a generator's get_state()); rank 0's is kept. Anything else is a TypeError naming its key path,
    raised before any shard is written.
    `meta`: JSON-serializable; store the base model directory as meta["model_dir"] so that
    `relayrl export` finds the config and tokenizer (a relative path is made absolute).
    `keep_last`: after the new checkpoint is in place, delete all but the newest `keep_last`.
    Returns the final checkpoint directory (the same path on every rank). Not enough disk space,
    before or during the write, is a CheckpointSpaceError on every rank and leaves no partial checkpoint.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    meta = dict(meta or {})
    if meta.get("step", step) != step:
        raise ValueError(f"meta['step']={meta['step']} disagrees with step={step}")
    if meta.get("model_dir") is not None:
        meta["model_dir"] = str(Path(meta["model_dir"]).resolve())
    world = dist.get_world_size() if _distributed() else 1
    # "finite": the state was checked for NaN and inf below (a save fails otherwise), so a resume need not read it
    full_meta = {**meta, "step": step, "format_version": FORMAT_VERSION, "format": DCP_FORMAT,
                 "world_size": world, "has_optimizer": optimizer is not None, "entries": [EXTRA_ENTRY], "finite": True}
    # Serialized before any shard is written: a non-JSON meta fails on every rank right here.
    meta_bytes = (json.dumps(full_meta, indent=2, sort_keys=True) + "\n").encode()

    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{final.name}"  # no pid suffix: every rank must agree on the name
    state = _state(model, optimizer)
    # NaN or inf weights would make a COMPLETE checkpoint that every resume picks: refused before anything is written
    _refuse_nonfinite(state, f"refusing to save checkpoint {final.name}",
                      f"the last complete checkpoint in {root} stays the resume point")
    sizes = _all_gather(state_bytes(state))
    needed = expected_bytes(sum(b for b, _ in sizes), sum(n for _, n in sizes), len(meta_bytes) + (64 << 10))
    extra_files: dict[str, bytes] = {}

    def prepare() -> None:
        # An extra that is not data fails here, before any shard is written.
        extra_files.update(zip(state_file_names(EXTRA_ENTRY), encode_state(dict(extra or {}), EXTRA_ENTRY),
                               strict=True))
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
        check_free_space(root, needed + sum(len(b) for b in extra_files.values()))
        tmp.mkdir()

    _on_rank0(_space_guarded(prepare, root, needed))

    try:
        with warnings.catch_warnings():
            if not _distributed():  # one process holds every shard: the intended case, which DCP warns about
                warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=not _distributed())
    except BaseException as e:
        # DCP gathers write errors to every rank, so all ranks are here together.
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if is_out_of_space(e):
            raise out_of_space_error(root, needed) from e
        raise
    del state
    try:  # read back right after the write, from the page cache; a failure is reported by rank 0 below
        mine: dict | str = {p.name: file_digest(p) for p in sorted(tmp.glob(f"__{_rank()}_*.distcp"))}
    except OSError as e:
        mine = f"rank {_rank()} could not read back its shard: {e}"
    digests = _all_gather(mine)

    def commit() -> None:
        try:
            failed = [d for d in digests if isinstance(d, str)]
            if failed:
                raise RuntimeError(failed[0])
            for name, data in extra_files.items():
                write_synced(tmp / name, data)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish(tmp, final, meta_bytes, keep_last, {k: v for d in digests for k, v in d.items()})

    _on_rank0(_space_guarded(commit, root, needed))
    return final


# ---------------------------------------------------------------- load


class CheckpointContents(NamedTuple):
    """The small files of a sharded checkpoint, parsed and checked: meta.json, DCP's index, rank 0's extra."""

    meta: dict[str, Any]
    index: Metadata
    extra: dict[str, Any]


def open_checkpoint(path: str | os.PathLike[str], *, checksums: bool = False) -> CheckpointContents:
    """Check a sharded checkpoint's files against COMPLETE (sizes; CRC-32 too with `checksums`) and parse
    every file but the shards (which dcp_load reads as data). A CheckpointError naming the file at fault
    for anything missing, truncated, corrupt or crafted."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; pick one under RUN_DIR/{CHECKPOINTS_DIR}/")
    files = verify_checkpoint(path, checksums=checksums)
    meta = read_meta_file(path)
    if meta.get("format") != DCP_FORMAT:
        raise CheckpointError(f"checkpoint {path} is a single-process checkpoint (save_checkpoint), not a sharded "
                              "one: read it with relayrl.checkpoint.load_checkpoint")
    index = load_dcp_metadata(path, {n for n in files if SHARD_FILE.match(n)})
    extra = read_state(path, EXTRA_ENTRY)
    if type(extra) is not dict:
        raise CheckpointError(f"checkpoint file {path / state_file_names(EXTRA_ENTRY)[0]} does not hold a dict")
    return CheckpointContents(meta, index, extra)


def saved_nonfinite(path: str | os.PathLike[str]) -> str | None:
    """The first weight of sharded checkpoint `path` holding a NaN or inf, or None. A checkpoint saved since saves
    are checked says so in meta.json ("finite") and is not read; an older one is read as data, one tensor at a
    time, so that a resume passes over NaN weights an older relayrl saved as complete."""
    path = Path(path)
    meta, index, _ = open_checkpoint(path)
    if meta.get("finite") is True:
        return None
    for key, entry in index.state_dict_metadata.items():
        if not (key.startswith(f"{MODEL_KEY}.") and isinstance(entry, TensorStorageMetadata)
                and entry.properties.dtype.is_floating_point):
            continue
        name = key[len(MODEL_KEY) + 1:]
        t = torch.empty(entry.size, dtype=entry.properties.dtype)
        dcp_load({MODEL_KEY: {name: t}}, path, index, no_dist=True)
        if not bool(torch.isfinite(t).all()):
            return name
    return None


def read_meta(path: str | os.PathLike[str], *, checksums: bool = False) -> dict[str, Any]:
    """meta.json of a complete, sound distributed checkpoint; a one-line CheckpointError for anything else."""
    return open_checkpoint(path, checksums=checksums).meta


def check_model_entries(path: Path, model_sd: Mapping[str, Any], index: Metadata) -> None:
    """Every tensor the model wants is in the checkpoint's index, with its global shape (else one CheckpointError)."""
    saved = index.state_dict_metadata
    for fqn, tensor in model_sd.items():
        entry = saved.get(f"{MODEL_KEY}.{fqn}")
        if not isinstance(entry, TensorStorageMetadata):
            have = sorted(k[len(MODEL_KEY) + 1:] for k in saved if k.startswith(MODEL_KEY + "."))
            raise CheckpointError(f"checkpoint {path} has no tensor {fqn!r} (it has {len(have)} model tensors, "
                                  f"e.g. {have[:3]}): it was saved from a different model")
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {path}: {fqn!r} has shape {tuple(entry.size)}, the model's is "
                                  f"{tuple(tensor.shape)}: the model config differs from the saved run's")


def check_optimizer_entries(path: Path, optim_sd: Mapping[str, Any], index: Metadata) -> None:
    """Every optimizer state tensor and hyperparameter the optimizer wants is in the checkpoint's index (else one
    CheckpointError)."""
    saved = index.state_dict_metadata
    for i, group in enumerate(optim_sd["param_groups"]):
        missing = sorted(k for k in group if k != "params" and f"{OPTIMIZER_KEY}.param_groups.{i}.{k}" not in saved)
        if missing:
            raise CheckpointError(f"checkpoint {path} has no {missing} for optimizer param group {i}: it was saved "
                                  "with another optimizer or other param groups")
    for fqn, fields in optim_sd["state"].items():
        for field, value in fields.items():
            if isinstance(value, torch.Tensor) and f"{OPTIMIZER_KEY}.state.{fqn}.{field}" not in saved:
                raise CheckpointError(f"checkpoint {path} has no optimizer state {field!r} for {fqn!r}: it was saved "
                                      "from a different model or optimizer, or without that parameter training")


def load_distributed(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = False,
) -> dict[str, Any]:
    """Collective when a process group exists: load model (and optimizer) state into the CURRENT
    layout, whatever layout wrote it; return the `extra` dict rank 0 saved.

    Optimizer hyperparameters (lr, betas, ...) come from the checkpoint, as with load_state_dict.
    Every file is checked against COMPLETE first (sizes; CRC-32 too with `verify`, which reads the
    whole checkpoint: latest_valid_checkpoint already did that for a resume) and parsed as data only.
    """
    path = Path(path)
    meta, index, extra = open_checkpoint(path, checksums=verify)
    if optimizer is not None and not meta.get("has_optimizer", True):
        raise UserError(f"checkpoint {path} holds no optimizer state; load it without an optimizer")
    state = _state(model, optimizer)
    # a tied weight's copy without entries of its own reads the embedding's (relayrl.checkpoint.tied)
    request, after_load = plan_reads(path, model, state, index.state_dict_metadata)
    check_model_entries(path, request[MODEL_KEY], index)
    if optimizer is not None:
        check_optimizer_entries(path, request[OPTIMIZER_KEY], index)
    # which parameters a group holds is this layout's (DCP kept one rank's list of names): ours are put back
    groups = [g["params"] for g in state[OPTIMIZER_KEY]["param_groups"]] if optimizer is not None else []
    # DCP reads, for each tensor, the saved chunks that overlap this rank's shard, into it in place.
    dcp_load(request, path, index, no_dist=not _distributed())
    after_load()
    # a checkpoint written before saves were checked may hold NaN weights: they would train NaN from here on
    _refuse_nonfinite(state, f"checkpoint {path} cannot be resumed",
                      "move it out of checkpoints/ to resume from the one before it")
    if optimizer is None:
        set_model_state_dict(model, state[MODEL_KEY])
    else:
        for group, params in zip(state[OPTIMIZER_KEY]["param_groups"], groups, strict=True):
            group["params"] = params
        set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY], optim_state_dict=state[OPTIMIZER_KEY])
    return extra
