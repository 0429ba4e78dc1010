"""Worker: the object a worker group builds in each of its processes.

    class ActorWorker(Worker):
        def __init__(self, cfg):                 # self.rank / world_size / device already set
            self.init_distributed()              # joins the group's process group (collective)
            self.dims = ParallelDims(dp_shard=-1, tp=cfg.tp, world_size=self.world_size)
            ...
        def dp_info(self):                       # how DP_SPLIT cuts batches for this role
            return dp_info_from_dims(self.rank, self.dims)
        @dispatch(Dispatch.DP_SPLIT)
        def compute_logprobs(self, batch): ...
        def teardown(self):                      # free what references the process group
            del self.model, self.optimizer

The group sets the worker's WorkerInfo before __init__ runs (see `construct`), so subclasses do not
call super().__init__ and may take any arguments. A Worker built directly (a single-process test)
is rank 0 of 1.

Colocation: `ColocatedWorker(roles={"actor": ActorWorker, "rollout": (RolloutWorker, (cfg,))})`
builds every role object in the same process, each with the process's WorkerInfo, so they share its
device and process group. The group exposes them as `group.actor.compute_logprobs(batch)`; the call
travels as the path "actor.compute_logprobs" and each role keeps its own dispatch modes and dp layout.
A subclass may add @dispatch methods that use several roles in-process, called on the group itself:

    class ActorRollout(ColocatedWorker):
        @dispatch(Dispatch.ONE_TO_ALL)
        def sync_weights(self): self.rollout.load_weights(self.actor.local_shards())

It imports torch, relayrl.parallel and the rest of single_controller only; like all of
single_controller, it knows nothing of RL and must never import the RL layers (controller, trainer,
engine, rewards, sync, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relayrl.parallel import launch
from relayrl.parallel.device import process_group_backend
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.rendezvous import LOCALHOST, StoreAddress
from relayrl.single_controller.dispatch import DPInfo


@dataclass(kw_only=True, frozen=True)
class WorkerInfo:
    """Where a worker process sits in its group, and how to reach the group's rendezvous store."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node: int = 0
    device: str = "cpu"
    store: StoreAddress | None = None  # the group's rendezvous, hosted by the process that started it
    name: str = "worker"  # the group's name (its pool's): the process's name in a run's trace
    trace_dir: str | None = None  # where this process appends its spans (relayrl.observe.trace); None: off


class Worker:
    """Base class of worker-group workers: rank info, lazy process-group setup, teardown hook."""

    _info: WorkerInfo = WorkerInfo()

    @property
    def rank(self) -> int:
        return self._info.rank

    @property
    def world_size(self) -> int:
        return self._info.world_size

    @property
    def local_rank(self) -> int:
        return self._info.local_rank

    @property
    def device(self) -> str:
        return self._info.device

    @property
    def in_group(self) -> bool:
        """Whether this worker has a group to join (a rendezvous). Not when it was built directly or by an inline
        group (the driver's own process): there a world of 1 runs without a process group."""
        return self._info.store is not None

    @property
    def master_addr(self) -> str:
        """The address at which this worker reaches the process that started its group."""
        return self._info.store.host if self._info.store is not None else LOCALHOST

    def init_distributed(self, backend: str | None = None, timeout_s: float = 300.0) -> None:
        """Join the group's default process group (gloo on CPU; on CUDA nccl, with gloo for CPU tensors:
        relayrl.parallel.device.process_group_backend), unless `backend` says.

        Collective: every worker of the group must call it (typically in __init__). A no-op when
        the process already joined, so colocated roles may each call it."""
        import torch.distributed as dist

        if dist.is_initialized():
            return
        if self._info.store is None:
            raise RuntimeError(f"{type(self).__name__} has no rendezvous address: it was built directly, or by "
                               "an inline worker group (the driver's own process, which is no group's rank); run "
                               "it on the local or ray backend, or skip init_distributed in one process")
        launch.init_process_group(self.rank, self.world_size, backend=backend or process_group_backend(self.device),
                                  store=self._info.store, timeout_s=timeout_s)

    def dp_info(self) -> DPInfo:
        """Default: pure data parallel, every worker is its own dp rank. Override for TP/PP layouts."""
        return DPInfo(self.rank, self.world_size, True)

    @classmethod
    def group_interface(cls, *init_args, **init_kwargs) -> dict[str, type]:
        """Path prefix → class whose @dispatch methods the group exposes: a plain worker exposes its
        own at the group itself (prefix ""); ColocatedWorker one prefix per role."""
        return {"": cls}

    def teardown(self) -> None:
        """Release objects that hold the process group (models, optimizers, meshes) before the process
        group is destroyed. Called once at group shutdown; the default does nothing."""


def dp_info_from_dims(rank: int, dims: ParallelDims) -> DPInfo:
    """The DPInfo of `rank` in a ParallelDims layout (tp fastest, then cp, ..., pp slowest): dp rank =
    (rank mod dp cp tp) // (cp tp); the pp, cp and tp ranks of a data-parallel rank take the same rows, and its
    pp rank 0, cp rank 0, tp rank 0 answers for them (a pipeline's results are on every pp rank)."""
    inner = dims.tp * dims.cp
    stage = dims.dp * inner  # ranks per pipeline stage
    return DPInfo((rank % stage) // inner, dims.dp, rank % inner == 0 and rank < stage)


def construct(cls: type, info: WorkerInfo, args: tuple = (), kwargs: dict | None = None) -> Any:
    """Build cls(*args, **kwargs) with its WorkerInfo already in place (when it is a Worker)."""
    obj = cls.__new__(cls)
    if isinstance(obj, Worker):
        obj._info = info
    obj.__init__(*args, **(kwargs or {}))
    return obj


@dataclass
class RoleSpec:
    """How to build one role: cls(*args, **kwargs)."""

    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @staticmethod
    def of(spec: RoleSpec | type | tuple) -> RoleSpec:
        """Accepts a RoleSpec, a class, (cls, args) or (cls, args, kwargs)."""
        if isinstance(spec, RoleSpec):
            return spec
        if isinstance(spec, type):
            return RoleSpec(spec)
        if isinstance(spec, tuple) and 1 <= len(spec) <= 3 and isinstance(spec[0], type):
            return RoleSpec(*spec)
        raise TypeError(f"a role is a class, (cls, args), (cls, args, kwargs) or a RoleSpec; got {spec!r}")


class ColocatedWorker(Worker):
    """Several role objects in one process; each is reachable as an attribute named after its role."""

    role_names: tuple[str, ...] = ()

    def __init__(self, roles: dict[str, RoleSpec | type | tuple]):
        self.role_names = tuple(roles)
        for name, spec in roles.items():
            check_role_name(name, type(self))
            spec = RoleSpec.of(spec)
            setattr(self, name, construct(spec.cls, self._info, spec.args, spec.kwargs))

    @classmethod
    def group_interface(cls, roles: dict[str, Any]) -> dict[str, type]:
        # "" too: a subclass may add @dispatch methods that use several roles at once (weight sync)
        return {"": cls} | {name: RoleSpec.of(spec).cls for name, spec in roles.items()}

    def teardown(self) -> None:
        for name in reversed(self.role_names):
            obj = getattr(self, name)
            if hasattr(obj, "teardown"):
                obj.teardown()
            delattr(self, name)


def check_role_name(name: str, owner: type) -> None:
    if not name.isidentifier() or name.startswith("_") or hasattr(owner, name):
        raise ValueError(f"role name {name!r} must be a public identifier that is not already an attribute of "
                         f"{owner.__name__}")
