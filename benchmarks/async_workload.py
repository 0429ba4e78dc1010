"""The workload of benchmarks/bench_async.py: a long-tail prompt file, a tiny model that samples to its budget,
and a learnable reward with a latency.

- Prompts: arithmetic problems written to a .jsonl file with a `max_tokens` column: nine in ten get the
  median budget L, one in ten 8 L (the long tail of reasoning RL, where a step waits on its longest sample).
- Model: the arith task's randomly initialised tiny model, with one change so that samples run to their
  budget: a constant feature in one residual dimension (every token embedding carries it, so it survives
  the random layers) that the untied output row of <eos> reads with a large negative weight. An untrained
  tiny model otherwise ends a sample after ~20 tokens (its ~30-token vocabulary gives <eos> a few percent
  per token), which would cut the long tail off. Training could unlearn it; in these runs it does not
  (the benchmark prints the measured response lengths).
- Reward: the share of '7' characters in the completion (tests/fixtures/rewards.py's share_of_sevens,
  which a random tiny model climbs without ever emitting <eos>), after a sleep standing in for a verifier's or
  an environment's latency. It runs in the reward workers, loaded as `benchmarks.async_workload:slow_sevens`.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

EOS_DIM = 0  # the residual dimension that carries the constant feature
EOS_FEATURE = 0.2  # its value in every token embedding (the others are ~N(0, 0.02))
EOS_WEIGHT = -20.0  # what the <eos> output row reads from it


def slow_sevens(completion: str, example, sleep_s: float = 0.0) -> float:
    """The share of '7' characters, after `sleep_s` seconds (one call per sample)."""
    if sleep_s:
        time.sleep(sleep_s)
    return completion.count("7") / max(len(completion), 1)


def write_prompts(path: Path, n: int, median_tokens: int, long_every: int = 10, long_factor: int = 8,
                  seed: int = 0) -> list[int]:
    """`n` arithmetic prompts in a .jsonl file; every `long_every`-th row (a tenth) gets a budget of
    long_factor x median_tokens, the rest median_tokens. Returns the budgets, in row order."""
    from relayrl.data import get_task

    rows = get_task("arith").generate(n, seed=seed)
    rng = random.Random(seed)
    long_rows = set(rng.sample(range(n), n // long_every))
    budgets = [median_tokens * (long_factor if i in long_rows else 1) for i in range(n)]
    with open(path, "w") as f:
        for ex, b in zip(rows, budgets, strict=True):
            f.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer, "max_tokens": b}) + "\n")
    return budgets


def build_model(out_dir: Path, shape: dict, seed: int = 0) -> Path:
    """The arith task's tiny model of `shape` (TinyModelConfig fields), made to (almost) never emit <eos>."""
    import torch

    from relayrl.data import get_task
    from relayrl.models import load_pretrained, save_pretrained
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model
    from relayrl.models.tokenizer import load_tokenizer

    raw = out_dir.parent / f".{out_dir.name}_raw"
    build_tiny_model(raw, get_task("arith").alphabet, TinyModelConfig(**shape, tie_word_embeddings=False, seed=seed))
    model = load_pretrained(raw)
    eos = load_tokenizer(raw).eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight[:, EOS_DIM] = EOS_FEATURE
        model.lm_head.weight[:, EOS_DIM] = 0.0
        model.lm_head.weight[eos, EOS_DIM] = EOS_WEIGHT
    save_pretrained(model, out_dir, tokenizer_dir=raw)
    return out_dir
