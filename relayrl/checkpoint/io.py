"""Checkpoints of a run: run_dir/checkpoints/step_{step:08d}/ with one file per state entry.

    step_00000040/
      model.pt  optimizer.pt  scheduler.pt  rng.pt ...   one torch.save per entry of `state`
      meta.json                                          {"step": 40, "entries": [...], ...}
      COMPLETE                                           written last

A checkpoint is written under a hidden temporary name (.tmp_step_...), every file is fsynced, and
only then is the directory renamed to step_XXXXXXXX. Rename is atomic, so a run killed at any point
leaves either the complete new checkpoint or none — never a half-written one under a visible name.
Old checkpoints are removed only after the new one is in place, and are first renamed to a hidden
name, so a kill during deletion cannot leave a partial checkpoint that looks complete either.

The COMPLETE marker is redundant with the rename in this single-process writer; it is kept because
the sharded (torch.distributed.checkpoint) writer that will grow from this API has many ranks
writing into one directory, where "complete" is a marker rank 0 writes after a barrier.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from relayrl.errors import UserError

CHECKPOINTS_DIR = "checkpoints"
META_FILE = "meta.json"
COMPLETE_MARKER = "COMPLETE"
FORMAT_VERSION = 1
_TMP_PREFIX = ".tmp_"
_TRASH_PREFIX = ".trash_"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_ENTRY_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory holding the entry is synced. Windows cannot open
    # a directory for fsync; there the rename itself is the best available guarantee.
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _remove_hidden(path: Path) -> None:
    """Renames a directory to a hidden trash name, then deletes it (see module docstring)."""
    trash = path.parent / f"{_TRASH_PREFIX}{path.name}.{os.getpid()}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    # Temp and trash directories can only be left by a writer that was killed: this one is the
    # only writer of the run's checkpoints, so anything hidden here is garbage from a crash.
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(child, ignore_errors=True)


def _is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and (path / META_FILE).is_file()


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints of the run, oldest step first; temp and incomplete dirs are ignored."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and _is_complete(child):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step, or None when the run has none."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    state: Mapping[str, object],
    meta: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Writes `state` (name -> picklable object, typically state dicts) as checkpoint `step`.

    `meta` must be JSON-serializable (config, data position, ...); `step` is added to it.
    `keep_last`: after the new checkpoint is in place, delete all but the newest `keep_last`.
    Returns the final checkpoint directory.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    for name in state:
        # Entry names become file names: no separators (every file stays inside the checkpoint)
        # and no leading dot (hidden names are reserved for temp and trash directories).
        if not _ENTRY_NAME.match(name):
            raise ValueError(f"checkpoint entry name {name!r} must be a plain file-name stem")
    meta = dict(meta or {})
    if meta.get("step", step) != step:
        raise ValueError(f"meta['step']={meta['step']} disagrees with step={step}")

    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final = root / _step_dir_name(step)
    tmp = root / f"{_TMP_PREFIX}{final.name}.{os.getpid()}"
    # Serialize meta first: a non-JSON value then fails before any large file is written.
    full_meta = {**meta, "step": step, "format_version": FORMAT_VERSION, "entries": list(state)}
    meta_bytes = (json.dumps(full_meta, indent=2, sort_keys=True) + "\n").encode()
    tmp.mkdir()
    try:
        for name, obj in state.items():
            _write_synced(tmp / f"{name}.pt", lambda f, obj=obj: torch.save(obj, f))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, final, meta_bytes, keep_last)


def publish(tmp: Path, final: Path, meta_bytes: bytes, keep_last: int | None) -> Path:
    """The one way a checkpoint becomes visible (both writers): meta.json and the COMPLETE marker
    into the filled temp dir, fsync, rename to `final`, then prune to `keep_last`."""
    root = final.parent
    try:
        _write_synced(tmp / META_FILE, lambda f: f.write(meta_bytes))
        _write_synced(tmp / COMPLETE_MARKER, lambda f: None)
        _fsync_dir(tmp)
        if final.exists():
            # Re-saving a step (a run resumed from an earlier checkpoint reaches it again): the old
            # copy must go before the rename; meanwhile the older checkpoints stay valid.
            _remove_hidden(final)
        os.rename(tmp, final)
    except BaseException:
        # An error we can see (disk full, unpicklable entry) cleans up; a hard kill leaves the
        # temp dir, which is hidden from latest_checkpoint and removed by the next save.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)

    if keep_last is not None:
        # The checkpoint just written always stays, even when a higher step exists (left by a run
        # that went further before this one resumed from an earlier step); the rest go oldest first.
        others = [p for p in list_checkpoints(root.parent) if p != final]
        for old in others[: max(len(others) - (keep_last - 1), 0)]:
            _remove_hidden(old)
    return final


def load_checkpoint(
    path: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    map_location: str | torch.device | None = "cpu",
) -> tuple[dict[str, object], dict[str, Any]]:
    """Reads a checkpoint directory back as (state, meta); `names` limits which entries load.

    Entries are loaded with torch.load(weights_only=False): they hold optimizer state and RNG
    states (numpy arrays, Python tuples) that the weights-only unpickler rejects. Unpickling can
    run code, so load only checkpoints your own runs wrote. Tensors land on `map_location` (CPU by
    default, so a GPU run's checkpoint opens anywhere; load_state_dict moves them into place).
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(
            f"checkpoint {path} does not exist; pick one under RUN_DIR/{CHECKPOINTS_DIR}/"
        )
    if not _is_complete(path):
        raise UserError(
            f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} or {META_FILE}); "
            "it was interrupted while being written: resume from an earlier one"
        )
    meta = json.loads((path / META_FILE).read_text())
    wanted = list(meta["entries"]) if names is None else list(names)
    missing = [n for n in wanted if n not in meta["entries"]]
    if missing:
        raise UserError(f"checkpoint {path} has no entries {missing}; it has {meta['entries']}")
    state = {
        name: torch.load(path / f"{name}.pt", map_location=map_location, weights_only=False)
        for name in wanted
    }
    return state, meta
