"""This module hosts the engine's tensor-parallel ranks in the actor's processes (placement colocated), and
shows them to the engine as a RunnerGroup (relayrl.engine.protocols).

    LLMEngine ──RunnerGroup──> ActorHostedRanks ──ActorWorker.engine_call / engine_run──> actor ranks
                                                   0..tp-1 each hold one ModelRunner; ranks >= tp answer None

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

    def call(self, method: str, *args) -> Any:
        return self.actor.call(ActorWorker.engine_call, method, args)[0]

    def call_all(self, method: str, *args) -> list:
        return self.actor.call(ActorWorker.engine_call, method, args)[: self.tp]

    def run_fn(self, fn: Callable, *args) -> list:
        return self.actor.call(ActorWorker.engine_run, fn, args)[: self.tp]

    def close(self) -> None:
        pass  # the actor group owns the processes
