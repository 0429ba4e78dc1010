"""Starting and stopping processes and process groups: the one process manager of relayrl.

Every process relayrl starts on this machine (a worker group's workers, the engine's tensor-parallel
ranks, which are a worker group too, and the ranks of `launch` below) is started by `spawn_process`
and stopped by `stop_processes`:

    spawn_process(target, args)   a 'spawn' child that first asks the kernel to SIGKILL it when
                                  its parent dies (Linux PR_SET_PDEATHSIG), so no rank outlives a
                                  killed driver, whatever killed it (SIGKILL included)
    stop_processes(procs)         SIGTERM, a grace period, then SIGKILL what is left; joins all

`launch(fn, N, *args)` runs one function on N such processes joined in a gloo / nccl group:

    parent ── hosted store (relayrl.parallel.rendezvous: loopback, token) ──┬── rank 0: init_process_group
           │                                                                │   → fn(0, N, *args) → result file
           │                                                                └── rank N-1 ...
           wait on the children: all exit 0 → unpickle their results; a child error → kill the rest and
           re-raise it; past the deadline → kill all, TimeoutError.

Why the parent owns the store: "pick a free port, close it, let rank 0 bind it" races with any other
process on the machine (parallel test runs); a store the parent already listens on never does.

Why the teardown is so careful (`shutdown_process_group`): with gloo, a process that exits while
FSDP / DTensor / checkpoint objects still reference the process group aborts about half the time
("terminate called without an active exception") after an otherwise clean run. The work therefore
runs inside a function whose locals are gone when it returns, then gc, a barrier so that no rank
tears down while a peer still talks to it, then destroy_process_group(). A spawned worker finally
leaves with os._exit(code) after flushing its streams: its result is already on disk, and skipping
interpreter finalisation removes the last chance for a C++ destructor to abort a finished run.

This module imports torch and the standard library only (and relayrl.parallel.rendezvous); it must
never import the RL layers (trainer, engine, controller) or single_controller.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relayrl.parallel import host_memory
from relayrl.parallel.rendezvous import LOCALHOST, StoreAddress, join_store, serve_store

__all__ = ["LOCALHOST", "WorkerError", "die_with_parent", "init_process_group", "launch", "shutdown_process_group",
           "spawn_process", "stop_processes"]


class WorkerError(RuntimeError):
    """A spawned rank raised; the message carries its traceback text."""

    def __init__(self, rank: int, traceback_text: str):
        super().__init__(f"rank {rank} failed:\n{traceback_text}")
        self.rank, self.traceback_text = rank, traceback_text


# ---------------------------------------------------------------------------- processes
def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies, so a killed driver (or test
    runner) leaves no rank behind blocked in a collective. Best effort elsewhere. If the parent is
    already gone when this runs, exit at once."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def set_process_name(name: str) -> None:
    """Linux: the name `ps -o comm`, `top` and /proc/PID/comm show for this process (15 bytes), so an
    operator (or a fault-injection test) can tell the actor's ranks from the rollout worker's."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except OSError:
        pass


def _child_main(target: Callable, args: tuple, name: str | None) -> None:
    die_with_parent()
    if name:
        set_process_name(name)
    target(*args)


def spawn_process(target: Callable, args: tuple = (), *, name: str | None = None,
                  daemon: bool = False) -> mp.Process:
    """Start target(*args) in a fresh 'spawn' process tied to this one's life (module doc), named
    `name` (its first 15 bytes) where the OS shows process names.

    target must be importable by name (a module-level function). daemon=False lets the child start
    processes of its own (a rollout worker starts its engine's tensor-parallel ranks)."""
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_child_main, args=(target, args, name), name=name, daemon=daemon)
    proc.start()
    return proc


def stop_processes(procs: Iterable[mp.Process], grace_s: float = 5.0) -> None:
    """Stop processes started by spawn_process: SIGTERM to the live ones, wait up to grace_s for all
    of them together, SIGKILL whatever is left, and join everything (no zombies). Safe to call twice
    and on processes that already exited."""
    procs = list(procs)
    for p in procs:
        if p.is_alive():
            p.terminate()
            try:  # a stopped (SIGSTOP) process only sees the SIGTERM once it runs again
                os.kill(p.pid, signal.SIGCONT)
            except (OSError, TypeError):
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


# ---------------------------------------------------------------------------- process groups
def init_process_group(
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    store: StoreAddress | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Join the default process group.

    store given: meet at that hosted store (relayrl.parallel.rendezvous; its token is in the
    address). None: the env:// rendezvous of torchrun (MASTER_ADDR / MASTER_PORT set by the
    launcher; torch decides who hosts the store). RANK / WORLD_SIZE are set either way, for code
    that reads them."""
    timeout = timedelta(seconds=timeout_s)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    if store is None:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return
    client = join_store(store, timeout_s)
    dist.init_process_group(backend, store=client, rank=rank, world_size=world_size, timeout=timeout)


def shutdown_process_group() -> None:
    """gc → barrier → destroy: the order that lets gloo processes exit cleanly (module doc)."""
    if not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


# ---------------------------------------------------------------------------- launch
def _call(fn: Callable, rank: int, world_size: int, args: tuple) -> Any:
    # A frame of its own: every object fn made is unreferenced once this returns.
    return fn(rank, world_size, *args)


def _write(path: Path, payload: tuple) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(payload))
    tmp.rename(path)


def _rank_main(rank: int, world_size: int, store: StoreAddress, backend: str, threads: int,
               result_dir: str, fn: Callable, args: tuple) -> None:
    code = 1
    out = Path(result_dir) / f"rank{rank}.pkl"
    try:
        torch.set_num_threads(threads)
        host_memory.apply()  # freed memory kept for the next step (relayrl.parallel.host_memory)
        init_process_group(rank, world_size, backend=backend, store=store)
        try:
            result = _call(fn, rank, world_size, args)
            _write(out, ("ok", result))
            del result
        except BaseException as e:
            tb = traceback.format_exc()
            try:
                exc = pickle.dumps(e)
            except Exception:
                exc = None
            _write(out, ("error", tb, exc, time.time_ns()))
            raise
        shutdown_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _load(path: Path):
    # our own children's result files, in a private temporary directory
    return pickle.loads(path.read_bytes()) if path.exists() else None


def launch(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0,
           threads: int = 1) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size spawned processes; return their results by rank.

    fn must be importable by name (a module-level function) and its result picklable (move tensors
    to the CPU). A rank that raises makes this raise WorkerError with that rank's traceback (the
    others are killed); a run longer than `timeout` seconds is killed and raises TimeoutError.
    """
    hosted = serve_store(LOCALHOST, world_size + 1, timeout_s=timeout)
    with tempfile.TemporaryDirectory(prefix="relayrl-launch-") as tmp:
        result_dir = Path(tmp)
        procs = [spawn_process(_rank_main, (r, world_size, hosted.address, backend, threads, tmp, fn, args),
                               name=f"rl-launch-{r}", daemon=True)
                 for r in range(world_size)]
        try:
            _wait(procs, result_dir, timeout)
        finally:
            stop_processes(procs)
            hosted.close()
        payloads = [_load(result_dir / f"rank{r}.pkl") for r in range(world_size)]
    return [p[1] for p in payloads]


def _wait(procs, result_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    running = {p.sentinel: r for r, p in enumerate(procs)}
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"distributed run exceeded {timeout:.0f}s; ranks still running: "
                               f"{sorted(running.values())} (killed)")
        for sentinel in wait(list(running), timeout=left):
            rank = running.pop(sentinel)
            procs[rank].join()
            payload = _load(result_dir / f"rank{rank}.pkl")
            if payload is not None and payload[0] == "error":
                _raise_first_error(result_dir)
            if procs[rank].exitcode != 0 or payload is None:
                raise WorkerError(rank, f"exited with code {procs[rank].exitcode} "
                                        f"({'after' if payload else 'without'} writing a result); "
                                        "see its stderr above")


def _raise_first_error(result_dir: Path) -> None:
    """Raise the earliest error written: a rank's real failure often makes its peers fail next
    (a closed connection), and those secondary errors are listed after it."""
    time.sleep(0.2)  # let near-simultaneous failures land
    payloads = [(int(f.stem[4:]), _load(f)) for f in result_dir.glob("rank*.pkl")]
    errors = sorted(((r, p) for r, p in payloads if p[0] == "error"), key=lambda e: (e[1][3], e[0]))
    first_rank, first = errors[0]
    try:
        cause = pickle.loads(first[2]) if first[2] is not None else None
    except Exception:
        cause = None
    text = first[1] + "".join(f"\n(then rank {r} failed too:)\n{p[1]}" for r, p in errors[1:])
    raise WorkerError(first_rank, text) from cause
