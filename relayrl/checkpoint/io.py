"""Single-process checkpoints: a run's state as one data file pair per entry, under the shared layout.

    step_00000040/
      model.json  model.safetensors  optimizer.json  optimizer.safetensors ...   one pair per entry
      meta.json                                        {"step": 40, "entries": [...], ...}
      COMPLETE                                         each file's size and CRC-32, written last

Each entry (a state dict, the RNG state, plain numbers) is stored with relayrl.checkpoint.statefile: a JSON
tree plus the tensors it refers to, so loading a checkpoint parses data and can never run code from it.
The write goes through relayrl.checkpoint.layout (temp name, fsync, manifest, atomic rename), the same
protocol as the sharded writer, so `list_checkpoints` / `latest_valid_checkpoint` see both kinds. Training
runs use the sharded writer (relayrl.checkpoint.distributed); this one serves tests and small tools. This
module must never import the trainer, engine or controller.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from relayrl.checkpoint.errors import CheckpointError
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
from relayrl.checkpoint.manifest import verify_checkpoint
from relayrl.checkpoint.space import check_free_space, is_out_of_space, out_of_space_error
from relayrl.checkpoint.statefile import encode_state, read_state, state_file_names

_ENTRY_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    state: Mapping[str, object],
    meta: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write `state` (entry name -> data: nested dict / list / tuple / scalars / tensors / numpy arrays) as
    checkpoint `step`; anything else is a TypeError naming its key path, raised before any file is written.

    `meta` must be JSON-serializable (config, data position, ...); `step` is added to it.
    `keep_last`: after the new checkpoint is in place, delete all but the newest `keep_last`.
    Returns the final checkpoint directory.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    for name in state:
        # Entry names become file names: no separators (every file stays inside the checkpoint), no dots
        # (NAME.json must not collide with meta.json), no leading dot (hidden names are for temp dirs).
        if not _ENTRY_NAME.match(name) or name == "meta":
            raise ValueError(f"checkpoint entry name {name!r} must be a plain file-name stem (letters, digits, _ -)")
    meta = dict(meta or {})
    if meta.get("step", step) != step:
        raise ValueError(f"meta['step']={meta['step']} disagrees with step={step}")
    # Everything is serialized first: a non-data entry or a non-JSON meta fails before any file is written.
    full_meta = {**meta, "step": step, "format_version": FORMAT_VERSION, "entries": list(state)}
    meta_bytes = (json.dumps(full_meta, indent=2, sort_keys=True) + "\n").encode()
    files = {}
    for name, obj in state.items():
        json_name, tensors_name = state_file_names(name)
        files[json_name], files[tensors_name] = encode_state(obj, name)
    needed = sum(len(b) for b in files.values()) + len(meta_bytes) + (64 << 10)  # + manifest, with room

    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{final.name}.{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
        check_free_space(root, needed)
        tmp.mkdir()
        try:
            for file_name, data in files.items():
                write_synced(tmp / file_name, data)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return publish(tmp, final, meta_bytes, keep_last)
    except OSError as e:
        if is_out_of_space(e):
            raise out_of_space_error(root, needed) from e
        raise


def load_checkpoint(
    path: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    *,
    verify: bool = False,
) -> tuple[dict[str, object], dict[str, Any]]:
    """Read a checkpoint directory back as (state, meta); `names` limits which entries load.

    Every file is checked against the COMPLETE manifest first: its size always, its CRC-32 too when
    `verify`. Tensors come back on the CPU (load_state_dict moves them into place). A missing, incomplete,
    truncated or malformed checkpoint raises a CheckpointError (a UserError) naming the file.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; pick one under RUN_DIR/{CHECKPOINTS_DIR}/")
    verify_checkpoint(path, checksums=verify)
    meta = read_meta_file(path)
    entries = meta.get("entries")
    if type(entries) is not list or not all(type(n) is str and _ENTRY_NAME.match(n) for n in entries):
        raise CheckpointError(f"checkpoint file {path / 'meta.json'} has a malformed 'entries' list")
    wanted = list(entries) if names is None else list(names)
    missing = [n for n in wanted if n not in entries]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no entries {missing}; it has {entries}")
    return {name: read_state(path, name) for name in wanted}, meta
