"""Tensor-parallel execution: one process per TP rank, each holding a ModelRunner shard.

    driver process (scheduler, sampler) ──pipe──> rank 0 ┐
                                        ──pipe──> rank 1 ├─ gloo / nccl all-reduce inside the forward
                                        ──pipe──> ...    ┘
    every call goes to all ranks; rank 0's result comes back (all ranks compute the same logits),
    or every rank's with call_all (e.g. a weight sync's per-rank figures)
    run_fn(fn, *args): fn(runner, *args) on every rank — how layers above the engine (the weight
    sync) act on a rank's parameters without the engine importing them

The driver process itself joins no process group, so a trainer in the same process keeps its own.
"""

from __future__ import annotations

import gc
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import TPInfo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, cfg, dtype, device: str, conn) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=size)
    try:
        _serve(rank, size, cfg, dtype, device, conn)
    finally:
        # work done inside a function, then collect, barrier, destroy: gloo groups otherwise
        # abort at exit on these machines about half the time
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _serve(rank, size, cfg, dtype, device, conn) -> None:
    if device.startswith("cuda"):
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    runner = ModelRunner(cfg, dtype, TPInfo(rank, size, dist.group.WORLD), device)
    conn.send(("ok", None))
    while True:
        method, args, every_rank = conn.recv()
        if method == "stop":
            conn.send(("ok", None))
            return
        try:
            if method == "__fn__":
                result = args[0](runner, *args[1:])
            else:
                result = getattr(runner, method)(*args)
            conn.send(("ok", result if rank == 0 or every_rank else None))
        except Exception:  # reported to the driver, which raises it
            conn.send(("error", traceback.format_exc()))


class TPWorkerGroup:
    def __init__(self, cfg, dtype: torch.dtype, tp_size: int, device: str = "cpu"):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(tp_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, tp_size, port, cfg, dtype, device, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._gather()

    def _recv(self, rank: int):
        conn, proc = self.conns[rank], self.procs[rank]
        while not conn.poll(1.0):  # a rank that died (killed, failed to start) must not hang the caller
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel worker {rank} exited (code {proc.exitcode}) without answering")
        return conn.recv()

    def _gather(self) -> list:
        results = [self._recv(r) for r in range(len(self.conns))]
        errors = [r[1] for r in results if r[0] == "error"]
        if errors:
            raise RuntimeError("tensor-parallel worker failed:\n" + errors[0])
        return [r[1] for r in results]

    def call(self, method: str, *args):
        """method(*args) on every rank's runner; rank 0's result."""
        for c in self.conns:
            c.send((method, args, False))
        return self._gather()[0]

    def call_all(self, method: str, *args) -> list:
        """method(*args) on every rank's runner; every rank's result, by rank."""
        for c in self.conns:
            c.send((method, args, True))
        return self._gather()

    def run_fn(self, fn, *args) -> list:
        """fn(runner, *args) on every rank (fn: a module-level function); results by rank."""
        return self.call_all("__fn__", fn, *args)

    def close(self) -> None:
        if not self.procs:
            return
        try:
            self.call("stop")
        except (OSError, EOFError):
            pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self.procs, self.conns = [], []
