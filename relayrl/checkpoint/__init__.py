"""Checkpoints: atomic save/load of run state, and RNG state capture for exact resume."""

from relayrl.checkpoint.io import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from relayrl.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "capture_rng_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]

