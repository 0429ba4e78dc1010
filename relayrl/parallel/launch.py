"""Starting and stopping process groups, and running one function on N local processes.

    parent ── TCPStore(port 0) ──┬── spawn rank 0: init_process_group(store) → fn(0, N, *args) → result file
           (holds the rendezvous │   ...
            socket, so no other  └── spawn rank N-1 ...
            process can take it)
           wait on the children: all exit 0 → unpickle results; a child error → kill the rest, re-raise;
           past the deadline → kill all, TimeoutError.

Why the parent owns the store: "pick a free port, close it, let rank 0 bind it" races with any other
process on the machine (parallel test runs); a store listening on port 0 in the parent never does.

Why the teardown is so careful (`shutdown_process_group`): with gloo, a process that exits while
FSDP / DTensor / checkpoint objects still reference the process group aborts about half the time
("terminate called without an active exception") after an otherwise clean run. The work therefore
runs inside a function whose locals are gone when it returns, then gc, a barrier so that no rank
tears down while a peer still talks to it, then destroy_process_group(). A spawned worker finally
leaves with os._exit(code) after flushing its streams: its result is already on disk, and skipping
interpreter finalisation removes the last chance for a C++ destructor to abort a finished run.
Workers also ask the kernel to kill them when the parent dies, so a killed test run leaves no
ranks behind blocked in a collective.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOCALHOST = "127.0.0.1"


class WorkerError(RuntimeError):
    """A spawned rank raised; the message carries its traceback text."""

    def __init__(self, rank: int, traceback_text: str):
        super().__init__(f"rank {rank} failed:\n{traceback_text}")
        self.rank, self.traceback_text = rank, traceback_text


def free_port(host: str = LOCALHOST) -> int:
    """A port that was free a moment ago (racy; prefer a parent-owned store, see the module doc)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_process_group(
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    master_addr: str = LOCALHOST,
    master_port: int | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Join the default process group.

    master_port given: connect to the TCP store already listening there (launch's parent hosts
    it). master_port None: the env:// rendezvous of torchrun (MASTER_ADDR / MASTER_PORT set by the
    launcher; torch decides who hosts the store). RANK / WORLD_SIZE / MASTER_* are set either way,
    for code that reads them."""
    timeout = timedelta(seconds=timeout_s)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    if master_port is None:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def shutdown_process_group() -> None:
    """gc → barrier → destroy: the order that lets gloo processes exit cleanly (module doc)."""
    if not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def _call(fn: Callable, rank: int, world_size: int, args: tuple) -> Any:
    # A frame of its own: every object fn made is unreferenced once this returns.
    return fn(rank, world_size, *args)


def _write(path: Path, payload: tuple) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(payload))
    tmp.rename(path)


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (a killed test runner must
    not leave ranks behind blocked in a collective). Best effort elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            pass


def _worker(rank: int, world_size: int, port: int, backend: str, threads: int,
            result_dir: str, fn: Callable, args: tuple) -> None:
    code = 1
    out = Path(result_dir) / f"rank{rank}.pkl"
    try:
        _die_with_parent()
        torch.set_num_threads(threads)
        init_process_group(rank, world_size, backend=backend, master_port=port)
        try:
            result = _call(fn, rank, world_size, args)
            _write(out, ("ok", result))
            del result
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
            tb = traceback.format_exc()
            try:
                exc = pickle.dumps(e)
            except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
                exc = None
            _write(out, ("error", tb, exc, time.time_ns()))
            raise
        shutdown_process_group()
        code = 0
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _load(path: Path):
    return pickle.loads(path.read_bytes()) if path.exists() else None


def launch(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0,
           threads: int = 1) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size spawned processes; return their results by rank.

    fn must be importable by name (a module-level function) and its result picklable (move tensors
    to the CPU). A rank that raises makes this raise WorkerError with that rank's traceback (the
    others are killed); a run longer than `timeout` seconds is killed and raises TimeoutError.
    """
    ctx = mp.get_context("spawn")
    store = dist.TCPStore(LOCALHOST, 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="relayrl-launch-") as tmp:
        result_dir = Path(tmp)
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, store.port, backend, threads, tmp, fn, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            _wait(procs, result_dir, timeout)
        finally:
            _kill(procs)
            del store
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
    except Exception:  # noqa: BLE001 - e.g. an exception class the parent cannot import
        cause = None
    text = first[1] + "".join(f"\n(then rank {r} failed too:)\n{p[1]}" for r, p in errors[1:])
    raise WorkerError(first_rank, text) from cause
