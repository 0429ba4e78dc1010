"""This module turns an example's prompt into token ids; it is the one place where both rollout and SFT turn
examples into model input.

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the
loop, the roles or the jobs.
"""

from __future__ import annotations

from relayrl.data import DataConfig, Example, format_prompt
from relayrl.data.chat import uses_chat_template


def encode_prompt(tokenizer, example: Example, data: DataConfig) -> list[int]:
    """The prompt's ids: BOS (when the tokenizer has one) + a string prompt, or the chat-formatted prompt
    (string prompts with data.use_chat_template, message prompts always), whose template decides the BOS."""
    ids = tokenizer(prompt_text(tokenizer, example, data), add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and not uses_chat_template(example.prompt, data.use_chat_template):
        ids = [bos] + ids
    return ids


def prompt_text(tokenizer, example: Example, data: DataConfig) -> str:
    """The prompt as the model sees it, before tokenizing: the text encode_prompt encodes (its BOS aside), and
    what relayrl.rollout.charset checks the tokenizer can represent."""
    return format_prompt(tokenizer, example.prompt, data.use_chat_template, data.system_prompt)


def encode_answer(tokenizer, answer: str) -> list[int]:
    """The SFT target: the answer's ids, then EOS so the model learns to stop."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
