"""The seam between the driver and the trainer, as typing.Protocols: a `Policy` is the trainer wherever
it runs, and a `TrainerRank` is what a function sent to each of its ranks receives.

    driver ──Policy──> GroupPolicy   actor (+ reference, critic) worker groups, SPMD inside, on local
                                     processes or Ray, or inline in the driver's own process (a world of 1;
                                     relayrl.roles.group_policy)

The driver computes with `compute_logprobs`, `compute_ref_logprobs` and `update`, checkpoints with
`save` / `load`, exports with `weights`, and reaches every rank with `run_on_ranks(fn, *args)`:
fn(trainer_rank, *args) runs on each rank, where the rank's model and (colocated) engine rank are.
That one call is how the weight sync acts on the trainer's shards; the engine offers the same call
for its ranks.

This module imports torch and the trainer's own batch type only; like all of the trainer, it must never
import the engine, sync, the controller or the CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from relayrl.trainer.batch import TrainBatch


class TrainerRank(Protocol):
    """What a function run on a trainer rank gets to work with."""

    rank: int  # the rank in the trainer's group (0 of 1 in the driver's own process)
    model: nn.Module  # this rank's (possibly sharded) model
    engine_runner: Any  # the engine rank this process hosts (colocated), or None
    sync_state: dict[str, Any]  # what the weight sync keeps on this rank between syncs


class Policy(Protocol):
    """The trainer, wherever it runs."""

    address: str  # where the trainer's processes reach the driver (rendezvous of the weight sync)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprobs [B, T] of the batch's tokens under the current weights (no grad)."""

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """The reference model's logprobs [B, T], or None when the run has no reference model. With
        trainer.lora the reference is the actor's frozen base: the actor's logprobs with its adapters off."""

    def update(self, batch: TrainBatch, *, profile: bool = False) -> dict[str, float]:
        """One RL update over the batch (PPO epochs, mini-batches); its statistics. profile: also the seconds
        trainer rank 0 spent in collectives (relayrl.observe.comm_profile: time/update_comm, comm/update_share)."""

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values [B, T] of the batch's tokens (PPO with a critic; no grad)."""

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        """One update of the critic on the batch's values and returns; its statistics."""

    def save(self, run_dir: str | Path, step: int, *, extra: Mapping[str, Any], meta: Mapping[str, Any],
             keep_last: int | None) -> Path:
        """A checkpoint of the model, optimizer and run state (`extra`), and the critic's beside it; its directory."""

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint into the current layout; the run state saved with it."""

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every parameter as one full tensor (the final export; vLLM's loader)."""

    def run_on_ranks(self, fn: Callable, *args) -> list:
        """fn(trainer_rank, *args) on every rank of the trainer; results by rank."""

    def close(self) -> None:
        """Stop every process the trainer owns."""
