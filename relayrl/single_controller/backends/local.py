"""Local backend: one spawned process per rank on this machine, driven over a pipe each.

    driver ── pipe 0 ──> process 0: WorkerHost loop   recv (op, args) → host.op(*args) → send payload
           ── pipe 1 ──> process 1: ...               ("close" → reply, flush, os._exit(0))

Messages are pickled with plain pickle (tensors are copied, not moved to shared memory): simple,
and nothing a worker sends depends on the sender staying alive. A message that several ranks
receive unchanged (ONE_TO_ALL arguments, a chunk shared by TP peers) is pickled once.

A worker leaves with os._exit after its reply to "close" is sent: its process group is already
destroyed, and skipping interpreter finalisation removes the last chance for a C++ destructor to
abort a finished run (as relayrl.parallel.launch does). The processes are started and stopped by
relayrl.parallel.launch (spawn_process / stop_processes), so they die with the driver, SIGKILL
included. The group's store is hosted on 127.0.0.1 only.

It imports torch, relayrl.parallel and the rest of single_controller only; like all of
single_controller, it knows nothing of RL and must never import the RL layers (controller, trainer,
engine, rewards, sync, ...).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import weakref
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from relayrl.parallel.launch import spawn_process, stop_processes
from relayrl.parallel.rendezvous import LOCALHOST
from relayrl.single_controller.backends.host import Payload, WorkerHost, error_payload
from relayrl.single_controller.resource_pool import ResourcePool


def _serve(conn) -> int:
    host = WorkerHost()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return 1  # the driver is gone: leave without the barrier (peers may be gone too)
        try:
            op, args = pickle.loads(data)
        except BaseException:  # e.g. a class this process cannot import
            op, payload = "?", error_payload("unpickling the driver's message:")
        else:
            payload = getattr(host, op)(*args)
        try:
            out = pickle.dumps(payload)
        except BaseException:  # report it, whatever it is
            out = pickle.dumps(error_payload(f"pickling the result of {op} (return CPU tensors and plain data):"))
        del payload
        conn.send_bytes(out)
        if op == "close":
            return 0


def _process_main(conn) -> None:
    code = 1
    try:
        code = _serve(conn)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class LocalBackend:
    master_addr = LOCALHOST

    def __init__(self, pool: ResourcePool):
        self.pool = pool
        ctx = mp.get_context("spawn")
        self.conns: list = []
        self.procs: list[mp.Process] = []
        for rank in range(pool.world_size):
            parent, child = ctx.Pipe(duplex=True)
            # not daemons: a worker may start processes of its own (an engine's tensor-parallel ranks)
            proc = spawn_process(_process_main, (child,), name=f"rl-{pool.name or 'worker'}-{rank}")
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._reaper = weakref.finalize(self, stop_processes, self.procs)

    def pid(self, rank: int) -> int | None:
        return self.procs[rank].pid

    def device_for(self, rank: int) -> str:
        return self.pool.device_for(rank)

    def submit_all(self, calls: dict[int, tuple[str, tuple]]) -> dict[int, int]:
        memo: dict[tuple, bytes] = {}
        blobs = {}
        for rank, (op, args) in calls.items():  # pickle everything first: a failure sends nothing
            key = (op, *map(id, args))
            if key not in memo:
                memo[key] = pickle.dumps((op, args))
            blobs[rank] = memo[key]
        for rank, blob in blobs.items():
            try:
                self.conns[rank].send_bytes(blob)
            except OSError:  # a dead process's pipe: wait() reports it through the sentinel
                pass
        return {rank: rank for rank in calls}

    def wait(self, handles: dict[int, int], timeout: float | None) -> dict[int, Payload]:
        """Payloads of the ranks that answered (or died) within `timeout`; {} when none did."""
        watch = {self.conns[r]: r for r in handles} | {self.procs[r].sentinel: r for r in handles}
        out: dict[int, Payload] = {}
        for obj in wait(list(watch), timeout):
            rank = watch[obj]
            if rank in out:
                continue
            conn = self.conns[rank]
            try:
                if conn.poll():
                    out[rank] = pickle.loads(conn.recv_bytes())
                    continue
            except (EOFError, OSError):
                pass
            self.procs[rank].join(1)
            out[rank] = ("lost", f"died ({_exit_reason(self.procs[rank].exitcode)}) without answering")
        return out

    def stop(self, graceful: bool, timeout: float) -> None:
        """Join the processes (they exit after answering "close"); kill what is left after `timeout`."""
        if graceful:
            deadline = time.monotonic() + timeout
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self._reaper()  # terminate → kill whatever did not exit
        for c in self.conns:
            c.close()


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
