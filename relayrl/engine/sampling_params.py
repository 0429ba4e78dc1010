"""What a request asks of the sampler."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling settings of one request (vLLM-like names).

    n:           samples drawn for the prompt (the G of GRPO).
    temperature: 0 means greedy; logprobs are then those of the temperature-1 distribution.
    top_k:       keep the k most likely tokens (0 = off).
    top_p:       keep the smallest set whose probability reaches p (1.0 = off).
    min_p:       drop tokens whose probability is below min_p x the top token's (0 = off).
    seed:        sample j of this request draws from a stream seeded by (seed, j) alone, so the
                 tokens do not depend on what else is in the batch.
    stop:        stop strings; the text is cut before the stop string, the tokens keep the token
                 that completed it (that token was sampled and is trained on).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int = 0  # also return the top-`logprobs` tokens' logprobs at each step (same definition)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("SamplingParams.n must be >= 1")
        if self.temperature < 0:
            raise ValueError("SamplingParams.temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("SamplingParams.top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("SamplingParams.top_k must be >= 0 (0 = off)")
        if not 0 <= self.min_p < 1:
            raise ValueError("SamplingParams.min_p must be in [0, 1)")
        if self.logprobs < 0:
            raise ValueError("SamplingParams.logprobs must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("SamplingParams.max_tokens must be >= 1")
