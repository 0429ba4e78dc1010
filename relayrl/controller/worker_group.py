"""WorkerGroup: N workers of one class on a ResourcePool, called by the driver as one object.

    with WorkerGroup(ResourcePool([4]), ActorWorker, cfg) as actor:   # 4 processes, SPMD inside
        out = actor.compute_logprobs(batch)    # @dispatch(DP_SPLIT) on ActorWorker: split by dp rank,
                                               # run on all 4, concat the dp representatives' results
        actor.execute_all("set_lr", 1e-5)      # a plain method on every rank → list by rank
        actor.execute_rank0("describe")        # a plain method on rank 0 only (no collectives in it!)

Every @dispatch method of the worker class becomes a method of the group; the group only splits
inputs and gathers outputs as the declaration says (relayrl.controller.dispatch). Colocated roles
(`ColocatedWorker`) appear as attributes: `group.actor.compute_logprobs(batch)`. `spawn_roles`
builds the groups of a placement so the driver's code does not depend on it:

    roles = spawn_roles(placement, {"actor": (ActorWorker, (cfg,)), "rollout": (RolloutWorker, (cfg,))})
    roles.rollout.generate(prompts); roles.actor.update(batch); roles.shutdown()

A call waits for every rank. A worker's exception is re-raised here as WorkerError carrying its
traceback (the original exception as __cause__). If a rank fails while its peers do not answer
within `error_grace_s` (they are typically stuck in a collective), or a call exceeds `timeout_s`,
the group is broken: later calls raise, and shutdown kills its processes.
"""

from __future__ import annotations

import pickle
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from relayrl.controller.dispatch import Dispatch, DPInfo, check_layout, collect_outputs, dispatch_mode, split_inputs
from relayrl.controller.resource_pool import ResourcePool
from relayrl.controller.worker import ColocatedWorker, RoleSpec, WorkerInfo, check_role_name
from relayrl.parallel.launch import WorkerError

BACKENDS = ("local", "ray")


def _make_backend(name: str, pool: ResourcePool):
    if name == "local":
        from relayrl.controller.backends.local import LocalBackend
        return LocalBackend(pool)
    if name == "ray":
        from relayrl.controller.backends.ray import RayBackend
        return RayBackend(pool)
    raise ValueError(f"unknown worker-group backend {name!r}; use one of {BACKENDS}")


class _Caller:
    """The calls a driver makes on a group, or on one role of a colocated group (path prefix)."""

    def __init__(self, group: "WorkerGroup", prefix: str, cls: type):
        self._group, self._prefix, self._cls = group, prefix, cls
        for name in dir(cls):
            mode = dispatch_mode(getattr(cls, name, None))
            if mode is None:
                continue
            if hasattr(type(self), name) or name in vars(self):
                raise ValueError(f"{cls.__name__}.{name} is a @dispatch method, but the group already has an "
                                 f"attribute {name!r}; rename the method")
            setattr(self, name, _GroupMethod(self, name, mode))

    @property
    def master_addr(self) -> str:
        """An address of the driver that the group's workers reach (their rendezvous, the weight sync's)."""
        return self._group._backend.master_addr

    def _path(self, method: str) -> str:
        return f"{self._prefix}.{method}" if self._prefix else method

    @property
    def group(self) -> "WorkerGroup":
        """The WorkerGroup behind this handle (for a colocated role: the group hosting all its roles)."""
        return self._group

    @property
    def layout(self) -> list[DPInfo]:
        """Each rank's DPInfo for this role."""
        return self._group._layouts[self._prefix]

    @property
    def dp_size(self) -> int:
        return self.layout[0].dp_size

    def call(self, method: str, *args, **kwargs) -> Any:
        """Call a @dispatch method by name, split and gathered by its declared mode."""
        mode = dispatch_mode(getattr(self._cls, method, None))
        if mode is None:
            raise TypeError(f"{self._cls.__name__}.{method} is not declared with @dispatch(...); declare it, "
                            "or use execute_all / execute_rank0")
        return self._dispatch(method, mode, args, kwargs)

    def _dispatch(self, method: str, mode: Dispatch, args: tuple, kwargs: dict) -> Any:
        layout = self.layout
        per_rank = split_inputs(mode, layout, args, kwargs)
        results = self._group._run({r: ("call", (self._path(method), a, k)) for r, (a, k) in enumerate(per_rank)})
        return collect_outputs(mode, layout, [results[r] for r in range(len(layout))])

    def execute_all(self, method: str, *args, **kwargs) -> list[Any]:
        """Any method, same arguments on every rank; the results by rank."""
        n = self._group.world_size
        results = self._group._run({r: ("call", (self._path(method), args, kwargs)) for r in range(n)})
        return [results[r] for r in range(n)]

    def execute_rank0(self, method: str, *args, **kwargs) -> Any:
        """Any method on rank 0 only. Never for methods with collectives: they need every rank
        (declare those @dispatch(Dispatch.RANK_ZERO))."""
        return self._group._run({0: ("call", (self._path(method), args, kwargs))})[0]


class _GroupMethod:
    """`group.name(...)`: a worker's @dispatch method called through its group."""

    def __init__(self, caller: _Caller, name: str, mode: Dispatch):
        self._caller, self.__name__, self.mode = caller, name, mode
        self.__doc__ = getattr(caller._cls, name).__doc__

    def __call__(self, *args, **kwargs) -> Any:
        return self._caller._dispatch(self.__name__, self.mode, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self.mode.value} method {self._caller._cls.__name__}.{self.__name__} of a worker group>"


class RoleView(_Caller):
    """One role of a colocated group: `group.actor.compute_logprobs(batch)`."""

    def __repr__(self) -> str:
        return f"RoleView({self._prefix!r}: {self._cls.__name__} on {self._group!r})"


class WorkerGroup(_Caller):
    """pool.world_size instances of worker_cls(*init_args, **init_kwargs), one per process.

    Keyword options (so a worker cannot take arguments with these names): backend ("local" or
    "ray"), timeout_s (per call, None = wait forever), error_grace_s (how long to wait for the other
    ranks after one failed), threads (torch threads per worker process)."""

    def __init__(self, pool: ResourcePool, worker_cls: type, *init_args, backend: str = "local",
                 timeout_s: float | None = None, error_grace_s: float = 10.0, threads: int = 1, **init_kwargs):
        self._start(pool, worker_cls, init_args, init_kwargs, backend, timeout_s, error_grace_s, threads)
        self._finish()

    def _start(self, pool, worker_cls, init_args, init_kwargs, backend, timeout_s, error_grace_s, threads) -> None:
        """Start the processes and send them "construct" without waiting (spawn_roles starts several
        groups before waiting on any, so their processes start and build their models in parallel)."""
        self.pool, self.worker_cls, self.backend_name = pool, worker_cls, backend
        self.timeout_s, self.error_grace_s = timeout_s, error_grace_s
        self._broken: str | None = None
        self._closed = False
        self._pending = None
        self._backend = _make_backend(backend, pool)
        try:
            self._iface = worker_cls.group_interface(*init_args, **init_kwargs) \
                if hasattr(worker_cls, "group_interface") else {"": worker_cls}
            # the driver owns the rendezvous store (relayrl.parallel.launch explains why)
            self._store = dist.TCPStore(self._backend.master_addr, 0, pool.world_size + 1, is_master=True,
                                        wait_for_workers=False, timeout=timedelta(seconds=300))
            calls = {r: ("construct", (self._info(r), worker_cls, init_args, init_kwargs, threads))
                     for r in range(pool.world_size)}
            self._pending = (calls, self._backend.submit_all(calls), time.monotonic())
        except BaseException:
            self._fail_construction()
            raise

    def _finish(self) -> None:
        """Wait for construction, learn each role's dp layout, bind the @dispatch methods."""
        try:
            calls, handles, started = self._pending
            self._pending = None
            timeout = None if self.timeout_s is None else max(0.0, self.timeout_s - (time.monotonic() - started))
            self._gather(calls, handles, timeout)
            n = self.pool.world_size
            dp = self._run({r: ("dp_infos", (list(self._iface),)) for r in range(n)})
            self._layouts = {p: [dp[r][p] for r in range(n)] for p in self._iface}
            for prefix, layout in self._layouts.items():
                check_layout(layout, f"{self.worker_cls.__name__}{'.' + prefix if prefix else ''}")
            super().__init__(self, "", self.worker_cls if "" in self._iface else object)
            for prefix, cls in self._iface.items():
                if prefix:
                    check_role_name(prefix, type(self))
                    setattr(self, prefix, RoleView(self, prefix, cls))
        except BaseException:
            self._fail_construction()
            raise

    def _fail_construction(self) -> None:
        self._broken = "construction failed"
        self.shutdown(raise_errors=False)

    def _info(self, rank: int) -> WorkerInfo:
        node, local = self.pool.locate(rank)
        return WorkerInfo(rank, self.pool.world_size, local, node, self._backend.device_for(rank),
                          self._backend.master_addr, self._store.port)

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    def _run(self, calls: dict[int, tuple[str, tuple]], timeout_s: float | None = -1) -> dict[int, Any]:
        """Send each rank its (op, args); wait for all; their values by rank, or raise."""
        if self._closed or self._broken:
            raise RuntimeError(f"worker group {self!r} is {'shut down' if self._closed else 'broken'}"
                               f"{': ' + self._broken if self._broken else ''}; create a new one")
        return self._gather(calls, self._backend.submit_all(calls), self.timeout_s if timeout_s == -1 else timeout_s)

    def _gather(self, calls: dict, pending: dict, timeout_s: float | None) -> dict[int, Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        values: dict[int, Any] = {}
        errors: list[tuple[int, tuple]] = []  # in arrival order: the first is usually the cause
        grace_end = None
        try:
            while pending:
                ends = [t for t in (deadline, grace_end) if t is not None]
                left = None if not ends else max(0.0, min(ends) - time.monotonic())
                done = self._backend.wait(pending, left)
                for rank, payload in sorted(done.items()):
                    del pending[rank]
                    if payload[0] == "ok":
                        values[rank] = payload[1]
                    else:
                        errors.append((rank, payload))
                        if grace_end is None:
                            grace_end = time.monotonic() + self.error_grace_s
                if pending and not done and left is not None and time.monotonic() >= min(ends):
                    break
        except BaseException:  # e.g. Ctrl-C: the unanswered replies would be misread by the next call
            self._broken = "interrupted while waiting for the workers"
            raise
        if pending:
            op = next(iter(calls.values()))[0]
            self._broken = f"ranks {sorted(pending)} did not answer {op!r}"
            if not errors:
                raise TimeoutError(f"{op} on worker group {self!r} exceeded {timeout_s}s; ranks {sorted(pending)} "
                                   "did not answer (group is now broken; shut it down)")
        if errors:
            _raise_worker_errors(errors, pending)
        return values

    def shutdown(self, timeout_s: float = 60.0, raise_errors: bool = True) -> None:
        """Teardown hooks → drop workers → gc → barrier → destroy process group on every rank, then
        join the processes; kill only what did not exit within timeout_s (or all, if broken)."""
        if self._closed or not hasattr(self, "_backend"):
            self._closed = True
            return
        errors = None
        graceful = self._broken is None and self._pending is None  # a pending reply would be misread
        if graceful:
            try:
                self._run({r: ("close", ()) for r in range(self.world_size)}, timeout_s=timeout_s)
            except Exception as e:  # noqa: BLE001 - still stop the processes
                errors, graceful = e, False
        self._closed = True
        self._backend.stop(graceful, timeout_s)
        self._store = None
        if errors is not None:
            if raise_errors:
                raise errors
            warnings.warn(f"worker group shutdown: {errors}", stacklevel=2)

    def __enter__(self) -> "WorkerGroup":
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
            cause = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - the traceback text is enough
            cause = None
    raise WorkerError(rank, text) from cause


class RoleGroups(Mapping):
    """The role handles of a placement (`roles.actor` or `roles["actor"]`) and the groups behind them."""

    def __init__(self, handles: dict[str, _Caller], groups: list[WorkerGroup]):
        self._handles, self.groups = handles, groups

    def __getitem__(self, role: str) -> _Caller:
        return self._handles[role]

    def __getattr__(self, role: str) -> _Caller:
        try:
            return self.__dict__["_handles"][role]
        except KeyError:
            raise AttributeError(f"no role {role!r}; roles: {list(self.__dict__.get('_handles', {}))}") from None

    def __iter__(self):
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)

    def shutdown(self, timeout_s: float = 60.0, raise_errors: bool = True) -> None:
        first = None
        for g in reversed(self.groups):
            try:
                g.shutdown(timeout_s, raise_errors)
            except Exception as e:  # noqa: BLE001 - shut the others down too
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> "RoleGroups":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown(raise_errors=exc_type is None)


def spawn_roles(placement: Mapping[str, ResourcePool], roles: Mapping[str, RoleSpec | type | tuple],
                backend: str = "local", colocated_cls: type = ColocatedWorker, **group_options) -> RoleGroups:
    """One WorkerGroup per distinct pool of `placement` (role → pool): a pool with one role runs that
    role's class, a pool with several runs a ColocatedWorker hosting all of them.

    roles: role → class, (class, args), (class, args, kwargs) or RoleSpec.
    colocated_cls: the ColocatedWorker (sub)class that hosts a pool's roles (its own @dispatch
    methods are called on the group: `roles.groups[i].sync_weights()`).
    group_options: WorkerGroup keyword options (timeout_s, error_grace_s, threads)."""
    if set(placement) != set(roles):
        raise ValueError(f"placement roles {sorted(placement)} and role specs {sorted(roles)} must match")
    by_pool: dict[int, list[str]] = {}
    for role, pool in placement.items():
        by_pool.setdefault(id(pool), []).append(role)
    options = dict(timeout_s=None, error_grace_s=10.0, threads=1)
    unknown = set(group_options) - set(options)
    if unknown:
        raise TypeError(f"spawn_roles: unknown group options {sorted(unknown)}; known: {sorted(options)}")
    options.update(group_options)
    groups: list[WorkerGroup] = []
    try:
        for names in by_pool.values():  # start every group first: they build in parallel
            if len(names) == 1:
                spec = RoleSpec.of(roles[names[0]])
                cls, args, kwargs = spec.cls, spec.args, spec.kwargs
            else:
                cls, args, kwargs = colocated_cls, (), {"roles": {n: roles[n] for n in names}}
            group = WorkerGroup.__new__(WorkerGroup)
            groups.append(group)
            group._start(placement[names[0]], cls, args, kwargs, backend, **options)
        for group in groups:
            group._finish()
    except BaseException:
        RoleGroups({}, groups).shutdown(raise_errors=False)
        raise
    handles: dict[str, _Caller] = {}
    for names, group in zip(by_pool.values(), groups):
        handles.update({names[0]: group} if len(names) == 1 else {n: getattr(group, n) for n in names})
    return RoleGroups({r: handles[r] for r in placement}, groups)
