"""This module draws a one-line progress bar for training steps: step, a few metrics, rate and ETA.

On a terminal the bar redraws often. When stderr is not a terminal (CI, `nohup ... > log`), every
redraw becomes a new line in the log, so it is redrawn at most every `NON_TTY_INTERVAL_S` seconds.

It imports tqdm only; it must never import another relayrl layer: observe is a leaf, which the
controller and the CLI import.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm import tqdm

NON_TTY_INTERVAL_S = 5.0


def _format(value: Any) -> str:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Progress:
    """`Progress(total, desc)`; `update(step, {"reward": r, "acc": a})` after each step; `close()`.

    `step` is the number of steps completed so far (absolute, not an increment), so a run resumed
    at step 40 passes `initial=40` and keeps counting from there without skewing the rate.
    """

    def __init__(
        self,
        total: int,
        desc: str = "train",
        *,
        initial: int = 0,
        file: TextIO | None = None,
        disable: bool = False,
    ) -> None:
        stream = file if file is not None else sys.stderr
        self._stream = stream
        is_tty = bool(getattr(stream, "isatty", lambda: False)())
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            file=stream,
            disable=disable,
            dynamic_ncols=is_tty,
            mininterval=0.1 if is_tty else NON_TTY_INTERVAL_S,
            # Without a fixed width tqdm guesses 10 columns on a pipe and drops the postfix.
            ncols=None if is_tty else 120,
        )

    def update(self, step: int, postfix: Mapping[str, Any] | None = None) -> None:
        if postfix:
            # refresh=False: the redraw below (rate-limited by mininterval) shows it.
            self._bar.set_postfix({k: _format(v) for k, v in postfix.items()}, refresh=False)
        self._bar.update(step - self._bar.n)

    def write(self, line: str) -> None:
        """A line of its own above the bar (the bar redrawn below it), on the bar's stream."""
        self._bar.write(line, file=self._stream)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
