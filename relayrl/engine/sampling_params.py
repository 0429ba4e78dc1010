"""This module defines what a request asks of the sampler, checked when it is built.

`SamplingParams` holds one request's sampling settings under vLLM's names. Every field is checked
in `validate()` (run at construction, and again by the engine when the request is added, so a field
changed afterwards is caught too): a NaN, an infinity, a value of the wrong type or out of range is
refused with a `SamplingParamsError` naming the field and the value. That error is a user error
(the CLI prints one line and exits 2) and a ValueError (for callers that caught ValueError before).

It imports the standard library and relayrl.errors only; like the whole engine, it must never import the
trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from relayrl.errors import SamplingParamsError

# Below this (and above 0) logits / temperature can overflow float32 to inf and the sampler's
# softmax turns to NaN; 0 already means greedy.
MIN_TEMPERATURE = 1e-6


def _bad(name: str, value, want: str) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams.{name} must be {want}, got {value!r}")


def _int(name: str, value, low: int | None, want: str) -> int:
    # bool is an Integral, but True as a sample count or a seed is a mistake, not a number
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (low is not None and value < low):
        raise _bad(name, value, want)
    return int(value)


def _real(name: str, value, ok, want: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise _bad(name, value, want)
    return float(value)


@dataclass
class SamplingParams:
    """Sampling settings of one request (vLLM-like names).

    n:           samples drawn for the prompt (the G of GRPO); an integer >= 1.
    temperature: 0 means greedy; logprobs are then those of the temperature-1 distribution.
                 Otherwise at least MIN_TEMPERATURE (1e-6), finite.
    top_k:       keep the k most likely tokens (0 = off).
    top_p:       keep the smallest set whose probability reaches p, in (0, 1] (1.0 = off).
    min_p:       drop tokens whose probability is below min_p x the top token's, in [0, 1) (0 = off).
    max_tokens:  the most completion tokens per sample, >= 1. The model's maximum length
                 (max_position_embeddings, prompt and completion together) ends a sample earlier,
                 with finish_reason "length"; the KV cache reserves no more than that maximum.
    stop:        stop strings (one string is taken as a list of one); the text is cut before the stop
                 string, the tokens keep the token that completed it (that token was sampled and is
                 trained on).
    stop_token_ids: token ids that end a sample (finish_reason "stop").
    ignore_eos:  keep sampling past EOS.
    seed:        an integer or None. Sample j of this request draws from a stream seeded by (seed, j)
                 alone, so the tokens do not depend on what else is in the batch.
    logprobs:    also return the top-`logprobs` tokens' logprobs at each step (same definition), >= 0.
    truncate_prompt_tokens: None (default) refuses a prompt that leaves no room for a completion
                 within the model's maximum length; an integer k >= 1 keeps only the LAST k prompt
                 tokens (left truncation, as in vLLM) before that check. The output's
                 prompt_token_ids are the tokens actually used.
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
    logprobs: int = 0
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalise to plain int / float / list) every field; raise SamplingParamsError."""
        self.n = _int("n", self.n, 1, "an integer >= 1")
        self.temperature = _real("temperature", self.temperature, lambda t: t == 0 or t >= MIN_TEMPERATURE,
                                 f"0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
        self.top_p = _real("top_p", self.top_p, lambda p: 0 < p <= 1, "a number in (0, 1] (1 = off)")
        self.top_k = _int("top_k", self.top_k, 0, "an integer >= 0 (0 = off)")
        self.min_p = _real("min_p", self.min_p, lambda p: 0 <= p < 1, "a number in [0, 1) (0 = off)")
        self.max_tokens = _int("max_tokens", self.max_tokens, 1, "an integer >= 1")
        self.logprobs = _int("logprobs", self.logprobs, 0, "an integer >= 0")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, None, "an integer or None")
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1,
                                               "an integer >= 1 (the last k prompt tokens are kept) or None")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "True or False")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise _bad("stop", self.stop, "a list of non-empty strings")
        self.stop = list(self.stop)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise _bad("stop_token_ids", ids, "a list of token ids (integers >= 0)")
        self.stop_token_ids = [int(t) for t in ids]


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """The seed of a multi-turn episode's turn-th request, for sample `sample` of a request seeded `seed`: an
    episode draws the same tokens whatever runs beside it (relayrl's agent loop and the endpoint's episodes)."""
    if seed is None:
        return None
    return ((seed * 1_000_003 + sample) * 10_007 + turn) % (1 << 62)
