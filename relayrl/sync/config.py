"""SyncConfig is the `sync:` section of a run: how weights move from the trainer to the engine, and how
each sync is checked.

This module is configuration only: it imports relayrl.config and pydantic, and it must never import
torch.distributed, the transfer code, the trainer, the engine or the controller.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relayrl.config import Config


class SyncConfig(Config):
    """The `sync:` section: how weights move from the trainer to the engine, and how it is checked."""

    bucket_mb: float = Field(32.0, gt=0)  # pieces for one (source, destination) pair, per message
    window: int = Field(4, ge=1)  # buckets a member keeps in flight, each way
    # the canary costs one forward of rows x len tokens on each side per sync (at least one row
    # per trainer rank): 64 tokens, a small share of a step's rollout tokens
    canary_rows: int = Field(4, ge=1)
    canary_len: int = Field(16, ge=2)
    gap_bound: float | None = Field(None, gt=0)  # None: by the engine's (and trainer's) dtype
    debug_checksums: bool = False  # compare every piece's checksum on every sync, not only on failure
    # float8: each piece crosses as float8 e4m3 with a scale of its own, recomputed every sync (a
    # quarter of fp32's bytes, half of bf16's); the engine holds the dequantised values
    wire: Literal["engine", "float8"] = "engine"
    # how buckets cross between processes: gloo (their bytes, GPU buckets staged through host memory) or ipc
    # (CUDA IPC handles to the sender's packed bucket, copied device to device, acked: relayrl.sync.ipc; needs
    # CUDA and one machine's processes). auto: ipc with parallel.device cuda and local processes, else gloo
    transport: Literal["auto", "gloo", "ipc"] = "auto"
    # how long a member waits on a message (a peer that died mid-sync surfaces as an error after this)
    timeout_s: float = Field(300.0, gt=0)
    # with LoRA (trainer.lora) every sync after the first sends the adapters only; the engine then keeps
    # them apart (separate: its forward adds s * (x A^T) B^T, no extra weights) or merges them into its
    # fused weights (merge: a plain forward, at the cost of a copy of the targeted base weights per rank)
    lora: Literal["separate", "merge"] = "separate"
