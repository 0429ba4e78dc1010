"""Disk space for a checkpoint: checked before writing, and a clear line when it runs out during the write.

Before a checkpoint is written, its expected size (the bytes of the tensors in the state, plus a per-entry
allowance for the serialization around them) is compared with the free space of the checkpoints
directory; a shortfall is refused in one line naming the directory and the bytes needed. The check cannot
see other writers, quotas or file-size limits, so running out mid-write is recognized too: ENOSPC, EFBIG
or EDQUOT from any file write, torch's `inline_container` messages ("PytorchStreamWriter failed writing
file ...", "file write failed"), and the same failures gathered from every rank by
torch.distributed.checkpoint. The writer then removes its temporary directory and raises a
CheckpointSpaceError, so the previous checkpoint stays the latest. This module imports only torch and
the checkpoint errors; it must never import the trainer, engine or controller (they import it).
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from relayrl.checkpoint.errors import CheckpointSpaceError

# torch.save's zip archive around each tensor or value that DCP writes (1.27 KiB measured, torch 2.13) and
# its entry in DCP's index (0.21 KiB): rounded up, so that the check errs toward refusing.
ENTRY_OVERHEAD_BYTES = 4096
_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NO_SPACE_TEXT = ("PytorchStreamWriter failed writing", "file write failed", "No space left on device",
                  "File too large", "Disk quota exceeded")


def state_bytes(state: Any) -> tuple[int, int]:
    """(tensor bytes held by THIS process, number of entries) of a nested state dict. A DTensor counts its
    local shard, so the sum over ranks is the size of the sharded checkpoint."""
    total, entries = 0, 0
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            total += local.numel() * local.element_size()
            entries += 1
        else:
            entries += 1
    return total, entries


def expected_bytes(tensor_bytes: int, entries: int, other_bytes: int = 0) -> int:
    return tensor_bytes + entries * ENTRY_OVERHEAD_BYTES + other_bytes


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free_space(directory: Path, needed: int) -> None:
    """Refuse (CheckpointSpaceError) when `directory`'s file system has fewer than `needed` bytes free."""
    free = shutil.disk_usage(_existing(directory)).free
    if free < needed:
        raise CheckpointSpaceError(
            f"not enough disk space for a checkpoint in {directory}: it needs about {needed} bytes "
            f"({needed / 2**30:.2f} GiB), {free} bytes are free; free some space, lower run.keep_last, or point "
            "run.out_dir elsewhere")


def _causes(exc: BaseException) -> Iterable[BaseException]:
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        # torch.distributed.checkpoint's CheckpointException: {rank: (exception, traceback summary)}
        for failure in (getattr(e, "failures", None) or {}).values():
            if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
                todo.append(failure[0])
            elif isinstance(failure, BaseException):
                todo.append(failure)


def is_out_of_space(exc: BaseException) -> bool:
    """Whether `exc` (or anything it wraps) says a write ran out of disk space or hit a file-size limit."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS:
            return True
        if isinstance(e, (OSError, RuntimeError)) and any(t in str(e) for t in _NO_SPACE_TEXT):
            return True
    return False


def out_of_space_error(directory: Path, needed: int) -> CheckpointSpaceError:
    free = shutil.disk_usage(_existing(directory)).free
    return CheckpointSpaceError(
        f"ran out of disk space writing a checkpoint in {directory} (it needs about {needed} bytes, "
        f"{free} bytes are free now, or a file-size limit was hit); nothing was kept of this checkpoint and the "
        "previous one is still the latest")
