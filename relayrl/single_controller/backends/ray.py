"""Ray backend: one Ray actor per rank, each running the same WorkerHost as a local process.

    pool [4, 4] → placement group per node, STRICT_PACK, bundles {CPU: cpus_per_process, GPU: gpus_per_process
                  on cuda}
               → actor of rank r in bundle (its node's group, its local rank)

Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES, so a worker's device is cuda:0 (an actor of several GPUs
sees them as cuda:0.., for the group it starts). The driver
hosts the rendezvous store at its node's IP (that interface only, behind the run's token gate:
relayrl.parallel.rendezvous): run the driver on a node of the cluster (`ray job submit` does).
relayrl must be importable on every node. Calls are actor method calls; a payload comes back as
the call's result, a dead actor as an error payload. Shutdown: "close" on every
actor (teardown order in host.py), then ray.kill and the placement groups are removed.

It imports ray (on first use) and the rest of single_controller only; like all of single_controller, it
knows nothing of RL and must never import the RL layers (controller, trainer, engine, rewards, sync,
...).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from relayrl.single_controller.backends.host import Payload, WorkerHost
from relayrl.single_controller.resource_pool import ResourcePool


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("the ray backend needs Ray: pip install 'relayrl[ray]'") from e
    return ray


def bundle_of(pool: ResourcePool) -> dict[str, float]:
    """What each of the pool's processes reserves: its CPUs, and its GPUs on cuda."""
    return {"CPU": pool.cpus_per_process} | ({"GPU": pool.gpus_per_process} if pool.device_type == "cuda" else {})


def room(pool: ResourcePool) -> int:
    """How many more one-node groups like `pool` Ray could place now: node by node, the copies of its processes'
    bundles the node's free resources hold (what a node that joined the cluster adds; what placement groups
    already reserved is not free). Per node from Ray's state, else (that view unavailable) from the cluster's
    total, which can overcount a cluster whose free resources are split over nodes."""
    ray = _ray()
    need = bundle_of(pool)
    if len(pool.processes_per_node) != 1:
        raise ValueError(f"room() counts one-node pools; {pool.processes_per_node} spans nodes")
    processes = pool.processes_per_node[0]
    try:
        from ray._private.state import available_resources_per_node  # Ray's own view, per node

        nodes = list(available_resources_per_node().values())
    except (ImportError, AttributeError):
        nodes = [ray.available_resources()]
    return sum(int(min(free.get(k, 0.0) / v for k, v in need.items()) + 1e-9) // processes for free in nodes)


class RayBackend:
    def __init__(self, pool: ResourcePool, ready_timeout_s: float = 300.0):
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()  # RAY_ADDRESS / a running cluster, else a local one
        self.pool, self._ray = pool, ray
        self._remove_pg = remove_placement_group
        bundle = bundle_of(pool)
        gpus = int(bundle.get("GPU", 0))
        self.pgs = [placement_group([bundle] * n, strategy="STRICT_PACK") for n in pool.processes_per_node]
        self.actors: list[Any] = []
        try:
            ready, _ = ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs), timeout=ready_timeout_s)
            if len(ready) < len(self.pgs):
                raise RuntimeError(f"Ray could not reserve pool {pool.name or ''} {pool.processes_per_node} x "
                                   f"{bundle} within {ready_timeout_s:.0f}s; check ray.cluster_resources()")
            host_cls = ray.remote(WorkerHost)
            for rank in range(pool.world_size):
                node, local = pool.locate(rank)
                strategy = PlacementGroupSchedulingStrategy(self.pgs[node], placement_group_bundle_index=local)
                self.actors.append(host_cls.options(num_cpus=pool.cpus_per_process, num_gpus=gpus,
                                                    scheduling_strategy=strategy).remote())
        except BaseException:
            self.stop(graceful=False, timeout=0)
            raise

    @property
    def master_addr(self) -> str:
        return self._ray.util.get_node_ip_address()

    def pid(self, rank: int) -> int | None:
        return None  # known once the worker answers "construct"

    def device_for(self, rank: int) -> str:
        return "cpu" if self.pool.device_type == "cpu" else f"{self.pool.device_type}:0"

    def submit_all(self, calls: dict[int, tuple[str, tuple]]) -> dict[int, Any]:
        # an argument object several ranks receive (same args to all, a chunk shared by TP peers)
        # goes to the object store once; Ray resolves a top-level ObjectRef argument to its value
        uses = Counter(id(a) for _, args in calls.values() for a in args)
        stored: dict[int, Any] = {}
        refs = {}
        for rank, (op, args) in calls.items():
            passed = []
            for a in args:
                if uses[id(a)] > 1 and isinstance(a, (tuple, dict)) and a:
                    if id(a) not in stored:
                        stored[id(a)] = self._ray.put(a)
                    a = stored[id(a)]
                passed.append(a)
            refs[rank] = getattr(self.actors[rank], op).remote(*passed)
        return refs

    def wait(self, handles: dict[int, Any], timeout: float | None) -> dict[int, Payload]:
        ray = self._ray
        by_ref = {ref: rank for rank, ref in handles.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout)
        if ready:  # collect everything else that is done too
            ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        out = {}
        for ref in ready:
            rank = by_ref[ref]
            try:
                out[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as e:  # the actor's process is gone
                out[rank] = ("lost", f"died (Ray: {type(e).__name__}: {str(e).strip().splitlines()[0]})")
            except Exception as e:  # an unserialisable result
                out[rank] = ("error", f"Ray actor of rank {rank} failed: {type(e).__name__}: {e}", None)
        return out

    def stop(self, graceful: bool, timeout: float) -> None:
        for actor in self.actors:
            self._ray.kill(actor)
        for pg in self.pgs:
            self._remove_pg(pg)
        self.actors, self.pgs = [], []
