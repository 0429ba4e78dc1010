"""The trainer state a TRL reward function reads (`trainer_state`): the fields of transformers' TrainerState that
reward functions use, with TRL's meaning, as a plain frozen dataclass (a worker unpickles it without importing
transformers; a function cannot change what the other calls see).

    global_step       updates done before the samples were drawn: 0 for the first step's batch (TRL scores
                      step k's completions before update k), s for an evaluation after s steps
    max_steps         the run's steps (run.steps; sft.steps in `relayrl sft`'s evaluations); 0 outside training
                      (`relayrl eval`), as TRL's own default
    epoch             passes over the training prompts drawn before this batch (fractional: 1.5 is half-way
                      through the second pass)
    num_train_epochs  passes the whole run draws: ceil(max_steps * prompts_per_step / training prompts)
    is_world_process_zero, is_local_process_zero   always True: one driver scores every sample

    TrainerState.at(step, max_steps, sampler_state, prompts_per_step)   the state of the batch a step draws

It imports the standard library only; like all of rewards, it must never import the trainer, the engine, sync
or the controller (rewards may use relayrl.data and the ground floor only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerState:
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 0
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True

    @classmethod
    def at(cls, step: int, max_steps: int, sampler_state: dict | None = None,
           prompts_per_step: int = 0) -> TrainerState:
        """The state of step `step`'s batch (0-based: `step` updates done); `sampler_state` is the prompt
        sampler's before it drew the batch (relayrl.data.PromptSampler.state_dict: epoch, position, num_examples)."""
        n = (sampler_state or {}).get("num_examples") or 0
        if not n:
            return cls(global_step=step, max_steps=max_steps)
        epoch = sampler_state["epoch"] + sampler_state["position"] / n
        return cls(global_step=step, max_steps=max_steps, epoch=epoch,
                   num_train_epochs=math.ceil(max_steps * prompts_per_step / n))
