"""This module measures the wall time of each loop stage.

The driver wraps each stage of a step (`sync`, `rollout`, `score`, ...) in `timer.stage(name)`;
at the end of the step `pop()` hands the totals to the metrics logger as `time/<name>` and starts
the next step from zero. A stage entered several times in one step (e.g. rollout per micro-batch)
accumulates, so the reported number is the stage's total share of the step.

With a `tracer` (relayrl.observe.trace), each entry of a stage is also recorded as a span with its
own start and end, for the run's timeline (`relayrl report RUN --trace`).

It imports the standard library only; it must never import another relayrl layer: observe is a leaf,
which the controller and the CLI import.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class SpanSink(Protocol):
    """Where stage spans go (relayrl.observe.trace.Tracer)."""

    def now_ns(self) -> int: ...

    def record(self, name: str, start_ns: int, end_ns: int, args: dict[str, Any] | None = None) -> None: ...


class StageTimer:
    """Accumulates seconds per stage name until `pop()`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, tracer: SpanSink | None = None) -> None:
        # The clock is injectable so tests need not sleep; perf_counter is monotonic, unlike
        # time.time, so a clock adjustment mid-run cannot produce a negative stage time.
        self._clock = clock
        self._totals: dict[str, float] = {}
        self.tracer = tracer  # settable later: the run attaches its tracer to the driver's timer

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        tracer = self.tracer
        span_start = tracer.now_ns() if tracer is not None else 0
        start = self._clock()
        try:
            yield
        finally:
            # Counted even when the stage raises, so a step that fails still shows where it spent
            # its time before failing.
            self._totals[name] = self._totals.get(name, 0.0) + (self._clock() - start)
            if tracer is not None:
                tracer.record(name, span_start, tracer.now_ns())

    def add(self, name: str, seconds: float) -> None:
        """Adds time measured elsewhere (e.g. reported back by a worker)."""
        self._totals[name] = self._totals.get(name, 0.0) + float(seconds)

    def pop(self) -> dict[str, float]:
        """Returns {"time/<stage>": seconds} for everything since the last pop, and resets."""
        out = {f"time/{name}": seconds for name, seconds in self._totals.items()}
        self._totals = {}
        return out
