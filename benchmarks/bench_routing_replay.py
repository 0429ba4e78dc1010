"""Routing replay (R3): a few GRPO steps of a tiny random MoE model with a bf16 engine and an fp32 trainer, with and
without algo.routing_replay, and the trainer-engine gap each leaves.

    for replay in (off, on):   relayrl.jobs.train.train, one process, the same seed, model and prompts
        mismatch/logp_abs_mean, mismatch/logp_abs_max, mismatch/k3    |trainer logp - engine logp| over response tokens
                                                                      (the update's own forward: one optimiser step)
        moe/routing_mismatch   share of (response token, MoE layer) choices whose top-k set the trainer's router
                               picks differently from the engine's record (with replay: what the replay overrode)
        moe/load_max_over_mean the trainer's busiest expert over the mean (max over layers)

    python benchmarks/bench_routing_replay.py              # 20 steps each (under a minute on 2 cores)
    python benchmarks/bench_routing_replay.py --steps 10 --router-std 0.1

Model: Qwen3-MoE, hidden 64, 2 layers, 8 experts top-2 (expert width 32), the arith task's char tokenizer; routers
N(0, --router-std): small values leave near-ties between the k-th and (k+1)-th expert, where the bf16 engine and the
fp32 trainer pick differently. The tiny model is written by this script (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from relayrl.controller.config import RunConfig
from relayrl.data import DataConfig, build_task
from relayrl.jobs.train import train
from relayrl.models.tiny import build_tiny_moe_model
from relayrl.observe import read_metrics

KEYS = ("mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/k3", "moe/routing_mismatch",
        "moe/load_max_over_mean")


def build_model(out: Path, router_std: float, seed: int = 0) -> Path:
    return build_tiny_moe_model(out, build_task(DataConfig(task="arith")).alphabet, hidden_size=64, num_experts=8,
                                moe_intermediate_size=32, init_std=0.1, router_std=router_std, seed=seed)


def run(src: Path, out_dir: Path, replay: bool, steps: int) -> list[dict]:
    cfg = RunConfig.from_dict({
        "model": {"path": str(src)},
        "data": {"task": "arith", "n_train": 256, "n_eval": 8},
        "algo": {"routing_replay": replay},
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_tokens": 8, "engine_dtype": "bfloat16"},
        "trainer": {"lr": 1e-3, "micro_batch_size": 16},  # fp32 trainer; one optimiser step: the update's forward
        "eval": {"max_tokens": 4},
        "run": {"steps": steps, "out_dir": str(out_dir), "save_every": 0, "loggers": [], "trace": False},
    })
    train(cfg, show_progress=False)
    return [m for m in read_metrics(out_dir) if "reward/mean" in m]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--router-std", type=float, default=0.05)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = build_model(Path(tmp) / "moe", args.router_std)
        results = {}
        for replay in (False, True):
            t0 = time.perf_counter()
            results[replay] = run(src, Path(tmp) / f"replay_{replay}", replay, args.steps)
            print(f"routing_replay={replay}: {args.steps} steps in {time.perf_counter() - t0:.1f} s")
    print(f"\nbf16 engine, fp32 trainer, router std {args.router_std}; mean over {args.steps} steps (per step below)\n")
    print("| key | R3 off | R3 on |")
    print("|---|---|---|")
    for k in KEYS:
        off, on = (sum(m[k] for m in results[r]) / len(results[r]) for r in (False, True))
        print(f"| {k} | {off:.4g} | {on:.4g} |")
    print("\n| step | logp_abs_mean off | on | routing_mismatch off | on |")
    print("|---|---|---|---|---|")
    for i, (a, b) in enumerate(zip(results[False], results[True], strict=True), 1):
        print(f"| {i} | {a['mismatch/logp_abs_mean']:.4g} | {b['mismatch/logp_abs_mean']:.4g} | "
              f"{a['moe/routing_mismatch']:.4g} | {b['moe/routing_mismatch']:.4g} |")


if __name__ == "__main__":
    main()
