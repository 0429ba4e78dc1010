"""Weight sync: the planned shard-to-shard transfer vs gather-everything-then-slice, vs a memcpy floor,
and the share of the sync in a GRPO step.

    1. transfer  for each placement / layout, every round (alternating, after --warmup rounds):
                   planned   relayrl.sync: each engine rank receives exactly its shard, own pieces
                             copied in place (colocated), the rest bucketed point to point
                   gather    the way it is usually done: every trainer tensor gathered whole
                             (colocated: DTensor.full_tensor() on each rank, an all-gather;
                             disaggregated: the trainer ranks all-gather, then trainer rank r sends
                             every full tensor to engine rank r), then the engine's loader slices
                             and fuses
                   floor     one torch copy of the bytes the planned sync writes into an engine rank
                 seconds per sync (median over rounds, the slowest engine rank), bytes each engine
                 rank receives from other processes, and the ratios gather / planned, planned / floor;
                 disaggregated once more with the float8 wire (a byte per element + a scale per piece)
    2. step      the driver's time/sync against time/step in a short GRPO run, colocated and
                 disaggregated (FSDP 2 trainer, engine TP 2), and in one process

    python benchmarks/bench_sync.py                      # all of it (a few minutes on 2 cores)
    python benchmarks/bench_sync.py --skip-step          # the transfer table only
    python benchmarks/bench_sync.py --skip-transfer      # the GRPO step table only

Model (part 1): qwen2-style, hidden --hidden, --layers layers, 8 Q / 2 KV heads of 64, MLP 3 x hidden,
vocab 8192, untied, fp32 (~40M parameters at the defaults): large enough that bytes, not call
overheads, dominate. Colocated runs 2 processes (trainer FSDP 2 from parallelize_model; engine TP 2 in
the same processes); disaggregated runs 4 (trainer FSDP 2 -> engine TP 2 in 2 processes of their own).
The machine is noisy and has 2 cores: read the ratios, measured side by side in the same processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import TPInfo
from relayrl.models import CausalLM, ModelConfig
from relayrl.models.config import ModelShape
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.launch import launch
from relayrl.parallel.parallelize import parallelize_model
from relayrl.parallel.rendezvous import serve_store
from relayrl.single_controller.process_setup import configure_process
from relayrl.sync.apply import shard_state_dict
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.transfer import (
    BackgroundSend,
    Members,
    SyncComm,
    SyncSpec,
    finish_receives,
    post_receives,
    sync_step,
    trainer_locals,
)


def model_config(hidden: int, layers: int) -> ModelConfig:
    return ModelConfig(model_type="qwen2", vocab_size=8192, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                       qkv_bias=True, tie_word_embeddings=False)


def _floor(nbytes: int) -> float:
    """One copy of `nbytes` between buffers already in memory (the engine's parameters are: a fresh
    buffer would add its page faults), best of 3."""
    src = torch.randn(nbytes // 4)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- colocated: 2 processes
def colocated(rank: int, world: int, store, hidden: int, layers: int, rounds: int, warmup: int) -> dict:
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up
    cfg = model_config(hidden, layers)
    torch.manual_seed(0)
    dims = ParallelDims(dp_shard=2, world_size=2)
    model = parallelize_model(CausalLM(cfg), dims, dims.build_mesh("cpu"))
    members = Members(2, 2, colocated=True)
    spec = SyncSpec(shape=ModelShape.of(cfg), trainer=TrainerLayout(dp_shard=2), engine=EngineLayout(2),
                    members=members, dtype=torch.float32)
    plan = spec.plan
    comm = SyncComm(store, rank, 2)
    runner = ModelRunner(cfg, torch.float32, TPInfo(rank, 2, dist.group.WORLD))
    stats = {}

    def planned():
        stats["s"] = sync_step(spec, comm=comm, trainer_rank=rank, engine_rank=rank, local=trainer_locals(model),
                               params=runner.params())

    def gathered():
        full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.state_dict().items()}
        runner.load_weights(full.items())

    times = {"planned": [], "gather": [], "floor": []}
    shard = plan.bytes_per_dst_rank(torch.float32)[rank]
    for i in range(warmup + rounds):
        row = {"planned": _timed(planned), "gather": _timed(gathered), "floor": _floor(shard)}
        if i >= warmup:
            for k, v in row.items():
                times[k].append(v)
    full_bytes = sum(p.numel() for p in model.parameters()) * 4
    comm.close()
    return {"times": times, "received": stats["s"].bytes_received, "copied": stats["s"].bytes_copied,
            "shard": shard, "gather_received": full_bytes // 2}  # an all-gather of 2 brings the other half


# ---------------------------------------------------------------------------- disaggregated: 4 processes
def disaggregated(rank: int, world: int, store, hidden: int, layers: int, rounds: int, warmup: int,
                  fp8: bool = False) -> dict:
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up
    cfg = model_config(hidden, layers)
    torch.manual_seed(0)
    full = {k: v.detach() for k, v in CausalLM(cfg).state_dict().items()}
    layout, members = TrainerLayout(dp_shard=2), Members(2, 2, colocated=False)
    spec = SyncSpec(shape=ModelShape.of(cfg), trainer=layout, engine=EngineLayout(2), members=members,
                    dtype=torch.float32, fp8=fp8)
    plan = spec.plan
    comm = SyncComm(store, rank, 4)
    trainer_group = dist.new_group([0, 1])
    engine_group = dist.new_group([2, 3])
    trainer = rank < 2
    local = shard_state_dict(full, cfg, layout, rank) if trainer else None
    runner = None if trainer else ModelRunner(cfg, torch.float32, TPInfo(rank - 2, 2, engine_group))
    names = list(full)
    stats = {}

    def planned():
        if trainer:
            BackgroundSend(spec, rank, local, comm).join()
        else:
            params = runner.params()
            stats["s"] = finish_receives(post_receives(spec, rank - 2, params, comm), params)

    def gathered():
        # trainer ranks all-gather each tensor (chunks padded to equal size); then both hold the
        # whole model, and trainer rank r sends it to engine rank r (the two sends run at once),
        # whose loader slices and fuses
        if trainer:
            got = {}
            for n in names:
                mine = local[n]
                c = -(-full[n].shape[0] // 2)
                pad = torch.zeros((c, *mine.shape[1:]), dtype=mine.dtype)
                pad[: mine.shape[0]] = mine
                parts = [torch.empty_like(pad) for _ in range(2)]
                dist.all_gather(parts, pad, group=trainer_group)
                got[n] = torch.cat(parts)[: full[n].shape[0]]
            for n in names:
                dist.send(got[n].contiguous(), rank + 2)
        else:
            recv = {}
            for n in names:
                recv[n] = torch.empty_like(full[n])
                dist.recv(recv[n], rank - 2)
            runner.load_weights(recv.items())

    times = {"planned": [], "gather": [], "floor": []}
    shard = plan.bytes_per_dst_rank(torch.float32)[rank - 2] if not trainer else 0
    for i in range(warmup + rounds):
        row = {"planned": _timed(planned), "gather": _timed(gathered), "floor": _floor(shard) if shard else 0.0}
        if i >= warmup:
            for k, v in row.items():
                times[k].append(v)
    comm.close()
    if trainer:
        return {}
    return {"times": times, "received": stats["s"].bytes_received, "copied": 0, "shard": shard,
            "gather_received": sum(v.numel() for v in full.values()) * 4}


def report(name: str, results: list[dict]) -> list[str]:
    rows = [r for r in results if r]
    med = {k: max(statistics.median(r["times"][k]) for r in rows) for k in ("planned", "gather", "floor")}
    mib = 2 ** 20
    line = (f"| {name} | {med['planned'] * 1e3:.1f} | {med['gather'] * 1e3:.1f} | {med['floor'] * 1e3:.2f} | "
            f"{med['gather'] / med['planned']:.2f}x | {med['planned'] / med['floor']:.1f}x | "
            f"{max(r['received'] for r in rows) / mib:.1f} | {max(r['copied'] for r in rows) / mib:.1f} | "
            f"{max(r['shard'] for r in rows) / mib:.1f} | {max(r['gather_received'] for r in rows) / mib:.1f} |")
    return [line]


# ---------------------------------------------------------------------------- part 2: in a GRPO step
def step_share(steps: int) -> list[str]:
    from relayrl.controller.config import RunConfig
    from relayrl.jobs.train import train
    from relayrl.observe import read_metrics

    base = {
        "model": {"tiny": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                           "num_attention_heads": 8, "num_key_value_heads": 2}},
        "data": {"task": "arith", "n_train": 256, "n_eval": 8},
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_tokens": 12},
        "trainer": {"lr": 1e-4, "micro_batch_size": 16},
        "eval": {"max_tokens": 4},
        "run": {"steps": steps, "save_every": 0, "loggers": []},
    }
    layouts = {
        "one process, colocated (engine TP 1)": {},
        "FSDP 2, colocated (engine TP 2 in the actor's processes)":
            {"parallel": {"backend": "local", "dp_shard": 2}, "rollout": {"tp": 2}},
        "FSDP 2, disaggregated (engine TP 2 in 2 processes of its own)":
            {"parallel": {"backend": "local", "dp_shard": 2, "placement": "disaggregated"}, "rollout": {"tp": 2}},
    }
    lines = ["| layout | time/sync (s) | of which transfer | of which canary | time/step (s) | sync share |",
             "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in layouts.items():
            d = {k: dict(v) for k, v in base.items()}
            for k, v in extra.items():
                d[k] = {**d.get(k, {}), **v}
            d["run"]["out_dir"] = os.path.join(tmp, str(len(lines)))
            res = train(RunConfig.from_dict(d), show_progress=False)
            ms = [m for m in read_metrics(res["run_dir"]) if "time/sync" in m][1:]  # the first step warms up
            def mean(k, ms=ms):
                return statistics.mean(m[k] for m in ms)

            lines.append(f"| {name} | {mean('time/sync'):.3f} | {mean('time/sync_transfer'):.3f} | "
                         f"{mean('time/sync_verify'):.3f} | {mean('time/step'):.3f} | "
                         f"{mean('time/sync') / mean('time/step'):.1%} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--skip-transfer", action="store_true")
    args = ap.parse_args()
    if args.skip_transfer:
        print("\n".join(step_share(args.steps)))
        return
    cfg = model_config(args.hidden, args.layers)
    n = sum(p.numel() for p in CausalLM(cfg).parameters())
    print(f"model: {n / 1e6:.1f}M parameters ({n * 4 / 2**20:.0f} MiB fp32); "
          f"rounds {args.rounds} after {args.warmup} warm-up")
    lines = ["| placement: trainer -> engine | planned (ms) | gather-then-slice (ms) | memcpy floor (ms) | "
             "gather / planned | planned / floor | MiB received / engine rank (planned) | MiB copied in place | "
             "MiB engine shard | MiB received / engine rank (gather) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    common = (args.hidden, args.layers, args.rounds, args.warmup)
    store = serve_store()
    lines += report("colocated: FSDP 2 -> TP 2 (2 processes)",
                    launch(colocated, 2, store.address, *common, timeout=1800))
    store.close()
    store = serve_store()
    lines += report("disaggregated: FSDP 2 -> TP 2 (4 processes)",
                    launch(disaggregated, 4, store.address, *common, timeout=1800))
    store.close()
    store = serve_store()
    lines += report("disaggregated, float8 wire (sync.wire=float8)",
                    launch(disaggregated, 4, store.address, *common, True, timeout=1800))
    store.close()
    print("\n".join(lines), flush=True)
    if not args.skip_step:
        print("\n".join(step_share(args.steps)))


if __name__ == "__main__":
    main()
