"""This module hosts the engine's tensor-parallel ranks in the actor's processes (placement colocated), and
shows them to the engine as a RunnerGroup (relayrl.engine.protocols).

    LLMEngine ──RunnerGroup──> ActorHostedRanks ──ActorWorker.run_on_engine_rank(fn)──> actor ranks
              call(ModelRunner.run, ...)             0..tp-1 each hold one ModelRunner and run fn(runner, ...);
                                                     ranks >= tp answer None

The actor group owns the processes, so closing the engine stops nothing here.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the
jobs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relayrl.roles.actor_workers import ActorWorker
from relayrl.single_controller.worker_group import GroupHandle


class ActorHostedRanks:
    """The engine's ranks as hosted by actor ranks 0..tp-1."""

    def __init__(self, actor: GroupHandle, tp: int, free_bytes: int):
        self.actor, self.tp, self.free_bytes = actor, tp, free_bytes

    def free_memory(self) -> int:
        return self.free_bytes

    def call(self, fn: Callable[..., Any], *args) -> Any:
        return self.actor.call(ActorWorker.run_on_engine_rank, fn, args, False)[0]

    def call_all(self, fn: Callable[..., Any], *args) -> list:
        return self.actor.call(ActorWorker.run_on_engine_rank, fn, args, True)[: self.tp]

    def close(self) -> None:
        pass  # the actor group owns the processes
