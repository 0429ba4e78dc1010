"""This module turns a raw prompt into the text the model sees (optionally through its chat template).

A prompt is a string or a list of chat messages (TRL's conversational format,
`[{"role": "user", "content": "..."}]`, a system message optionally first). `data.chat_template` decides:

    prompt      always                    never          auto (the default)
    messages    the template              the template   the template
    string      the template (a tokenizer the raw text   the template when the tokenizer has one meant for
                without one: DataError)                  string prompts (string_template), else the raw text

A list of messages always goes through the template, since a template is the only way to turn messages into
text (a tokenizer without one is then a DataError). Under auto a string prompt keeps its raw text when the
tokenizer has no template, or when its template carries the CONVERSATIONS_ONLY mark: relayrl's own tiny
tokenizers (relayrl.models.tokenizer) carry a plain-line template for tool episodes and message prompts, while
the built-in tasks they are built for are completion-style ("12+7=" continued by "19").

It imports the standard library and relayrl.errors only; it must never import another relayrl layer:
data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any, Literal

from relayrl.errors import DataError

Prompt = str | list[dict[str, Any]]
ChatTemplateMode = Literal["auto", "always", "never"]
CHAT_TEMPLATE_MODES = ("auto", "always", "never")

# A Jinja comment (it renders nothing) that marks a template as meant for conversations only: under
# chat_template=auto, string prompts stay raw text. relayrl.models.tokenizer.CHAT_TEMPLATE carries it (a test
# checks); a user may put it into a template of their own for the same effect.
CONVERSATIONS_ONLY = "{# relayrl: conversations only #}"


def max_token_chars(tokenizer: Any) -> int:
    """K, the most characters one token of `tokenizer` stands for: its longest vocabulary entry (a byte-level
    entry is one character per byte, so never fewer than the text it decodes to). A text of more than n x K
    characters is more than n tokens, known without tokenizing it: how prompts and observations are bounded before
    they are sized (a tokenizer given megabytes in one piece takes minutes, or aborts the process)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max(max((len(t) for t in vocab), default=1), 1)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def string_template(tokenizer: Any) -> bool:
    """Whether chat_template=auto renders a string prompt through `tokenizer`'s template: it has one, and the
    template is not marked CONVERSATIONS_ONLY (relayrl's tiny tokenizers' is)."""
    return has_chat_template(tokenizer) and CONVERSATIONS_ONLY not in tokenizer.chat_template


def uses_chat_template(tokenizer: Any, prompt: Prompt, mode: ChatTemplateMode) -> bool:
    """Whether `prompt` is rendered through the chat template under `mode` (the table in the module docstring)."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"chat_template mode must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {mode!r}")
    if not isinstance(prompt, str) or mode == "always":
        return True
    return mode == "auto" and string_template(tokenizer)


def format_prompt(tokenizer: Any, prompt: Prompt, mode: ChatTemplateMode, system: str | None = None) -> str:
    """The prompt text to tokenize.

    A string prompt without a chat template is used as is (a system prompt is then an error rather
    than silently dropped). Through the template, the messages are [system?, user] for a string and
    the list itself for messages (with the system prompt first unless it has one), and the template's
    generation prompt is appended, so the completion starts right where the assistant's turn begins.
    """
    if not uses_chat_template(tokenizer, prompt, mode):
        if system is not None:
            why = ("data.chat_template is never" if mode == "never" else
                   "the tokenizer has no chat template" if not has_chat_template(tokenizer) else
                   "the tokenizer's chat template is for conversations only (relayrl's tiny tokenizers)")
            raise DataError(f"data.system_prompt is set but string prompts are not rendered through a chat "
                            f"template ({why}); set data.chat_template=always with a tokenizer that has a "
                            f"template, or drop the system prompt")
        return prompt
    if not has_chat_template(tokenizer):
        if isinstance(prompt, str):
            raise DataError(
                "data.chat_template is always but the tokenizer has no chat template; "
                "set data.chat_template=auto (or never) or add a chat_template to the tokenizer"
            )
        raise DataError(
            "the dataset's prompts are chat messages, which only a chat template can turn into text, but the "
            "tokenizer has no chat template; add a chat_template to the tokenizer or use string prompts"
        )
    messages = prompt_messages(prompt, system)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2's TemplateError (a template's raise_exception), a TypeError in the template, ...
        said = str(e).strip().splitlines()[0] if str(e).strip() else ""
        roles = ", ".join(str(m.get("role")) for m in messages[:8])
        raise DataError(f"the tokenizer's chat template raised {type(e).__name__}{': ' + said if said else ''} on a "
                        f"prompt of {len(messages)} message(s) (roles: {roles}); fix the template or the prompt "
                        "(data.system_prompt, the dataset's messages)") from None


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
