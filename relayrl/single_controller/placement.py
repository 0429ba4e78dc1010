"""Turning a placement (role → resource pool) into worker groups, so the driver's code does not
depend on where each role runs.

    roles = spawn_roles(placement, {"actor": (ActorWorker, (cfg,)), "rollout": (RolloutWorker, (cfg,))})
    roles["rollout"].call(RolloutWorker.generate, prompts)
    roles["actor"].call(ActorWorker.update, batch)
    roles.shutdown()

Roles on the same pool object share processes (one ColocatedWorker per process hosts them all);
roles on different pools get groups of their own. Every group is started before any is waited on,
so their processes start and build their models at the same time.

Like the rest of single_controller, this module knows nothing of RL: it imports the rest of
single_controller only, and it must never import the RL layers.
"""

from __future__ import annotations

from collections.abc import Mapping

from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import ColocatedWorker, RoleSpec
from relayrl.single_controller.worker_group import GroupHandle, WorkerGroup


class RoleGroups(Mapping):
    """The role handles of a placement (`roles["actor"]`) and the groups behind them."""

    def __init__(self, handles: dict[str, GroupHandle], groups: list[WorkerGroup]):
        self._handles, self.groups = handles, groups

    def __getitem__(self, role: str) -> GroupHandle:
        try:
            return self._handles[role]
        except KeyError:
            raise KeyError(f"no role {role!r}; roles: {list(self._handles)}") from None

    def __iter__(self):
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)

    def shutdown(self, timeout_s: float | None = None, raise_errors: bool = True) -> None:
        first = None
        for g in reversed(self.groups):
            try:
                g.shutdown(timeout_s, raise_errors)
            except Exception as e:  # shut the others down too
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> RoleGroups:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown(raise_errors=exc_type is None)


def spawn_roles(placement: Mapping[str, ResourcePool], roles: Mapping[str, RoleSpec | type | tuple], *,
                options: GroupOptions | None = None, colocated_cls: type = ColocatedWorker) -> RoleGroups:
    """One WorkerGroup per distinct pool of `placement` (role → pool): a pool with one role runs that
    role's class, a pool with several runs a ColocatedWorker hosting all of them.

    roles: role → class, (class, args), (class, args, kwargs) or RoleSpec.
    colocated_cls: the ColocatedWorker (sub)class that hosts a pool's roles (its own @dispatch
    methods are called on the group: `roles.groups[i].call(MyColocated.sync_weights)`)."""
    if set(placement) != set(roles):
        raise ValueError(f"placement roles {sorted(placement)} and role specs {sorted(roles)} must match")
    by_pool: dict[int, list[str]] = {}
    for role, pool in placement.items():
        by_pool.setdefault(id(pool), []).append(role)
    groups: list[WorkerGroup] = []
    try:
        for names in by_pool.values():  # start every group first: they build in parallel
            if len(names) == 1:
                spec = RoleSpec.of(roles[names[0]])
                cls, args, kwargs = spec.cls, spec.args, spec.kwargs
            else:
                cls, args, kwargs = colocated_cls, (), {"roles": {n: roles[n] for n in names}}
            groups.append(WorkerGroup.start(placement[names[0]], cls, args, kwargs, options))
        for group in groups:
            group.wait_ready()
    except BaseException:
        RoleGroups({}, groups).shutdown(raise_errors=False)
        raise
    handles: dict[str, GroupHandle] = {}
    for names, group in zip(by_pool.values(), groups, strict=True):
        handles.update({names[0]: group} if len(names) == 1 else {n: group.role(n) for n in names})
    return RoleGroups({r: handles[r] for r in placement}, groups)
