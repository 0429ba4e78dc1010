"""The bottleneck section of a run's report: where the step's time went, and what to change.

    metrics.jsonl ──> shares of the step (each time/* stage summed over the steps / time/step summed)
                  ──> checks against the thresholds of the distributed-RL texts:

    rollout          time/rollout                               >= 80% of the step
    weight sync      time/sync (its transfer, verify included)  >=  5%
    communication    time/update_comm (the trainer's collectives) >= 10%, over the profiled steps
    stragglers       rollout/straggler_share                    >= 25% of the rollout's engine steps
    low MFU          throughput/mfu_update, /mfu_rollout        <= 30%
    expert imbalance moe/load_max_over_mean                     >= 3x (90% busy against 30%)

The expert load is the trainer's (relayrl.trainer.routing): max over MoE layers of the busiest expert's routed slots
over the mean, in the update's forwards; the finding names the worst layer (moe/load_max_over_mean/layer_<i>).

A finding fires when its figure reaches the threshold. Each comes with advice lines naming the config keys to
change, in backticks (`rollout.max_num_seqs`, `sync.wire=float8`); tests/observe/test_bottleneck.py checks that every
such key is a field of RunConfig.

Communication: the texts' "all-reduce or all-gather" is the trainer's collectives (FSDP's all-gathers and
reduce-scatters, DDP's all-reduce, TP's), measured on trainer rank 0 by torch.profiler every run.profile_every
steps (relayrl.observe.comm_profile): time/update_comm, a part of time/update. Its share is taken over the
steps that were profiled only. The weight sync's transfer (time/sync_transfer) is a part of time/sync and is
judged there, once: a slow sync is the "weight sync" finding, never this one too.

Stragglers: rollout/straggler_share is the share of the rollout's engine steps during which at most max(1, 10%)
of its samples were still unfinished (relayrl.controller.step_cost; synchronous runs only). At 25% a quarter
of the rollout's steps run a tenth of the batch or less, so at least ~22% of its batch slots sit idle, and a
decode step on a GPU costs about the same full or not.

Steps: the first is left out when the run has three or more (it carries one-time costs: allocations, warm-up,
the matmul peak's measurement); an asynchronous run's waits (time/wait_*) and time/env (inside the rollout)
are not stages of their own.

It imports the standard library and the metrics reader only; it must never import another relayrl layer:
observe is a leaf, which the controller and the CLI import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STEP_TIME = "time/step"
# Seconds inside environment steps, summed over episodes: they overlap the rollout (and each other), so
# they are a part of time/rollout, not a stage of their own.
ENV_TIME = "time/env"
# An asynchronous run's waits: the trainer's for its batch (the same seconds as its time/rollout) and the
# engine's for the trainer (spent beside the step, in another thread): neither is a stage of the step.
ASYNC_WAITS = ("time/wait_rollout", "time/wait_train")

ROLLOUT_SHARE = 0.80
SYNC_SHARE = 0.05
COMM_SHARE = 0.10
STRAGGLER_SHARE = 0.25
LOW_MFU = 0.30
EXPERT_IMBALANCE = 3.0  # the busiest expert's load over the mean: 90% against 30%

COMM_TIME = "time/update_comm"  # relayrl.observe.comm_profile.COMM_TIME (observe's modules stay apart)
STRAGGLER = "rollout/straggler_share"
MFU_KEYS = {"update": "throughput/mfu_update", "rollout": "throughput/mfu_rollout"}
PEAK_KEYS = {"update": "throughput/peak_gflops_trainer", "rollout": "throughput/peak_gflops_engine"}
EXPERT_LOAD = "moe/load_max_over_mean"
MFU_FORMULA = ("MFU = flops / (seconds x peak x ranks): update = flops/update / (time/update x trainer peak x "
               "trainer ranks); rollout = flops/rollout / (engine seconds x engine peak x engine ranks), engine "
               "seconds = time/rollout (asynchronous: time/step - time/wait_train); peak = one rank's best "
               "square-matmul GFLOP/s at its threads and dtype (relayrl.observe.peak); flops: 6N per trained "
               "token + attention (4N + 6 N_adapters with trainer.lora), 2(N - Vh) per token the engine computed + 2Vh "
               "per logit position + attention (relayrl.models.flops)")


def time_stages(keys) -> list[str]:
    """The stage timers among `keys`: time/* but time/step, and not a stage's parts (time/sync_verify
    is inside time/sync), so the shares add up."""
    timers = {k for k in keys if k.startswith("time/") and k not in (STEP_TIME, ENV_TIME, *ASYNC_WAITS)}
    return sorted(k for k in timers if not any(k.startswith(t + "_") for t in timers))


@dataclass
class Finding:
    name: str
    what: str  # the measurement against its threshold, one line
    advice: list[str] = field(default_factory=list)


def training_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of training steps (those with time/step), the first left out when there are three or more."""
    rows = [r for r in records if STEP_TIME in r]
    return rows[1:] if len(rows) >= 3 else rows


def shares(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each stage's (and each stage part's) seconds summed over `rows`, over time/step summed."""
    total = sum(float(r[STEP_TIME]) for r in rows)
    if total <= 0:
        return {}
    keys = {k for r in rows for k in r if k.startswith("time/") and k not in (STEP_TIME, *ASYNC_WAITS)}
    return {k: sum(float(r.get(k, 0.0)) for r in rows) / total for k in sorted(keys)}


def comm_share(rows: list[dict[str, Any]]) -> float | None:
    """time/update_comm summed over the steps that were profiled, over their time/step summed; None if none was."""
    profiled = [r for r in rows if COMM_TIME in r]
    total = sum(float(r[STEP_TIME]) for r in profiled)
    return sum(float(r[COMM_TIME]) for r in profiled) / total if profiled and total > 0 else None


def _mean(rows, key) -> float | None:
    vals = [float(r[key]) for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None


def _mfu(rows, role: str) -> float | None:
    """Time-weighted over the steps: sum(flops) / (sum(seconds) x peak x ranks) when peak and ranks hold."""
    key = MFU_KEYS[role]
    secs = "time/update" if role == "update" else "time/rollout"
    pairs = [(float(r[key]), float(r.get(secs, 0.0))) for r in rows if key in r]
    if not pairs:
        return None
    weight = sum(t for _, t in pairs)
    return sum(m * t for m, t in pairs) / weight if weight > 0 else sum(m for m, _ in pairs) / len(pairs)


def _pct(x: float) -> str:
    return f"{x:.1%}"


ROLLOUT_ADVICE = [
    "raise `rollout.max_num_seqs` so more samples decode in one batch (and `rollout.kv_cache_bytes` if "
    "engine/preemptions is above zero)",
    "keep `rollout.enable_prefix_caching=true`: the samples of one prompt then share its prefill",
    "give the engine processes of its own and more of them: `parallel.placement=disaggregated` with `rollout.tp`",
    "overlap generation with the update: `rollout.mode=one_step_off`, or `rollout.mode=async` bounded by "
    "`rollout.max_staleness`",
    "a long tail of lengths: lower `rollout.max_tokens`",
]
SYNC_ADVICE = [
    "send fewer bytes: `sync.wire=float8` (a quarter of fp32's, half of bf16's)",
    "train low-rank adapters and sync only them: `trainer.lora.rank` (a `trainer.lora` section)",
    "fewer, fuller messages: raise `sync.bucket_mb` and `sync.window`",
    "keep the engine in the trainer's processes, where most pieces are copied in place: `parallel.placement=colocated`",
]
VERIFY_ADVICE = "the canary check is a large part of it: lower `sync.canary_rows` or `sync.canary_len`"
COMM_ADVICE = [
    "larger micro-batches: raise `trainer.micro_batch_size` (FSDP gathers the weights once per micro-batch)",
    "`parallel.dp_mode=ddp` when the model and its optimiser fit on each rank: one all-reduce per optimiser step",
    "fewer optimiser steps per batch: lower `trainer.mini_batches`",
    "another split: lower `parallel.tp`, raise `parallel.dp_shard` or `parallel.dp_replicate`",
]
STRAGGLER_ADVICE = [
    "cap the tail: lower `rollout.max_tokens`",
    "let new groups take the slots the tail frees: `rollout.mode=async` with `rollout.max_inflight` above "
    "`rollout.prompts_per_step`",
]
MFU_ADVICE = {
    "update": [
        "bigger matmuls: raise `trainer.micro_batch_size`",
        "`trainer.bf16=true` on hardware with bf16 units",
        "`parallel.activation_checkpointing=false` when memory allows (MFU does not count the recompute)",
        "then read the shares above: time lost to communication or waiting shows here",
    ],
    "rollout": [
        "decode is memory-bound: more FLOPs per weight read with a larger batch, `rollout.max_num_seqs`",
        "`rollout.engine_dtype=bfloat16` halves the bytes read per token",
        "a small model split too far spends its time in collectives: lower `rollout.tp`",
    ],
}
EXPERT_ADVICE = [
    "balance the routers: raise `algo.moe_aux_loss_coef` (the load-balancing loss, off by default in RL), and "
    "`algo.moe_z_loss_coef` if the router logits grow",
    "under expert parallelism the rank holding the busiest expert sets the pace: lower `parallel.ep` (more ranks "
    "share each expert's tokens through FSDP instead)",
    "in the engine, `rollout.expert_placement=tp` shards every expert over its ranks, so a hot expert no longer "
    "waits on one rank",
]


def findings(records: list[dict[str, Any]]) -> list[Finding]:
    """The checks above over a run's metrics records."""
    rows = training_steps(records)
    share = shares(rows)
    out: list[Finding] = []
    rollout = share.get("time/rollout", 0.0)
    if rows and rollout >= ROLLOUT_SHARE:
        out.append(Finding("rollout", f"rollout is {_pct(rollout)} of the step (threshold {_pct(ROLLOUT_SHARE)})",
                           list(ROLLOUT_ADVICE)))
    sync = share.get("time/sync", 0.0)
    if rows and sync >= SYNC_SHARE:
        advice = list(SYNC_ADVICE)
        if share.get("time/sync_verify", 0.0) >= sync / 2:
            advice.append(VERIFY_ADVICE)
        out.append(Finding("weight sync", f"the weight sync is {_pct(sync)} of the step (threshold "
                                          f"{_pct(SYNC_SHARE)})", advice))
    comm = comm_share(rows)
    if comm is not None and comm >= COMM_SHARE:
        out.append(Finding("communication", f"the trainer's collectives ({COMM_TIME}) are {_pct(comm)} of the step "
                                            f"(threshold {_pct(COMM_SHARE)})", list(COMM_ADVICE)))
    straggle = _mean(rows, STRAGGLER)
    if straggle is not None and straggle >= STRAGGLER_SHARE:
        out.append(Finding("stragglers", f"the rollout spends {_pct(straggle)} of its engine steps with at most a "
                                         f"tenth of its samples left (threshold {_pct(STRAGGLER_SHARE)})",
                           list(STRAGGLER_ADVICE)))
    for role in ("update", "rollout"):
        value = _mfu(rows, role)
        if value is not None and value <= LOW_MFU:
            out.append(Finding(f"{role} MFU", f"{role} MFU is {_pct(value)} (threshold {_pct(LOW_MFU)})",
                               list(MFU_ADVICE[role])))
    load = _mean(rows, EXPERT_LOAD)
    if load is not None and load >= EXPERT_IMBALANCE:
        out.append(Finding("expert imbalance", f"the busiest expert carries {load:.2f}x the mean load{_worst(rows)} "
                                               f"(threshold {EXPERT_IMBALANCE:.0f}x: 90% busy against 30%)",
                           list(EXPERT_ADVICE)))
    return out


def _worst(rows: list[dict[str, Any]]) -> str:
    """' in MoE layer i' for the layer whose mean moe/load_max_over_mean/layer_<i> is the highest, '' without them."""
    layers = {k for r in rows for k in r if k.startswith(EXPERT_LOAD + "/layer_")}
    if not layers:
        return ""
    worst = max(sorted(layers), key=lambda k: _mean(rows, k))
    return f" in MoE layer {worst.rsplit('_', 1)[1]}"


def comm_line(rows: list[dict[str, Any]]) -> str:
    comm = comm_share(rows)
    if comm is None:
        return ("Communication: no step was profiled (run.profile_every); the trainer's collectives are inside "
                "time/update.")
    n = len([r for r in rows if COMM_TIME in r])
    return (f"Communication: the trainer's collectives are {_pct(comm)} of the step over {n} profiled step(s) "
            f"(torch.profiler on trainer rank 0; {COMM_TIME}, a part of time/update); the weight sync's transfer is "
            "counted in time/sync.")


def section(records: list[dict[str, Any]]) -> str:
    """The bottleneck section as Markdown text."""
    rows = training_steps(records)
    lines = ["## Bottleneck", ""]
    if not rows:
        return "\n".join([*lines, "No training step logged time/step: nothing to decompose.", ""])
    steps = [int(r["step"]) for r in rows]
    left_out = len([r for r in records if STEP_TIME in r]) - len(rows)
    lines.append(f"Steps {min(steps)}-{max(steps)} ({len(rows)} steps"
                 + ("; the first left out: one-time costs" if left_out else "") + ").")
    share = shares(rows)
    stages = time_stages(share)
    parts = [f"{k.removeprefix('time/')} {_pct(share[k])}" for k in stages]
    other = 1.0 - sum(share[k] for k in stages)
    lines += ["", "Share of the step: " + ", ".join(parts + [f"other {_pct(max(other, 0.0))}"]) + ".",
              comm_line(rows)]
    mfus = [(role, _mfu(rows, role), _mean(rows, PEAK_KEYS[role])) for role in ("update", "rollout")]
    if any(v is not None for _, v, _ in mfus):
        figures = [f"{role} {_pct(v)}" + (f" (peak {peak:.1f} GFLOP/s per rank)" if peak else "")
                   for role, v, peak in mfus if v is not None]
        lines += ["", "MFU: " + ", ".join(figures) + ".", MFU_FORMULA + "."]
    straggle = _mean(rows, STRAGGLER)
    if straggle is not None:
        lines.append(f"Stragglers: {_pct(straggle)} of the rollout's engine steps with at most a tenth of its samples "
                     "left (at least one).")
    found = findings(records)
    lines += ["", "### Findings", ""]
    if not found:
        lines.append("No bottleneck over its threshold.")
    for f in found:
        lines.append(f"- **{f.name}**: {f.what}")
        lines += [f"  - {a}" for a in f.advice]
    return "\n".join(lines) + "\n"
