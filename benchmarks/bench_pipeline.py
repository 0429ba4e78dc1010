"""Pipeline bubble: each schedule's measured idle share per rank against (p - 1) / (m + p - 1).

    per rank, per timed step:   busy = seconds inside the stage's compute (forward / backward / weight-grad
                                       chunks: torch's PipelineStage methods, and the last stage's loss,
                                       timed by wrapping them here)
                                idle = 1 - busy / step seconds     (waiting on a neighbour, p2p, the bubble)
    reported: each rank's median over the timed steps, averaged over the ranks

The 1F1B / GPipe ideal, with equal stages and free communication, is (p - 1) / (m + p - 1) for p stages and
m micro-batches; interleaving v stages per rank divides the bubble by v: (p - 1) / (v m + p - 1); the
zero-bubble schedules (interleaved_zb, zbv, dualpipev) fill it with deferred weight-grad work.

Model: a llama-style CausalLM (--layers, --hidden; vocab 256 so the last stage's head is light and the
stages near equal), fp32, seed 0 on every rank; each micro-batch --rows rows of --seq tokens, the GRPO
token-mean loss (random advantages) with global denominators. Ranks are local gloo processes with one
thread each. On a machine with fewer free cores than ranks the ranks time-slice, and "busy" then counts
time a rank was runnable but descheduled: read pp > cores as an upper bound on compute, not a bubble.

    python benchmarks/bench_pipeline.py                       # pp 2, m 4 and 8, every schedule
    python benchmarks/bench_pipeline.py --pp 2 4 --micro 4 8 --steps 3
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule

from relayrl.algorithms import AlgoConfig, policy_objective
from relayrl.models import CausalLM, ModelConfig
from relayrl.models.stage import split_model
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.launch import WorkerError, launch
from relayrl.parallel.pipeline import SCHEDULES, Pipeline, TokenLoss, rank_stages
from relayrl.single_controller.process_setup import configure_process

_BUSY = [0.0]


def _timed(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _BUSY[0] += time.perf_counter() - t0
    return run


def _instrument() -> None:
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(PipelineStage, name, _timed(getattr(PipelineStage, name)))
    # the last stage's loss (logprobs + GRPO objective) is compute too; the schedule calls it between chunks
    _PipelineSchedule._compute_loss = _timed(_PipelineSchedule._compute_loss)


def _config(args) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=args.hidden // 8)


def _batch(rows: int, seq: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (rows, seq), generator=g)
    mask = torch.ones(rows, seq)
    mask[:, : seq // 4] = 0  # the prompt
    adv = torch.randn(rows, 1, generator=g).expand(rows, seq)
    return ids, mask, adv


def _rank(rank, world_size, args, schedule, m):
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up
    _instrument()
    dims = ParallelDims(pp=world_size, world_size=world_size)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = CausalLM(_config(args))
    pipe = Pipeline(split_model(model, *rank_stages(dims, schedule)), dims, schedule)
    del model
    ids, mask, adv = _batch(m * args.rows, args.seq)
    algo, n_tok = AlgoConfig(), mask.sum()

    def objective(rows, logp, ent):
        old = logp.detach()
        return policy_objective(logp, old, adv[rows], mask[rows], algo, num_tokens=n_tok, num_seqs=len(ids))

    idle, step_s = [], []
    for step in range(args.warmup + args.steps):
        for p in pipe.parameters():
            p.grad = None
        _BUSY[0] = 0.0
        t0 = time.perf_counter()
        pipe.step(ids, TokenLoss(ids, objective), m)
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            idle.append(1.0 - _BUSY[0] / dt)
            step_s.append(dt)
    return statistics.median(idle), statistics.median(step_s)


def _ideal(schedule: str, p: int, m: int) -> str:
    """The schedule's own bubble with equal stages and free communication; the zero-bubble ones fill theirs
    with deferred weight-grad work (none left when there is enough of it), so '-' there."""
    if schedule in ("interleaved_zb", "zbv", "dualpipev"):
        return "-"
    v = SCHEDULES[schedule][1]
    return f"{(p - 1) / (v * m + p - 1):.3f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, nargs="+", default=[2])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)

    print(f"model: {args.layers} layers, hidden {args.hidden}; micro-batch {args.rows} x {args.seq} tokens; "
          f"{args.steps} timed steps after {args.warmup}; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'p':>2} {'m':>3}  {'schedule':<17} {'idle measured':>13} {'(p-1)/(m+p-1)':>14} {'ideal (/v)':>10} "
          f"{'step s':>8}")
    for p in args.pp:
        for m in args.micro:
            for schedule in args.schedules:
                try:
                    per_rank = launch(_rank, p, args, schedule, m, backend="gloo", timeout=600.0, threads=1)
                except WorkerError as e:  # a schedule refusing this (p, m), e.g. DualPipeV needs m >= 2p
                    reason = [line for line in str(e).splitlines() if "Error:" in line]
                    print(f"{p:>2} {m:>3}  {schedule:<17} refused: {reason[0].strip() if reason else e}")
                    continue
                idle = sum(r[0] for r in per_rank) / p
                step = max(r[1] for r in per_rank)
                print(f"{p:>2} {m:>3}  {schedule:<17} {idle:>13.3f} {(p - 1) / (m + p - 1):>14.3f} "
                      f"{_ideal(schedule, p, m):>10} {step:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
