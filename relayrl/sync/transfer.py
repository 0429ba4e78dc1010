"""This module carries out a SyncPlan between processes, with local copies and bucketed point-to-point
messages.

Who is where (a `Members` map: trainer rank / engine rank -> rank in the sync group):

    colocated      engine rank r lives in trainer rank r's process: members = trainer ranks; the
                   r -> r pieces are copied in place (no buffer), the others go over the group. Replica k of
                   a colocated fleet (rollout.replicas) lives in trainer ranks k*tp.. (engine_offset k*tp):
                   engine rank r in trainer rank k*tp + r's process, whose own pieces it copies in place
    disaggregated  members = trainer ranks 0..T-1, then engine ranks T..T+E-1

The sync group is a gloo process group of its own (`SyncComm`: it meets at a store the driver hosts,
behind the run's token: relayrl.parallel.rendezvous), made beside whatever default group the trainer
or the engine's TP workers already have.
Buckets of GPU tensors are staged through host memory, unless `SyncSpec.ipc`: then each bucket's message
is a CUDA IPC handle to the sender's packed bucket, the receiver copies from it device to device and acks
(relayrl.sync.ipc; the sender frees the bucket on the ack, so the window still bounds its memory). An nccl
sync group (between machines) is not wired yet.

One sync, on every member (`sync_send` / `post_receives` + `finish_receives`, or `sync_step` for both):

    engine side   irecv the buckets of each (source, me) pair, at most `window` posted at a time;
                  unpack each as it lands and post the next in its place
    trainer side  for each destination: pack the next bucket (slices of its local shards, cast to
                  the engine's dtype), isend it; at most `window` buckets in flight

A bucket is a list of the plan's pieces for one (source, destination) pair, at most `bucket_bytes`
(a single piece larger than that goes alone). Memory: besides its parameters a member holds at most
`window` buckets it receives and `window` it sends: never a second copy of the model, of its shard,
or any full unsharded parameter it does not own.

No cycle of waits: every member sends and receives in one global message order, (destination,
source, bucket), each side waiting only on its oldest message and refilling its window at once. The
globally oldest unfinished message is then posted on both of its ends and completes; by induction
all do. A process that is both a trainer and an engine rank (colocated) receives in a thread of its
own, so its sender's waits never hold up its receiver (and the reverse).

What a bucket looks like on the wire (the engine's dtype, or float8 with a scale per piece) is
relayrl.sync.wire; the per-piece checksums that verify a sync are relayrl.sync.checksums.

It imports torch, relayrl.models, relayrl.parallel and the sync modules only; like all of sync, it must
never import the trainer, the engine or the controller: the controller hands it plain tensors.
"""

from __future__ import annotations

import threading
import time
from dataclasses import KW_ONLY, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from relayrl.models.config import ModelShape
from relayrl.parallel.rendezvous import StoreAddress, join_store
from relayrl.sync import ipc
from relayrl.sync.adapters import AdapterShape
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.plan import SyncPlan, Transfer, plan_sync
from relayrl.sync.wire import decode, encode, fp8_round_trip, fp8_scales, nbytes, receive_buffers

DEFAULT_BUCKET_BYTES = 32 << 20


# ---------------------------------------------------------------------------- the group
@dataclass(frozen=True)
class Members:
    """Where the plan's ranks sit in the sync group."""

    trainer_world: int
    engine_world: int
    colocated: bool
    engine_offset: int = 0  # colocated: the trainer rank whose process holds engine rank 0 (a fleet's replica k: k*tp)

    def __post_init__(self) -> None:
        if self.engine_offset and (not self.colocated or self.engine_offset + self.engine_world > self.trainer_world):
            raise ValueError(f"engine ranks {self.engine_offset}..{self.engine_offset + self.engine_world - 1} "
                             f"must sit in the {self.trainer_world} trainer ranks' processes (colocated)")

    @property
    def world_size(self) -> int:
        return self.trainer_world if self.colocated else self.trainer_world + self.engine_world

    def of_trainer(self, rank: int) -> int:
        return rank

    def of_engine(self, rank: int) -> int:
        return self.engine_offset + rank if self.colocated else self.trainer_world + rank

    def hosted_engine_rank(self, trainer_rank: int) -> int | None:
        """Colocated: the engine rank trainer rank `trainer_rank`'s process holds, or None."""
        r = trainer_rank - self.engine_offset
        return r if self.colocated and 0 <= r < self.engine_world else None


@dataclass(kw_only=True, frozen=True)
class SyncSpec:
    """Everything a member needs to play its part in a sync (small, picklable; the plan is derived
    and cached in each process)."""

    shape: ModelShape
    trainer: TrainerLayout
    engine: EngineLayout
    members: Members
    dtype: torch.dtype  # the engine's: what goes over the wire
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    window: int = 4
    fp8: bool = False  # float8 e4m3 on the wire, a scale per piece
    lora: AdapterShape | None = None  # LoRA adapters move too (relayrl.sync.adapters)
    base: bool = True  # False: the adapters alone (the engine already holds the frozen base)
    ipc: bool = False  # buckets cross as handles to the sender's memory, acked (relayrl.sync.ipc): one machine

    @property
    def plan(self) -> SyncPlan:
        # colocated, each engine rank's pieces come from its own process's trainer rank where it holds them
        home = self.members.engine_offset if self.members.colocated else 0
        return plan_sync(self.shape, self.trainer, self.engine, self.lora, self.base, home=home)


class SyncComm:
    """A gloo process group used only for weight sync. Construction returns at once; the rendezvous
    (all members must join) runs in a thread and the first operation waits for it, so a driver can
    ask the trainer and the engine to connect one after the other.

    gloo moves CPU tensors: buckets of GPU shards are staged through host memory (`wire_device`).
    An nccl sync group (GPU to GPU, no staging) is not wired yet."""

    wire_device = torch.device("cpu")

    def __init__(self, store: StoreAddress, rank: int, world_size: int, timeout_s: float = 300.0):
        self.rank, self.world_size = rank, world_size
        self._pg = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._connect, args=(store, timeout_s), daemon=True)
        self._thread.start()

    def _connect(self, address: StoreAddress, timeout_s: float) -> None:
        try:
            timeout = timedelta(seconds=timeout_s)
            store = join_store(address, timeout_s)
            prefixed = dist.PrefixStore("relayrl-sync", store)
            self._pg = dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, timeout)
        except BaseException as e:  # raised in the caller's thread by .pg
            self._error = e

    @property
    def pg(self):
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"weight-sync group rank {self.rank}/{self.world_size} could not connect: "
                               f"{self._error}") from self._error
        return self._pg

    def isend(self, t: torch.Tensor, peer: int, tag: int):
        return self.pg.send([t], peer, tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int):
        return self.pg.recv([t], peer, tag)

    def close(self) -> None:
        """Shut the group down (a member that failed mid-sync must not leave peers' ops matched
        against stale buffers by a later sync)."""
        self._thread.join()
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # already broken: nothing more to release
                pass


# ---------------------------------------------------------------------------- the trainer's shards
def trainer_locals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> this rank's local tensor of every parameter (DTensor.to_local(): an FSDP / TP
    shard, no copy; plain tensors as they are). Tied lm_head is left to embed_tokens."""
    from torch.distributed.tensor import DTensor

    if hasattr(model, "reshard"):  # FSDP2 may keep the root unsharded after a no-grad forward
        model.reshard()
    out = {}
    for name, t in model.state_dict().items():
        out[name] = (t.to_local() if isinstance(t, DTensor) else t).detach()
    return out


def check_locals(plan: SyncPlan, rank: int, local: dict[str, torch.Tensor]) -> None:
    """Every tensor the plan reads from trainer `rank` is there with the shape the layout says."""
    for name, (h,) in plan.trainer_holdings(rank).items():
        if name not in local:
            raise KeyError(f"trainer rank {rank} has no tensor {name!r} for the weight sync")
        if tuple(local[name].shape) != h.local_shape:
            raise RuntimeError(f"trainer rank {rank} holds {name} as {tuple(local[name].shape)}, but its layout "
                               f"(tp={plan.trainer.tp}, dp_shard={plan.trainer.dp_shard}) says {h.local_shape}: "
                               "the sync plan does not match how the model was parallelised")


# ---------------------------------------------------------------------------- buckets
def buckets(transfers: tuple[Transfer, ...], itemsize: int, bucket_bytes: int) -> list[tuple[Transfer, ...]]:
    """Consecutive pieces of one (source, destination) pair, grouped up to `bucket_bytes` each."""
    out, cur, size = [], [], 0
    for t in transfers:
        n = t.numel * itemsize
        if cur and size + n > bucket_bytes:
            out.append(tuple(cur))
            cur, size = [], 0
        cur.append(t)
        size += n
    if cur:
        out.append(tuple(cur))
    return out


@dataclass(kw_only=True)
class SyncStats:
    """What one member did in one sync (bytes as they travel: the engine's dtype, or float8 + scales)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0  # colocated pieces copied in place
    messages: int = 0
    seconds: float = 0.0

    def add(self, other: SyncStats) -> SyncStats:
        return SyncStats(**{f: getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__})


# ---------------------------------------------------------------------------- one sync
@torch.no_grad()
def copy_own(plan: SyncPlan, rank: int, local: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
             fp8: bool = False, src_rank: int | None = None) -> SyncStats:
    """Colocated: trainer rank `src_rank`'s (`rank`'s unless given: a fleet replica's engine rank r sits beside
    trainer rank offset + r) pieces for engine rank `rank`, copied straight into place (through the same fp8
    rounding as the pieces that travel, when the wire is fp8)."""
    n = 0
    ts = plan.between(rank if src_rank is None else src_rank, rank)
    scales = fp8_scales(ts, local) if fp8 and ts else None
    for i, t in enumerate(ts):
        src = local[t.name][t.src_box.slices()]
        params[t.dst_param][t.dst_box.slices()].copy_(fp8_round_trip(src, scales[i]) if fp8 else src)
        n += t.numel
    itemsize = next(iter(params.values())).dtype.itemsize if params else 0
    return SyncStats(bytes_copied=n * itemsize)


@dataclass
class PendingReceives:
    """An engine rank's receives for one sync: (peer, tag base, transfers) per bucket in the global
    message order, at most `window` of them posted at a time."""

    todo: list  # buckets not yet posted
    _: KW_ONLY
    comm: SyncComm | None
    dtype: torch.dtype
    fp8: bool
    window: int
    ipc: bool = False  # each message a handle to the sender's bucket (relayrl.sync.ipc), acked once copied
    posted: list = field(default_factory=list)  # (works, buffers, transfers, peer, bucket), oldest first
    acks: list = field(default_factory=list)  # ack sends in flight (ipc)
    stats: SyncStats = field(default_factory=SyncStats)

    def post_more(self) -> None:
        while self.todo and len(self.posted) < self.window:
            peer, b, ts = self.todo.pop(0)
            payload = receive_buffers(ts, self.dtype, self.fp8, "meta")  # shapes only: what arrives
            bufs = ipc.handle_buffers(len(payload)) if self.ipc else receive_buffers(ts, self.dtype, self.fp8,
                                                                                      self.comm.wire_device)
            works = [self.comm.irecv(buf, peer, 2 * b + k) for k, buf in enumerate(bufs)]
            self.posted.append((works, bufs, ts, peer, b))
            self.stats.bytes_received += nbytes(payload)
            self.stats.messages += len(bufs)


@torch.no_grad()
def post_receives(spec: SyncSpec, engine_rank: int, params: dict[str, torch.Tensor], comm: SyncComm) -> PendingReceives:
    """Engine side, step 1: post the first `window` buckets' receives (returns at once)."""
    plan, members, fp8 = spec.plan, spec.members, spec.fp8
    me = members.of_engine(engine_rank)
    dtype = next(iter(params.values())).dtype
    todo = []
    for src in sorted(plan.sources(engine_rank)):  # (source, bucket): the senders' order too
        peer = members.of_trainer(src)
        if peer == me:
            continue
        for b, ts in enumerate(buckets(plan.between(src, engine_rank), 1 if fp8 else dtype.itemsize,
                                       spec.bucket_bytes)):
            todo.append((peer, b, ts))
    pending = PendingReceives(todo, comm=comm, dtype=dtype, fp8=fp8, window=spec.window, ipc=spec.ipc)
    pending.post_more()
    return pending


@torch.no_grad()
def finish_receives(pending: PendingReceives, params: dict[str, torch.Tensor]) -> SyncStats:
    """Engine side, step 2: unpack each bucket as it lands and post the next one in its place (ipc: from the
    sender's memory, then ack it)."""
    while pending.posted:
        works, bufs, ts, peer, b = pending.posted.pop(0)
        for w in works:
            w.wait()
        if pending.ipc:
            decode(ts, [ipc.open_shared(m) for m in bufs], params, pending.fp8)
            ipc.wait_for_copies(params)  # the sender may reuse its bucket once acked
            pending.acks.append(pending.comm.isend(ipc.ack_buffer(), peer, ipc.ACK_TAG + b))
        else:
            decode(ts, bufs, params, pending.fp8)
        pending.post_more()
    for w in pending.acks:
        w.wait()
    pending.acks.clear()
    return pending.stats


@torch.no_grad()
def sync_send(spec: SyncSpec, trainer_rank: int, local: dict[str, torch.Tensor], comm: SyncComm) -> SyncStats:
    """Trainer side: send every bucket this rank sources to other processes, `window` in flight (ipc: a bucket
    is in flight until its receiver acks)."""
    plan, members, dtype, fp8, window = spec.plan, spec.members, spec.dtype, spec.fp8, spec.window
    me = members.of_trainer(trainer_rank)
    stats, inflight = SyncStats(), []
    for (src, dst), ts_all in sorted(plan.pairs().items(), key=lambda kv: kv[0][1]):
        peer = members.of_engine(dst)
        if src != trainer_rank or peer == me:
            continue
        for b, ts in enumerate(buckets(ts_all, 1 if fp8 else dtype.itemsize, spec.bucket_bytes)):
            while len(inflight) >= window:  # at most `window` buckets of this rank in flight
                for w in inflight.pop(0)[0]:
                    w.wait()
            if spec.ipc:  # the packed bucket stays on the device; its handles travel, an ack comes back
                bufs = encode(ts, local, dtype, fp8)
                msgs, ack = [ipc.share(buf) for buf in bufs], ipc.ack_buffer()
                works = [comm.isend(m, peer, 2 * b + k) for k, m in enumerate(msgs)]
                works.append(comm.irecv(ack, peer, ipc.ACK_TAG + b))
                inflight.append((works, (bufs, msgs, ack)))
            else:
                bufs = [buf.to(comm.wire_device) for buf in encode(ts, local, dtype, fp8)]
                # the buffers live until their sends complete
                inflight.append(([comm.isend(buf, peer, 2 * b + k) for k, buf in enumerate(bufs)], bufs))
            stats.bytes_sent += nbytes(bufs)
            stats.messages += len(bufs)
    for works, _ in inflight:
        for w in works:
            w.wait()
    return stats


class _Background:
    """fn(*args) in a thread; join() returns its SyncStats or raises its error."""

    def __init__(self, fn, *args, **kwargs):
        self.result: SyncStats | None = None
        self.error: BaseException | None = None
        self._name, self._t0 = fn.__name__, time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(fn, *args), kwargs=kwargs, daemon=True)
        self._thread.start()

    def _run(self, fn, *args, **kwargs) -> None:
        try:
            self.result = fn(*args, **kwargs)
            self.result.seconds = time.perf_counter() - self._t0
        except BaseException as e:
            self.error = e

    def join(self) -> SyncStats:
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"weight sync ({self._name}) failed: {self.error}") from self.error
        return self.result


class BackgroundSend(_Background):
    """sync_send in a thread: the trainer's call returns while the engine receives (disaggregated)."""

    def __init__(self, *args, **kwargs):
        super().__init__(sync_send, *args, **kwargs)


def sync_step(spec: SyncSpec, *, comm: SyncComm | None, trainer_rank: int | None = None,
              engine_rank: int | None = None, local: dict[str, torch.Tensor] | None = None,
              params: dict[str, torch.Tensor] | None = None) -> SyncStats:
    """Everything one member does in one sync, when it is trainer rank, engine rank or both
    (colocated): its first receives posted, its own pieces copied in place, then sending and
    receiving side by side (a thread each when it does both)."""
    plan, members = spec.plan, spec.members
    t0 = time.perf_counter()
    if trainer_rank is not None:
        check_locals(plan, trainer_rank, local)
    stats, receiving = SyncStats(), None
    sends = trainer_rank is not None and members.world_size > 1
    if engine_rank is not None:
        pending = post_receives(spec, engine_rank, params, comm)
        if trainer_rank is not None and members.of_trainer(trainer_rank) == members.of_engine(engine_rank):
            stats = stats.add(copy_own(plan, engine_rank, local, params, spec.fp8, src_rank=trainer_rank))
        # both roles in one process: receiving runs in a thread of its own, so neither side's window
        # waits on the other (see the module doc)
        receiving = _Background(finish_receives, pending, params) if sends else None
        if not sends:
            stats = stats.add(finish_receives(pending, params))
    if sends:
        stats = stats.add(sync_send(spec, trainer_rank, local, comm))
    if receiving is not None:
        stats = stats.add(receiving.join())
    stats.seconds = time.perf_counter() - t0
    return stats
