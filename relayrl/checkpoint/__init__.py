"""Checkpoints of a run that hold data, never code: atomic, checksummed, and resumable on any layout.

A checkpoint is a directory of data files: DCP shards of the model and optimizer (read through a
restricted index reader and weights-only value loading), the run state (step, sampler, RNG, scheduler)
as JSON + safetensors, meta.json, and a COMPLETE manifest of every file's size and CRC-32 written last.
Nothing in a checkpoint is unpickled into code; anything wrong with one (missing, truncated, corrupt,
crafted) is a one-line CheckpointError naming the file. `latest_valid_checkpoint` picks the newest
checkpoint that passes its manifest and says why it skipped the newer ones.

The package may import relayrl.parallel, relayrl.models, relayrl.config and relayrl.errors; it must never
import the trainer, engine or controller (they import it).
"""

from relayrl.checkpoint.distributed import load_distributed, open_checkpoint, read_meta, save_distributed
from relayrl.checkpoint.errors import CheckpointError, CheckpointSpaceError
from relayrl.checkpoint.export import export_hf
from relayrl.checkpoint.io import load_checkpoint, save_checkpoint
from relayrl.checkpoint.layout import (
    SkippedCheckpoint,
    latest_checkpoint,
    latest_valid_checkpoint,
    list_checkpoints,
    step_dir_name,
)
from relayrl.checkpoint.manifest import verify_checkpoint
from relayrl.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "CheckpointError",
    "CheckpointSpaceError",
    "SkippedCheckpoint",
    "capture_rng_state",
    "export_hf",
    "latest_checkpoint",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_distributed",
    "open_checkpoint",
    "read_meta",
    "restore_rng_state",
    "save_checkpoint",
    "save_distributed",
    "step_dir_name",
    "verify_checkpoint",
]
