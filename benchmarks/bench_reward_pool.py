"""What the reward pool costs per sample, against scoring in the driver's process, side by side.

    exact_match   arith examples, short completions (the answer, or a near miss, a few characters)
    math          math-verify on ~400-character completions (reasoning text, then \\boxed{answer};
                  gold answers as fractions, decimals or integers, half of them right)

Each shape runs at batch 128 and 1024 through `RewardScorer.score` (what the driver calls; it also scores
the `task` reward of every sample, for accuracy, so a sample is two calls), in process
(reward.workers = 0) and in the pool (reward.workers = 1 and 2), interleaved over --repeats rounds after
one warm-up each; medians are reported. The results of the pool are checked equal to the in-process
ones on every round. ratio = pool time / in-process time (above 1: the pool is slower);
overhead = (pool - in-process) / batch, in microseconds per sample. With 2 workers on a 2-core machine
the pool also scores in parallel, so its ratio can fall below 1 where calls are expensive.
Also reported: the time to start a pool (until every worker has loaded its functions).

    python benchmarks/bench_reward_pool.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.data import Example, get_task
from relayrl.rewards import RewardConfig, build_scorer


def exact_match_batch(n: int, rng: random.Random):
    examples = get_task("arith").generate(64, seed=0)
    exs = [rng.choice(examples) for _ in range(n)]
    comps = [ex.answer if rng.random() < 0.5 else str(int(ex.answer) + rng.choice([-1, 1])) for ex in exs]
    return comps, exs


def math_batch(n: int, rng: random.Random):
    exs, comps = [], []
    for _ in range(n):
        p, q = rng.randint(1, 40), rng.randint(2, 12)
        gold = rng.choice([f"{p}/{q}", f"\\frac{{{p}}}{{{q}}}", str(p * q)])
        value = p * q if gold == str(p * q) else p / q
        said = value if rng.random() < 0.5 else value + rng.choice([1, 2, 0.5])
        said_text = f"\\frac{{{p}}}{{{q}}}" if said == value and gold != str(p * q) else f"{said:g}"
        reasoning = " ".join(rng.choice(["First", "we", "compute", "the", "ratio", "of", "terms,", "then", "simplify."])
                             for _ in range(60))
        exs.append(Example(prompt="q", answer=gold))
        comps.append(f"{reasoning} So the answer is \\boxed{{{said_text}}}.")
    return comps, exs


SHAPES = {"exact_match": ([{"name": "exact_match"}], exact_match_batch),
          "math": ([{"name": "math"}], math_batch)}


def timed(scorer, comps, exs):
    t = time.perf_counter()
    res = scorer.score(comps, exs)
    return time.perf_counter() - t, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 1024])
    args = ap.parse_args()
    rng = random.Random(0)
    rows, starts = [], []
    for shape, (functions, make) in SHAPES.items():
        scorers = {}
        for workers in (0, 1, 2):
            t = time.perf_counter()
            scorers[workers] = build_scorer(RewardConfig.from_dict({"functions": functions, "workers": workers}))
            if workers:
                starts.append((shape, workers, time.perf_counter() - t))
        try:
            for n in args.batches:
                comps, exs = make(n, rng)
                times = {w: [] for w in scorers}
                for s in scorers.values():  # warm-up: imports, regex and gold-parse caches
                    timed(s, comps, exs)
                for _ in range(args.repeats):
                    ref = None
                    for w, s in scorers.items():
                        dt, res = timed(s, comps, exs)
                        times[w].append(dt)
                        ref = res if ref is None else ref
                        assert res == ref, f"{shape} n={n}: the pool with {w} workers scored differently"
                base = statistics.median(times[0])
                for w in (1, 2):
                    pool = statistics.median(times[w])
                    rows.append((shape, n, w, base / n * 1e6, pool / n * 1e6, pool / base, (pool - base) / n * 1e6))
        finally:
            for s in scorers.values():
                s.close()
    print(f"\nmedian of {args.repeats} rounds; per sample = one reward call + the task-accuracy call\n")
    print("| shape | batch | workers | in-process us/sample | pool us/sample | ratio pool/in-process "
          "| overhead us/sample |")
    print("|---|---|---|---|---|---|---|")
    for shape, n, w, base, pool, ratio, over in rows:
        print(f"| {shape} | {n} | {w} | {base:.1f} | {pool:.1f} | {ratio:.2f} | {over:+.1f} |")
    worst = max(rows, key=lambda r: r[5])
    print(f"\nworst ratio: {worst[5]:.2f} ({worst[0]}, batch {worst[1]}, {worst[2]} workers; "
          f"{worst[6]:+.1f} us/sample)")
    print("pool start (every worker ready): " + ", ".join(f"{s} x{w}: {t:.2f} s" for s, w, t in starts))


if __name__ == "__main__":
    main()
