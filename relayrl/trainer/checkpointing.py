"""This module saves and restores an Actor: its (sharded) model and optimizer, LR schedule and shuffle
stream.

One checkpoint format serves every layout (torch.distributed.checkpoint shards, relayrl.checkpoint),
so a run saved on N ranks resumes on M, or in one process. The actor's own state (scheduler position,
the mini-batch shuffle generator) rides in the checkpoint's run state next to the caller's `extra`.

The trainer imports relayrl.checkpoint (below it); it must never import the engine, sync or the controller.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relayrl.checkpoint import load_distributed, read_meta, save_distributed
from relayrl.checkpoint.errors import CheckpointError
from relayrl.trainer.actor import Actor
from relayrl.trainer.optim import adam_kernel


def save_actor(actor: Actor, run_dir: str | Path, step: int, *, extra: Mapping[str, Any], meta: Mapping[str, Any],
               keep_last: int | None) -> Path:
    """Collective: every rank writes its shard; rank 0 adds the run state (`extra` + the actor's). With LoRA the
    shards hold the frozen base and the adapters (the optimizer state is the adapters' only), and meta.json
    records the adapters' settings (meta["lora"]), which `relayrl export` needs to merge them or write them
    for peft."""
    extra = {**extra, "scheduler": actor.scheduler.state_dict(), "shuffle": actor.shuffle_gen.get_state()}
    if actor.cfg.lora is not None:
        meta = {**meta, "lora": actor.cfg.lora.to_dict()}
    return save_distributed(run_dir, step, actor.model, actor.optimizer, extra, meta=meta, keep_last=keep_last)


def load_actor(actor: Actor, path: str | Path) -> dict[str, Any]:
    """Collective: load into the actor's current layout, whatever layout wrote it; returns the run state."""
    _check_lora(path, read_meta(path).get("lora"), actor.cfg.lora)
    extra = load_distributed(path, actor.model, actor.optimizer)
    for group in actor.optimizer.param_groups:  # the saved layout's choice does not fit this one
        group.update(adam_kernel(group["params"]))
    actor.scheduler.load_state_dict(extra["scheduler"])  # after the optimizer: its lr wins
    actor.shuffle_gen.set_state(extra["shuffle"])
    return extra


def _check_lora(path, saved: dict | None, lora) -> None:
    """The adapters' shape AND scale must be the run's: a different alpha would load silently and change
    every output (scaling = alpha / rank); so must the base's dtype: an fp32 base loaded into a bf16 one would
    be rounded silently (and a bf16 base widened to fp32 is not the model that was trained)."""
    if saved is None and lora is None:
        return
    have = None if saved is None else {"rank": saved["rank"], "alpha": saved["alpha"],
                                       "target_modules": sorted(saved["target_modules"]),
                                       "base_dtype": saved.get("base_dtype", "float32")}
    want = None if lora is None else {"rank": lora.rank, "alpha": lora.alpha,
                                      "target_modules": sorted(lora.target_modules), "base_dtype": lora.base_dtype}
    if have != want:
        raise CheckpointError(f"checkpoint {path} was trained with trainer.lora={have}, this run has {want}: "
                              "resume with the checkpoint's LoRA settings")


def critic_checkpoint(actor_checkpoint: str | Path) -> Path:
    """run_dir/critic/checkpoints/step_N for the actor's run_dir/checkpoints/step_N."""
    p = Path(actor_checkpoint)
    return p.parent.parent / "critic" / "checkpoints" / p.name


def save_critic(critic: Actor, run_dir: str | Path, step: int, *, meta: Mapping[str, Any],
                keep_last: int | None) -> Path:
    """The critic's checkpoint, in a tree of its own (run_dir/critic), written before the actor's: a step
    whose actor checkpoint is complete has its critic's too. The critic's tree keeps one more than the
    actor's, so a failure while the actor writes step N still finds the critic of step N - 1 beside the
    actor's last complete checkpoint."""
    keep = keep_last + 1 if keep_last is not None else None
    return save_actor(critic, Path(run_dir) / "critic", step, extra={}, meta=meta, keep_last=keep)


def load_critic(critic: Actor, actor_checkpoint: str | Path) -> None:
    """Collective: the critic's checkpoint of the same step as `actor_checkpoint`, into the current layout."""
    path = critic_checkpoint(actor_checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"{actor_checkpoint} has no critic checkpoint beside it ({path} is missing): "
                              "resume a PPO-with-critic run from a checkpoint it wrote")
    load_actor(critic, path)
