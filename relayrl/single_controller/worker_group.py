"""WorkerGroup: N workers of one class on a ResourcePool, called by the driver as one object.

    with WorkerGroup(ResourcePool([4]), ActorWorker, cfg) as actor:       # 4 processes, SPMD inside
        out = actor.call(ActorWorker.compute_logprobs, batch)   # @dispatch(DP_SPLIT): split by dp
                                               # rank, run on all 4, concat the dp representatives'
        actor.execute_all("set_lr", 1e-5)      # a plain method on every rank → list by rank
        actor.execute_rank0("describe")        # a plain method on rank 0 only (no collectives in it!)

`call` takes the worker's method itself (so a reader, and an editor's go-to-definition, lands on
it) or its name; the group only splits inputs and gathers outputs as the method's @dispatch
declaration says (relayrl.single_controller.dispatch). Colocated roles (`ColocatedWorker`) are
reached with `group.role("actor")`. `spawn_roles` builds the groups of a placement so the driver's
code does not depend on it (relayrl.single_controller.placement).

A call waits for every rank, under the deadline of its kind and the workers' heartbeats
(relayrl.single_controller.liveness). A worker's exception is re-raised here as WorkerError carrying
its traceback (the original exception as __cause__; a UserError, or a RunFault from a group the worker
drives, is re-raised as itself, one line).
A worker that dies, stops beating or runs past the deadline raises WorkerLostError /
CallDeadlineError naming role, rank, pid and call; so does a rank whose peers do not answer within
`error_grace_s` after it failed (they are typically stuck in a collective). The group is then
broken: later calls raise, and shutdown kills its processes without raising.

This module is generic: it imports relayrl.parallel (process launch, rendezvous), the rest of
single_controller and relayrl's ground floor, and it must never import the RL layers (controller,
trainer, engine, rewards, ...).
"""

from __future__ import annotations

import pickle
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from relayrl.errors import RunFault, UserError
from relayrl.parallel.launch import WorkerError
from relayrl.parallel.rendezvous import serve_store
from relayrl.single_controller.dispatch import (
    Dispatch,
    DPInfo,
    check_layout,
    collect_outputs,
    deadline_kind,
    dispatch_mode,
    split_inputs,
)
from relayrl.single_controller.liveness import CallDeadlineError, GroupOptions, Liveness, WorkerLostError
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import WorkerInfo, check_role_name

BACKENDS = ("local", "ray", "inline")


def _make_backend(name: str, pool: ResourcePool):
    if name == "inline":
        from relayrl.single_controller.backends.inline import InlineBackend
        return InlineBackend(pool)
    if name == "local":
        from relayrl.single_controller.backends.local import LocalBackend
        return LocalBackend(pool)
    if name == "ray":
        from relayrl.single_controller.backends.ray import RayBackend
        return RayBackend(pool)
    raise ValueError(f"unknown worker-group backend {name!r}; use one of {BACKENDS}")


def _method_name(method: Callable | str) -> str:
    return method if isinstance(method, str) else method.__name__


class GroupHandle:
    """The calls a driver makes on a group, or on one role of a colocated group (path prefix)."""

    def __init__(self, group: WorkerGroup, prefix: str, cls: type):
        self._group, self._prefix, self._cls = group, prefix, cls

    @property
    def master_addr(self) -> str:
        """An address of the driver that the group's workers reach (their rendezvous, the weight sync's)."""
        return self._group._backend.master_addr

    def _path(self, method: str) -> str:
        return f"{self._prefix}.{method}" if self._prefix else method

    @property
    def group(self) -> WorkerGroup:
        """The WorkerGroup behind this handle (for a colocated role: the group hosting all its roles)."""
        return self._group

    @property
    def layout(self) -> list[DPInfo]:
        """Each rank's DPInfo for this role."""
        return self._group._layouts[self._prefix]

    @property
    def dp_size(self) -> int:
        return self.layout[0].dp_size

    def call(self, method: Callable | str, *args, **kwargs) -> Any:
        """Call a @dispatch method of the worker class (the function, or its name), split and
        gathered by its declared mode, under the deadline of its declared kind."""
        name = _method_name(method)
        fn = getattr(self._cls, name, None)
        mode = dispatch_mode(fn)
        if mode is None:
            raise TypeError(f"{self._cls.__name__}.{name} is not declared with @dispatch(...); declare it, "
                            "or use execute_all / execute_rank0")
        layout = self.layout
        per_rank = split_inputs(mode, layout, args, kwargs)
        results = self._group._run({r: ("call", (self._path(name), a, k)) for r, (a, k) in enumerate(per_rank)},
                                   what=self._path(name), kind=deadline_kind(fn))
        return collect_outputs(mode, layout, [results[r] for r in range(len(layout))])

    def call_ranks(self, ranks: Sequence[int], method: Callable | str, *args, **kwargs) -> list[Any]:
        """A @dispatch(ONE_TO_ALL) method on `ranks` only (the same arguments to each), their results in that order:
        a part of the group that works on its own, e.g. one of several engine replicas placed in it. Calls on
        disjoint ranks may run at once from different threads."""
        name = _method_name(method)
        fn = getattr(self._cls, name, None)
        if dispatch_mode(fn) is not Dispatch.ONE_TO_ALL:
            raise TypeError(f"{self._cls.__name__}.{name} must be declared @dispatch(Dispatch.ONE_TO_ALL) to be "
                            "called on some ranks")
        results = self._group._run({r: ("call", (self._path(name), args, kwargs)) for r in ranks},
                                   what=self._path(name), kind=deadline_kind(fn))
        return [results[r] for r in ranks]

    def execute_all(self, method: Callable | str, *args, **kwargs) -> list[Any]:
        """Any method, same arguments on every rank; the results by rank."""
        name, n = _method_name(method), self._group.world_size
        results = self._group._run({r: ("call", (self._path(name), args, kwargs)) for r in range(n)},
                                   what=self._path(name), kind="compute")
        return [results[r] for r in range(n)]

    def execute_rank0(self, method: Callable | str, *args, **kwargs) -> Any:
        """Any method on rank 0 only. Never for methods with collectives: they need every rank
        (declare those @dispatch(Dispatch.RANK_ZERO))."""
        name = _method_name(method)
        return self._group._run({0: ("call", (self._path(name), args, kwargs))}, what=self._path(name),
                                kind="compute")[0]


class RoleView(GroupHandle):
    """One role of a colocated group: `group.role("actor").call(ActorWorker.compute_logprobs, batch)`."""

    def __repr__(self) -> str:
        return f"RoleView({self._prefix!r}: {self._cls.__name__} on {self._group!r})"


class WorkerGroup(GroupHandle):
    """pool.world_size instances of worker_cls(*init_args, **init_kwargs), one per process.

    `options` (GroupOptions: backend, deadlines, heartbeat timeout, error grace, threads) is the one
    keyword the group keeps for itself; every other keyword goes to the worker's constructor.
    `WorkerGroup.start(...)` + `wait_ready()` split construction in two, so several groups can start
    their processes and build their models at the same time (spawn_roles does)."""

    def __init__(self, pool: ResourcePool, worker_cls: type, *init_args, options: GroupOptions | None = None,
                 **init_kwargs):
        self._begin(pool, worker_cls, init_args, init_kwargs, options or GroupOptions())
        self.wait_ready()

    @classmethod
    def start(cls, pool: ResourcePool, worker_cls: type, init_args: tuple = (), init_kwargs: dict | None = None,
              options: GroupOptions | None = None) -> WorkerGroup:
        """Start the processes and send them "construct" without waiting; call wait_ready() next."""
        group = cls.__new__(cls)
        group._begin(pool, worker_cls, init_args, dict(init_kwargs or {}), options or GroupOptions())
        return group

    def _begin(self, pool, worker_cls, init_args, init_kwargs, options: GroupOptions) -> None:
        self.pool, self.worker_cls, self.options = pool, worker_cls, options
        self.backend_name = options.backend
        self.name = pool.name or worker_cls.__name__
        self._broken: str | None = None
        self._closed = False
        self._pending = None
        self._hosted = None
        self._backend = _make_backend(options.backend, pool)
        try:
            self._iface = worker_cls.group_interface(*init_args, **init_kwargs) \
                if hasattr(worker_cls, "group_interface") else {"": worker_cls}
            # the driver hosts the rendezvous (relayrl.parallel.launch explains why), on one interface
            # and behind the run's token (relayrl.parallel.rendezvous); inline workers need none
            deadline = options.deadlines.build
            if options.backend != "inline":
                self._hosted = serve_store(self._backend.master_addr, pool.world_size + 1,
                                           timeout_s=deadline if deadline is not None else 3600.0)
            self._liveness = Liveness(self._hosted.store if self._hosted else None, pool.world_size,
                                      options.heartbeat_timeout_s)
            self._pids = {r: self._backend.pid(r) for r in range(pool.world_size)}
            calls = {r: ("construct", (self._info(r), worker_cls, init_args, init_kwargs, options.threads))
                     for r in range(pool.world_size)}
            self._pending = (calls, self._backend.submit_all(calls), time.monotonic())
        except BaseException:
            self._fail_construction()
            raise

    def wait_ready(self) -> WorkerGroup:
        """Wait for construction, then learn each role's dp layout."""
        try:
            calls, handles, started = self._pending
            self._pending = None
            build = self.options.deadlines.build
            left = None if build is None else max(0.0, build - (time.monotonic() - started))
            pids = self._gather(calls, handles, "construct", "build", left)
            self._pids.update({r: p for r, p in pids.items() if p is not None})
            n = self.pool.world_size
            dp = self._run({r: ("dp_infos", (list(self._iface),)) for r in range(n)}, what="dp_infos", kind="control")
            self._layouts = {p: [dp[r][p] for r in range(n)] for p in self._iface}
            for prefix, layout in self._layouts.items():
                check_layout(layout, f"{self.worker_cls.__name__}{'.' + prefix if prefix else ''}")
            super().__init__(self, "", self.worker_cls if "" in self._iface else object)
            self._roles = {}
            for prefix, cls in self._iface.items():
                if prefix:
                    check_role_name(prefix, type(self))
                    self._roles[prefix] = RoleView(self, prefix, cls)
        except BaseException:
            self._fail_construction()
            raise
        return self

    def role(self, name: str) -> RoleView:
        """One role of a colocated group."""
        try:
            return self._roles[name]
        except KeyError:
            raise KeyError(f"{self!r} hosts no role {name!r}; roles: {sorted(self._roles)}") from None

    def _fail_construction(self) -> None:
        self._broken = "construction failed"
        self.shutdown(raise_errors=False)

    def _info(self, rank: int) -> WorkerInfo:
        node, local = self.pool.locate(rank)
        return WorkerInfo(rank=rank, world_size=self.pool.world_size, local_rank=local, node=node,
                          device=self._backend.device_for(rank),
                          store=self._hosted.address if self._hosted else None, name=self.name,
                          trace_dir=self.options.trace_dir)

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    def _run(self, calls: dict[int, tuple[str, tuple]], what: str, kind: str) -> dict[int, Any]:
        """Send each rank its (op, args); wait for all under the kind's deadline; values by rank."""
        if self._closed or self._broken:
            raise RuntimeError(f"worker group {self!r} is {'shut down' if self._closed else 'broken'}"
                               f"{': ' + self._broken if self._broken else ''}; create a new one")
        return self._gather(calls, self._backend.submit_all(calls), what, kind, self.options.deadlines.of(kind))

    def _who(self, rank: int) -> str:
        pid = self._pids.get(rank)
        return f"{self.name} worker rank {rank} (pid {pid if pid is not None else '?'})"

    def _gather(self, calls: dict, pending: dict, what: str, kind: str, timeout_s: float | None) -> dict[int, Any]:
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        values: dict[int, Any] = {}
        errors: list[tuple[int, tuple]] = []  # in arrival order: the first is usually the cause
        grace_end = None
        try:
            while pending:
                ends = [t for t in (deadline, grace_end) if t is not None]
                now = time.monotonic()
                if ends and now >= min(ends):
                    break
                left = 1.0 if not ends else max(0.0, min(min(ends) - now, 1.0))  # wake to check heartbeats
                done = self._backend.wait(pending, left)
                for rank, payload in sorted(done.items()):
                    del pending[rank]
                    if payload[0] == "ok":
                        values[rank] = payload[1]
                    elif payload[0] == "lost":
                        self._broken = f"{self._who(rank)} {payload[1]}"
                        hint = ("; see its stderr (a driver script that starts worker groups needs an `if __name__ "
                                "== '__main__':` guard: workers are spawned)") if what == "construct" else ""
                        raise WorkerLostError(f"{self._who(rank)} {payload[1]} during {what!r}; the group is "
                                              f"stopped{hint}")
                    else:
                        errors.append((rank, payload))
                        if grace_end is None:
                            grace_end = time.monotonic() + self.options.error_grace_s
                stale = self._liveness.stale(pending) if pending and not done else []
                if stale:
                    rank, quiet = stale[0]
                    self._broken = f"{self._who(rank)} stopped beating"
                    raise WorkerLostError(f"{self._who(rank)} sent no heartbeat for {quiet:.0f}s during {what!r}: "
                                          "it is stopped or hung; the group is stopped")
        except WorkerLostError:
            raise
        except BaseException:  # e.g. Ctrl-C: the unanswered replies would be misread by the next call
            self._broken = "interrupted while waiting for the workers"
            raise
        if pending:
            self._broken = f"ranks {sorted(pending)} did not answer {what!r}"
            if not errors:
                who = ", ".join(self._who(r) for r in sorted(pending))
                raise CallDeadlineError(f"{what!r} on {self.name} ran past its {kind} deadline of {timeout_s:.0f}s "
                                        f"(parallel.call_timeout_s.{kind}): {who} did not answer; the group "
                                        "is stopped")
        if errors:
            _raise_worker_errors(errors, pending)
        return values

    def shutdown(self, timeout_s: float | None = None, raise_errors: bool = True) -> None:
        """Teardown hooks → drop workers → gc → barrier → destroy process group on every rank, then
        join the processes; kill only what did not exit in time (or all, if broken: a broken group
        never raises here)."""
        if self._closed or not hasattr(self, "_backend"):
            self._closed = True
            return
        timeout_s = timeout_s if timeout_s is not None else (self.options.deadlines.close or 120.0)
        errors = None
        graceful = self._broken is None and self._pending is None  # a pending reply would be misread
        if graceful:
            try:
                self._gather(*self._submit_close(), "close", "close", timeout_s)
            except Exception as e:  # still stop the processes
                errors, graceful = e, False
        self._closed = True
        self._backend.stop(graceful, timeout_s)
        if self._hosted is not None:
            self._hosted.close()
            self._hosted = None
        if errors is not None:
            if raise_errors and not isinstance(errors, (WorkerLostError, CallDeadlineError)):
                raise errors
            warnings.warn(f"worker group shutdown: {errors}", stacklevel=2)

    def _submit_close(self) -> tuple[dict, dict]:
        calls = {r: ("close", ()) for r in range(self.world_size)}
        return calls, self._backend.submit_all(calls)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown(raise_errors=exc_type is None)

    def __repr__(self) -> str:
        return (f"WorkerGroup({self.worker_cls.__name__} x {self.world_size}, pool {self.pool.name or '?'} "
                f"{self.pool.processes_per_node}, {self.backend_name})")


def _raise_worker_errors(errors: list[tuple[int, tuple]], pending: dict) -> None:
    rank, (_, text, blob) = errors[0]
    text += "".join(f"\n(then rank {r} failed too:)\n{p[1]}" for r, p in errors[1:])
    if pending:
        text += f"\n(ranks {sorted(pending)} did not answer: stuck in a collective? the group is now broken)"
    cause = None
    if blob is not None:
        try:
            cause = pickle.loads(blob)  # our own workers' exceptions
        except Exception:  # the traceback text is enough
            cause = None
    error = WorkerError(rank, text)
    # a user error stays one line, wherever it was found; so does a fault below the worker (a rank of a group it
    # drives was lost), which is the run's fault and not the worker's bug
    if isinstance(cause, (UserError, RunFault)):
        raise cause from error
    raise error from cause
