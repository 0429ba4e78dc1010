"""Rollout throughput: relayrl's engine vs Hugging Face `generate`, on an RL-shaped workload.

    16 prompts x n=8 samples, temperature 1, no top-k/top-p, per-prompt max_tokens from a long tail
    (most short, a few at --max-tokens), ignore_eos / min_new_tokens so both systems generate exactly
    the same tokens count; both return the logprob of every sampled token.

Both systems load the same HF directory, run in one process with the same torch threads, and are
timed interleaved (relayrl, HF, relayrl, HF, ...) after one warm-up each; the machine is noisy, so
read the RATIO columns, not the absolute tokens/s. --threads defaults to 1: on a 2-core box shared
with other jobs, 2 intra-op threads can make every small op wait for a busy core (seen: a 128x128
linear at 15 ms instead of 0.12 ms), which then measures op count, not work.

HF cannot give each row its own length in one `generate` call (without EOS), so it is run two ways
and compared against its faster one:
  hf-group: one call per distinct max length, prompts of that length batched (left padding);
  hf-pad:   one call for all prompts to the longest length; only each prompt's own first L tokens
            are counted (the rest is the price of one big batch).
HF logprobs: `output_logits=True` and log_softmax/gather of the sampled tokens inside the timed
region (the engine computes them too). HF's EOS ban from `min_new_tokens` and relayrl's ignore_eos
differ in distribution, not in cost.

    python benchmarks/bench_rollout.py --dtype both [--preset 25m] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.engine import LLMEngine, SamplingParams  # noqa: E402
from relayrl.models import load_pretrained  # noqa: E402
from relayrl.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from relayrl.models.tokenizer import load_tokenizer  # noqa: E402

ALPHABET = "0123456789+-*= "
PRESETS = {
    "tiny": TinyModelConfig(),
    "25m": TinyModelConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def long_tail_lengths(k: int, max_tokens: int, seed: int) -> list[int]:
    """~1 in 8 prompts runs to max_tokens (at least one does); the rest are max * u^3 (mostly short)."""
    rng = random.Random(seed)
    lens = [max_tokens if rng.random() < 0.125 else max(2, round(max_tokens * rng.random() ** 3)) for _ in range(k)]
    if max_tokens not in lens:
        lens[max(range(k), key=lens.__getitem__)] = max_tokens
    return lens


def make_prompts(tok, k: int, seed: int) -> list[list[int]]:
    """Arithmetic prompts of varying length ("12+345=", "7*8-90="), as token ids."""
    rng = random.Random(seed)
    texts = []
    for _ in range(k):
        terms = [str(rng.randint(0, 10 ** rng.randint(1, 4))) for _ in range(rng.randint(2, 4))]
        texts.append("".join(t + rng.choice("+-*") for t in terms[:-1]) + terms[-1] + "=")
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def run_relayrl(engine: LLMEngine, prompts, lens, n: int, seed: int) -> int:
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=L, ignore_eos=True, seed=seed + i) for i, L in enumerate(lens)]
    outs = engine.generate(prompts, params)
    total = 0
    for out, L in zip(outs, lens):
        for s in out.samples:
            assert len(s.token_ids) == len(s.logprobs) == L, (len(s.token_ids), L)
            total += L
    return total


def hf_batches(lens, mode: str) -> list[tuple[list[int], int]]:
    if mode == "pad":
        return [(list(range(len(lens))), max(lens))]
    groups: dict[int, list[int]] = {}
    for i, L in enumerate(lens):
        groups.setdefault(L, []).append(i)
    return sorted(((idx, L) for L, idx in groups.items()), key=lambda b: -b[1])


@torch.inference_mode()
def run_hf(model, prompts, lens, n: int, mode: str, seed: int, pad_id: int) -> int:
    torch.manual_seed(seed)
    total = 0
    for idx, L in hf_batches(lens, mode):
        P = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), P), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            ids[row, P - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, P - len(prompts[i]):] = 1
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            num_return_sequences=n, max_new_tokens=L, min_new_tokens=L, pad_token_id=pad_id,
            output_logits=True, return_dict_in_generate=True,
        )
        new = out.sequences[:, P:]
        assert new.shape[1] == L, (new.shape, L)
        logp = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)
        assert logp.shape == new.shape
        total += n * sum(lens[i] for i in idx)  # the tokens each prompt asked for
    return total


def bench_dtype(model_dir: Path, dtype_name: str, prompts, lens, args) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[dtype_name]
    tok = load_tokenizer(model_dir)
    engine = LLMEngine(load_pretrained(model_dir, dtype=dtype), tok, max_num_seqs=256)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    pad_id = tok.pad_token_id
    systems = {"relayrl": lambda s: run_relayrl(engine, prompts, lens, args.n, s)}
    for mode in args.hf_modes:
        systems[f"hf-{mode}"] = lambda s, m=mode: run_hf(hf, prompts, lens, args.n, m, s, pad_id)
    times = {k: [] for k in systems}
    tokens = {k: f(1000) for k, f in systems.items()}  # warm-up, also gives the token counts
    if len(set(tokens.values())) != 1:
        raise SystemExit(f"generated token counts differ: {tokens}")
    for r in range(args.repeats):
        for name, f in systems.items():  # interleaved: A, B, C, A, B, C, ...
            t0 = time.perf_counter()
            f(args.seed + r)
            times[name].append(time.perf_counter() - t0)
    return {"tokens": tokens["relayrl"], "times": times, "engine": engine}


def profile_engine(engine, prompts, lens, args) -> None:
    pr = cProfile.Profile()
    pr.enable()
    run_relayrl(engine, prompts, lens, args.n, args.seed)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(15)
    print("\n### cProfile of one relayrl run (top 15 by cumulative time)")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_relayrl(engine, prompts, lens, args.n, args.seed)
    print("\n### torch.profiler of one relayrl run (top 12 ops by self CPU time)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="HF model directory (default: build --preset into a temp dir)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-modes", nargs="+", choices=["group", "pad"], default=["group", "pad"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both (default 1: see the docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="profile one relayrl run (first dtype)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / args.preset, ALPHABET, PRESETS[args.preset])
        tok = load_tokenizer(model_dir)
        prompts = make_prompts(tok, args.prompts, args.seed)
        lens = long_tail_lengths(args.prompts, args.max_tokens, args.seed)
        n_params = sum(p.numel() for p in load_pretrained(model_dir).parameters())
        print(f"model {model_dir.name if args.model_dir else args.preset}: {n_params / 1e6:.2f}M params, "
              f"vocab {len(tok)}; threads {torch.get_num_threads()}; {args.prompts} prompts x n={args.n}")
        print(f"prompt lengths {[len(p) for p in prompts]}")
        print(f"max_tokens per prompt {lens} -> {args.n * sum(lens)} generated tokens per run")
        dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
        results = {d: bench_dtype(model_dir, d, prompts, lens, args) for d in dtypes}

        print(f"\n| dtype | system | tokens | median s | tokens/s | relayrl / system (ratio of medians) "
              f"| median of paired ratios |\n|---|---|---|---|---|---|---|")
        for d, res in results.items():
            t_ours = res["times"]["relayrl"]
            for name, ts in res["times"].items():
                med = statistics.median(ts)
                paired = statistics.median(b / a for a, b in zip(t_ours, ts))
                print(f"| {d} | {name} | {res['tokens']} | {med:.3f} | {res['tokens'] / med:.0f} "
                      f"| {med / statistics.median(t_ours):.2f}x | {paired:.2f}x |")
        for d, res in results.items():
            hf_best = min((k for k in res["times"] if k != "relayrl"), key=lambda k: statistics.median(res["times"][k]))
            ratio = statistics.median(res["times"][hf_best]) / statistics.median(res["times"]["relayrl"])
            print(f"{d}: relayrl / best HF ({hf_best}) tokens/s = {ratio:.2f}x")
        if args.profile:
            profile_engine(results[dtypes[0]]["engine"], prompts, lens, args)


if __name__ == "__main__":
    main()
