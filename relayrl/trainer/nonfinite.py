"""A step whose loss or gradient norm is not finite is never applied; K such steps in a row stop the run.

    backward ──> grad norm ──> finite? ──yes──> optimizer.step()                         streak = 0
                               (loss and norm,  ──no───> grads dropped, no step, counted  streak += 1
                                every rank agrees)        streak == trainer.max_nonfinite_steps: NonFiniteStepError

One NaN (an overflowing forward, a reward that slipped through) applied once makes every weight NaN, and every
later step, sync and checkpoint NaN with it; a skipped step costs one batch. Several in a row mean the weights or
the settings are the problem (a learning rate that overflows the weights), so the run stops in one line naming
the cause and the step, before anything non-finite is saved: the last complete checkpoint stays the resume point.

Every rank must take the same decision, or the ranks that step would wait in a collective the others skip (and
the replicas would drift apart): the flags are reduced (MAX) over every axis of the trainer's device mesh. The
gradient norm is already global (relayrl.parallel.grad_norm), but the loss is each rank's own share.

It imports torch, relayrl.parallel's dims and relayrl.errors only; like all of the trainer, it must never import
the engine, sync, the controller or the CLI.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from relayrl.errors import UserError
from relayrl.parallel.dims import ParallelDims

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class NonFiniteStepError(UserError):
    """trainer.max_nonfinite_steps optimizer steps in a row had a non-finite loss or gradient norm."""


class NonFiniteGuard:
    """`check(loss, grad_norm)` -> None (apply the step) or the cause ("loss" / "gradient norm") of a step to skip;
    `skipped` counts the skips since `take_skipped()`; `streak` the skips in a row. `who` names the model in the
    error (the actor, the critic)."""

    def __init__(self, limit: int, *, dims: ParallelDims | None = None, device: torch.device | str = "cpu",
                 who: str = "policy"):
        self.limit, self.who, self.device = limit, who, torch.device(device)
        self.groups = _mesh_groups(dims)
        self.streak = self.skipped = 0

    def check(self, loss: float, grad_norm: float) -> str | None:
        flags = torch.tensor([not math.isfinite(loss), not math.isfinite(grad_norm)], dtype=torch.float32,
                             device=self.device)
        for group in self.groups:  # MAX over each mesh axis in turn is the MAX over the whole mesh
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        bad_loss, bad_norm = (bool(f) for f in flags.tolist())
        if not (bad_loss or bad_norm):
            self.streak = 0
            return None
        self.streak += 1
        self.skipped += 1
        return "loss" if bad_loss else "gradient norm"

    def stop_if_exhausted(self, cause: str, value: float, step: int) -> None:
        """Raise NonFiniteStepError once `limit` steps in a row were skipped (every rank does, together)."""
        if self.streak < self.limit:
            return
        shown = f" ({value})" if not math.isfinite(value) else ""
        raise NonFiniteStepError(
            f"training stopped at step {step}: the {self.who}'s {cause} was not finite{shown} in {self.streak} "
            f"optimizer steps in a row (trainer.max_nonfinite_steps={self.limit}); none was applied, so the last "
            "complete checkpoint is a good resume point: lower trainer.lr and check "
            "the rewards")

    def take_skipped(self) -> int:
        n, self.skipped = self.skipped, 0
        return n


def step_schedule(scheduler) -> None:
    """scheduler.step(), once per RL step even when its optimizer steps were all skipped: the schedule follows the
    run's steps (torch warns that the optimizer did not step first; here that is the point)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()


def _mesh_groups(dims: ParallelDims | None) -> list:
    """The process groups of the mesh's axes of more than one rank (none in one process)."""
    if dims is None or not (dist.is_available() and dist.is_initialized()):
        return []
    sizes = dict(zip(MESH_AXES, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp), strict=True))
    return [dims.mesh[axis].get_group() for axis in MESH_AXES if sizes[axis] > 1]
