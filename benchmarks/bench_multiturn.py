"""Multi-turn rollout with KV reuse between turns, against re-prefilling each turn, side by side.

Each turn of an episode is a new engine request holding the whole conversation so far. With prefix
caching, its full KV blocks written in the previous turn are still cached, so only the observation and
the next generation prompt are prefilled; without, every turn prefills the whole conversation again,
which grows with the turns. Both runs draw the same tokens (same seeds), so the ratio is the cost of
the prefills alone; `same` is the share of episodes whose ids came out identical (KV recomputed in a
prefill may round differently from KV written during decoding, and flip a rare sample).

Workload: the `guess` environment (no tools; "Higher."/"Lower." observations) on a randomly initialised
tiny model, which rarely guesses right, so episodes run their `max_turns`. One episode per prompt
(G = 1), so the only reuse is across turns of the same episode. Shapes vary model size, turns and
tokens per turn; each runs --repeats times interleaved after a warm-up, medians reported.
ratio = time with re-prefill / time with reuse (above 1: reuse is faster).

    python benchmarks/bench_multiturn.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.data import get_task
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.envs.config import EnvConfig
from relayrl.models import load_pretrained
from relayrl.models.config import TinyModelConfig
from relayrl.models.tiny import build_tiny_model
from relayrl.models.tokenizer import load_tokenizer
from relayrl.rollout.agent_loop import AgentLoop
from relayrl.single_controller.process_setup import configure_process

SHAPES = [  # (name, tiny model, episodes, turns, tokens per turn)
    ("h64 x2, 4 turns x 16 tok", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2), 32, 4, 16),
    ("h128 x4, 6 turns x 24 tok", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4), 32, 6, 24),
    ("h256 x4, 8 turns x 8 tok", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4), 16, 8, 8),
]


def run(model, tok, episodes: int, turns: int, tokens: int, reuse: bool):
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=256 << 20, enable_prefix_caching=reuse)
    loop = AgentLoop(engine, EnvConfig(name="guess", max_turns=turns, max_total_tokens=512))
    examples = get_task("guess", high=1000).generate(episodes, seed=0)
    params = [SamplingParams(n=1, temperature=1.0, max_tokens=tokens, seed=i, ignore_eos=True)
              for i in range(episodes)]
    try:
        t0 = time.perf_counter()
        trajs = loop.run(examples, params)
        seconds = time.perf_counter() - t0
        stats = engine.stats()
    finally:
        loop.close()
        engine.close()
    return seconds, trajs, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up
    task = get_task("guess", high=1000)
    print(f"{'shape':28s} {'reuse s':>8s} {'re-prefill s':>12s} {'ratio':>6s} {'hit rate':>8s} {'turns':>6s} "
          f"{'same':>5s}")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape, episodes, turns, tokens in SHAPES:
            d = Path(tmp) / name.split(",")[0]
            build_tiny_model(d, task.alphabet, TinyModelConfig(**shape, init_std=0.2))
            model, tok = load_pretrained(d).eval(), load_tokenizer(d)
            run(model, tok, episodes, turns, tokens, True)  # warm-up
            times = {True: [], False: []}
            for _ in range(args.repeats):
                for reuse in (True, False):
                    seconds, trajs, stats = run(model, tok, episodes, turns, tokens, reuse)
                    times[reuse].append(seconds)
                    ids = [t.prompt_ids + t.response_ids for t in trajs]
                    if reuse:
                        hit, reference = stats["engine/prefix_hit_rate"], ids
                        mean_turns = sum(t.turns for t in trajs) / len(trajs)
                    else:  # recomputed KV can round differently from cached KV, and flip a rare sample
                        same = sum(a == b for a, b in zip(ids, reference, strict=True)) / len(ids)
            on, off = statistics.median(times[True]), statistics.median(times[False])
            ratios.append(off / on)
            print(f"{name:28s} {on:8.2f} {off:12.2f} {off / on:6.2f} {hit:8.2f} {mean_turns:6.1f} {same:5.2f}")
    print(f"worst ratio {min(ratios):.2f}  best {max(ratios):.2f}")


if __name__ == "__main__":
    main()
