"""This module computes the alphabet of a set of examples: every character a char-level tokenizer needs so that
their prompts and answers round-trip exactly (relayrl.models.tokenizer builds one over it).

    alphabet_of(examples, *texts)   the characters of each prompt (a string; or each message's role and
                                    content), each answer and each extra text (a system prompt, prompts as a
                                    chat template rendered them), sorted, each once

Sorted rather than in first-seen order, so the same rows in another order (a shuffled file) give the same
tokenizer. A built-in task states its alphabet by hand (Task.alphabet, fixed ids for its tiny model); a task that
only has examples can take this one.

It imports the task protocol only; it must never import another relayrl layer: data is a leaf, which rewards and the
controller import.
"""

from __future__ import annotations

from collections.abc import Iterable

from relayrl.data.tasks import Example


def alphabet_of(examples: Iterable[Example], *texts: str) -> str:
    chars: set[str] = set()
    for ex in examples:
        if isinstance(ex.prompt, str):
            chars.update(ex.prompt)
        else:
            for m in ex.prompt:
                chars.update(m.get("role") or "")
                content = m.get("content")
                chars.update(content if isinstance(content, str) else "")
        chars.update(ex.answer or "")
    for t in texts:
        chars.update(t)
    return "".join(sorted(chars))
