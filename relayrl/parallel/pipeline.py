"""Pipeline parallelism: this pp rank's stages of a CausalLM, run over micro-batches by a torch schedule.

    batch [B, T] ──tensor_split(m)──> micro-batches ──stage 0 ─h─> stage 1 ─h─> … ─> last stage: logits
                                                                                        │ TokenLoss
      loss_mb = objective(rows_mb, logp_mb)    (divided by the GLOBAL token / sequence counts)
      sum_mb loss_mb = the single-process loss   backward flows stage by stage, grads accumulate

Schedules (torch.distributed.pipelining; parallel.pp_schedule), with p ranks and m micro-batches:

    gpipe              all forwards, then all backwards       1 stage / rank   bubble (p-1)/(m+p-1)
    1f1b               one forward, one backward in steady    1 stage / rank   same bubble, p in flight
    interleaved_1f1b   1F1B over v = 2 stages per rank (loop: rank r holds r, r+p)   bubble / v
    interleaved_zb     zero bubble: input-grad and weight-grad backward split (loop, 2 per rank)
    zbv                zero bubble, V placement (rank r holds r and 2p-1-r)
    dualpipev          DualPipe's V schedule (2 per rank, V placement)

The loss: torch calls loss_fn(last stage's output, target) once per micro-batch and backpropagates each
loss as it is. The target handed to the schedule is the batch's ROW INDICES (split like the input), so
TokenLoss looks up the micro-batch's token targets and lets the objective slice its own per-token inputs
(advantages, masks, old logprobs). The objective divides by counts of the whole batch (computed before
the step, over data-parallel ranks too), and grads are not rescaled (scale_grads=False): the micro-batch
losses sum to the single-process loss and their gradients to its gradient.

Tied embeddings: the first stage's embed_tokens.weight and the last stage's lm_head.weight are one
parameter; each stage holds a copy and the copies' gradients are summed after the step (over Megatron's
"embedding group", the pair of ranks holding them, or on the one rank of a V placement), so both copies
take the same update. Norms for clipping count it once (Pipeline.norm_parameters).

Micro-batches must have equal shapes: torch infers the activations' shapes from the first one (one extra
forward and backward of it) and sizes its receive buffers by it. A schedule (with its stages) is built per
batch shape and reused, the last MAX_SCHEDULES kept: pad batches to a few lengths.

How a trainer drives it (relayrl.trainer.actor with relayrl.trainer.pipelined, for parallel.pp > 1 runs):

    pipe = Pipeline(split_model(model, *rank_stages(dims, schedule)), dims, schedule)
    for m in pipe.modules: parallelize_model(m, dims, mesh, ...)          # TP / AC / FSDP per stage
    optimizer = build(pipe.parameters())
    old = pipe.logprobs(ids, m, attention_mask=attn)                       # forward only, on every pp rank
    loss = pipe.step(ids, TokenLoss(ids, lambda rows, logp, ent: policy_objective(
        logp, old[rows], adv[rows], mask[rows], cfg, num_tokens=N_global, num_seqs=B_global)), m,
        attention_mask=attn)
    pipe.clip_grad_norm(max_norm); optimizer.step()
    checkpoints: save_distributed(run_dir, step, merge_stages(pipe.modules), optimizer)

It imports torch, relayrl.errors and the parallel modules only (the stage modules come from the caller, cut
by relayrl.models.stage); it must never import another relayrl layer (models, the trainer, the engine, ...):
they import it. The objective comes from the caller too (relayrl.algorithms' policy_objective in the
trainer), so this module knows nothing of RL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from relayrl.errors import ConfigError
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.grad_norm import grad_norm, scale_grads
from relayrl.parallel.pipeline_stages import SCHEDULE_STAGES, check_schedule, schedule_stages
from relayrl.parallel.vocab_parallel import (
    full_vocab_logprobs,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_entropy,
)

# name: (torch schedule, stages per rank, placement); the names are relayrl.parallel.config.PP_SCHEDULES, the
# placement relayrl.parallel.pipeline_stages
SCHEDULES = {name: (cls, *SCHEDULE_STAGES[name]) for name, cls in (
    ("gpipe", ScheduleGPipe),
    ("1f1b", Schedule1F1B),
    ("interleaved_1f1b", ScheduleInterleaved1F1B),
    ("interleaved_zb", ScheduleInterleavedZeroBubble),
    ("zbv", ScheduleZBVZeroBubble),
    ("dualpipev", ScheduleDualPipeV),
)}


def rank_stages(dims: ParallelDims, schedule: str) -> tuple[tuple[int, ...], int]:
    """(the stage indices this rank holds, the number of stages) under `schedule`: cut the model with
    relayrl.models.stage.split_model(model, *rank_stages(dims, schedule))."""
    return schedule_stages(schedule, dims.pp_mesh.get_local_rank(), dims.pp)


MAX_SCHEDULES = 8  # schedules (with their stages' receive buffers) kept per Pipeline, one per batch shape
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # hidden states between stages, by index in a header

# objective(rows [b], logp [b, T], entropy [b, T] or None) -> (loss, stats): the micro-batch's share
Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict]]


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable):
    """The torch schedule `name` over this rank's stages; gradients not rescaled (the losses are shares)."""
    check_schedule(name)
    cls, per_rank, _ = SCHEDULES[name]
    if len(stages) != per_rank:
        raise ConfigError(f"schedule {name} runs {per_rank} stage(s) per rank, got {len(stages)}")
    try:
        return cls(stages[0] if per_rank == 1 else stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                   scale_grads=False)
    except ValueError as e:  # torch's own refusals (DualPipeV: m >= stages, ...), named as relayrl's setting
        raise ConfigError(f"pipeline schedule {name} with {n_microbatches} micro-batches: {e}") from None


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = False, tp_group=None, entropy_grad: bool = True):
    """(logp [b, T], entropy [b, T] or None) by relayrl.trainer.logprobs' definition: logp[:, t] =
    log_softmax(logits[:, t-1] / temperature)[input_ids[:, t]], logp[:, 0] = 0, in fp32; vocab-sharded
    logits (tp_group) never gathered. entropy_grad=False: the entropy is a statistic (no graph)."""
    logits, targets = logits[:, :-1], input_ids[:, 1:]
    if tp_group is not None:
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        if with_entropy:
            logp, ent = vocab_parallel_logprobs_and_entropy(local, targets, tp_group, temperature, grad=entropy_grad)
        else:
            logp, ent = vocab_parallel_logprobs(local, targets, tp_group, temperature), None
    else:
        logp, ent = full_vocab_logprobs(logits, targets, temperature, with_entropy, entropy_grad)

    def pad(x):
        return None if x is None else torch.nn.functional.pad(x, (1, 0))
    return pad(logp), pad(ent)


class TokenLoss:
    """The last stage's loss_fn: logits of micro-batch `rows` → the objective on their token logprobs.

    Stats are kept per micro-batch, keyed by its first row: torch's shape inference calls the loss once
    more on the first micro-batch, and that call overwrites rather than doubles."""

    def __init__(self, input_ids: torch.Tensor, objective: Objective, *, temperature: float = 1.0,
                 with_entropy: bool = False, tp_group=None, entropy_grad: bool = True):
        self.input_ids, self.objective = input_ids, objective
        self.temperature, self.with_entropy, self.tp_group = temperature, with_entropy, tp_group
        self.entropy_grad = entropy_grad
        self.stats: dict[int, dict] = {}

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ids = self.input_ids[rows.to(self.input_ids.device)]
        logp, ent = logprobs_from_logits(logits, ids, self.temperature, self.with_entropy, self.tp_group,
                                         self.entropy_grad)
        loss, stats = self.objective(rows, logp, ent)
        self.stats[int(rows[0])] = stats
        return loss


class Pipeline:
    """This pp rank's stage modules (relayrl.models.stage, cut by rank_stages) and the schedule that runs
    them (see the module docstring).

    Apply TP / FSDP to each of `modules` as to a whole model (parallelize_model(module, dims, mesh)); then
    give the optimizer `parameters()` and call step() once per optimiser step."""

    def __init__(self, modules: list[nn.Module], dims: ParallelDims, schedule: str = "1f1b"):
        stage_ids, self.num_stages = rank_stages(dims, schedule)
        if [m.stage_index for m in modules] != list(stage_ids):
            raise ConfigError(f"schedule {schedule} on pp rank {dims.pp_mesh.get_local_rank()} runs stages "
                              f"{list(stage_ids)}, got modules of stages {[m.stage_index for m in modules]}")
        self.schedule_name, self.stage_ids, self.modules = schedule, stage_ids, modules
        self.pp, self.pp_rank = dims.pp, dims.pp_mesh.get_local_rank()
        self.pp_group = dims.pp_mesh.get_group()
        style = SCHEDULES[schedule][2]
        self.last_rank = 0 if style == "v" else self.pp - 1  # the pp rank holding the last stage
        self._tied = modules[0].config.tie_word_embeddings and self.num_stages > 1
        self._tied_group = self._embedding_group(dims, style) if self._tied else None
        self._schedules: dict[tuple, tuple] = {}
        self._loss: TokenLoss | None = None

    def _embedding_group(self, dims: ParallelDims, style: str):
        """The pair of pp ranks holding the first and the last stage (None when one rank holds both: V)."""
        if style == "v":
            return None
        if self.pp == 2:
            return self.pp_group
        ranks = dims.mesh.mesh.reshape(self.pp, -1)  # pp outermost: column j is one pipeline
        mine = None
        for j in range(ranks.shape[1]):  # every rank creates every group, in the same order
            pair = [int(ranks[0, j]), int(ranks[-1, j])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                mine = group
        return mine

    def micro_batches(self, wanted: int) -> int:
        """The fewest micro-batches >= wanted that the schedule runs: torch's 1F1B and DualPipeV need at least one
        per stage, its interleaved schedules a multiple of pp once there are pp or more (whole rounds); every
        schedule but GPipe is given at least one per stage, ZBV too (fewer leave its pipeline unfilled)."""
        name, m = self.schedule_name, max(1, wanted)
        if name == "gpipe":
            return m
        if name in ("interleaved_1f1b", "interleaved_zb"):
            return -(-max(m, self.pp) // self.pp) * self.pp
        return max(m, self.num_stages)

    def parameters(self) -> list[torch.nn.Parameter]:
        seen, out = set(), []
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Names as in the full model; a tied weight held twice on one rank once."""
        seen, out = set(), []
        for m in self.modules:
            for n, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((n, p))
        return out

    def norm_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters a global gradient norm sums over this rank (a tied model's lm_head copy left out)."""
        skip = {id(m.lm_head.weight) for m in self.modules if m.is_last} if self._tied else set()
        return [p for p in self.parameters() if id(p) not in skip]

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global gradient norm over every stage (a tied weight once), every gradient scaled to max_norm."""
        total = grad_norm(self.norm_parameters(), group=self.pp_group)
        scale_grads(self.parameters(), max_norm, total)
        return total

    def _schedule(self, input_ids: torch.Tensor, n_microbatches: int, kwargs: dict):
        key = (tuple(input_ids.shape), n_microbatches, tuple((k, tuple(v.shape)) for k, v in kwargs.items()))
        if key not in self._schedules:
            if len(self._schedules) >= MAX_SCHEDULES:  # batches of ever new shapes: drop the oldest
                self._schedules.pop(next(iter(self._schedules)))
            stages = [PipelineStage(m, m.stage_index, self.num_stages, input_ids.device, group=self.pp_group)
                      for m in self.modules]
            self._schedules[key] = build_schedule(self.schedule_name, stages, n_microbatches, self._call_loss)
        return self._schedules[key]

    def _call_loss(self, logits, rows):
        return self._loss(logits, rows)

    def step(self, input_ids: torch.Tensor, loss: TokenLoss, n_microbatches: int, **model_kwargs) -> torch.Tensor:
        """Forward and backward of this rank's rows in `n_microbatches` micro-batches; the summed loss (the
        rows' share of the objective) on every pp rank. Every pp rank passes the same batch; gradients
        accumulate into .grad as loss.backward() would."""
        B = input_ids.shape[0]
        if B % n_microbatches:
            raise ConfigError(f"{B} rows do not split into {n_microbatches} equal micro-batches: torch's pipeline "
                              "sizes its buffers by the first; give a row count divisible by the micro-batches")
        kwargs = {k: v for k, v in model_kwargs.items() if v is not None}
        schedule = self._schedule(input_ids, n_microbatches, kwargs)
        self._loss = loss
        losses: list[torch.Tensor] = []
        rows = torch.arange(B, device=input_ids.device)
        try:
            schedule.step(input_ids, target=rows, losses=losses, return_outputs=False, **kwargs)
        finally:
            self._loss = None
        self._sum_tied_grads()
        total = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros(())
        total = total.to(input_ids.device)
        dist.broadcast(total, group=self.pp_group, group_src=self.last_rank)
        return total

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, n_microbatches: int, temperature: float = 1.0, tp_group=None,
                 **model_kwargs) -> torch.Tensor:
        """Token logprobs [B, T] of the rows (logprobs_from_logits' definition) on every pp rank, forward only
        (the old-logprob and reference passes).

        Not the training schedule (torch's multi-stage runtimes expect a backward): micro-batches go through
        the stages in (micro-batch, stage) order, GPipe's forward; sends are asynchronous, so an earlier stage
        runs ahead on the next micro-batch while a later one computes. Each hop sends a small header (shape,
        dtype) before the hidden states. The last stage's logprobs are then broadcast."""
        B, T = input_ids.shape
        if B % n_microbatches:
            raise ConfigError(f"{B} rows do not split into {n_microbatches} equal micro-batches")
        kwargs = {k: v for k, v in model_kwargs.items() if v is not None}
        out = torch.zeros(B, T, dtype=torch.float32, device=input_ids.device)
        held = dict(zip(self.stage_ids, self.modules, strict=True))
        pending: list = []
        for mb, rows in enumerate(torch.arange(B, device=input_ids.device).tensor_split(n_microbatches)):
            mb_kwargs = {k: v[rows] for k, v in kwargs.items()}
            h = None
            for s in range(self.num_stages):
                if s not in held:
                    continue
                if s == 0:
                    h = input_ids[rows]
                elif s - 1 not in held:  # from the rank holding the previous stage
                    h = self._recv_hidden(s - 1, tag=mb * self.num_stages + s, device=input_ids.device)
                h = held[s](h, **mb_kwargs)
                if held[s].is_last:
                    logp, _ = logprobs_from_logits(h, input_ids[rows], temperature, tp_group=tp_group)
                    out[rows] = logp.float()
                elif s + 1 not in held:
                    pending += self._send_hidden(h, s + 1, tag=mb * self.num_stages + s + 1)
        for work in pending:
            work.wait()
        dist.broadcast(out, group=self.pp_group, group_src=self.last_rank)
        return out

    def _stage_rank(self, stage: int) -> int:
        """The pp rank holding `stage` (loop: stage mod p; v: the mirror for the second half)."""
        if SCHEDULES[self.schedule_name][2] == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def _send_hidden(self, h: torch.Tensor, stage: int, tag: int) -> list:
        h = h.to_local() if isinstance(h, DTensor) else h
        header = torch.tensor([*h.shape, _DTYPES.index(h.dtype)], dtype=torch.long, device=h.device)
        peer = self._stage_rank(stage)
        return [dist.isend(header, group=self.pp_group, group_dst=peer, tag=tag),
                dist.isend(h.contiguous(), group=self.pp_group, group_dst=peer, tag=tag)]

    def _recv_hidden(self, stage: int, tag: int, device) -> torch.Tensor:
        header = torch.empty(4, dtype=torch.long, device=device)
        peer = self._stage_rank(stage)
        dist.recv(header, group=self.pp_group, group_src=peer, tag=tag)
        h = torch.empty(*header[:3].tolist(), dtype=_DTYPES[int(header[3])], device=device)
        dist.recv(h, group=self.pp_group, group_src=peer, tag=tag)
        return h

    def _sum_tied_grads(self) -> None:
        """Both copies of a tied weight take the sum of their gradients (summed here when one rank holds both)."""
        if not self._tied:
            return
        held = [m.model.embed_tokens.weight for m in self.modules if m.is_first]
        held += [m.lm_head.weight for m in self.modules if m.is_last]
        for p in held:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                # TP's embedding lookup leaves its grad partial / replicated; the copies agree once laid out as
                # their parameters (both sharded on the vocabulary alike)
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in held]
        if len(grads) == 2:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads:
            dist.all_reduce(grads[0], group=self._tied_group)
