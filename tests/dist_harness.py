"""Run a test function on N local gloo processes (see relayrl.parallel.launch for the why).

    results = run_distributed(fn, 2, arg)   # fn(rank, world_size, arg) on each rank, by rank

fn must be a module-level function of a test module and return something picklable (CPU tensors).
A failing rank re-raises here with its traceback; a hang past `timeout` kills the ranks and fails.
"""

from __future__ import annotations

from relayrl.parallel.launch import WorkerError, launch

__all__ = ["WorkerError", "run_distributed"]


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    return launch(fn, world_size, *args, backend="gloo", timeout=timeout, threads=1)
