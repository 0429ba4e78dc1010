"""This module loads a user's dataset from .jsonl or .parquet into Examples.

Each row needs a string prompt field; the answer field is required unless `answer_field` is None
(then the answer is ""). Non-string answers (numbers) are converted with str(). Every other
column goes to `meta["fields"]` for user reward functions, and `meta["row"]` is the 0-based row
index. File examples have no `meta["task"]`, which is how the `task` reward knows to fall back to
exact match.

Every problem is a DataError on one line that says where (file, line or row) and what to do.

It imports the standard library, pyarrow (on first use) and relayrl.errors only; it must never import another relayrl
layer: data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relayrl.data.tasks import Example
from relayrl.errors import DataError

SUFFIXES = (".jsonl", ".parquet")


def load_dataset_file(
    path: str | Path, prompt_field: str = "prompt", answer_field: str | None = "answer"
) -> list[Example]:
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
    return [_to_example(p, where, loc, row, i, prompt_field, answer_field) for i, (loc, row) in enumerate(rows)]


def _read_jsonl(p: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    offset = 0  # of the line's first byte, for an encoding error's position
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{p} is not UTF-8: byte {offset + e.start} (line {lineno}) is {raw[e.start]:#04x}; "
                                "save the dataset as UTF-8") from None
            offset += len(raw)
            if not line.strip():
                continue  # blank lines (often a trailing one) are not rows
            try:
                row = json.loads(line)
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
    p: Path, where: str, loc: int, row: dict[str, Any], index: int, prompt_field: str, answer_field: str | None
) -> Example:
    fields = ", ".join(repr(k) for k in row) or "none"
    if prompt_field not in row:
        raise DataError(
            f"{p} {where} {loc} has no prompt field '{prompt_field}' (fields: {fields}); "
            f"set data.prompt_field to the right one"
        )
    prompt = row[prompt_field]
    if not isinstance(prompt, str):
        raise DataError(
            f"{p} {where} {loc}: prompt field '{prompt_field}' must be a string, got {type(prompt).__name__}"
        )
    if answer_field is None:
        answer = ""
    elif answer_field not in row:
        raise DataError(
            f"{p} {where} {loc} has no answer field '{answer_field}' (fields: {fields}); "
            f"set data.answer_field to the right one, or to null if there is no answer"
        )
    else:
        answer = row[answer_field]
        answer = answer if isinstance(answer, str) else str(answer)
    rest = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
    return Example(prompt=prompt, answer=answer, meta={"row": index, "fields": rest})
