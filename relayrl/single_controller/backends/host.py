"""WorkerHost: what runs inside every worker process, whatever the backend.

    driver ──("construct", info, cls, args, kwargs, threads)──> host starts its heartbeat, builds
                                                                 the worker object, answers its pid
           ──("dp_infos", prefixes)──────────────────────────> each role's DPInfo
           ──("call", "actor.compute_logprobs", args, kwargs)─> getattr path, call (a span in the
                                                                 run's trace when info.trace_dir is set)
           ──("close",)───────────────────────────────────────> teardown hooks → drop the worker
                                                                 → gc → barrier → destroy group
Every operation answers a payload, never raises:
    ("ok", value)  |  ("error", traceback text, pickled exception or None)
A backend adds ("lost", what happened) for a process that died without answering.

Why close drops the worker before the barrier: objects that reference the process group (FSDP
modules, DTensors, meshes) must be gone before destroy_process_group(), or gloo aborts at exit
about half the time (relayrl.parallel.launch explains the order).

It imports torch, relayrl.parallel, relayrl.observe and the rest of single_controller only (the models through
process_setup, which hands them their CPU kernels); like all of single_controller, it knows nothing of RL and must
never import the RL layers (controller, trainer, engine, rewards, sync, ...).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any

from relayrl.observe.trace import NullTracer, Tracer, open_tracer
from relayrl.parallel import launch
from relayrl.single_controller.dispatch import DPInfo
from relayrl.single_controller.liveness import start_heartbeat
from relayrl.single_controller.worker import WorkerInfo, construct

Payload = tuple


def error_payload(context: str = "") -> Payload:
    """The payload of the exception being handled (call from an except block)."""
    exc = sys.exc_info()[1]
    text = (context + "\n" if context else "") + traceback.format_exc()
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:  # the text still carries everything
        blob = None
    return ("error", text, blob)


def resolve(root: Any, path: str) -> Any:
    obj = root
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


class WorkerHost:
    """Holds one process's worker object and runs the driver's operations on it."""

    caught: type[BaseException] = BaseException  # what a call answers as an error payload (in a worker: anything)

    def __init__(self) -> None:
        self.worker: Any = None
        self.info: WorkerInfo | None = None
        self.tracer: Tracer | NullTracer = NullTracer()

    def construct(self, info: WorkerInfo, cls: type, args: tuple, kwargs: dict, threads: int) -> Payload:
        try:
            if info.store is not None:
                start_heartbeat(info.store, info.rank)
            self.tracer = open_tracer(info.trace_dir, info.name, info.rank)
            import torch

            # imports the models: in the worker's process, not wherever single_controller is imported
            from relayrl.single_controller.process_setup import configure_process

            torch.set_num_threads(threads)
            configure_process()  # the models' CPU kernels, decided once in this process (process_setup)
            if info.device.startswith("cuda"):
                torch.cuda.set_device(info.device)
            self.info = info
            with self.tracer.span(f"construct {getattr(cls, '__name__', cls)}", rank=info.rank):
                self.worker = construct(cls, info, args, kwargs)
            return ("ok", os.getpid())
        except BaseException:  # reported to the driver
            return error_payload(f"building {getattr(cls, '__name__', cls)} on rank {info.rank}:")

    def dp_infos(self, prefixes: list[str]) -> Payload:
        try:
            out = {}
            for prefix in prefixes:
                obj = resolve(self.worker, prefix)
                out[prefix] = obj.dp_info() if hasattr(obj, "dp_info") else \
                    DPInfo(self.info.rank, self.info.world_size, True)
            return ("ok", out)
        except BaseException:
            return error_payload()

    def call(self, path: str, args: tuple, kwargs: dict) -> Payload:
        try:
            if self.worker is None:
                raise RuntimeError("this worker was never built (its construction failed) or is closed")
            with self.tracer.span(path, rank=self.info.rank):
                return ("ok", resolve(self.worker, path)(*args, **kwargs))
        except self.caught:
            return error_payload()

    def close(self) -> Payload:
        """Teardown hook, drop the worker, then gc → barrier → destroy_process_group."""
        result: Payload = ("ok", None)
        try:
            if self.worker is not None and hasattr(self.worker, "teardown"):
                self.worker.teardown()
        except BaseException:  # still tear the process group down
            result = error_payload("teardown:")
        self.worker = None
        try:
            launch.shutdown_process_group()
        except BaseException:
            result = error_payload("destroying the process group:")
        self.tracer.close()
        return result
