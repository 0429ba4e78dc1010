"""Run a test function on N local gloo processes (see relayrl.parallel.launch for the why).

    results = run_distributed(fn, 2, arg)   # fn(rank, world_size, arg) on each rank, by rank

fn must be a module-level function of a test module and return something picklable (CPU tensors).
A failing rank re-raises here with its traceback; a hang past `timeout` kills the ranks and fails.
"""

from __future__ import annotations

from relayrl.parallel.launch import WorkerError, launch
from relayrl.single_controller.process_setup import configure_process

__all__ = ["WorkerError", "run_distributed"]


def _configured(rank: int, world_size: int, fn, *args):
    configure_process()  # each rank sets up its models' CPU kernels, as every relayrl process that runs models does
    return fn(rank, world_size, *args)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    return launch(_configured, world_size, fn, *args, backend="gloo", timeout=timeout, threads=1)
