"""This module refuses text the policy's tokenizer cannot represent, before any work: a prompt (as the model sees
it: relayrl.rollout.prompts.prompt_text, through the chat template where one applies) or a reference answer whose
characters the tokenizer drops (a vocabulary without them and no unk token: Qwen2's loader) or turns into its unk
token would otherwise train and evaluate on other text than the dataset's, silently.

    check_representable(tokenizer, {"train": [...], "eval": [...]}, data, model)
        every text, batch-encoded and decoded back (no special tokens added, none skipped, no clean-up):
        equal, or different only where the tokenizer's own normalisation is harmless (lost_characters), or a
        DataError on one line: the split, the example's index (and its file row), the characters, what to do;
        with max_tokens (the model's maximum length), a prompt too long for it by its characters alone
        (relayrl.data.chat.max_token_chars) is refused first, before anything is tokenized

Harmless differences (what a Hugging Face tokenizer may do to text it represents): anything the decode adds (a
prefix space, a space after a special token), spaces it drops, a run of whitespace that comes back as other
whitespace, and Unicode canonical equivalents (NFC: "e" + U+0301 for "é"). A newline or tab that vanishes, a
character that comes back as another one (or as the unk token, or as U+FFFD from a partial UTF-8 byte sequence)
is lost. Byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's, SmolLM2's) represent every text; the check fires
for character vocabularies (relayrl's tiny models) and vocabularies without byte fallback.

Refusing is the only mode: dropping the characters instead would change the reference answers the rewards compare
completions against, and a tiny model can be built over the dataset's own characters (relayrl.jobs.base_model).

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the loop,
the roles or the jobs.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from difflib import SequenceMatcher

from relayrl.data import DataConfig, Example
from relayrl.data.chat import max_token_chars
from relayrl.data.config import FILE_TASK
from relayrl.errors import DataError
from relayrl.rollout.prompts import prompt_text

SHOWN = 5  # characters named in the message; the rest are counted
UNK_MARK = "\uffff"  # a noncharacter: no text holds it, so an unk token marked with it aligns with nothing


def lost_characters(text: str, decoded: str, unk_token: str | None = None) -> list[str]:
    """The characters of `text` that `decoded` (its round trip through a tokenizer) lost, each once, in order of
    appearance; [] when the two differ only harmlessly (module docstring)."""
    if decoded == text:
        return []
    if unk_token and unk_token in decoded and unk_token not in text:
        decoded = decoded.replace(unk_token, UNK_MARK)  # "<unk>" must not align with a '<' or 'k' of the text
    if unicodedata.normalize("NFC", decoded) == unicodedata.normalize("NFC", text):
        return []
    lost: dict[str, None] = {}
    for op, i1, i2, j1, j2 in SequenceMatcher(None, text, decoded, autojunk=False).get_opcodes():
        if op in ("equal", "insert"):  # an insertion adds to the text, it loses nothing
            continue
        seg, rep = text[i1:i2], decoded[j1:j2]
        if seg.isspace() and (rep.isspace() or not rep):
            # the whole run of whitespace around it, on each side: one that comes back as whitespace, or one of
            # spaces only that vanishes, is harmless
            run, back = _whitespace_run(text, i1, i2), _whitespace_run(decoded, j1, j2)
            if back or set(run) == {" "}:
                continue
        elif unicodedata.normalize("NFC", seg) == unicodedata.normalize("NFC", rep):
            continue
        lost.update(dict.fromkeys(seg if seg.isspace() else (c for c in seg if not c.isspace())))
    return list(lost)


def _whitespace_run(s: str, i: int, j: int) -> str:
    """s[i:j] widened to the whitespace on both sides of it."""
    while i > 0 and s[i - 1].isspace():
        i -= 1
    while j < len(s) and s[j].isspace():
        j += 1
    return s[i:j]


ADVICE = ("remove them from the data, or use a model whose tokenizer has them (without model.path relayrl builds a "
          "tiny model over the dataset's characters)")


def check_representable(tokenizer, splits: dict[str, Sequence[Example]], data: DataConfig, model: str,
                        advice: str = ADVICE, max_tokens: int | None = None) -> None:
    """Refuse (DataError, one line ending in `advice`) the first example of `splits` (in order; its prompt before its
    answer) whose text the tokenizer of `model` (a name for the message) cannot represent; see the module
    docstring."""
    unk = getattr(tokenizer, "unk_token", None)
    for split, examples in splits.items():
        if not examples:
            continue
        n = len(examples)
        texts = [prompt_text(tokenizer, ex, data) for ex in examples] + [ex.answer or "" for ex in examples]
        if max_tokens is not None:
            _check_lengths(tokenizer, texts[:n], split, examples, data, model, max_tokens)
        lost = _round_trip(tokenizer, texts, unk)
        prompt_lost, answer_lost = lost[:n], lost[n:]
        bad = [i for i in range(n) if prompt_lost[i] or answer_lost[i]]
        if not bad:
            continue
        i = bad[0]
        what, chars = ("prompt", prompt_lost[i]) if prompt_lost[i] else ("reference answer", answer_lost[i])
        named = ", ".join(repr(c) for c in chars[:SHOWN]) + (f" and {len(chars) - SHOWN} more"
                                                              if len(chars) > SHOWN else "")
        where = _row(examples[i], split, data)
        others = f"; {len(bad)} of the {len(examples)} {split} examples have such characters" if len(bad) > 1 else ""
        raise DataError(
            f"{split} example {i}{where}: the {what} has characters the tokenizer of {model} cannot represent "
            f"({named}), which the model would never see{others}; {advice}")


def _check_lengths(tokenizer, prompts: list[str], split: str, examples: Sequence[Example], data: DataConfig,
                   model: str, max_tokens: int) -> None:
    """DataError for the first prompt whose characters alone are more tokens than the model holds (no tokenizer sees
    it: megabytes given to one took minutes, or aborted the process)."""
    k = max_token_chars(tokenizer)
    for i, text in enumerate(prompts):
        if len(text) > 2 * max_tokens * k:  # 2: slack for a normaliser that composes characters
            raise DataError(f"{split} example {i}{_row(examples[i], split, data)}: the prompt has {len(text):,} "
                            f"characters, far more than the {max_tokens} tokens {model} holds can take (its tokens "
                            f"are at most {k} characters each); shorten the prompt or drop it")


def _round_trip(tokenizer, texts: list[str], unk: str | None) -> list[list[str]]:
    """Each text's lost characters, the whole list encoded and decoded in one batch each way (10^4 short prompts
    and answers: about half a second on one CPU core)."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return [lost_characters(t, d, unk) for t, d in zip(texts, decoded, strict=True)]


def _row(example: Example, split: str, data: DataConfig) -> str:
    """" (row R of FILE)" for an example read from a dataset file (its 0-based row), else ""."""
    row = example.meta.get("row")
    if data.task != FILE_TASK or row is None:
        return ""
    path = data.eval_path if split == "eval" and data.eval_path else data.path
    return f" (row {row} of {path}, counting from 0)"
