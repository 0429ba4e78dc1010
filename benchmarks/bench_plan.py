"""The memory planner (relayrl.planner) against what relayrl measures, per layout and per rank.

For every CPU layout relayrl runs (one process, DDP 2, FSDP 2, HSDP 2 x 2, TP 2, TP 2 x FSDP 2, each
with and without activation checkpointing) on the ~27M model of bench_trainer.py:

    held    storage bytes of this rank's parameters, gradients and AdamW state after the last update
            (bench_trainer._held_bytes: DTensor local shards, each storage counted once), against
            train_memory(...).params / .grads / .optim for this rank: these must be EQUAL
    peak    the rise of the RSS high-water mark over the RSS before the model was built (VmHWM reset
            before each update and before each optimiser step, as bench_trainer does; the spawned
            ranks run with MALLOC_MMAP_THRESHOLD_ so freed tensors leave RSS), against
            train_memory(...).total for this rank: planned / measured within 1 +- 0.15

Every rank of a layout runs in one launch (its own processes, so one layout's allocations never
pollute another's baseline). The batch is bench_trainer's GRPO batch; --prompts 4 (32 rows) by
default so every layout's forward sees the same --micro-batch rows (single: 4 micro-batches; DP 2: 2
per rank; DP 4: 1 per rank), and the planner's workload is that micro-batch.

    python benchmarks/bench_plan.py                   # every layout, with and without checkpointing
    python benchmarks/bench_plan.py --layouts single fsdp2 --no-ac
    python benchmarks/bench_plan.py --layouts single+lora16 fsdp2+lora16-bf16 --no-ac    # trainer.lora
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_trainer import (
    ALGO,
    MiB,
    _held_bytes,
    _reset_hwm,
    _status,
    build_model,
    make_batch,
    model_config,
    trainer_cfg,
)
from relayrl.algorithms import AlgoConfig
from relayrl.models import ModelConfig
from relayrl.models.config import ModelShape
from relayrl.models.lora import apply_lora_config
from relayrl.models.lora_config import LoRAConfig
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.launch import launch
from relayrl.parallel.parallelize import apply_activation_checkpointing, parallelize_model
from relayrl.single_controller.process_setup import configure_process
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.config import TrainerConfig


@dataclass(frozen=True)
class RunLayout:
    """One layout as relayrl runs it (relayrl.parallel.parallelize_model's arguments)."""

    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    dp_mode: str = "fsdp"
    ac: bool = False
    lora_rank: int = 0  # > 0: trainer.lora on every target linear (relayrl.models.lora), the base frozen
    lora_base: str = "float32"  # the frozen base's dtype (trainer.lora.base_dtype)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def with_ac(self) -> RunLayout:
        return dataclasses.replace(self, name=self.name + "+ac", ac=True)

    def with_lora(self, rank: int, base: str = "float32") -> RunLayout:
        suffix = f"+lora{rank}" + ("-bf16" if base == "bfloat16" else "")
        return dataclasses.replace(self, name=self.name + suffix, lora_rank=rank, lora_base=base)


LAYOUTS = {
    "single": RunLayout("single"),
    "ddp2": RunLayout("ddp2", dp_replicate=2, dp_mode="ddp"),
    "fsdp2": RunLayout("fsdp2", dp_shard=2),
    "hsdp2x2": RunLayout("hsdp2x2", dp_replicate=2, dp_shard=2),
    "tp2": RunLayout("tp2", tp=2),
    "fsdp2_tp2": RunLayout("fsdp2_tp2", dp_shard=2, tp=2),
}


def build(layout: RunLayout, mc: ModelConfig, world: int):
    """The model of bench_trainer (with trainer.lora when asked), parallelised as relayrl does: (model, dims or
    None). LoRA comes first, as relayrl.roles.actor_workers.actor_model applies it before parallelism."""
    model = build_model(mc)
    if layout.lora_rank:
        apply_lora_config(model, LoRAConfig(rank=layout.lora_rank, base_dtype=layout.lora_base))
    if layout.world == 1:
        if layout.ac:
            apply_activation_checkpointing(model)
        return model, None
    dims = ParallelDims(world_size=world, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp)
    mesh = dims.build_mesh("cpu")
    parallelize_model(model, dims, mesh, dp_mode=layout.dp_mode, activation_checkpointing=layout.ac)
    return model, dims


def rows_of(batch: TrainBatch, dims: ParallelDims | None) -> TrainBatch:
    """This rank's rows: its contiguous 1/dp of the batch (TP ranks of one replica share them)."""
    if dims is None or dims.dp == 1:
        return batch
    return batch.split(len(batch) // dims.dp)[dims.dp_rank]


def held_detail(model, optimizer) -> dict[str, int]:
    """The optimiser state split by kind (exp_avg, exp_avg_sq, step), each storage counted once, and the
    number of parameter tensors: what a disagreement with the plan is read from."""
    seen: set = set()
    out: dict[str, int] = {"param_tensors": len(list(model.parameters()))}
    for key in ("exp_avg", "exp_avg_sq", "step"):
        total = 0
        for st in optimizer.state.values():
            v = st.get(key)
            if isinstance(v, torch.Tensor):
                t = v._local_tensor if hasattr(v, "_local_tensor") else v
                s = t.untyped_storage()
                if s.data_ptr() not in seen and s.nbytes():
                    seen.add(s.data_ptr())
                    total += s.nbytes()
        out[key] = total
    return out


def measure_layout(layout: RunLayout, mc: ModelConfig, batch: TrainBatch, tcfg: TrainerConfig, steps: int,
                   world: int) -> dict:
    """On this rank: build, `steps` updates, then the held bytes; and the peak of the last update."""
    gc.collect()
    rss_base = _status()["VmRSS"]
    model, dims = build(layout, mc, world)
    rows = rows_of(batch, dims)
    actor = Actor(model, tcfg, AlgoConfig(**ALGO), total_steps=steps, dims=dims)
    rec: dict = {}
    inner_step = actor.optimizer.step

    def step(*a, **kw):  # split the peak: forward + backward + clip | optimiser step
        rec["fb_hwm"] = _status()["VmHWM"]
        _reset_hwm()
        out = inner_step(*a, **kw)
        rec["opt_hwm"] = _status()["VmHWM"]
        return out

    step._wrapped_by_lr_sched = True  # inner_step is the scheduler's wrapper: keep its check quiet
    actor.optimizer.step = step
    peaks = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        gc.collect()
        rss_before = _status()["VmRSS"]
        _reset_hwm()
        t0 = time.perf_counter()
        actor.update(rows)
        peaks.append(dict(fb=rec["fb_hwm"] - rss_base, opt=rec["opt_hwm"] - rss_base,
                          before=rss_before - rss_base, time=time.perf_counter() - t0))
    held = _held_bytes(model, actor.optimizer)
    detail = held_detail(model, actor.optimizer)
    # drop the model's and optimiser's references before the next layout of this launch builds its own
    del actor, model
    gc.collect()
    return dict(held=held, detail=detail, rows=len(rows), peaks=peaks,
                micro_batch=min(tcfg.micro_batch_size, len(rows)))


def _rank_measure(rank: int, world: int, jobs: list[tuple[RunLayout, ModelConfig, TrainBatch]], tcfg: TrainerConfig,
                  steps: int) -> list[dict]:
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up
    return [measure_layout(lay, mc, batch, tcfg, steps, world) for lay, mc, batch in jobs]


def measure(jobs: list[tuple[RunLayout, ModelConfig, TrainBatch]], tcfg: TrainerConfig, *, steps: int,
            threads: int = 1, env: dict | None = None, timeout: float = 3600) -> list[list[dict]]:
    """Run jobs (layout, model config, global batch), all of one world size, one after another in one
    launch; [job][rank] -> measurement."""
    worlds = {lay.world for lay, _, _ in jobs}
    if len(worlds) != 1:
        raise ValueError(f"one launch runs layouts of one world size, got {sorted(worlds)}")
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # spawned ranks read it at exec (glibc reads MALLOC_* at start-up)
    try:
        per_rank = launch(_rank_measure, worlds.pop(), jobs, tcfg, steps, threads=threads, timeout=timeout)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [[per_rank[r][i] for r in range(len(per_rank))] for i in range(len(jobs))]


# ---------------------------------------------------------------------------------------------
# the engine's KV cache


def _kv_cache_bytes(runner) -> int:
    """Bytes of this engine rank's KV cache: one tensor [layers, 2, slots, local kv heads, head_dim]
    that every layer's (k, v) views, so one storage."""
    storages = {k.untyped_storage().data_ptr(): k.untyped_storage().nbytes() for kv in runner.kv_cache for k in kv}
    return sum(storages.values())


def engine_measure(engine) -> dict:
    """What an LLMEngine sized itself to: bytes per block, blocks, and each rank's allocated cache bytes."""
    return dict(bytes_per_block=engine.kv_bytes_per_block, num_blocks=engine.num_blocks,
                cache_bytes=engine.run_on_ranks(_kv_cache_bytes))


def run_concurrent(engine, n: int, prompt_len: int, max_tokens: int, seed: int = 0) -> dict:
    """Submit n sequences (distinct random prompts of prompt_len tokens, max_tokens completion tokens each,
    EOS ignored: each reaches L = prompt_len + max_tokens tokens, and holds KV for L - 1 of them when its
    last token is sampled) and step the engine to the end. Observed through the scheduler: the largest
    batch it scheduled, the most sequences in one decode batch at their final length (KV for L - 1 tokens
    written in that step), its preemptions, and each sample's completion length."""
    from relayrl.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    sched = engine.scheduler
    preempt0 = sched.num_preemptions
    final = prompt_len + max_tokens - 1
    seen = dict(batch=0, at_final=0)
    inner = sched.schedule

    def schedule():  # observe each batch as the engine runs it
        batch, is_prefill = inner()
        seen["batch"] = max(seen["batch"], len(batch))
        if not is_prefill:
            seen["at_final"] = max(seen["at_final"], sum(1 for s in batch if s.num_tokens == final))
        return batch, is_prefill

    sched.schedule = schedule
    try:
        rids = [engine.add_request(torch.randint(3, engine.config.vocab_size, (prompt_len,), generator=g).tolist(),
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
                for _ in range(n)]
        lengths: dict[int, int] = {}
        while engine.has_unfinished():
            for o in engine.step():
                lengths[o.request_id] = len(o.samples[0].token_ids)
    finally:
        del sched.schedule
    return dict(most_batch=seen["batch"], at_final=seen["at_final"], preemptions=sched.num_preemptions - preempt0,
                lengths=[lengths.get(r) for r in rids])


# ---------------------------------------------------------------------------------------------
# the benchmark


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # the model and batch of bench_trainer.py (same names, so its builders take these args)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=4, help="GRPO groups (default 4: 32 rows)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=192)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward, every layout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS),
                    help=f"of {', '.join(LAYOUTS)}, each optionally +ac, +lora<rank> or +lora<rank>-bf16 "
                         "(trainer.lora on every target, a float32 / bfloat16 frozen base)")
    ap.add_argument("--no-ac", action="store_true", help="skip the activation-checkpointing runs")
    ap.add_argument("--steps", type=int, default=2, help="updates per layout (the last one's peak is reported)")
    ap.add_argument("--mmap-threshold", type=int, default=65536, help="MALLOC_MMAP_THRESHOLD_ in the ranks")
    ap.add_argument("--tolerance", type=float, default=0.15, help="allowed |planned / measured peak - 1|")
    ap.add_argument("--save", help="write the measurements to this JSON file")
    ap.add_argument("--load", help="compare against measurements saved with --save instead of measuring")
    args = ap.parse_args(argv)
    for name in args.layouts:
        try:
            layout_named(name)
        except (KeyError, ValueError) as e:
            ap.error(f"--layouts {name}: {e}")
    args.bf16 = False
    return args


def run_measurements(args) -> dict:
    """{layout name: [per rank: measurement]} for the layouts asked, each layout in a launch of its own."""
    mc = model_config(args)
    batch = make_batch(args, mc)
    tcfg = trainer_cfg(args)
    env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    layouts = [layout_named(name) for name in args.layouts]
    if not args.no_ac:
        layouts += [lay.with_ac() for lay in layouts if not lay.ac]
    out = {}
    for lay in layouts:
        t = time.time()
        out[lay.name] = measure([(lay, mc, batch)], tcfg, steps=args.steps, env=env)[0]
        if args.save:  # after each layout, so a long run stopped midway keeps what it measured
            Path(args.save).write_text(json.dumps(out))
        print(f"  measured {lay.name:14s} in {time.time() - t:.0f}s; load {os.getloadavg()[0]:.1f}", flush=True)
    return out


def layout_named(name: str) -> RunLayout:
    """The RunLayout a name stands for: a LAYOUTS key, then +ac and +lora<rank>[-bf16] in any order."""
    base, *mods = name.split("+")
    lay = LAYOUTS[base]
    for mod in mods:
        if mod == "ac":
            lay = lay.with_ac()
        elif mod.startswith("lora"):
            rank, _, bf16 = mod[4:].partition("-")
            lay = lay.with_lora(int(rank), "bfloat16" if bf16 else "float32")
        else:
            raise ValueError(f"unknown layout modifier {mod!r} in {name!r}")
    return lay


def planned(lay: RunLayout, mc: ModelConfig, seq: int, micro_batch: int, rank: int):
    """train_memory for this rank of this layout, the workload as the trainer runs it (fp32, its micro-batch)."""
    from relayrl.planner import Layout, Workload, train_memory

    layout = Layout(dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, tp=lay.tp, dp_mode=lay.dp_mode)
    workload = Workload(seq=seq, micro_batch=micro_batch, dtype="float32", mixed_precision=False,
                        recompute="full" if lay.ac else "none", lora_rank=lay.lora_rank, base_dtype=lay.lora_base)
    return train_memory(ModelShape.of(mc), layout, workload, rank=rank)


def compare(args, measured: dict) -> list[dict]:
    """One row per layout and rank: planned and measured state bytes, planned total vs measured peak."""
    mc = model_config(args)
    seq = args.prompt_len + args.response_len
    rows = []
    for name, ranks in measured.items():
        lay = layout_named(name)
        for r, m in enumerate(ranks):
            plan = planned(lay, mc, seq, m["micro_batch"], r)
            last = m["peaks"][-1]
            peak = max(last["fb"], last["opt"])
            rows.append(dict(layout=name, rank=r, held=m["held"],
                             plan=dict(params=plan.params, grads=plan.grads, optim=plan.optim),
                             activations=plan.activations, transient=plan.transient, total=plan.total,
                             peak=peak, peak_phase="fwd+bwd" if last["fb"] >= last["opt"] else "optimiser",
                             ratio=plan.total / peak, steps_peaks=[max(p["fb"], p["opt"]) for p in m["peaks"]]))
    return rows


def report(args, measured: dict) -> None:
    rows = compare(args, measured)
    print(f"\nplanned vs measured per rank (MiB; held = params + grads + AdamW storage; peak = RSS high-water rise "
          f"over the pre-build RSS, last of {args.steps} updates):")
    print("| layout | rank | params p/m | grads p/m | optim p/m | state exact | planned act + transient | "
          "planned peak | measured peak | planned / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        p, h = x["plan"], x["held"]
        cells = [f"{p[k] / MiB:.2f} / {h[k] / MiB:.2f}" for k in ("params", "grads", "optim")]
        exact = "yes" if p == h else "**no** (" + ", ".join(f"{k} {p[k] - h[k]:+d} B" for k in p if p[k] != h[k]) + ")"
        print(f"| {x['layout']} | {x['rank']} | {' | '.join(cells)} | {exact} | "
              f"{x['activations'] / MiB:.0f} + {x['transient'] / MiB:.0f} | {x['total'] / MiB:.0f} | "
              f"{x['peak'] / MiB:.0f} ({x['peak_phase']}) | {x['ratio']:.3f} |")
    print("\nper layout (MiB; state = params + grads + AdamW of rank 0, planned; peaks: the largest rank's; ratio: "
          "the rank furthest from 1):")
    print("| layout | ranks | state bytes planned = measured | planned state | planned act + transient | "
          "planned peak | measured peak | planned / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(x["layout"] for x in rows):
        mine = [x for x in rows if x["layout"] == name]
        ok = sum(x["plan"] == x["held"] for x in mine)
        far = max(mine, key=lambda x: abs(x["ratio"] - 1))
        print(f"| {name} | {len(mine)} | {'yes' if ok == len(mine) else f'**{ok} of {len(mine)}**'} | "
              f"{sum(mine[0]['plan'].values()) / MiB:.1f} | "
              f"{mine[0]['activations'] / MiB:.0f} + {mine[0]['transient'] / MiB:.0f} | "
              f"{max(x['total'] for x in mine) / MiB:.0f} | {max(x['peak'] for x in mine) / MiB:.0f} | "
              f"{far['ratio']:.2f} |")
    exact = sum(x["plan"] == x["held"] for x in rows)
    worst = max(rows, key=lambda x: abs(x["ratio"] - 1))
    print(f"\nstate bytes equal on {exact} of {len(rows)} (layout, rank) pairs")
    print(f"peak ratio planned / measured: {min(x['ratio'] for x in rows):.3f} .. {max(x['ratio'] for x in rows):.3f}; "
          f"worst {worst['ratio']:.3f} ({worst['layout']} rank {worst['rank']}); "
          f"within +-{args.tolerance:.0%}: {sum(abs(x['ratio'] - 1) <= args.tolerance for x in rows)} of {len(rows)}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up
    t0 = time.time()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    if args.load:
        measured = json.loads(Path(args.load).read_text())
    else:
        measured = run_measurements(args)
    report(args, measured)
    print(f"\ntotal {time.time() - t0:.0f}s; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
