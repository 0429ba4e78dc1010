"""This module loads a user's dataset from .jsonl or .parquet into Examples.

A row's prompt is a string or a list of chat messages (each an object with a string `role` among
system/user/assistant/tool and a string `content`; TRL's conversational format). Three layouts
(`data.format`):

    plain   the prompt field and the answer field (required unless `answer_field` is None, then the
            answer is ""); a number or boolean answer is converted with str(), a list or object is written as
            JSON, and a null answer is refused (it would become the text "None", which a completion "None"
            matches): give the row its answer, or set `answer_field: null` for a dataset without answers
    trl     TRL's prompt-only datasets: the prompt field, any other columns (`solution`,
            `ground_truth`, ...) for the reward functions; the answer field is used when a row has it,
            else the answer is "" (a null answer is no answer too: TRL rows may lack one); the answer's
            other types as for plain
    verl    verl's RL parquet: `data_source`, `prompt` (chat messages), `ability`, `reward_model`
            ({style, ground_truth}) and `extra_info`; the answer is `reward_model.ground_truth`
            (a string as is, a number by str(), a list or object as JSON; null is "")
    auto    verl when the first row has a `reward_model` object and a message-list prompt, else plain

Every column but the prompt goes to `meta["fields"]` as read (for user reward functions: TRL-style
batch functions get each as a keyword list, verl-style ones `data_source`, `ground_truth`,
`extra_info`), and `meta["row"]` is the 0-based row index. File examples have no `meta["task"]`,
which is how the `task` reward knows to fall back to exact match.

Every problem is a DataError on one line that says where (file, line or row) and what to do. Input is bounded
before it is sized: a .jsonl line past MAX_LINE_BYTES is refused without being read whole, a prompt past
MAX_PROMPT_CHARS (string, or the messages' contents together) is refused before any tokenizer sees it (a 100 MB
line would abort the process inside the Rust tokenizer), and a row nested past relayrl.config.MAX_JSON_DEPTH or
holding a number of thousands of digits is malformed JSON (relayrl.config.parse_json).

It imports the standard library, pyarrow (on first use) and relayrl.errors only; it must never import another relayrl
layer: data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relayrl.config import parse_json
from relayrl.data.tasks import Example
from relayrl.errors import DataError

SUFFIXES = (".jsonl", ".parquet")
FORMATS = ("auto", "plain", "trl", "verl")
ROLES = ("system", "user", "assistant", "tool")
MAX_LINE_BYTES = 16 * 2**20  # one .jsonl row: a long-context prompt of a million tokens is about 4 MB
MAX_PROMPT_CHARS = 8 * 2**20  # what any tokenizer is given in one piece (relayrl.rollout.prompts checks it too)


def load_dataset_file(
    path: str | Path, prompt_field: str = "prompt", answer_field: str | None = "answer", format: str = "auto"
) -> list[Example]:
    if format not in FORMATS:
        raise DataError(f"unknown dataset format '{format}': use one of {', '.join(FORMATS)}")
    p = Path(path)
    if not p.is_file():
        raise DataError(f"dataset file not found: {p} (check data.path)")
    if p.suffix == ".jsonl":
        rows = _read_jsonl(p)
        where = "line"
    elif p.suffix == ".parquet":
        rows = _read_parquet(p)
        where = "row"
    else:
        raise DataError(f"unsupported dataset file type '{p.suffix}' for {p}: use one of {', '.join(SUFFIXES)}")
    if not rows:
        raise DataError(f"dataset {p} is empty: it needs at least one row with a '{prompt_field}' field")
    if format == "auto":
        format = detect_format(rows[0][1], prompt_field)
    return [_to_example(p, where, loc, row, i, prompt_field, answer_field, format) for i, (loc, row) in enumerate(rows)]


def detect_format(row: dict[str, Any], prompt_field: str = "prompt") -> str:
    """'verl' for a row shaped like verl's (a `reward_model` object and a message-list prompt), else 'plain'."""
    return "verl" if isinstance(row.get("reward_model"), dict) and isinstance(row.get(prompt_field), list) else "plain"


def _read_jsonl(p: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    offset = 0  # of the line's first byte, for an encoding error's position
    with p.open("rb") as f:
        # a bounded read: a line past the bound (a 10 GB file without a newline) is refused, never held whole
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 2), b""), start=1):
            if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                raise DataError(f"{p} line {lineno} is longer than {MAX_LINE_BYTES // 2**20} MiB, past what one "
                                "row may hold; shorten the row (or split the text over several rows)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{p} is not UTF-8: byte {offset + e.start} (line {lineno}) is {raw[e.start]:#04x}; "
                                "save the dataset as UTF-8") from None
            offset += len(raw)
            if not line.strip():
                continue  # blank lines (often a trailing one) are not rows
            try:
                row = parse_json(line)  # bounded: nesting and digits
            except json.JSONDecodeError as e:
                raise DataError(f"malformed JSON in {p} at line {lineno}: {e.msg} (column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(
                    f"malformed row in {p} at line {lineno}: expected a JSON object, got {type(row).__name__}"
                )
            rows.append((lineno, row))
    return rows


def _read_parquet(p: Path) -> list[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq  # lazy: only parquet users pay for the import

    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot read parquet file {p}: {reason}") from None
    return list(enumerate(table.to_pylist()))


def _to_example(
    p: Path, where: str, loc: int, row: dict[str, Any], index: int, prompt_field: str, answer_field: str | None,
    format: str,
) -> Example:
    at = f"{p} {where} {loc}"
    fields = ", ".join(repr(k) for k in row) or "none"
    if prompt_field not in row:
        raise DataError(
            f"{at} has no prompt field '{prompt_field}' (fields: {fields}); set data.prompt_field to the right one"
        )
    prompt = _check_prompt(at, prompt_field, row[prompt_field])
    if format == "verl":
        answer = _verl_answer(at, row)
    elif answer_field is None or (format == "trl" and answer_field not in row):
        answer = ""
    elif answer_field not in row:
        raise DataError(
            f"{at} has no answer field '{answer_field}' (fields: {fields}); set data.answer_field to the right "
            f"one, or to null if there is no answer (data.format=trl: the reward functions read their own columns)"
        )
    else:
        answer = _answer_text(at, answer_field, row[answer_field], format)
    rest = {k: v for k, v in row.items() if k != prompt_field}
    return Example(prompt=prompt, answer=answer, meta={"row": index, "fields": rest})


def _answer_text(at: str, answer_field: str, answer: Any, format: str) -> str:
    """A plain or TRL row's answer as the text the rewards compare against (module docstring)."""
    if answer is None:
        if format == "trl":
            return ""
        raise DataError(f"{at}: answer field '{answer_field}' is null; give the row its answer, or set "
                        "data.answer_field: null if the dataset has no answers (a null would become the text 'None')")
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (list, dict)):
        return json.dumps(answer, ensure_ascii=False, default=str)  # JSON, never a Python repr
    return str(answer)


def _check_prompt(at: str, prompt_field: str, prompt: Any) -> str | list[dict[str, Any]]:
    """The prompt as given: a string, or a non-empty list of {role, content} messages (the keys a
    parquet struct column gives every message but holds null for are dropped), at most MAX_PROMPT_CHARS long."""
    if isinstance(prompt, str):
        _check_length(at, prompt_field, len(prompt))
        return prompt
    what = f"{at}: prompt field '{prompt_field}'"
    if not isinstance(prompt, list):
        raise DataError(f"{what} must be a string or a list of chat messages, got {type(prompt).__name__}")
    if not prompt:
        raise DataError(f"{what} is an empty list of messages; it needs at least one {{role, content}} message")
    messages = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise DataError(f"{what}: message {j} is a {type(m).__name__}, not an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise DataError(f"{what}: message {j} has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{what}: message {j} ({role}) needs a string 'content', got {type(content).__name__}")
        messages.append({k: v for k, v in m.items() if v is not None})
    _check_length(at, prompt_field, sum(len(m["content"]) for m in messages))
    return messages


def _check_length(at: str, prompt_field: str, chars: int) -> None:
    if chars > MAX_PROMPT_CHARS:
        raise DataError(f"{at}: prompt field '{prompt_field}' holds {chars:,} characters, more than "
                        f"{MAX_PROMPT_CHARS:,} (no model's context holds it); shorten the prompt or drop the row")


def _verl_answer(at: str, row: dict[str, Any]) -> str:
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        got = "no 'reward_model'" if rm is None else f"'reward_model' = {str(rm)[:60]}"
        raise DataError(f"{at}: a verl row needs a 'reward_model' object with a 'ground_truth' (got {got}); "
                        f"set data.format=plain or trl for another layout")
    truth = rm["ground_truth"]
    if truth is None:
        return ""
    if isinstance(truth, str):
        return truth
    if isinstance(truth, (list, dict)):
        return json.dumps(truth, ensure_ascii=False, default=str)
    return str(truth)
