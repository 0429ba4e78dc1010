"""The errors a checkpoint can cause that are the user's to fix, each a one-line `UserError`.

A checkpoint on disk is untrusted input: it may be truncated by a crash, corrupted by a bad disk, copied
halfway, or crafted. Every such case is reported as a `CheckpointError` naming the file at fault, never as
an EOFError / UnpicklingError / JSONDecodeError traceback. Running out of disk space while writing one is a
`CheckpointSpaceError` naming the directory and the bytes needed. This module imports nothing but
relayrl.errors, so every checkpoint module can use it; it must never import the trainer, engine or
controller (they import it).
"""

from __future__ import annotations

from relayrl.errors import UserError


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt, or holds something other than the data relayrl writes."""


class CheckpointSpaceError(CheckpointError):
    """A checkpoint could not be written for lack of space (checked before writing, or ENOSPC / EFBIG during)."""
