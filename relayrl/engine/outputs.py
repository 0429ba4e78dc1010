"""This module defines what the engine returns: per prompt, its samples with their tokens, logprobs and text,
and why each one ended.

It imports the standard library only; like the whole engine, it must never import the trainer, sync, the
controller or the CLI.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field


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


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    samples: list[CompletionSample]
    weights_version: int
