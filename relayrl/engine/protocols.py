"""The engine's two seams, as typing.Protocols: what the layers above may call, and where its ranks live.

    RolloutEngine   what the driver, the evaluator and the weight sync use: generate, score, sleep /
                    wake, the weight-update bracket, run_on_ranks, stats, close. LLMEngine is one;
                    so are the rollout role's handle (relayrl.roles.rollout_worker) and vLLM's adapter.
    StepEngine      what the agent loop and the rollout stream use to drive the engine step by step: add a
                    request, run one engine step, collect the requests it completed (LLMEngine is one; so is
                    a fleet's replicas stepped together, relayrl.roles.fleet_stepper)
    RunnerGroup     where the engine's tensor-parallel ranks (ModelRunners) live, as the engine
                    sees them: in this process (InProcessRunner), or RunnerWorkers in a worker group
                    (WorkerRanks, relayrl.engine.tp_workers): processes of their own, or placed in the
                    trainer's processes (colocated). The engine calls every rank alike, with
                    a function, never a method's name: call(ModelRunner.run, ...).

The engine module imports relayrl.models, relayrl.single_controller (its tensor-parallel ranks are a
worker group) and relayrl's ground floor; it must never import the trainer, sync, controller or cli.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from relayrl.engine.outputs import RequestOutput
from relayrl.engine.sampling_params import SamplingParams

T = TypeVar("T")


class RunnerGroup(Protocol):
    """The engine's tensor-parallel ranks, each holding a ModelRunner shard.

    Calls go by reference, never by a method's name: `fn` is a ModelRunner method or a module-level
    function (`group.call(ModelRunner.run, ids, batch)`), pickled by its qualified name where the ranks
    live in other processes, so a reader goes from the call to the definition. Every rank runs it (a
    forward all-reduces across them)."""

    def call(self, fn: Callable[..., T], *args) -> T:
        """fn(runner, *args) on every rank; rank 0's result (all ranks compute the same; the others send none)."""

    def call_all(self, fn: Callable[..., T], *args) -> list[T]:
        """fn(runner, *args) on every rank; every rank's result, by rank (e.g. a weight sync's per-rank figures)."""

    def free_memory(self) -> int:
        """The least free bytes over the ranks' devices (the KV cache budget's base)."""

    def close(self) -> None:
        """Stop the ranks this group owns (a no-op for ranks hosted by another role)."""


class RolloutEngine(Protocol):
    """What the RL loop uses of a rollout engine."""

    tokenizer: Any
    pad_id: int
    weights_version: int
    asleep: int  # 0 awake; 1 KV cache freed; 2 weights freed too

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in order."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load full logical tensors by Hugging Face name; returns the new weights version."""

    def run_on_ranks(self, fn: Callable, *args) -> list:
        """fn(model_runner, *args) on every tensor-parallel rank; results by rank."""

    def begin_weight_update(self) -> None:
        """Before a sync writes into the ranks' parameters (storage freed by sleep(2) comes back)."""

    def end_weight_update(self) -> int:
        """After a complete sync: a new weights version."""

    def score(self, rows: list[list[int]], temperature: float = 1.0) -> torch.Tensor:
        """Logprob of every token of `rows` given the ones before it, [B, L]."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, the weights unchanged (nothing may be in flight)."""

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 2: the weights too)."""

    def wake(self) -> None:
        """Restore the KV cache after sleep()."""

    def stats(self) -> dict[str, float]:
        """Engine figures since the last reset ({} when the backend has none)."""

    def reset_stats(self) -> None:
        """Start the stats() figures afresh."""

    def close(self) -> None:
        """Stop every process the engine owns."""


class StepEngine(Protocol):
    """An engine driven one step at a time (continuous batching): requests join while others run."""

    tokenizer: Any

    def add_request(self, prompt, params: SamplingParams, request_id: int | None = None) -> int:
        """Queue `params.n` samples of `prompt` (token ids); returns the request id."""

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; the requests it completed."""

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running."""

    def abort(self, request_ids: Iterable[int]) -> list[RequestOutput]:
        """Drop requests; what they produced so far."""
