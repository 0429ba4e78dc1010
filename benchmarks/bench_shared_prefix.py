"""Shared-prefix training: one actor update on padded rows, padding-free rows, and padding-free rows whose G
samples share their prompt (the default), side by side in one process, on GRPO-shaped batches.

    python benchmarks/bench_shared_prefix.py [--repeats 3] [--threads 1]

Shapes (model, P prompt tokens, R the longest response, prompts x G samples; response lengths drawn uniformly in
[R/2, R], seeded): the demo's model and step (tiny: 0.8M, 4 layers, h128; P 8, R 4, 32 x 8), the 25M Qwen2 of
bench_grpo_trl's 25m workload (P 10, R 32, 16 x 8), the same model with a long prompt (P 64, R 32), and the tiny
model with long answers like bench_grpo_trl's sort workload (P 70, R 64, 16 x 8). Each
update is one optimiser step over the whole batch in one micro-batch (one mini-batch, the on-policy step);
every layout starts from the same weights and takes the same step (tests/trainer/test_shared_prefix.py checks that).
Reported per shape: the tokens each layout's forward computes (rows x T padded; the real tokens; each prompt
once), the median seconds of --repeats updates after one warm-up, interleaved
(padded, packed, shared, padded, ...), and the ratios padded / shared and packed / shared (higher: shared is
faster), with the worst ratio over the shapes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.algorithms import AlgoConfig
from relayrl.models import CausalLM, ModelConfig
from relayrl.parallel import host_memory
from relayrl.single_controller.process_setup import configure_process
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.logprobs import computed_tokens, prompt_lens

MODELS = {
    "tiny": dict(vocab_size=30, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "25m": dict(vocab_size=30, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64),
}
# model, P, R, prompts, G
SHAPES = [("tiny", 8, 4, 32, 8), ("25m", 10, 32, 16, 8), ("25m", 64, 32, 16, 8), ("tiny", 70, 64, 16, 8)]
LAYOUTS = {"padded": dict(padding_free=False), "packed": dict(shared_prefix=False), "shared": {}}


def grpo_batch(P: int, R: int, prompts: int, G: int, vocab: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ps, rs = [], []
    for _ in range(prompts):
        p = torch.randint(3, vocab, (P,), generator=g).tolist()
        for _ in range(G):
            n = int(torch.randint(max(1, R // 2), R + 1, (1,), generator=g))
            ps.append(p)
            rs.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    ids, attn, resp = build_rows(ps, rs)
    return TrainBatch(ids, attn, resp, advantages=torch.randn(len(ps), generator=g))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"host memory: {host_memory.apply()} (this process; RELAYRL_HOST_MEMORY=release for glibc's)")
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.repeats} timed updates per layout\n")
    print("| model | P | R | rows | tokens padded / real / shared | s padded | s packed | s shared | "
          "padded / shared | packed / shared |\n|---|---|---|---|---|---|---|---|---|---|")
    worst = []
    for name, P, R, prompts, G in SHAPES:
        cfg = ModelConfig(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True, **MODELS[name])
        base = CausalLM(cfg)
        base.reset_parameters(seed=0)
        b = grpo_batch(P, R, prompts, G, cfg.vocab_size)
        actors = {k: Actor(copy.deepcopy(base), TrainerConfig(micro_batch_size=len(b), **kw), AlgoConfig(),
                           total_steps=args.repeats + 1) for k, kw in LAYOUTS.items()}
        for a in actors.values():
            a.update(b)  # warm-up
        times: dict[str, list[float]] = {k: [] for k in actors}
        for _ in range(args.repeats):
            for k, a in actors.items():
                t0 = time.perf_counter()
                a.update(b)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        shared = computed_tokens(b.input_ids, b.attention_mask, prompt_lens(b.response_mask, b.attention_mask))
        ratios = (med["padded"] / med["shared"], med["packed"] / med["shared"])
        worst.append(min(ratios))
        tokens = f"{b.input_ids.numel()} / {int(b.attention_mask.sum())} / {shared}"
        print(f"| {name} | {P} | {R} | {len(b)} | {tokens} | {med['padded']:.3f} | {med['packed']:.3f} | "
              f"{med['shared']:.3f} | {ratios[0]:.2f}x | {ratios[1]:.2f}x |")
    print(f"\nworst ratio over the shapes (shared against the faster of the two others): {min(worst):.2f}x")


if __name__ == "__main__":
    main()
