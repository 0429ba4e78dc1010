"""Where checkpoints live and how one becomes visible: the on-disk protocol both checkpoint writers share.

    run_dir/checkpoints/
      step_00000040/        a complete checkpoint: its files, meta.json, and COMPLETE (written last)
      .tmp_step_00000050    one being written (hidden; a crash leaves it, the next save removes it)
      .trash_step_...       one being deleted (hidden, so a kill mid-delete leaves nothing that looks valid)

A checkpoint is written under the hidden temporary name, every file is fsynced, meta.json and the COMPLETE
manifest (each file's size and CRC-32, see relayrl.checkpoint.manifest) go in last, and only then is the
directory renamed to step_XXXXXXXX. The rename is atomic, so a run killed at any point leaves either the
complete new checkpoint or none under a visible name. Old checkpoints are removed only after the new one
is in place.

`list_checkpoints` / `latest_checkpoint` are cheap (they look for COMPLETE and meta.json);
`latest_valid_checkpoint` also verifies sizes and checksums and says why it skipped each newer one, which
is what a resume uses. This module imports only the standard library and the checkpoint modules below it
(errors, manifest); it must never import the trainer, engine or controller.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

from relayrl.checkpoint.errors import CheckpointError
from relayrl.checkpoint.manifest import COMPLETE_MARKER, manifest_bytes, verify_checkpoint

__all__ = ["CHECKPOINTS_DIR", "COMPLETE_MARKER", "FORMAT_VERSION", "META_FILE", "TMP_PREFIX", "SkippedCheckpoint",
           "fsync_dir", "latest_checkpoint", "latest_valid_checkpoint", "list_checkpoints", "publish",
           "read_meta_file", "remove_leftovers", "step_dir_name", "write_synced"]

CHECKPOINTS_DIR = "checkpoints"
META_FILE = "meta.json"
# 2: run state as JSON + safetensors (statefile) and a checksummed COMPLETE manifest; 1 held pickles.
FORMAT_VERSION = 2
TMP_PREFIX = ".tmp_"
_TRASH_PREFIX = ".trash_"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """The directory name of checkpoint `step` (zero-padded, so names sort by step)."""
    return f"step_{step:08d}"


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a rename is durable only once its directory is synced).
    Windows cannot open a directory for fsync; there the rename itself is the best available guarantee."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to a new file `path` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _remove_hidden(path: Path) -> None:
    """Rename a directory to a hidden trash name, then delete it (see the module docstring)."""
    trash = path.parent / f"{_TRASH_PREFIX}{path.name}.{os.getpid()}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_leftovers(root: Path) -> None:
    """Delete the temp and trash directories under `root`: only a killed writer leaves them, and a run
    has one checkpoint writer, so anything hidden there is garbage from a crash."""
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith((TMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(child, ignore_errors=True)


def _step_dirs(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), c) for c in root.iterdir() if (m := _STEP_DIR.match(c.name)) and c.is_dir()]
    return sorted(found)


def _is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and (path / META_FILE).is_file()


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints of the run, oldest step first; temp and incomplete dirs are ignored."""
    return [path for _, path in _step_dirs(run_dir) if _is_complete(path)]


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step, or None (not verified: see latest_valid_checkpoint)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def read_meta_file(path: Path) -> dict[str, Any]:
    """meta.json of checkpoint `path` as a dict; a CheckpointError naming the file otherwise."""
    file = path / META_FILE
    try:
        meta = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete (no {META_FILE}): it was interrupted while being "
                              "written; use an earlier one") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {e.strerror or e}") from None
    except (ValueError, RecursionError):
        raise CheckpointError(f"checkpoint file {file} is not valid JSON: it is corrupt or not written by "
                              "relayrl") from None
    if type(meta) is not dict or type(meta.get("step")) is not int:
        raise CheckpointError(f"checkpoint file {file} is not a relayrl checkpoint's meta.json (no integer 'step')")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {meta.get('format_version')!r}; this relayrl "
                              f"reads version {FORMAT_VERSION} (older checkpoints held pickles and are not loaded)")
    return meta


class SkippedCheckpoint(NamedTuple):
    """A checkpoint latest_valid_checkpoint passed over, and why (one line)."""

    path: Path
    reason: str


def latest_valid_checkpoint(run_dir: str | os.PathLike[str]) -> tuple[Path | None, list[SkippedCheckpoint]]:
    """The newest checkpoint whose files match its COMPLETE manifest (sizes and CRC-32), whose meta.json
    reads and whose weights are finite (read only for a checkpoint saved before saves were checked), and the newer
    ones skipped on the way, newest first, each with a one-line reason (incomplete, truncated, checksum mismatch,
    bad JSON, NaN weights). (None, skipped) when no checkpoint passes."""
    skipped = []
    for step, path in reversed(_step_dirs(run_dir)):
        try:
            verify_checkpoint(path, checksums=True)
            meta = read_meta_file(path)
            if meta["step"] != step:
                raise CheckpointError(f"checkpoint file {path / META_FILE} is for another step than {path.name}")
            if meta.get("format") == "dcp" and meta.get("finite") is not True:
                from relayrl.checkpoint.distributed import saved_nonfinite  # it imports this module

                bad = saved_nonfinite(path)
                if bad is not None:
                    raise CheckpointError(f"its weights are not finite (NaN or inf in {bad}): an older relayrl saved "
                                          "them as complete")
        except CheckpointError as e:
            skipped.append(SkippedCheckpoint(path, str(e)))
            continue
        return path, skipped
    return None, skipped


def publish(tmp: Path, final: Path, meta_bytes: bytes, keep_last: int | None,
            known_digests: dict[str, dict[str, int]] | None = None) -> Path:
    """The one way a checkpoint becomes visible (both writers): meta.json and the COMPLETE manifest into the
    filled temp dir, fsync, rename to `final`, then prune to `keep_last`. `known_digests`: file digests
    the ranks already computed (the rest are computed here)."""
    root = final.parent
    try:
        write_synced(tmp / META_FILE, meta_bytes)
        write_synced(tmp / COMPLETE_MARKER, manifest_bytes(tmp, known_digests))
        fsync_dir(tmp)
        if final.exists():
            # Re-saving a step (a run resumed from an earlier checkpoint reaches it again): the old copy must
            # go before the rename; meanwhile the older checkpoints stay valid.
            _remove_hidden(final)
        os.rename(tmp, final)
    except BaseException:
        # An error we can see (disk full, a failed fsync) cleans up; a hard kill leaves the temp dir, which
        # is hidden from latest_checkpoint and removed by the next save.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)

    if keep_last is not None:
        # The checkpoint just written always stays, even when a higher step exists (left by a run that went
        # further before this one resumed from an earlier step); the rest go oldest first.
        others = [p for p in list_checkpoints(root.parent) if p != final]
        for old in others[: max(len(others) - (keep_last - 1), 0)]:
            _remove_hidden(old)
    return final
