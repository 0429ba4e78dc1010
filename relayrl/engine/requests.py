"""What a request to the engine must be, checked before anything is queued: its sampling settings, and
its prompt as token ids in the vocabulary leaving room for a completion within the model's maximum
length (truncated to its last k tokens only when SamplingParams.truncate_prompt_tokens asks). Each
refusal is one line (a relayrl.errors.UserError) naming the prompt.

This module imports the engine's own modules, relayrl.models' config and relayrl.errors only; like all
of the engine it must never import the trainer, sync, controller or cli.
"""

from __future__ import annotations

import operator
from typing import Any

from relayrl.engine.sampling_params import SamplingParams
from relayrl.errors import PromptError, SamplingParamsError
from relayrl.models.config import ModelConfig


def encode(prompt: Any, config: ModelConfig, tokenizer, where: str) -> list[int]:
    """Token ids of a prompt: a string through the tokenizer (no special tokens added), or token
    ids, each checked to be in the vocabulary (a bad id would fail deep inside the forward)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError(f"{where} is a string, but the engine has no tokenizer: give token ids")
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    try:
        ids = [operator.index(t) for t in prompt]
    except TypeError:
        raise PromptError(f"{where} must be a string or a list of token ids (integers), "
                          f"got {prompt!r:.80}") from None
    vocab = config.vocab_size
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise PromptError(f"{where} holds token id {bad}, outside the vocabulary [0, {vocab})")
    return ids


def prompt_ids(prompt: Any, params: SamplingParams, config: ModelConfig, tokenizer, where: str) -> list[int]:
    """The token ids a request runs on, after every check of its input."""
    if not isinstance(params, SamplingParams):
        raise SamplingParamsError(f"{where}: the sampling settings must be a SamplingParams, got {params!r:.80}")
    params.validate()  # again: a field may have been set since construction
    if params.logprobs > config.vocab_size:
        raise SamplingParamsError(f"SamplingParams.logprobs must be at most the vocabulary size "
                                  f"({config.vocab_size}), got {params.logprobs}")
    ids = encode(prompt, config, tokenizer, where)
    if not ids:
        raise PromptError(f"{where} is empty: give at least one token (the engine adds no BOS token of its own)")
    k = params.truncate_prompt_tokens
    if k is not None:
        ids = ids[-k:]  # the last k tokens: the end of a prompt is what the completion continues
    limit = config.max_position_embeddings
    if len(ids) >= limit:
        kept = f" (after truncate_prompt_tokens={k})" if k is not None else ""
        raise PromptError(
            f"{where} has {len(ids)} tokens{kept}, but the model's maximum length (max_position_embeddings) is "
            f"{limit} tokens, prompt and completion together: at most {limit - 1} prompt tokens leave room for "
            f"a completion (max_tokens {params.max_tokens}). Shorten the prompt, or set "
            f"SamplingParams.truncate_prompt_tokens to at most {limit - 1} to keep its last tokens")
    return ids
