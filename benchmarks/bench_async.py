"""Asynchronous RL against synchronous, side by side: samples/s and held-out reward against wall time.

Every run is `relayrl.jobs.train.train` on the same workload, seed, prompts and steps; only the
rollout mode differs:

    sync                  roll out, score, train, in turn (the default)
    one_step_off          batch k+1 generates while batch k trains (weights change between batches)
    async eta=1, 2, 4     the engine generates continuously, up to eta policy versions ahead; new weights
                          reach it between two engine steps (rollout.partial=keep_kv, the default)
    async eta=4 plain     eta=4 with algo.proximal=behaviour and algo.tis_cap=null: plain PPO against the
                          sampling policy, no correction (the default is decoupled PPO with TIS)

Layout (2 cores): parallel.backend=local, placement=disaggregated: the trainer in a worker process of its
own, the engine's rank in another, the driver (scheduler, rollout and score threads) in this one; one
torch thread each; two reward worker processes (reward.workers, the default).

Workload (benchmarks/async_workload.py): arithmetic prompts whose rows carry a `max_tokens` budget, L for
nine in ten and 8 L for one in ten (rollout.max_tokens = 8 L); a tiny model that does not emit <eos>,
so every sample runs to its budget; reward = share of '7's, after a sleep per sample (a verifier's
latency). P = 8 prompts x G = 8 samples a step. Held-out: the mean reward of one sample (temperature 1, 2 L
tokens) on each of 64 held-out prompts, every 4 steps. Not greedy: greedy decoding of this reward jumps from 0
to 1 as soon as '7' becomes the most likely character, which hides every difference between the runs.
relayrl's evaluation seeds every prompt alike, so the held-out samples of two runs share their random numbers
(a paired comparison), and samples of similar prompts are correlated (a coarser figure than 64 draws).

Runs `sync plain` and `async eta=4 plain` use algo.proximal=behaviour, algo.tis_cap=null: plain PPO, the
ratio against the sampling policy; `sync plain` is the control (no staleness) for `async eta=4 plain`.
`sync seed+1` is sync on run.seed + 1 (other sampling seeds and prompt order), run last: its held-out reward
against sync's is the run-to-run spread, and the two sync runs bracket the others in time, so ratios are
against their mean samples/s (the 2-core machine is shared; its load drifts).

samples/s = samples trained / wall seconds from the start of step 1 to the end of the last step
(intermediate evaluations and their drains included, the first and last evaluation and the final save
not); a watcher thread stamps each metrics.jsonl line as it appears. ratio = samples/s / sync's.

    python benchmarks/bench_async.py [--quick] [--out /tmp/bench_async] [--plot benchmarks/async_accuracy.png]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: the workers inherit it

import argparse
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import relayrl.jobs.train as run_mod
from benchmarks.async_workload import build_model, write_prompts
from relayrl.controller.config import RunConfig

torch.set_num_threads(1)

SHAPES = [  # (name, tiny model, median tokens L, reward sleep per sample in s)
    ("h64 x2, L=16", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2), 16, 0.008),
    ("h128 x4, L=12", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4), 12, 0.008),
]
PLAIN = {"proximal": "behaviour", "tis_cap": None}
RUNS = [  # (name, rollout overrides, algo overrides, run seed offset)
    ("sync", {"mode": "sync"}, {}, 0),
    ("one_step_off", {"mode": "one_step_off"}, {}, 0),
    ("async eta=1", {"mode": "async", "max_staleness": 1}, {}, 0),
    ("async eta=2", {"mode": "async", "max_staleness": 2}, {}, 0),
    ("async eta=4", {"mode": "async", "max_staleness": 4}, {}, 0),
    ("sync plain", {"mode": "sync"}, PLAIN, 0),  # plain PPO without staleness: the control for the next
    ("async eta=4 plain", {"mode": "async", "max_staleness": 4}, PLAIN, 0),
    # last, so the two sync runs bracket the others in time (the machine's load drifts): ratios are against
    # their mean samples/s; its held-out reward against sync's is the run-to-run spread
    ("sync seed+1", {"mode": "sync"}, {}, 1),
]
P, G, N_EVAL = 8, 8, 64


def config(out: Path, model: Path, data: Path, L: int, sleep_s: float, steps: int, eval_every: int,
           rollout: dict, algo: dict, seed: int, lr: float) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"path": str(model)},
        "data": {"task": "file", "path": str(data), "n_eval": N_EVAL, "seed": 0},
        "reward": {"functions": [{"name": "benchmarks.async_workload:slow_sevens", "params": {"sleep_s": sleep_s}}]},
        "algo": algo,
        "rollout": {"prompts_per_step": P, "group_size": G, "max_tokens": 8 * L, **rollout},
        "trainer": {"lr": lr, "micro_batch_size": 16, "mini_batches": 2},
        "eval": {"max_tokens": 2 * L, "every": eval_every, "temperature": 1.0},
        "run": {"steps": steps, "seed": seed, "out_dir": str(out), "save_every": 0, "loggers": []},
        "parallel": {"backend": "local", "placement": "disaggregated"},
    })


class Stamper:
    """Stamps every complete line of metrics.jsonl with the wall time it appeared (polled every 10 ms)."""

    def __init__(self, path: Path):
        self.path, self.stamps, self.stop = path, [], threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        seen, tail = 0, b""
        while not self.stop.is_set():
            try:
                with open(self.path, "rb") as f:  # only the bytes added since the last look
                    f.seek(seen)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            now = time.perf_counter()
            seen += len(chunk)
            *lines, tail = (tail + chunk).split(b"\n")  # the part after the last newline may be half-written
            self.stamps += [(now, json.loads(line)) for line in lines if line.strip()]
            self.stop.wait(0.01)

    def close(self) -> list[tuple[float, dict]]:
        self.stop.set()
        self.thread.join()
        return self.stamps


def one_run(cfg: RunConfig) -> dict:
    out = Path(cfg.run.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    stamper = Stamper(out / "metrics.jsonl")
    try:
        run_mod.train(cfg, show_progress=False)
    finally:
        stamps = stamper.close()
    steps = [(t, m) for t, m in stamps if "reward/mean" in m]
    evals = [(t, m) for t, m in stamps if "eval/reward" in m]
    t_start = steps[0][0] - steps[0][1]["time/step"]
    wall = steps[-1][0] - t_start
    mean = lambda k: statistics.fmean(m.get(k, 0.0) for _, m in steps)  # noqa: E731
    return {
        "samples_per_s": len(steps) * P * G / wall, "wall": wall,
        "eval_first": evals[0][1]["eval/reward"], "eval_last": evals[-1][1]["eval/reward"],
        "curve": [(max(t - t_start, 0.0), m["eval/reward"]) for t, m in evals],
        "train_reward_last": statistics.fmean(m["reward/mean"] for _, m in steps[-3:]),
        "len_mean": mean("response_length/mean"), "len_max": max(m["response_length/max"] for _, m in steps),
        "stale_mean": mean("staleness/mean"), "stale_max": max(m.get("staleness/max", 0.0) for _, m in steps),
        "wait_rollout": mean("time/wait_rollout") if "time/wait_rollout" in steps[0][1] else mean("time/rollout"),
        "reward_s": mean("time/reward"), "update_s": mean("time/update") + mean("time/old_logp"),
        "sync_s": mean("time/sync"),
    }


def sync_rate(runs: dict) -> float:
    return statistics.fmean(runs[n]["samples_per_s"] for n in ("sync", "sync seed+1") if n in runs)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (shape, runs) in zip(axes[0], results.items(), strict=True):
        for name, r in runs.items():
            xs, ys = zip(*r["curve"], strict=True)
            ax.plot(xs, ys, marker="o", ms=3, label=name, linestyle="--" if "plain" in name else "-")
        ax.set_title(shape)
        ax.set_xlabel("wall seconds since step 1")
        ax.set_ylabel("held-out reward (share of 7s, T=1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a short smoke run: 4 steps, first shape, 3 modes")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", default=None, help="comma-separated shape indices (default: all)")
    ap.add_argument("--runs", default=None, help="comma-separated run names (default: all; sync is always run)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="/tmp/bench_async")
    ap.add_argument("--plot", default=str(Path(__file__).with_name("async_accuracy.png")))
    args = ap.parse_args()
    shapes, runs, steps = SHAPES, RUNS, args.steps
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    if args.runs:
        runs = [r for r in RUNS if r[0] == "sync" or r[0] in args.runs.split(",")]
    if args.quick:
        shapes, runs, steps = SHAPES[:1], [r for r in RUNS if r[0] in ("sync", "async eta=1", "async eta=4")], 4
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict]] = {}
    head = (f"{'shape':14s} {'run':18s} {'samples/s':>9s} {'ratio':>6s} {'wall s':>7s} {'eval 0':>6s} {'eval end':>8s} "
            f"{'train end':>9s} {'len':>5s} {'stale':>5s} {'max':>3s} {'wait gen':>8s} {'reward':>6s} {'update':>6s}")
    print(f"load average at the start {os.getloadavg()}")
    print(head, flush=True)
    for si, (sname, shape, L, sleep_s) in enumerate(shapes):
        d = root / f"shape{si}"
        d.mkdir(exist_ok=True)
        model = build_model(d / "model", dict(shape, init_std=0.02))
        data = d / "prompts.jsonl"
        budgets = write_prompts(data, 256 + N_EVAL, L)
        assert sum(b > L for b in budgets) == len(budgets) // 10
        results[sname] = {}
        for name, rollout, algo, seed in runs:
            cfg = config(d / name.replace(" ", "_").replace("=", "").replace("+", "p"), model, data, L, sleep_s, steps,
                         args.eval_every, rollout, algo, args.seed + seed, args.lr)
            r = results[sname][name] = one_run(cfg)
            ratio = r["samples_per_s"] / results[sname]["sync"]["samples_per_s"]  # final ratios: sync_rate()
            print(f"{sname:14s} {name:18s} {r['samples_per_s']:9.1f} {ratio:6.2f} {r['wall']:7.1f} "
                  f"{r['eval_first']:6.3f} {r['eval_last']:8.3f} {r['train_reward_last']:9.3f} {r['len_mean']:5.1f} "
                  f"{r['stale_mean']:5.2f} {r['stale_max']:3.0f} {r['wait_rollout']:8.2f} {r['reward_s']:6.2f} "
                  f"{r['update_s']:6.2f}", flush=True)
    print(f"\nratio = samples/s over the mean of the sync runs' (sync, sync seed+1); load average {os.getloadavg()}")
    for name, *_ in runs:
        ratios = [results[s][name]["samples_per_s"] / sync_rate(results[s]) for s in results]
        evals = " ".join(f"{results[s][name]['eval_last']:.3f}" for s in results)
        print(f"{name:18s} ratio: " + " ".join(f"{x:.2f}" for x in ratios) +
              f"  (worst {min(ratios):.2f})   held-out reward at the end: {evals}")
    plot(results, Path(args.plot))
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(f"plot: {args.plot}   runs and results.json: {root}")


if __name__ == "__main__":
    main()
