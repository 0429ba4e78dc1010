"""This module turns an example's prompt into token ids; it is the one place where both rollout and SFT turn
examples into model input.

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the
loop, the roles or the jobs.
"""

from __future__ import annotations

from relayrl.data import DataConfig, Example, format_prompt
from relayrl.data.chat import uses_chat_template


def encode_prompt(tokenizer, example: Example, data: DataConfig) -> list[int]:
    """The prompt's ids: BOS (when the tokenizer has one) + a raw string prompt, or the chat-formatted prompt
    (message prompts always, string prompts as data.chat_template says), whose template decides the BOS."""
    return encode_text(tokenizer, example.prompt, data.chat_template, data.system_prompt)


def encode_text(tokenizer, prompt, chat_template: str = "auto", system: str | None = None) -> list[int]:
    """encode_prompt of a bare prompt (a string or messages): what `relayrl generate` sends the engine."""
    text = format_prompt(tokenizer, prompt, chat_template, system)  # prompt_text of a bare prompt
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and not uses_chat_template(tokenizer, prompt, chat_template):
        ids = [bos] + ids
    return ids


def prompt_text(tokenizer, example: Example, data: DataConfig) -> str:
    """The prompt as the model sees it, before tokenizing: the text encode_prompt encodes (its BOS aside), and
    what relayrl.rollout.charset checks the tokenizer can represent."""
    return format_prompt(tokenizer, example.prompt, data.chat_template, data.system_prompt)


def encode_answer(tokenizer, answer: str) -> list[int]:
    """The SFT target: the answer's ids, then EOS so the model learns to stop."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
