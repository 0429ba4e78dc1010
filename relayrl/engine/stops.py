"""This module decides when a sample ends, and why: the engine asks after every token it appends.

    "stop"    its newest token is an end-of-sequence id (the model config's and the tokenizer's; unless
              params.ignore_eos) or one of params.stop_token_ids, or its text contains one of params.stop
              (the text is then cut before the earliest one)
    "length"  it reached params.max_tokens completion tokens, or the model's max_position_embeddings
    None      it goes on

It imports the engine's own modules and relayrl.models; like the whole engine, it must never import the
trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

from relayrl.engine.sequence import Sequence
from relayrl.models.config import ModelConfig


class StopChecker:
    """The end-of-sequence ids, the tokenizer (for stop strings and text) and the model's maximum length."""

    def __init__(self, config: ModelConfig, tokenizer=None):
        self.tokenizer, self.max_len = tokenizer, config.max_position_embeddings
        self.eos_ids = set(config.eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)

    def decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""

    def finish_reason(self, s: Sequence) -> str | None:
        tok, sp = s.last_token, s.params
        if (tok in self.eos_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
            return "stop"
        if sp.stop and self.tokenizer is not None:
            text = self.decode(s.completion_token_ids)
            hits = [i for i in (text.find(x) for x in sp.stop) if i >= 0]
            if hits:
                s.text = text[: min(hits)]
                return "stop"
        if s.num_completion_tokens >= sp.max_tokens or s.num_tokens >= self.max_len:
            return "length"
        return None
