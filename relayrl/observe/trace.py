"""This module records spans (a name, a start, an end) for a run's timeline, and merges them into one
Chrome / Perfetto trace.

    driver process ─┐  run_dir/trace/driver-0-<host>-<pid>.jsonl   step, sync, rollout, reward, update, ...
    actor rank 0  ──┤  run_dir/trace/actor-0-<host>-<pid>.jsonl    actor.compute_logprobs, actor.update, ...
    actor rank 1  ──┤  run_dir/trace/actor-1-<host>-<pid>.jsonl
    ...             └─ `relayrl report RUN --trace` ──> run_dir/report/trace.json  (chrome://tracing, ui.perfetto.dev)

Each process appends one JSON line per finished span and flushes it, so a killed run keeps every span
that ended (a half-written last line is skipped when merging). Nothing is pickled, nothing is sent to
the driver: a span costs a clock read, a json.dumps and a write (measured: a few microseconds).

One clock for every process: a span's times are `wall_anchor + (perf_counter_ns() - perf_anchor)` in
nanoseconds since the epoch, where the anchors are read together when the process's tracer starts.
Inside a process the times are monotonic (perf_counter), and processes agree as far as their wall
clocks agree: exactly on one machine; across machines (Ray) only as well as the nodes' clocks are
synchronised (NTP: typically well under a millisecond, sometimes worse), so cross-node gaps smaller than
the skew mean nothing. Each node writes where run_dir is on that node: the merged trace has every
process only when run_dir is on a filesystem the nodes share (the host name in each file's name keeps
two nodes' processes with the same pid apart there).

The worker processes learn the directory as an argument: the run hands it to its worker groups in their
options (relayrl.single_controller.liveness.GroupOptions.trace_dir), and each group puts it in its workers'
WorkerInfo, on every backend (Ray's actors included).

It imports the standard library and relayrl.errors only; it must never import another relayrl layer:
observe is a leaf, which the controller, the worker groups and the CLI import.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from relayrl.errors import UserError

TRACE_DIR = "trace"
TRACE_FILE = "trace.json"  # the merged trace, in run_dir/report/


def trace_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / TRACE_DIR


class Tracer:
    """Appends this process's spans to directory/<role>-<rank>-<host>-<pid>.jsonl, one JSON line each:

        {"process": {"role": "actor", "rank": 0, "pid": 4242, "host": "node1"}}   first line
        {"thread": 4242, "name": "MainThread"}                          the first span of each thread
        {"name": "actor.update", "t0": <ns>, "t1": <ns>, "tid": 4242, "args": {...}}
    """

    def __init__(self, directory: str | os.PathLike[str], role: str, rank: int = 0) -> None:
        self._wall0, self._perf0 = time.time_ns(), time.perf_counter_ns()
        self.role, self.rank = role, int(rank)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.]+", "_", role) or "process"
        host = re.sub(r"[^A-Za-z0-9_.]+", "_", socket.gethostname()) or "host"
        self.path = directory / f"{safe}-{self.rank}-{host}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()  # the async driver's rollout thread records too
        self._threads: set[int] = set()
        self._file = open(self.path, "a", encoding="utf-8")
        self._write({"process": {"role": role, "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}})

    def now_ns(self) -> int:
        """Nanoseconds since the epoch, on this process's monotonic clock (see the module's docstring)."""
        return self._wall0 + time.perf_counter_ns() - self._perf0

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """A span around the block; recorded even when the block raises (where the time went before it failed)."""
        start = self.now_ns()
        try:
            yield
        finally:
            self.record(name, start, self.now_ns(), args)

    def record(self, name: str, start_ns: int, end_ns: int, args: dict[str, Any] | None = None) -> None:
        tid = threading.get_native_id()
        line = {"name": name, "t0": int(start_ns), "t1": int(end_ns), "tid": tid}
        if args:
            line["args"] = args
        with self._lock:
            if self._file.closed:
                return
            if tid not in self._threads:
                self._threads.add(tid)
                self._write({"thread": tid, "name": threading.current_thread().name})
            self._write(line)

    def _write(self, obj: dict[str, Any]) -> None:
        # flushed per line: a killed process keeps every finished span
        self._file.write(json.dumps(obj, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


class NullTracer:
    """The tracer of a run with run.trace off: the same calls, nothing recorded."""

    def now_ns(self) -> int:
        return time.time_ns()

    def span(self, name: str, **args: Any):
        return nullcontext()

    def record(self, name: str, start_ns: int, end_ns: int, args: dict[str, Any] | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def open_tracer(directory: str | os.PathLike[str] | None, role: str, rank: int = 0) -> Tracer | NullTracer:
    """A Tracer writing to `directory`, or a NullTracer when it is None (tracing off)."""
    return Tracer(directory, role, rank) if directory is not None else NullTracer()


# ---------------------------------------------------------------------------- merging


def _read_lines(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i == last:  # a process killed mid-write: only its last line can be cut short
                break
            raise UserError(f"{path} line {i + 1} is not valid JSON; fix or remove that line") from None
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _process_order(header: dict[str, Any]) -> tuple:
    role = str(header.get("role", "?"))
    return (role != "driver", role, int(header.get("rank", 0)), int(header.get("pid", 0)))


def merge_traces(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Every run_dir/trace/*.jsonl into one Chrome trace (run_dir/report/trace.json unless `out`):
    complete events (ph "X", microseconds from the earliest span), one pid per process named
    "driver", "actor rank 0", ..., thread names, sorted by start time. Returns its path."""
    run_dir = Path(run_dir)
    files = sorted(trace_dir(run_dir).glob("*.jsonl"))
    procs = []
    for path in files:
        lines = _read_lines(path)
        header = next((x["process"] for x in lines if isinstance(x.get("process"), dict)), None)
        spans = [x for x in lines if "name" in x and "t0" in x and "t1" in x]
        if header is not None and spans:
            procs.append((header, lines, spans))
    if not procs:
        raise UserError(f"{run_dir} has no trace spans ({TRACE_DIR}/*.jsonl): it was run with run.trace=false, "
                        "before tracing existed, or is not a run directory")
    procs.sort(key=lambda p: _process_order(p[0]))
    t_min = min(s["t0"] for _, _, spans in procs for s in spans)
    events: list[dict[str, Any]] = []
    spans_out: list[dict[str, Any]] = []
    seen_names: dict[str, int] = {}
    for pid, (header, lines, spans) in enumerate(procs, start=1):
        role, rank = str(header.get("role", "?")), int(header.get("rank", 0))
        name = "driver" if role == "driver" else f"{role} rank {rank}"
        seen_names[name] = seen_names.get(name, 0) + 1
        if seen_names[name] > 1:  # a resumed run's second driver, a restarted worker
            name = f"{name} (pid {header.get('pid')})"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        events.append({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                       "args": {"labels": f"pid {header.get('pid')}"}})
        for x in lines:
            if "thread" in x:
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": x["thread"],
                               "args": {"name": str(x.get("name", x["thread"]))}})
        for s in spans:
            ev = {"ph": "X", "name": str(s["name"]), "cat": role, "pid": pid, "tid": s.get("tid", 0),
                  "ts": (s["t0"] - t_min) / 1000.0, "dur": max(0, s["t1"] - s["t0"]) / 1000.0}
            if s.get("args"):
                ev["args"] = s["args"]
            spans_out.append(ev)
    # the enclosing span first when two start together, so viewers nest them
    spans_out.sort(key=lambda e: (e["ts"], -e["dur"]))
    trace = {"traceEvents": events + spans_out, "displayTimeUnit": "ms",
             "otherData": {"t0_unix_us": t_min / 1000.0, "clock": "wall anchor + perf_counter, per process"}}
    path = Path(out) if out is not None else run_dir / "report" / TRACE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(trace))
    os.replace(tmp, path)
    return path
