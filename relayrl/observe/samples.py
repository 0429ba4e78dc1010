"""This module writes what the model said: run_dir/samples.jsonl, one JSON object per sample (an evaluation's
every example; every run.samples_every steps, the first run.samples_per_step samples the step trained on), and
the same rows as a table for the loggers (TensorBoard text, a W&B Table, an MLflow table artifact).

    {"step": 10, "split": "eval", "index": 0, "prompt": "...", "completion": "...", "reward": 1.0, ...}

The fields of a row are relayrl.rollout.sample_rows'; this module adds the step and knows nothing else of them:
it writes any JSON-able rows. Each call's rows are written and flushed at once, so a run killed at any moment
loses at most the line being written (`read_samples` skips such a cut last line); resuming from the checkpoint of
step S drops the rows of later steps first (`truncate_samples`), as metrics.jsonl's lines are, so a resumed run's
file equals the one a never-stopped run would have written.

    SampleLog(path, logger=, resume_step=)   write(step, rows) appends the rows and hands each split's table to
                                             the logger's sinks (MetricsLogger.log_table: `samples/eval`,
                                             `samples/train`); close()

It imports relayrl.observe.metrics (its line reader and its logger) only; it must never import another relayrl
layer: observe is a leaf.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relayrl.observe.metrics import MetricsLogger, _parse_lines, append_line, rewrite_jsonl

SAMPLES_FILE = "samples.jsonl"

Table = tuple[list[str], list[list[Any]]]


def samples_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / SAMPLES_FILE


def read_samples(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every row of a samples file (a run directory: its samples.jsonl) in file order; [] when there is none."""
    path = Path(path)
    path = samples_path(path) if path.is_dir() else path
    return _parse_lines(path) if path.exists() else []


def sample_lines(step: int, rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as samples.jsonl's lines, each led by its step."""
    return "".join(json.dumps({"step": int(step), **row}, ensure_ascii=False, default=str) + "\n" for row in rows)


def truncate_samples(path: Path, last_step: int) -> set[tuple[int, str]]:
    """Drops the rows with step > last_step (and a cut last line) from the samples file, atomically (a temporary
    file renamed into place); returns the (step, split) pairs dropped, which the append-only loggers hold."""
    if not path.exists():
        return set()
    rows = _parse_lines(path)
    dropped = {(int(r["step"]), str(r.get("split"))) for r in rows if r.get("step", -math.inf) > last_step}
    rewrite_jsonl(path, [r for r in rows if r.get("step", -math.inf) <= last_step], ensure_ascii=False)
    return dropped


def _cell(value: Any) -> Any:
    """A table cell: numbers and booleans as themselves, None as an empty string, anything else (chat messages)
    as its JSON."""
    if value is None:
        return ""
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def table(rows: Sequence[Mapping[str, Any]]) -> Table:
    """(columns, data) of the rows for a logger's table: every field but split (the table's name says it), in
    the order first seen; a `rewards` mapping becomes one `reward/<function>` column per function."""
    columns: list[str] = []
    flat = []
    for row in rows:
        cells: dict[str, Any] = {}
        for key, value in row.items():
            if key == "split":
                continue
            if key == "rewards" and isinstance(value, Mapping):
                cells.update({f"reward/{name}": v for name, v in value.items()})
            else:
                cells[key] = value
        for key in cells:
            if key not in columns:
                columns.append(key)
        flat.append(cells)
    return columns, [[_cell(cells.get(c)) for c in columns] for cells in flat]


class SampleLog:
    """Appends rows to the samples file `path` (run_dir/samples.jsonl) and shows each split's rows as a table in
    `logger`'s sinks. `resume_step`: a run resumed from the checkpoint of that step drops the later rows first,
    and the append-only sinks (W&B, MLflow) are not sent again the tables of the (step, split) pairs dropped."""

    def __init__(self, path: str | os.PathLike[str], logger: MetricsLogger | None = None,
                 resume_step: int | None = None) -> None:
        self.path, self.logger = Path(path), logger
        self._replayed = truncate_samples(self.path, resume_step) if resume_step is not None else set()
        self._fd: int | None = None  # opened at the first rows: a run that records none writes no file

    def write(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        append_line(self._fd, sample_lines(step, rows), self.path)  # whole rows, or none on a full disk
        if self.logger is None:
            return
        for split in dict.fromkeys(str(r.get("split")) for r in rows):
            columns, data = table([r for r in rows if str(r.get("split")) == split])
            self.logger.log_table(step, f"samples/{split}", columns, data, replayed=(step, split) in self._replayed)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> SampleLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
