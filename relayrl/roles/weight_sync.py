"""This module is the driver's weight sync: it carries out the planned reshard where the roles live, and
verifies it every time.

    placement colocated      engine rank r runs in trainer rank r's process (the driver's own with
                             parallel.backend none; otherwise a RunnerWorker beside each actor rank,
                             whose runner the actor rank holds as engine_runner): own pieces are
                             copied in place, the rest go over a sync group of the trainer ranks
    placement disaggregated  the engine's ranks have processes of their own; a sync group of
                             trainer ranks + engine ranks carries every piece point to point

    sync():  engine.begin_weight_update()
             colocated      policy.run_on_ranks(trainer_colocated, spec)
             disaggregated  policy.run_on_ranks(trainer_start_send, spec)   sends posted in a thread
                            engine.run_on_ranks(engine_receive, spec)       receives, unpacks
                            policy.run_on_ranks(trainer_finish_send)
             engine.end_weight_update()
             verify()       canary rows scored by the trainer and by the engine; a mean |logprob gap|
                            over the bound of the engine's dtype (or NaN) stops the run, naming the
                            first parameter whose checksum differs, or, where the trainer's own canary
                            logprobs are NaN or inf, its non-finite (or overflowing) weights instead.
                            Every piece's checksum is also compared after the first sync (the plan
                            never changes, so a layout bug shows there) and, with sync.debug_checksums,
                            after every sync.

LoRA (`lora`, the trainer's adapters' AdapterShape): the engine gets adapter slots on its targeted
modules (relayrl.engine.lora, kept apart or merged as sync.lora says); the first sync, and any after
sleep(level=2) released the engine's weights, sends base + adapters, every other one the adapters
only (the base is frozen). Checksums always cover base and adapters.

What each rank runs is in relayrl.roles.sync_steps. The driver process hosts the sync group's
rendezvous (on the address the trainer's workers reach it by, behind the run's token) and joins no
group itself. Both classes here implement relayrl.sync.protocol.WeightSync.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the
jobs.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from relayrl.engine.protocols import RolloutEngine
from relayrl.errors import RunFault, UserError
from relayrl.models.config import ModelShape
from relayrl.models.lora import merge_lora_state_dict
from relayrl.models.lora_config import LoRAConfig
from relayrl.parallel.rendezvous import serve_store
from relayrl.roles import sync_steps as steps
from relayrl.sync.adapters import AdapterShape
from relayrl.sync.checksums import describe_piece, first_mismatch
from relayrl.sync.config import SyncConfig
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.transfer import Members, SyncSpec
from relayrl.sync.wire import FP8
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.policy import Policy

# mean |trainer logp - engine logp| over the canary tokens, by the lower of the two precisions.
# Measured on the demo's SFT and GRPO models (benchmarks/RESULTS.md): 0 with fp32 on both sides,
# 0.013-0.024 with bf16 on either side, 0.05-0.09 through the float8 wire; a misplaced piece moves
# it by ~0.1-1 (tests/roles/test_weight_sync.py)
GAP_BOUND = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2, FP8: 0.25}
GAP_MARGIN = 3.0  # the bound after the first (checksum-verified) sync: at least 3x the gap measured there


class SyncVerificationError(UserError):
    """The engine does not hold what the trainer holds (or computes differently from it)."""


def lora_options(lora: LoRAConfig | None) -> dict:
    """The weight sync's LoRA arguments from the run's `trainer.lora` section (none without one)."""
    if lora is None:
        return {}
    return {"lora": AdapterShape(lora.rank, tuple(lora.target_modules)), "lora_scaling": lora.alpha / lora.rank}


# ---------------------------------------------------------------------------- the driver's side
def canary_rows(vocab_size: int, rows: int, length: int) -> list[list[int]]:
    """Fixed token rows (a seeded draw, the same every sync and in every process)."""
    g = torch.Generator().manual_seed(20261129)
    return torch.randint(0, vocab_size, (rows, length), generator=g).tolist()


class PlannedWeightSync:
    """Moves the policy's weights into the engine by the plan, and checks them, every step."""

    channel = 0  # the engine replica this sync reaches (the one engine's unless a fleet sets it: __init__)

    def __init__(self, policy: Policy, engine: RolloutEngine, *, shape: ModelShape, trainer_layout: TrainerLayout,
                 engine_tp: int, colocated: bool, engine_dtype: torch.dtype, trainer_dtype: torch.dtype,
                 temperature: float, cfg: SyncConfig | None = None, lora: AdapterShape | None = None,
                 lora_scaling: float = 1.0, ipc: bool = False, expert_placement: str = "tp", channel: int = 0,
                 engine_offset: int = 0):
        """ipc: buckets between processes cross as CUDA IPC handles (when: relayrl.jobs.preflight.sync_transport).
        shape: relayrl.sync.sync_shape of the model (an MoE model's keeps its experts); expert_placement: the
        engine's (rollout.expert_placement). channel: which engine replica of a rollout fleet this sync reaches
        (the trainer ranks keep a sync group per replica; relayrl.roles.fleet_sync), 0 for the one engine.
        engine_offset: colocated, the trainer rank whose process holds engine rank 0 (a colocated fleet's replica k:
        k * engine_tp; relayrl.roles.fleet_colocated)."""
        cfg = cfg if cfg is not None else SyncConfig()
        self.policy, self.engine, self.cfg, self.temperature = policy, engine, cfg, temperature
        self.channel = channel
        members = Members(trainer_layout.world_size, engine_tp, colocated, engine_offset)
        # base (+ adapters): the first sync, the checksums; adapters alone: every later sync with LoRA
        self.spec = SyncSpec(shape=shape, trainer=trainer_layout, engine=EngineLayout(engine_tp, expert_placement),
                             members=members,
                             dtype=engine_dtype, bucket_bytes=int(cfg.bucket_mb * 2**20), window=cfg.window,
                             fp8=cfg.wire == "float8", lora=lora, ipc=ipc)
        self.adapters_spec = dataclasses.replace(self.spec, base=False) if lora is not None else None
        self.lora = lora
        if lora is not None:
            engine.run_on_ranks(steps.engine_enable_lora, lora.rank, lora_scaling, lora.targets, cfg.lora)
        lower = FP8 if self.spec.fp8 else engine_dtype if engine_dtype != torch.float32 else trainer_dtype
        self.bound = cfg.gap_bound if cfg.gap_bound is not None else GAP_BOUND[lower]
        self.rows = canary_rows(shape.vocab_size, max(cfg.canary_rows, trainer_layout.world_size), cfg.canary_len)
        self.shard_bytes = self.bytes_per_engine_rank(self.spec)  # the largest engine shard
        self.syncs = 0
        self._hosted = None
        if members.world_size > 1:
            # the driver, as the trainer's workers reach it
            self._hosted = serve_store(policy.address, members.world_size + 1, timeout_s=cfg.timeout_s)
            policy.run_on_ranks(steps.trainer_connect, self._hosted.address, members, cfg.timeout_s, channel)
            if not colocated:
                engine.run_on_ranks(steps.engine_connect, self._hosted.address, members, cfg.timeout_s)
        self.checked_pieces = False  # every piece's checksum is compared after the first sync
        self.last_table: dict[str, tuple[float, float]] = {}  # the last comparison (debug mode: every sync)
        self.broken = False

    @property
    def colocated(self) -> bool:
        return self.spec.members.colocated

    def bytes_per_engine_rank(self, spec: SyncSpec) -> int:
        """What `spec`'s plan moves into the largest engine shard (in the engine's dtype)."""
        return max(spec.plan.bytes_per_dst_rank(self.spec.dtype).values())

    def _name_a_dead_rank(self, error: Exception) -> None:
        """A rank killed part way through a transfer shows on the other side as a socket error of the survivor
        (gloo: connection reset by peer); ask both sides for a live answer, so that the dead rank's own one-line
        fault (its role, rank, pid and exit) is what the run reports."""
        for side in (self.policy, self.engine):
            try:
                side.run_on_ranks(steps.alive)
            except RunFault as fault:
                raise fault from error
            except Exception:  # this side answers, if with an error of its own: not the cause
                pass

    def transfer(self) -> dict[str, float]:
        """One planned transfer (verify() next). Returns its figures: bytes per engine rank (what
        the plan moves into the largest engine shard), bytes moved between processes, bytes copied
        in place (colocated pieces)."""
        t0 = time.perf_counter()
        spec = self.next_spec()
        self.engine.begin_weight_update()
        try:
            if self.colocated:
                stats = steps.total(self.policy.run_on_ranks(steps.trainer_colocated, spec, self.channel))
            else:
                self.start_sends(spec)
                received = self.receive(spec)
                stats = steps.total(self.finish_sends() + received)
            self.after_receive()
        except BaseException as e:
            self.failed(e)
            raise
        self.engine.end_weight_update()
        self.syncs += 1
        return self.figures(spec, stats, t0)

    # the phases of a disaggregated transfer, which a rollout fleet interleaves over its replicas (fleet_sync)
    def next_spec(self) -> SyncSpec:
        """What the next transfer moves: the base goes once, unless deep sleep released the engine's copy of it."""
        if self.broken:
            raise RuntimeError("an earlier weight sync failed part way; the sync group's state is unknown: "
                               "restart the run from its last checkpoint")
        return self.adapters_spec if self.lora is not None and self.syncs and self.engine.asleep < 2 else self.spec

    def start_sends(self, spec: SyncSpec) -> None:
        """The trainer ranks post their sends to this engine in a thread each, and return."""
        self.policy.run_on_ranks(steps.trainer_start_send, spec, self.channel)

    def receive(self, spec: SyncSpec) -> list:
        """The engine's ranks receive and unpack (their SyncStats)."""
        return self.engine.run_on_ranks(steps.engine_receive, spec)

    def finish_sends(self) -> list:
        """The trainer ranks wait for their sends (their SyncStats)."""
        return self.policy.run_on_ranks(steps.trainer_finish_send, self.channel)

    def after_receive(self) -> None:
        if self.lora is not None and self.cfg.lora == "merge":
            self.engine.run_on_ranks(steps.engine_merge_lora)

    def failed(self, e: BaseException) -> None:
        """A transfer failed part way: sends or receives may still be posted, so no later sync may reuse the group;
        a dead rank is named as the cause."""
        self.broken = True
        if isinstance(e, Exception) and not isinstance(e, RunFault):
            self._name_a_dead_rank(e)

    def figures(self, spec: SyncSpec, stats, t0: float) -> dict[str, float]:
        out = {"time/sync_transfer": time.perf_counter() - t0,
               "sync/bytes_between_processes": float(stats.bytes_received),
               "sync/bytes_copied_in_place": float(stats.bytes_copied),
               "sync/bytes_per_engine_rank": float(self.bytes_per_engine_rank(spec)),
               "sync/messages": float(stats.messages)}
        if self.lora is not None:
            out["sync/adapters_only"] = float(not spec.base)
        return out

    def sync(self, label: str | None = None) -> dict[str, float]:
        """transfer(), wake() an engine put to sleep since the last sync, then verify() both."""
        out = self.transfer()
        woke = bool(self.engine.asleep)
        if woke:
            self.engine.wake()
        t0 = time.perf_counter()
        what = "sync + wake" if woke else "sync"
        out["sync/canary_gap"] = self.verify(f"{what} {label}" if label else f"{what} {self.syncs}")
        out["time/sync_verify"] = time.perf_counter() - t0
        return out

    def canary_batch(self) -> TrainBatch:
        """The canary rows as the trainer scores them (every token but the first)."""
        ids = torch.tensor(self.rows)
        mask = torch.ones(len(self.rows), len(self.rows[0]))
        mask[:, 0] = 0
        return TrainBatch(ids, torch.ones_like(ids), mask)

    def verify(self, after: str, trainer: torch.Tensor | None = None) -> float:
        """The canary: the mean |logprob gap| must stay under the bound, else stop, naming the first
        parameter whose checksum differs. Returns the gap. trainer: the trainer's logprobs of canary_batch(), when
        the caller computed them already (a fleet compares every replica against one trainer forward)."""
        batch = self.canary_batch()
        mask = batch.response_mask
        if trainer is None:
            trainer = self.policy.compute_logprobs(batch)
        engine = self.engine.score(self.rows, self.temperature)
        gap = float(((trainer - engine).abs() * mask).sum() / mask.sum())
        over = not gap <= self.bound  # NaN (an unwritten weight) fails too
        if over or self.cfg.debug_checksums or not self.checked_pieces:
            # a layout bug shows on the first sync (the plan never changes): every piece is checked then
            bad = self.first_bad_piece()
            first, self.checked_pieces = not self.checked_pieces, True
            if first and bad is None and not over and self.cfg.gap_bound is None:
                # every weight is exactly where it belongs, so this gap is the dtypes' rounding on this
                # model; training sharpens the logits and that rounding grows: leave it room (3x), never
                # less than the dtype's bound, never more than 3x of it
                self.bound = max(self.bound, GAP_MARGIN * gap)
            if over and not bool(torch.isfinite(trainer[mask.bool()]).all()):
                raise SyncVerificationError(f"weight sync verification failed after {after}: {self._nonfinite()}")
            if bad is not None or over:
                where = (f"first parameter whose checksum differs: {describe_piece(bad)}" if bad is not None
                         else "every piece's checksum matches: the engine computes these weights differently "
                              "from the trainer (not a transfer error; if it is the dtype's rounding on this model, "
                              "raise sync.gap_bound)")
                raise SyncVerificationError(
                    f"weight sync verification failed after {after}: canary logprob gap {gap:.3g} "
                    f"(bound {self.bound:g} for the {str(self.spec.dtype).removeprefix('torch.')} engine"
                    f"{', float8 wire' if self.spec.fp8 else ''}); {where}")
        return gap

    def _nonfinite(self) -> str:
        """The trainer's own canary logprobs are NaN or inf: its weights are (or overflow its forward), whatever the
        engine got; the transfer is not to blame."""
        found = self.policy.run_on_ranks(steps.trainer_weights_finite)
        bad = next(((r, name) for r, (name, _) in enumerate(found) if name is not None), None)
        fix = "the update diverged, not the transfer: lower trainer.lr"
        if bad is not None:
            return (f"the trainer's own weights are not finite (NaN or inf in {bad[1]} on trainer rank {bad[0]}); "
                    f"{fix}")
        peak = max(p for _, p in found)
        return (f"the trainer's own canary logprobs are not finite: its weights are finite but overflow its forward "
                f"(the largest |weight| is {peak:.3g}); {fix}")

    def checksums(self) -> tuple[dict[int, float], dict[int, float]]:
        """(trainer side, engine side): plan piece index -> checksum (the debug view)."""
        return (steps.merged(self.policy.run_on_ranks(steps.trainer_checksums, self.spec)),
                steps.merged(self.engine.run_on_ranks(steps.engine_checksums, self.spec)))

    def first_bad_piece(self):
        src, dst = self.checksums()
        self.last_table = self._table(src, dst)
        return first_mismatch(self.spec.plan, src, dst)

    def checksum_table(self) -> dict[str, tuple[float, float]]:
        """'engine rank r: param' -> (trainer's, engine's) checksum, summed over the param's pieces."""
        return self._table(*self.checksums())

    def _table(self, src: dict[int, float], dst: dict[int, float]) -> dict[str, tuple[float, float]]:
        out: dict[str, list[float]] = {}
        for i, t in enumerate(self.spec.plan.transfers):
            row = out.setdefault(f"engine rank {t.dst_rank}: {t.dst_param}", [0.0, 0.0])
            row[0] += src[i]
            row[1] += dst[i]
        return {k: (a, b) for k, (a, b) in out.items()}

    def abandon(self) -> None:
        """The engine was lost part way through a transfer (a fleet's replica): the trainer ranks drop their side of
        this sync without waiting for it, and the store goes; nothing of this sync is used again."""
        self.broken = True
        self.policy.run_on_ranks(steps.trainer_abandon, self.channel)
        if self._hosted is not None:
            self._hosted.close()
            self._hosted = None

    def close(self) -> None:
        """Shut both sides' sync groups down (best effort: this runs on the way out of failures too)."""
        if self._hosted is None:
            return
        try:
            self.policy.run_on_ranks(steps.trainer_close, self.channel)
            if not self.colocated:
                self.engine.run_on_ranks(steps.engine_close)
        except Exception:  # a broken role is torn down by its own close
            pass
        self._hosted.close()
        self._hosted = None


class FullWeightSync:
    """The weight sync for vLLM, whose own loader takes full tensors (the one engine whose layout needs
    them): the trainer gathers them and vLLM slices them. There is no plan and no canary (vLLM scores
    no given rows). With LoRA the adapters are merged into the gathered weights first (every sync
    sends the full model: vLLM's loader has no adapters-only path here)."""

    def __init__(self, policy: Policy, engine: RolloutEngine, lora: AdapterShape | None = None,
                 lora_scaling: float = 1.0):
        self.policy, self.engine = policy, engine
        self.lora_scaling = lora_scaling if lora is not None else None
        self.last_table: dict = {}  # no pieces, no checksums

    def sync(self, label: str | None = None) -> dict[str, float]:
        weights = self.policy.weights()
        if self.lora_scaling is not None:
            weights = merge_lora_state_dict(dict(weights), self.lora_scaling).items()
        self.engine.load_weights(weights)
        if self.engine.asleep:
            self.engine.wake()
        return {}

    def close(self) -> None:
        pass
