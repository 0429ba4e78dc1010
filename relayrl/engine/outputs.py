"""This module defines what the engine returns: per prompt, its samples with their tokens, logprobs and text,
and why each one ended.

It imports the standard library only; like the whole engine, it must never import the trainer, sync, the
controller or the CLI.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # an annotation only: this module stays importable without torch
    import torch


@dataclass
class SampleCost:
    """What the engine spent on one sample, for the FLOP count and the straggler measure.

    computed_tokens  tokens run through the model for it: the prefill past its prefix-cache hits (none for
                     a sample forked from a sibling's prefill: the sibling computed them), one per
                     decode step (with record_routing, one more for the final token's routing), and again
                     whatever a preemption or re-prefill recomputed
    attended         keys those tokens attended to, summed (a token at position p attends to p + 1, or
                     to the sliding window): attention's share of the FLOPs
    logit_positions  positions the lm_head ran at for it: one per model run it took part in (the engine
                     computes logits at each sequence's last position only; a fork reads its sibling's
                     prefill row), prefill re-runs included
    added_step       the engine's step count when the sample was queued (0: before the first step)
    finished_step    the engine step that produced its last token (-1: not finished, e.g. aborted)

    Engine steps are the clock here, not seconds: deterministic, and on a GPU a decode step costs about
    the same whether the batch is full or has one sequence left (memory-bound), which is what a long
    tail wastes."""

    computed_tokens: int = 0
    attended: int = 0
    logit_positions: int = 0
    added_step: int = 0
    finished_step: int = -1


@dataclass
class CompletionSample:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, as defined in relayrl.engine.sampler
    text: str
    _: KW_ONLY
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", "abort"
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # when SamplingParams.logprobs > 0
    # per token, the engine's weights version that sampled it (-1: unknown; empty from backends that do not say)
    versions: list[int] = field(default_factory=list)
    cost: SampleCost | None = None  # None from backends that do not count (vLLM)
    # MoE with record_routing: int16 [len(prompt_token_ids) + len(token_ids), n_moe, k], the experts each token of
    # prompt + completion chose in each MoE layer (-1: never run); the layout in relayrl.engine.routing
    routing: torch.Tensor | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    samples: list[CompletionSample]
    weights_version: int
