"""ParallelDims is the one object that owns a role's topology; it is passed explicitly, never global.

    world = pp x dp_replicate x dp_shard x cp x tp    (rank order: tp fastest, then cp, ..., pp slowest,
                                                       so a TP group is contiguous ranks, e.g. one node's
                                                       GPUs; the planner's order, relayrl.planner.layout)
    mesh dims, always all five (size 1 allowed):   ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    plus ParallelDims.dp_mesh, the flattened dp_replicate x dp_shard (data-parallel rank / size,
    global loss counts, DDP)

Why all five dims even when some are 1: sub-mesh names never depend on the layout, so callers
write `mesh["tp"]` without branching, and a size-1 dim costs one trivial process group.

Context parallelism (cp > 1, relayrl.parallel.context_parallel on mesh["cp"]): the cp ranks of one
data-parallel rank share its batch rows and split their sequences. They hold the same parameters, so
FSDP shards over dp_shard x cp (torchtitan's "dp_shard_cp"), and the sum of the gradients over that
group is the gradient of the global loss.

    dp_replicate > 1, dp_shard = 1  → DDP (or HSDP with nothing to shard)
    dp_shard > 1                    → FSDP; with dp_replicate > 1 → HSDP on (dp_replicate, dp_shard)
    tp > 1                          → tensor parallel inside each data-parallel replica
    cp > 1                          → FSDP on dp_shard x cp (HSDP on (dp_replicate, dp_shard x cp))
    ep > 1                          → the experts split over ep ranks of the dp_shard x cp group (see below)
    pp > 1                          → the layers split into stages over mesh["pp"] (relayrl.parallel.pipeline);
                                      every sub-mesh above is then the one inside this rank's stage

Expert parallelism (ep > 1, relayrl.parallel.expert_parallel on ParallelDims.ep_mesh; torchtitan's convention): ep
is not a dim of the world; it borrows ranks from the data-parallel shard group dp_shard x cp, whose ranks hold the
same dense parameters anyway. That group, flattened (dp_shard outer, cp inner), is cut into (efsdp, ep) with ep
innermost: each run of ep consecutive ranks splits the experts (E / ep whole experts each) and all-to-alls tokens
among themselves; the efsdp = dp_shard x cp / ep ranks holding the same experts shard them further by FSDP (2-D
(dp_replicate, efsdp) for HSDP: ParallelDims.expert_fsdp_mesh), while the rest of the model is sharded by FSDP
over the whole dp_shard x cp group as without EP.

    dp_shard 4, ep 2:   ranks 0 1 | 2 3     ep groups {0, 1} {2, 3}: rank 0 and 2 hold experts 0..E/2-1
                                             expert FSDP groups {0, 2} {1, 3}; dense FSDP group {0, 1, 2, 3}

Pipeline parallelism (pp, outermost as in torchtitan and the planner): the ranks of one stage are a whole
(dp_replicate, dp_shard, cp, tp) layout of their own; ranks at the same coordinates in consecutive stages pass
activations forward and their gradients back. Data-parallel ranks (and global loss counts) are those of one
stage: each pipeline trains the same rows on all its stages.

It imports torch and relayrl.errors only; it must never import another relayrl layer (models,
single_controller, the trainer, the engine, ...): they import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from relayrl.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def backend_for(device: str | torch.device) -> str:
    """The collective backend for a device: gloo on CPU, nccl on CUDA."""
    kind = torch.device(device).type
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "nccl"
    raise ConfigError(f"no collective backend known for device type {kind!r} (supported: cpu → gloo, cuda → nccl)")


@dataclass(kw_only=True)
class ParallelDims:
    """Parallel degrees of one role. dp_shard=-1 takes whatever the world leaves."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel: borrowed from dp_shard x cp, not a dim of the world (module docstring)
    world_size: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _dp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _fsdp_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _sparse_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "cp", "pp", "ep", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel degree {name} must be an integer >= 1, got {value!r}")
        if self.dp_shard == -1:
            rest = self.pp * self.dp_replicate * self.cp * self.tp
            if self.world_size % rest:
                pp = f"pp ({self.pp}) x " if self.pp > 1 else ""
                cp = f" x cp ({self.cp})" if self.cp > 1 else ""
                raise ConfigError(f"dp_shard=-1: world_size {self.world_size} is not divisible by "
                                  f"{pp}dp_replicate ({self.dp_replicate}){cp} x tp ({self.tp}) = {rest}")
            self.dp_shard = self.world_size // rest
        if not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ConfigError(f"parallel degree dp_shard must be an integer >= 1 or -1, got {self.dp_shard!r}")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            pp = f"pp ({self.pp}) x " if self.pp > 1 else ""
            cp = f" x cp ({self.cp})" if self.cp > 1 else ""
            raise ConfigError(
                f"{pp}dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}){cp} x tp ({self.tp}) = "
                f"{product}, "
                f"but world_size is {self.world_size}: the degrees must multiply to the number of ranks"
            )
        if self.ep > 1:
            if (self.dp_shard * self.cp) % self.ep:
                raise ConfigError(f"ep={self.ep} must divide dp_shard x cp = {self.dp_shard * self.cp}: expert "
                                  "parallelism borrows its ranks from the data-parallel shard group")
            if self.tp > 1:
                raise ConfigError(f"ep={self.ep} with tp={self.tp} is not supported (experts are not tensor-parallel "
                                  "yet): set tp=1 or ep=1")

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batch shards are trained at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """How many ranks of one dp_replicate row hold the same experts (and FSDP-shard them): dp_shard x cp / ep."""
        return self.dp_shard * self.cp // self.ep

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the (pp, dp_replicate, dp_shard, cp, tp) mesh and its flattened "dp" dim (with cp > 1 also
        FSDP's dp_shard x cp); once per dims."""
        if self._mesh is not None:
            raise RuntimeError("ParallelDims.build_mesh was already called; pass the mesh it returned around")
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=MESH_DIMS)
        # private but the established way (torchtitan does the same) to get one group over both dp
        # dims; kept here because slicing a flattened dim out of the root mesh is being deprecated
        self._dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        if self.cp > 1:  # FSDP's group: dp_shard x cp, 2-D under dp_replicate for HSDP (bookkept, not sliced)
            if self.dp_replicate > 1:
                self._fsdp_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")._unflatten(
                    0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp"))
            else:
                self._fsdp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if self.ep > 1:  # (dp_replicate, efsdp, ep) over the same ranks as (dp_replicate, dp_shard, cp)
            self._sparse_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_ep")._unflatten(
                0, (self.dp_replicate, self.efsdp, self.ep), ("dp_replicate", "efsdp", "ep"))
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) first")
        return self._mesh

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        """1-D mesh over the pp ranks of this rank's pipeline (one per stage; relayrl.parallel.pipeline)."""
        return self.mesh["pp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        """1-D mesh over the cp ranks that split one batch row's sequence (relayrl.parallel.context_parallel)."""
        return self.mesh["cp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """1-D mesh over all data-parallel ranks (batch sharding, global token counts, DDP)."""
        self.mesh  # noqa: B018 - the property raises the helpful error when the mesh is not built
        return self._dp_mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh fully_shard takes: 1-D over dp_shard (x cp), or 2-D (dp_replicate, dp_shard (x cp)) for HSDP."""
        self.mesh  # noqa: B018 - the property raises the helpful error when the mesh is not built
        return self._fsdp_mesh if self._fsdp_mesh is not None else fsdp_mesh_of(self.mesh)

    @property
    def ep_mesh(self) -> DeviceMesh:
        """1-D mesh over the ep ranks that split the experts and exchange tokens (relayrl.parallel.expert_parallel)."""
        return self._sparse("ep")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh fully_shard takes for the experts: 1-D over efsdp, or 2-D (dp_replicate, efsdp) for HSDP."""
        return self._sparse("dp_replicate", "efsdp") if self.dp_replicate > 1 else self._sparse("efsdp")

    def _sparse(self, *names: str) -> DeviceMesh:
        self.mesh  # noqa: B018 - the property raises the helpful error when the mesh is not built
        if self._sparse_mesh is None:
            raise ConfigError("the expert meshes exist with ep > 1 only")
        return self._sparse_mesh[names if len(names) > 1 else names[0]]

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()


def fsdp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """1-D dp_shard mesh, or the 2-D (dp_replicate, dp_shard) one when dp_replicate > 1 (HSDP); without cp
    (with cp > 1 it is ParallelDims.fsdp_mesh)."""
    if "cp" in (mesh.mesh_dim_names or ()) and mesh["cp"].size() > 1:
        raise ConfigError("with cp > 1 FSDP shards over dp_shard x cp: take ParallelDims.fsdp_mesh")
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
