"""This module writes a run's metrics: one JSON object per line in run_dir/metrics.jsonl, plus the sinks of
relayrl.observe.loggers (TensorBoard scalars; W&B offline and MLflow when listed).

metrics.jsonl is the record the report, the CLI summary and the golden-curve tests read; TensorBoard
is for watching a run live. Each line goes to the file in one write of its own (append_line), so a run killed at
any moment loses at most the line being written — `read_metrics` skips such a truncated last line; a write that
fails (a full disk, a read-only remount) takes back what it wrote of its line before the error goes up, so the
file holds whole lines only and a `--resume` continues it.

Resuming from a checkpoint at step S replays steps S+1.. that the killed run may already have
logged; `truncate_metrics(run_dir, S)` drops those lines first (and the logger tells TensorBoard to
purge them), so a resumed run's file equals the one a never-stopped run would have written. The
append-only sinks (W&B, MLflow) cannot forget: the (step, metric) pairs the dropped lines held are not
sent to them again.

Tables (what the model said: relayrl.observe.samples) go to the sinks through `log_table`, beside the scalars.

It imports relayrl.observe.loggers (whose packages load lazily) and relayrl.errors only; it must never
import another relayrl layer: observe is a leaf, which the controller and the CLI import.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relayrl.errors import UserError
from relayrl.observe.loggers import LoggerOptions, build_sinks

METRICS_FILE = "metrics.jsonl"


def metrics_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / METRICS_FILE


def _to_float(key: str, value: Any) -> float:
    # Tensors (0-d or one element) and numpy scalars both have .item(); anything else must be a
    # plain number. Failing here, at the call site, beats a TypeError from json deep in the writer.
    wrong = TypeError(f"metric {key!r} must be a number or a one-element tensor, got {value!r}")
    if hasattr(value, "item"):
        try:
            value = value.item()
        except (RuntimeError, ValueError):  # torch / numpy refusing a multi-element .item()
            raise wrong from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong
    return float(value)


class MetricsLogger:
    """Appends `{"step": step, **metrics}` to metrics.jsonl and fans the scalars out to the sinks.

    `loggers`: the sinks (relayrl.observe.loggers.LOGGERS); None: TensorBoard alone, if `use_tensorboard`.
    `options` names the W&B / MLflow runs; `config` (the resolved run config) is logged to them.
    `resume_step`: when resuming from a checkpoint at that step, lines (and TensorBoard events) of
    later steps left by the interrupted run are dropped before anything new is written.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        use_tensorboard: bool = True,
        resume_step: int | None = None,
        loggers: Sequence[str] | None = None,
        options: LoggerOptions | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # (step -> metric names) the interrupted run logged past the resume point: the append-only
        # sinks already hold them
        self._replayed: dict[int, set[str]] = {}
        if resume_step is not None:
            if metrics_path(self.run_dir).exists():
                for r in _parse_lines(metrics_path(self.run_dir)):
                    if r.get("step", -math.inf) > resume_step:
                        self._replayed.setdefault(int(r["step"]), set()).update(k for k in r if k != "step")
            truncate_metrics(self.run_dir, resume_step)
        names = list(loggers) if loggers is not None else (["tensorboard"] if use_tensorboard else [])
        self._sinks = build_sinks(names, self.run_dir, options or LoggerOptions(), config or {}, resume_step)
        # unbuffered, each line one append_line; append mode keeps what a previous (resumed) run wrote
        self._path = metrics_path(self.run_dir)
        self._fd: int | None = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._fd is None:
            raise RuntimeError("MetricsLogger.log called after close()")
        values = {key: _to_float(key, value) for key, value in metrics.items()}
        if "step" in values:
            raise ValueError("'step' is reserved for the step number; rename that metric")
        record = {"step": int(step), **values}
        # NaN/inf are written as JSON's common extension (NaN, Infinity) rather than dropped: a NaN
        # loss is exactly what someone reading the file needs to see. Python's json reads it back.
        append_line(self._fd, json.dumps(record) + "\n", self._path)
        replayed = self._replayed.get(int(step), ())
        fresh = {k: v for k, v in values.items() if k not in replayed}
        for sink in self._sinks:
            out = fresh if sink.append_only else values
            if out:
                sink.log(int(step), out)

    def log_table(self, step: int, name: str, columns: list[str], data: list[list[Any]],
                  replayed: bool = False) -> None:
        """A table (relayrl.observe.samples' rows of what the model said) to each sink that shows tables;
        `replayed`: the interrupted run already sent it, so the append-only sinks are not sent it again."""
        for sink in self._sinks:
            if not (replayed and sink.append_only):
                sink.log_table(int(step), name, columns, data)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        sinks, self._sinks = self._sinks, []
        first = None
        for sink in sinks:  # each on its own: one failing must not leave the others open
            try:
                sink.close()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def append_line(fd: int, line: str, path: Path) -> None:
    """Append `line` to the file open at `fd` (O_APPEND, one writer: the run directory's lock) whole or not at all:
    a write that fails midway (ENOSPC, EFBIG, EIO) is cut back to the file's length before it, then raised as an
    OSError naming `path`."""
    data = memoryview(line.encode("utf-8"))
    start = os.fstat(fd).st_size
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as e:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass  # left for the next reader: a half line last is skipped, and a resume rewrites the file
        raise OSError(e.errno, e.strerror, str(path)) from e


def _parse_lines(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records: list[dict[str, Any]] = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            # Only the final line can be half-written by a killed run; damage anywhere else means
            # the file was edited or corrupted, which silently skipping would hide.
            if i == last:
                break
            raise UserError(f"{path} line {i + 1} is not valid JSON; fix or remove that line") from e
        records.append(record)
    return records


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of run_dir/metrics.jsonl in file order; [] when the file does not exist."""
    path = metrics_path(run_dir)
    if not path.exists():
        return []
    return _parse_lines(path)


def truncate_metrics(run_dir: str | os.PathLike[str], last_step: int) -> None:
    """Drops records with step > last_step (and a truncated last line), atomically.

    The new content goes to a temporary file in the same directory, is fsynced, then replaces the
    old file by rename, so a crash during truncation leaves either the old or the new file whole.
    """
    path = metrics_path(run_dir)
    if not path.exists():
        return
    rewrite_jsonl(path, [r for r in _parse_lines(path) if r.get("step", -math.inf) <= last_step])


def rewrite_jsonl(path: Path, records: list[dict[str, Any]], ensure_ascii: bool = True) -> None:
    """Replace the JSON-lines file `path` by `records`, atomically: the new content goes to a temporary file in the
    same directory, is fsynced, then replaces the old file by rename, so a crash leaves either file whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=ensure_ascii) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
