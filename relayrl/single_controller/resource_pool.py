"""ResourcePool: the processes (one per device) a worker group runs on, and how roles are placed.

    ResourcePool([4, 4], device="cuda")      2 nodes x 4 processes, rank = node-major:
                                             node 0 → ranks 0-3 (cuda:0-3), node 1 → ranks 4-7

A placement maps each role to a pool. Roles mapped to the SAME pool object share its processes
(colocated: one worker process hosts all of them, e.g. actor + rollout swapping the GPU); roles on
different pools run in separate processes on separate devices (disaggregated):

    colocated(pool, ["actor", "rollout", "reference"])   → {"actor": pool, "rollout": pool, ...}
    split_pool(pool, {"actor": 6, "rollout": 2})         → {"actor": [4, 2] on nodes 0-1,
                                                            "rollout": [2] on node 1, devices 2-3}
    {**colocated(train, ["actor", "reference"]), "rollout": gen}                   (mixed)

`relayrl.single_controller.placement.spawn_roles(placement, ...)` turns a placement into groups; the
driver's calls are the same for every placement.

It imports the standard library and relayrl.parallel only; like all of single_controller, it knows
nothing of RL and must never import the RL layers (controller, trainer, engine, rewards, sync, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass

from relayrl.parallel.dims import backend_for

Placement = dict[str, "ResourcePool"]


@dataclass(eq=False)  # identity matters: two pools with equal shapes are still different processes
class ResourcePool:
    """`processes_per_node[i]` worker processes on node i, one device each.

    device_offset[i] is the first local device index the pool uses on node i (split_pool sets it so
    that two pools on one node do not share GPUs). cpus_per_process is what the Ray backend reserves
    per process; a fraction lets several CPU workers share a core. gpus_per_process: the GPUs the Ray
    backend reserves per process on cuda (a process that starts a group of its own, e.g. a rollout worker
    whose engine has tensor-parallel ranks, sees them all: its ranks take cuda:0..).
    """

    processes_per_node: list[int]
    _: KW_ONLY
    device: str = "cpu"
    name: str = ""
    device_offset: list[int] | None = None
    cpus_per_process: float = 0.1
    gpus_per_process: int = 1
    node_ids: list[int] | None = None  # which node of the original pool each entry is (split_pool)

    def __post_init__(self) -> None:
        counts = list(self.processes_per_node)
        if not counts or any(not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"ResourcePool{' ' + self.name if self.name else ''}: processes_per_node must be a "
                             f"non-empty list of integers >= 1, got {self.processes_per_node!r}")
        self.processes_per_node = counts
        backend_for(self.device)  # validates the device type
        self.device_offset = list(self.device_offset or [0] * len(counts))
        self.node_ids = list(self.node_ids or range(len(counts)))
        if len(self.device_offset) != len(counts) or len(self.node_ids) != len(counts):
            raise ValueError("ResourcePool: device_offset and node_ids need one entry per node")
        if self.cpus_per_process < 0:
            raise ValueError(f"ResourcePool: cpus_per_process must be >= 0, got {self.cpus_per_process}")
        if self.gpus_per_process < 1:
            raise ValueError(f"ResourcePool: gpus_per_process must be >= 1, got {self.gpus_per_process}")

    @property
    def world_size(self) -> int:
        return sum(self.processes_per_node)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    def locate(self, rank: int) -> tuple[int, int]:
        """(node index in this pool, local rank on that node) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside pool of {self.world_size} processes")
        for node, n in enumerate(self.processes_per_node):
            if rank < n:
                return node, rank
            rank -= n
        raise AssertionError("unreachable")

    def device_for(self, rank: int) -> str:
        """The device a local process of this rank uses ("cpu", or "cuda:<offset + local rank>")."""
        if self.device_type == "cpu":
            return "cpu"
        node, local = self.locate(rank)
        return f"{self.device_type}:{self.device_offset[node] + local}"


def colocated(pool: ResourcePool, roles: Iterable[str]) -> Placement:
    """Every role on the same pool: one process per device hosts all of them."""
    return {role: pool for role in roles}


def split_pool(pool: ResourcePool, sizes: Mapping[str, int]) -> Placement:
    """Disaggregated placement: consecutive ranks of `pool` for each role, in the order given.

    The sizes may sum to less than the pool (the rest stays unused), never to more."""
    if sum(sizes.values()) > pool.world_size or any(n < 1 for n in sizes.values()):
        raise ValueError(f"split_pool: sizes {dict(sizes)} must be >= 1 each and sum to at most the pool's "
                         f"{pool.world_size} processes")
    out, start = {}, 0
    for role, n in sizes.items():
        per_node: dict[int, list[int]] = {}  # node → local ranks taken
        for rank in range(start, start + n):
            node, local = pool.locate(rank)
            per_node.setdefault(node, []).append(local)
        nodes = sorted(per_node)
        out[role] = ResourcePool(
            [len(per_node[i]) for i in nodes], device=pool.device, name=role,
            device_offset=[pool.device_offset[i] + per_node[i][0] for i in nodes],
            cpus_per_process=pool.cpus_per_process, gpus_per_process=pool.gpus_per_process,
            node_ids=[pool.node_ids[i] for i in nodes])
        start += n
    return out
