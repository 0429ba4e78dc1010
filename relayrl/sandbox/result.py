"""This module defines what a sandboxed run returns.

A `RunResult` holds the run's decoded output and how it ended. `exit_code` is the program's exit
status as a shell reports it (128 + N when signal N killed it, e.g. 152 for SIGXCPU at the CPU
limit), or None when the host killed the sandbox (past the wall clock or the output cap).

It imports the standard library only, and must never import another relayrl layer.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass
class RunResult:
    """The outcome of one `relayrl.sandbox.run`."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    output_truncated: bool
    wall_s: float
    memory_peak_bytes: int | None = None  # the most the run held at once, by its memory cgroup (None: no cgroup)
    memory_exceeded: bool = False  # the kernel killed a process of the run at Limits.memory_mb

    @property
    def ok(self) -> bool:
        """The program ran to its end by itself and exited 0."""
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated

    def describe(self) -> str:
        """One line saying how the run ended: 'exit 0', 'timeout', 'killed by SIGXCPU', ..."""
        if self.timed_out:
            return f"timeout after {self.wall_s:.1f}s"
        if self.output_truncated:
            return "output limit exceeded"
        if self.exit_code is None:
            return "killed"
        if self.memory_exceeded and self.exit_code != 0:
            return "memory limit exceeded"
        if self.exit_code > 128:
            try:
                return f"killed by {signal.Signals(self.exit_code - 128).name}"
            except ValueError:
                pass
        return f"exit {self.exit_code}"
