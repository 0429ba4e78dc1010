"""This module keeps the engine's rank in this process: it is the RunnerGroup of an engine that runs its one
rank itself.

An LLMEngine talks to its ranks only through a RunnerGroup (relayrl.engine.protocols). With
tensor_parallel_size 1 and no worker processes asked for, that group is this one: one ModelRunner in
the calling process, called directly (no pickling, no pipe): `call(fn, *args)` is fn(runner, *args).
The weight sync's in-place copies reach the runner through `call_all` or `runner`. A colocated engine in the
driver's own process (an inline RunnerWorker beside the inline actor: relayrl.engine.tp_workers.colocated_ranks)
is called through one too, so a rollout thread steps it directly.

This module imports the engine's own modules only; like the whole engine, it must never import the
trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relayrl.engine.model_runner import ModelRunner, available_memory


class InProcessRunner:
    """One ModelRunner in this process, behind the RunnerGroup protocol."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def call(self, fn: Callable[..., Any], *args) -> Any:
        return fn(self.runner, *args)

    def call_all(self, fn: Callable[..., Any], *args) -> list:
        return [fn(self.runner, *args)]

    def free_memory(self) -> int:
        return available_memory(str(self.runner.device))

    def close(self) -> None:
        pass  # nothing of its own to stop: the runner goes with this object
