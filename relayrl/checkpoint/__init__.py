"""Checkpoints: atomic save/load of run state, and RNG state capture for exact resume."""

from relayrl.checkpoint.distributed import load_distributed, read_meta, save_distributed
from relayrl.checkpoint.export import export_hf
from relayrl.checkpoint.io import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from relayrl.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "capture_rng_state",
    "export_hf",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_distributed",
    "read_meta",
    "restore_rng_state",
    "save_checkpoint",
    "save_distributed",
]
