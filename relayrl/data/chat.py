"""This module turns a raw prompt into the text the model sees (optionally through its chat template).

It imports relayrl.errors only; it must never import another relayrl layer: data is a leaf, which
rewards and the controller import.
"""

from __future__ import annotations

from typing import Any

from relayrl.errors import DataError


def format_prompt(tokenizer: Any, prompt: str, use_chat_template: bool, system: str | None = None) -> str:
    """The prompt text to tokenize.

    Without a chat template the prompt is used as is (a system prompt is then an error rather than
    silently dropped). With one, the messages are [system?, user] and the template's generation
    prompt is appended, so the completion starts right where the assistant's turn begins.
    """
    if not use_chat_template:
        if system is not None:
            raise DataError(
                "data.system_prompt is set but data.use_chat_template is false; "
                "enable the chat template or drop the system prompt"
            )
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.use_chat_template is true but the tokenizer has no chat template; "
            "set data.use_chat_template=false or add a chat_template to the tokenizer"
        )
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_messages(prompt: str | list[dict[str, Any]], system: str | None = None) -> list[dict[str, Any]]:
    """A prompt as chat messages: a string becomes one user message; a list of messages (TRL's
    conversational format) is taken as is. A system prompt goes first unless the messages have one."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages
