"""This module turns a raw prompt into the text the model sees (optionally through its chat template).

A prompt is a string or a list of chat messages (TRL's conversational format,
`[{"role": "user", "content": "..."}]`, a system message optionally first). A string goes through the
chat template only when `data.use_chat_template` is true; a list of messages always does, since a
template is the only way to turn messages into text: with `use_chat_template: false` message prompts
are still rendered through the tokenizer's template, and a tokenizer without one is a DataError.

It imports the standard library and relayrl.errors only; it must never import another relayrl layer:
data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any

from relayrl.errors import DataError

Prompt = str | list[dict[str, Any]]


def uses_chat_template(prompt: Prompt, use_chat_template: bool) -> bool:
    """Whether `prompt` is rendered through the chat template: always for messages, for text when asked."""
    return use_chat_template or not isinstance(prompt, str)


def format_prompt(tokenizer: Any, prompt: Prompt, use_chat_template: bool, system: str | None = None) -> str:
    """The prompt text to tokenize.

    A string prompt without a chat template is used as is (a system prompt is then an error rather
    than silently dropped). Through the template, the messages are [system?, user] for a string and
    the list itself for messages (with the system prompt first unless it has one), and the template's
    generation prompt is appended, so the completion starts right where the assistant's turn begins.
    """
    if not uses_chat_template(prompt, use_chat_template):
        if system is not None:
            raise DataError(
                "data.system_prompt is set but data.use_chat_template is false; "
                "enable the chat template or drop the system prompt"
            )
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        if isinstance(prompt, str):
            raise DataError(
                "data.use_chat_template is true but the tokenizer has no chat template; "
                "set data.use_chat_template=false or add a chat_template to the tokenizer"
            )
        raise DataError(
            "the dataset's prompts are chat messages, which only a chat template can turn into text, but the "
            "tokenizer has no chat template; add a chat_template to the tokenizer or use string prompts"
        )
    return tokenizer.apply_chat_template(prompt_messages(prompt, system), add_generation_prompt=True, tokenize=False)


def prompt_messages(prompt: Prompt, system: str | None = None) -> list[dict[str, Any]]:
    """A prompt as chat messages: a string becomes one user message; a list of messages (TRL's
    conversational format) is taken as is. A system prompt goes first unless the messages have one."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def prompt_key(prompt: Prompt) -> Hashable:
    """A hashable key equal for equal prompts: the string itself, or the messages as canonical JSON
    (tagged, so no string prompt can equal a message prompt's key)."""
    if isinstance(prompt, str):
        return prompt
    return ("messages", json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str))
