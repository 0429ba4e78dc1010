"""Rollout throughput: relayrl's paged engine vs its previous form and Hugging Face `generate`, on an
RL-shaped workload.

    32 prompts x n=8 samples, temperature 1, no top-k/top-p, per-prompt max_tokens from a long tail
    (most short, ~1 in 8 at --max-tokens), ignore_eos / min_new_tokens so both systems generate
    exactly the same token count; both return the logprob of every sampled token.

Prompts: a shared few-shot prefix of --shots solved examples ("12+7=19 3*4=12 ... "; a stand-in for
an RL prompt template / system prompt) followed by the problem. With --shots 0 prompts are 4-17
tokens, nearly all shorter than one 16-token block, so almost nothing is a prefix hit (the block of
a sequence's last token never is); the shared prefix is what the engine's prefix cache exists for.

Both systems load the same HF directory, run in one process with the same torch threads, and are
timed interleaved (relayrl, HF, relayrl, HF, ...) after one warm-up each; the machine is noisy, so
read the RATIO columns, not the absolute tokens/s. --threads defaults to 1: on a 2-core box shared
with other jobs, 2 intra-op threads can make every small op wait for a busy core (seen: a 128x128
linear at 15 ms instead of 0.12 ms), which then measures op count, not work.

relayrl: `LLMEngine.from_pretrained(dir, dtype, block_size, num_blocks, enable_prefix_caching=True,
max_num_seqs=256)` (its defaults: the n samples of a prompt fork from one prefill, prefill attention
grouped by length). relayrl-prev: the same with `fork_samples=False, group_prefill=False`, the engine
before those two (each sample prefilled alone, its partial last block recomputed; prefill attention
padded to the batch's longest), timed in the same interleaving (--no-prev leaves it out). The KV pool
is sized so every sequence of the workload can hold its full length at once (no sharing assumed), so
the timed runs never preempt (reported). Before every run the engine is put to sleep and woken
(untimed), which drops the prefix cache: each run starts cold, as a new RL step with new prompts
would, instead of hitting the previous repeat's prompts.

HF cannot give each row its own length in one `generate` call (without EOS), so it is run two ways
and compared against its faster one:
  hf-group: one call per distinct max length, prompts of that length batched (left padding);
  hf-pad:   one call for all prompts to the longest length; only each prompt's own first L tokens
            are counted (the rest is the price of one big batch).
HF logprobs: `output_logits=True` and log_softmax/gather of the sampled tokens inside the timed
region (the engine computes them too). HF's EOS ban from `min_new_tokens` and relayrl's ignore_eos
differ in distribution, not in cost.

Untimed extras (after the timed runs): one run per engine stepped by hand (add_request + step) that
samples the block manager right after every schedule() — blocks in use, used_fraction(), utilisation()
= live KV slots / slots of the blocks in use — and reports the blocks in use after the prefill, at the
peak and the utilisation there, the tokens prefills computed (engine/prefill_tokens) and how many of the
two engines' samples are identical (same seeds: equal up to rounding of equal math).
--profile adds, for one run of the first dtype: a per-phase split of step time (schedule, prepare
[build_batch inside], model run [prefill/decode], sample, the rest of step() in Python), cProfile,
and torch.profiler's top ops.

    python benchmarks/bench_rollout.py --dtype both [--preset 25m] [--profile] [--no-prev]
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
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import relayrl.engine.llm_engine as llm_engine_mod
import relayrl.engine.model_runner as model_runner_mod
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.models import load_pretrained
from relayrl.models.config import TinyModelConfig
from relayrl.models.tiny import build_tiny_model
from relayrl.models.tokenizer import load_tokenizer
from relayrl.parallel import host_memory
from relayrl.single_controller.process_setup import configure_process

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


def _expr(rng: random.Random) -> str:
    terms = [str(rng.randint(0, 10 ** rng.randint(1, 4))) for _ in range(rng.randint(2, 4))]
    return "".join(t + rng.choice("+-*") for t in terms[:-1]) + terms[-1]


def make_prompts(tok, k: int, shots: int, seed: int) -> list[list[int]]:
    """Arithmetic prompts ("12+345=", "7*8-90="), after a few-shot prefix shared by all, as token ids."""
    rng = random.Random(seed)
    shot_rng = random.Random(seed + 1)
    prefix = ""
    for _ in range(shots):
        a, b, op = shot_rng.randint(0, 99), shot_rng.randint(0, 99), shot_rng.choice("+-*")
        prefix += f"{a}{op}{b}={eval(f'{a}{op}{b}')} "
    return [tok(prefix + _expr(rng) + "=", add_special_tokens=False)["input_ids"] for _ in range(k)]


def kv_blocks_needed(prompts, lens, n: int, block_size: int) -> int:
    """Blocks for every sequence at its full length at once, no prefix sharing: never preempts."""
    return sum(n * -(-(len(p) + L - 1) // block_size) for p, L in zip(prompts, lens, strict=True))


def fresh(engine: LLMEngine) -> None:
    """Untimed: drop the KV cache and prefix cache (new block manager and scheduler)."""
    engine.sleep(1)
    engine.wake()


def sampling_params(lens, n: int, seed: int) -> list[SamplingParams]:
    return [SamplingParams(n=n, temperature=1.0, max_tokens=L, ignore_eos=True, seed=seed + i)
            for i, L in enumerate(lens)]


def check(outs, lens) -> int:
    total = 0
    for out, L in zip(outs, lens, strict=True):
        for s in out.samples:
            assert len(s.token_ids) == len(s.logprobs) == L, (len(s.token_ids), L)
            total += L
    return total


def run_relayrl(engine: LLMEngine, prompts, lens, n: int, seed: int) -> int:
    return check(engine.generate(prompts, sampling_params(lens, n, seed)), lens)


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


ENGINES = {"relayrl": {}, "relayrl-prev": {"fork_samples": False, "group_prefill": False}}
ABLATIONS = {"fork only": {"group_prefill": False}, "grouped prefill only": {"fork_samples": False}}


def bench_dtype(model_dir: Path, dtype_name: str, prompts, lens, args) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[dtype_name]
    tok = load_tokenizer(model_dir)
    num_blocks = args.num_blocks or kv_blocks_needed(prompts, lens, args.n, args.block_size)
    engines = {name: LLMEngine.from_pretrained(model_dir, dtype=dtype, block_size=args.block_size,
                                               num_blocks=num_blocks, enable_prefix_caching=True,
                                               max_num_seqs=args.max_num_seqs, **kw)
               for name, kw in ENGINES.items() if name == "relayrl" or args.prev}
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    pad_id = tok.pad_token_id
    stats: dict[str, list[dict]] = {name: [] for name in engines}
    times: dict[str, list[float]] = {}
    systems = {}
    for name, engine in engines.items():
        times[name] = []

        def relayrl_run(seed: int, name=name, engine=engine) -> int:
            fresh(engine)
            t0 = time.perf_counter()
            total = run_relayrl(engine, prompts, lens, args.n, seed)
            times[name].append(time.perf_counter() - t0)
            stats[name].append(engine.stats())
            return total

        systems[name] = relayrl_run
    for mode in args.hf_modes:
        times[f"hf-{mode}"] = []

        def hf_run(s, m=mode):
            t0 = time.perf_counter()
            total = run_hf(hf, prompts, lens, args.n, m, s, pad_id)
            times[f"hf-{m}"].append(time.perf_counter() - t0)
            return total

        systems[f"hf-{mode}"] = hf_run
    tokens = {k: f(1000) for k, f in systems.items()}  # warm-up, also gives the token counts
    if len(set(tokens.values())) != 1:
        raise SystemExit(f"generated token counts differ: {tokens}")
    for t in times.values():
        t.clear()
    for r in range(args.repeats):
        for f in systems.values():  # interleaved: A, B, C, A, B, C, ...
            f(args.seed + r)
    return {"tokens": tokens["relayrl"], "times": times, "engines": engines, "engine": engines["relayrl"],
            "stats": {k: v[-1] for k, v in stats.items()},
            "preemptions": {k: [s["engine/preemptions"] for s in v] for k, v in stats.items()},
            "num_blocks": num_blocks}


def block_trace(engine: LLMEngine, prompts, lens, args) -> dict:
    """Untimed: step the engine by hand, sampling the block manager right after every schedule()."""
    fresh(engine)
    sched, bm = engine.scheduler, engine.block_manager
    trace = []
    orig = sched.schedule

    def schedule():
        seqs, is_prefill = orig()
        if seqs:
            used = bm.num_blocks - bm.num_free_blocks
            trace.append((len(trace), is_prefill, len(seqs), used, bm.used_fraction(), bm.utilisation()))
        return seqs, is_prefill

    sched.schedule = schedule
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params(lens, args.n, args.seed), strict=True)]
    outs = {}
    after_prefill = None
    prefill_s = 0.0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        n_before = len(trace)
        for o in engine.step():
            outs[o.request_id] = o
        if len(trace) > n_before and trace[-1][1]:
            prefill_s += time.perf_counter() - t0
        if after_prefill is None:  # blocks held once the first prefill (all prompts here) has run
            after_prefill = bm.num_blocks - bm.num_free_blocks
    check([outs[r] for r in rids], lens)
    del sched.schedule
    peak = max(trace, key=lambda t: (t[3], -t[0]))  # most blocks in use (first such step)
    slots = sum(t[3] for t in trace)
    return {"stats": engine.stats(), "steps": len(trace), "prefill_steps": sum(t[1] for t in trace), "peak": peak,
            "min_util": min(t[5] for t in trace), "after_prefill": after_prefill, "prefill_s": prefill_s,
            "samples": [s.token_ids for r in rids for s in outs[r].samples],
            "mean_util": sum(t[3] * t[5] for t in trace) / slots}  # weighted by blocks in use


def phase_profile(engine: LLMEngine, prompts, lens, args) -> None:
    """Untimed: wall time of one run split by phase, by wrapping the engine's callees (no code change)."""
    fresh(engine)
    acc: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    state = {"prefill": False}

    def timed(name, f):
        def g(*a, **k):
            t0 = time.perf_counter()
            r = f(*a, **k)
            key = name(r) if callable(name) else name
            acc[key] += time.perf_counter() - t0
            calls[key] += 1
            return r
        return g

    orig = {"prepare": llm_engine_mod.prepare, "sample": llm_engine_mod.sample, "bb": model_runner_mod.build_batch}
    sched_orig = engine.scheduler.schedule

    def schedule():
        r = sched_orig()
        state["prefill"] = r[1]
        return r

    engine.scheduler.schedule = timed("schedule", schedule)
    llm_engine_mod.prepare = timed("prepare (incl. build_batch)", orig["prepare"])
    model_runner_mod.build_batch = timed("  of which build_batch", orig["bb"])
    llm_engine_mod.sample = timed("sample()", orig["sample"])
    engine.runner.run = timed(lambda _: "model run, prefill" if state["prefill"] else "model run, decode",
                              engine.runner.run)
    step_orig = engine.step
    engine.step = timed("step() total", step_orig)
    try:
        t0 = time.perf_counter()
        run_relayrl(engine, prompts, lens, args.n, args.seed)
        total = time.perf_counter() - t0
    finally:
        llm_engine_mod.prepare, llm_engine_mod.sample = orig["prepare"], orig["sample"]
        model_runner_mod.build_batch = orig["bb"]
        del engine.runner.run, engine.step
    step = acc["step() total"]
    named = sum(v for k, v in acc.items() if k not in ("step() total", "  of which build_batch"))
    rows = [(k, acc[k], calls[k]) for k in ("schedule", "prepare (incl. build_batch)", "  of which build_batch",
                                            "model run, prefill", "model run, decode", "sample()")]
    rows += [("rest of step() (param tensors, RNG draws, append/finish, outputs)", step - named, calls["step() total"]),
             ("outside step() (add_request, generate loop)", total - step, 1)]
    print(f"\n### Where one relayrl run's wall time goes ({total:.3f} s, {calls['step() total']} steps)\n")
    print("| phase | s | % of run | calls | ms/call |\n|---|---|---|---|---|")
    for k, v, c in rows:
        print(f"| {k} | {v:.3f} | {100 * v / total:.1f}% | {c} | {1000 * v / max(c, 1):.2f} |")


def profile_engine(engine, prompts, lens, args) -> None:
    phase_profile(engine, prompts, lens, args)
    fresh(engine)
    pr = cProfile.Profile()
    pr.enable()
    run_relayrl(engine, prompts, lens, args.n, args.seed)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
    print("\n### cProfile of one relayrl run (top 15 by own time)")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))
    fresh(engine)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_relayrl(engine, prompts, lens, args.n, args.seed)
    print("\n### torch.profiler of one relayrl run (top 15 ops by self CPU time)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="HF model directory (default: build --preset into a temp dir)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts (default 32)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--shots", type=int, default=4, help="solved examples in the shared prompt prefix (default 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, help="KV pool size (default: every sequence at full length at once)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-modes", nargs="+", choices=["group", "pad"], default=["group", "pad"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both (default 1: see the docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="profile one relayrl run (first dtype)")
    ap.add_argument("--no-prev", dest="prev", action="store_false", help="leave the previous engine out")
    ap.add_argument("--ablate", action="store_true",
                    help="also step (untimed) an engine with only forks and one with only grouped prefill")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"host memory: {host_memory.apply()} (this process; RELAYRL_HOST_MEMORY=release for glibc's)")
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / args.preset, ALPHABET, PRESETS[args.preset])
        tok = load_tokenizer(model_dir)
        prompts = make_prompts(tok, args.prompts, args.shots, args.seed)
        lens = long_tail_lengths(args.prompts, args.max_tokens, args.seed)
        n_params = sum(p.numel() for p in load_pretrained(model_dir).parameters())
        print(f"model {model_dir.name if args.model_dir else args.preset}: {n_params / 1e6:.2f}M params, "
              f"vocab {len(tok)}; threads {torch.get_num_threads()}; {args.prompts} prompts x n={args.n}, "
              f"{args.shots}-shot prefix; block_size {args.block_size}")
        print(f"prompt lengths {[len(p) for p in prompts]}")
        print(f"max_tokens per prompt {lens} -> {args.n * sum(lens)} generated tokens per run")
        dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
        results = {}
        for d in dtypes:
            results[d] = bench_dtype(model_dir, d, prompts, lens, args)
            results[d]["traces"] = {k: block_trace(e, prompts, lens, args) for k, e in results[d]["engines"].items()}
            if args.ablate:  # untimed: each change alone, for the prefill columns
                for k, kw in ABLATIONS.items():
                    e = LLMEngine.from_pretrained(model_dir, dtype=DTYPES[d], block_size=args.block_size,
                                                  num_blocks=results[d]["num_blocks"], enable_prefix_caching=True,
                                                  max_num_seqs=args.max_num_seqs, **kw)
                    block_trace(e, prompts, lens, args)  # warm-up
                    results[d]["traces"][k] = block_trace(e, prompts, lens, args)

        print("\n| dtype | system | tokens | median s | tokens/s | relayrl / system (ratio of medians) "
              "| median of paired ratios |\n|---|---|---|---|---|---|---|")
        for d, res in results.items():
            t_ours = res["times"]["relayrl"]
            for name, ts in res["times"].items():
                med = statistics.median(ts)
                paired = statistics.median(b / a for a, b in zip(t_ours, ts, strict=True))
                print(f"| {d} | {name} | {res['tokens']} | {med:.3f} | {res['tokens'] / med:.0f} "
                      f"| {med / statistics.median(t_ours):.2f}x | {paired:.2f}x |")
        worst = []
        for d, res in results.items():
            med = {k: statistics.median(v) for k, v in res["times"].items()}
            hf_best = min((k for k in med if k.startswith("hf-")), key=med.__getitem__)
            line = f"{d}: relayrl / best HF ({hf_best}) tokens/s = {med[hf_best] / med['relayrl']:.2f}x"
            worst.append((med[hf_best] / med["relayrl"], f"{d} vs {hf_best}"))
            if "relayrl-prev" in med:
                line += (f"; relayrl / relayrl-prev = {med['relayrl-prev'] / med['relayrl']:.2f}x; "
                         f"relayrl-prev / best HF = {med[hf_best] / med['relayrl-prev']:.2f}x")
                worst.append((med["relayrl-prev"] / med["relayrl"], f"{d} vs relayrl-prev"))
            print(line)
        r, what = min(worst)
        print(f"worst ratio of relayrl (new engine) over the others: {r:.2f}x ({what})")
        print("\n| dtype | engine | prefill tokens | prefill steps | prefill s (one stepped run) "
              "| blocks after the prefill | peak blocks | utilisation at peak | hit rate | steps |"
              "\n|---|---|---|---|---|---|---|---|---|---|")
        for d, res in results.items():
            for k, tr in res["traces"].items():
                step, prefill, nseqs, used, frac, util = tr["peak"]
                print(f"| {d} | {k} | {int(tr['stats']['engine/prefill_tokens'])} | {tr['prefill_steps']} "
                      f"| {tr['prefill_s']:.3f} "
                      f"| {tr['after_prefill']} | {used} ({frac:.1%}) | {util:.1%} "
                      f"| {tr['stats']['engine/prefix_hit_rate']:.1%} | {tr['steps']} |")
        for d, res in results.items():
            tr = res["traces"]
            if "relayrl-prev" in tr:
                same = sum(a == b for a, b in zip(tr["relayrl"]["samples"], tr["relayrl-prev"]["samples"], strict=True))
                print(f"{d}: samples identical between relayrl and relayrl-prev (same seeds): "
                      f"{same} of {len(tr['relayrl']['samples'])}")
        for d, res in results.items():
            for k, tr in res["traces"].items():
                if k not in res["stats"]:  # an ablation: stepped only
                    continue
                st = res["stats"][k]
                step, prefill, nseqs, used, frac, util = tr["peak"]
                print(f"\n{d} {k}: KV pool {res['num_blocks']} blocks of {args.block_size}; preemptions per run "
                      f"(warm-up + timed) {[int(p) for p in res['preemptions'][k]]}")
                print(f"{d} {k}: engine.stats() after the last timed run: {st}")
                print(f"{d} {k}: stepped run: {tr['steps']} steps ({tr['prefill_steps']} prefill); peak {used} blocks "
                      f"in use ({frac:.1%} of the pool) at step {step} ({'prefill' if prefill else 'decode'}, "
                      f"{nseqs} seqs), utilisation there {util:.1%}; min over steps {tr['min_util']:.1%}, "
                      f"block-weighted mean {tr['mean_util']:.1%}")
        if args.profile:
            profile_engine(results[dtypes[0]]["engine"], prompts, lens, args)


if __name__ == "__main__":
    main()
