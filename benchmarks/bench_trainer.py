"""Trainer throughput, MFU and per-rank memory: single process vs FSDP=2, and DDP=2 vs FSDP=2.

    1. matmul peak    best GFLOP/s of square fp32 `a @ b` (--matmul-sizes; torch's kernel and oneDNN's, the
                      better: relayrl.models.linear runs oneDNN where it is faster), 1 thread and 2 threads in
                      this process, and 2 spawned processes x 1 thread at once (summed)
    2. throughput     one `Actor.update` (one AdamW step over the whole GRPO-shaped batch) timed after
                      --warmup updates; single process (1 rank x --threads threads) vs FSDP=2 (2 ranks
                      x 1 thread: the same cores), and 1 process x 1 thread (one core's rate, so each
                      2-core layout's scaling can be read off), launched alternately for --rounds rounds
    3. memory         DDP=2 vs FSDP=2 (ZeRO-3: reshard_after_forward=True), --mem-steps updates each
                      (--mem-layouts single adds the one-process reference); per rank: the rise of the
                      RSS high-water mark over the RSS before the model was built, and the bytes of
                      parameter / gradient / optimiser-state storage it holds

Model: a ~27M-parameter qwen2-style CausalLM (hidden 512, 8 layers, 8 heads / 4 KV heads, head dim
64, MLP 1536, vocab 4096, tied embeddings), fp32, randomly initialised (seed 0) on every rank.
Batch: --prompts prompts x --n samples, each row --prompt-len prompt + --response-len response tokens
(no padding, so every row is --prompt-len + --response-len long); advantages ~ N(0, 1); old_logp from
one no-grad pass of the same weights (untimed), rollout_logp = old_logp + N(0, 0.02) noise on the
response, ref_logp = old_logp, kl_coef 0.05: the GRPO loss with TIS and a KL term, as the driver runs
it. Each data-parallel rank updates on its contiguous 1/dp of the rows (the global loss denominators
and summed gradients make that the single-process step; tests/trainer/test_actor_parallel.py checks it).
--micro-batch (default 8 rows) is the same for every layout, so each forward has the same shape.

Model FLOPs per update (PaLM-style, no recomputation, attention counted over the full T x T):

    flops = tokens * (6 * N_matmul + 12 * L * H * d_head * T)

    N_matmul = weights of every matmul (the decoder's linear layers + the lm_head; the tied embedding
               matrix counted once, as the lm_head: its lookup is no matmul; biases and norms left out)
    tokens   = rows x T (prompt + response: the forward and backward run over every position)

MFU = flops / update seconds / the measured 2-core matmul peak (the best of 2 threads in one process,
2 processes x 1 thread at once, and twice the 1-thread peak: when another job holds a core the first
two drop), the same denominator for every 2-core layout; the 1-thread run is divided by the 1-thread
peak.

Memory: VmHWM is reset (`echo 5 > /proc/self/clear_refs`) after the model is built and parallelised,
and again before every update and before every optimiser step (the Actor's optimizer.step is
wrapped), so a step's peak is split into forward+backward+clip and the optimiser step. The
arithmetic is 16 bytes per parameter (fp32 weight 4 + gradient 4 + AdamW exp_avg 4 + exp_avg_sq 4),
whole on every DDP rank, /world_size on an FSDP rank, plus activations (identical per rank: both
layouts run the same micro-batch). The memory runs set MALLOC_MMAP_THRESHOLD_ (--mmap-threshold) in
the spawned ranks so glibc returns every freed large block to the kernel and RSS tracks live tensor
memory instead of the allocator's free lists (the timing runs keep glibc's default).

The machine is noisy (2 cores shared with other jobs): read the ratios, measured side by side, and
the "CPU share" of each update: CPU seconds of the run's processes / (wall seconds x its cores). Well
below 1 means other jobs held its cores (a rank blocked in a gloo collective also lowers it, by its
communication wait). The throughput summary is printed twice: over every timed update, and over the
"quiet" ones (CPU share >= --quiet-share). With one core taken by another job, 2 intra-op threads
in one process run ~3x slower than 1 thread (every parallel region waits for the thread without a
core), so unfiltered single-vs-FSDP ratios mostly measure the load.

    python benchmarks/bench_trainer.py      # defaults: ~2 min quiet, under 6 min with a core taken
    python benchmarks/bench_trainer.py --rounds 3 --time-layouts single single1 fsdp ddp --mem-layouts single ddp fsdp
    python benchmarks/bench_trainer.py --skip peak time --activation-checkpointing --mem-layouts single ddp fsdp
    python benchmarks/bench_trainer.py --prompts 4 --skip peak time   # 2 micro-batches per rank
    python benchmarks/bench_trainer.py --skip mem --rounds 3 --time-layouts single1 single1@release

A layout named L@release runs L with RELAYRL_HOST_MEMORY=release (glibc's allocator defaults: freed blocks go
back to the kernel and fault in again) against the default policy (relayrl.parallel.host_memory), in alternate
processes, and its ratio against L is printed.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.algorithms import AlgoConfig
from relayrl.models import CausalLM, ModelConfig
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.launch import launch
from relayrl.parallel.parallelize import apply_activation_checkpointing, parallelize_model
from relayrl.single_controller.process_setup import configure_process
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig

MiB = 2**20


def model_config(args) -> ModelConfig:
    return ModelConfig(model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                       qkv_bias=True, tie_word_embeddings=True, max_position_embeddings=4096,
                       eos_token_id=2, pad_token_id=0)


def build_model(mc: ModelConfig) -> CausalLM:
    model = CausalLM(mc)
    model.reset_parameters(std=0.02, seed=0)
    return model


def matmul_params(model: torch.nn.Module) -> int:
    """Weights that take part in a matmul: every 2-D parameter (the tied embedding is the lm_head)."""
    n = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    if not model.config.tie_word_embeddings:
        n -= model.model.embed_tokens.weight.numel()  # an untied embedding is only looked up
    return n


def trainer_cfg(args) -> TrainerConfig:
    # padded rows (none of this batch's rows has padding): the MFU's FLOPs count every row's tokens, while the
    # default padding-free rows with shared prompts would compute fewer (bench_shared_prefix.py measures that)
    return TrainerConfig(lr=1e-5, micro_batch_size=args.micro_batch, ppo_epochs=1, mini_batches=1,
                         shuffle=False, bf16=args.bf16, padding_free=False)


ALGO = dict(kl_coef=0.05, tis_cap=2.0)


# ---------------------------------------------------------------------------------------------
# 1. matmul peak


def _kernels():
    """The fp32 matmuls the peak takes the best of: torch's (MKL) and oneDNN's, which relayrl.models.linear runs
    where it is faster (relayrl.observe.peak measures the same two)."""
    out = [lambda a, b, o: torch.mm(a, b, out=o)]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        out.append(lambda a, b, o: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    return out


def _matmul_gflops(n: int, reps: int) -> float:
    """Best single-call GFLOP/s of an n x n fp32 matmul, over both kernels (after one warm-up call each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    best = float("inf")
    for mm in _kernels():
        mm(a, b, out)
        for _ in range(reps):
            t = time.perf_counter()
            mm(a, b, out)
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def _rank_matmul(rank: int, world: int, n: int, reps: int) -> float:
    """All ranks at once: this rank's GFLOP/s over `reps` back-to-back matmuls (1 thread each), the better
    kernel."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    best = 0.0
    for mm in _kernels():
        mm(a, b, out)
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(reps):
                mm(a, b, out)
            best = max(best, reps * 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def measure_peak(args) -> dict:
    threads0 = torch.get_num_threads()
    res = {}
    for threads in (1, args.threads):
        torch.set_num_threads(threads)
        res[f"{threads}t"] = {n: _matmul_gflops(n, args.matmul_reps) for n in args.matmul_sizes}
    torch.set_num_threads(threads0)
    n = max(args.matmul_sizes)
    per_rank = launch(_rank_matmul, 2, n, args.matmul_reps, threads=1, timeout=600)
    res["2x1t"] = {n: sum(per_rank)}
    return res


# ---------------------------------------------------------------------------------------------
# the batch


def make_batch(args, mc: ModelConfig) -> TrainBatch:
    g = torch.Generator().manual_seed(args.seed)
    prompts, responses = [], []
    for _ in range(args.prompts):
        p = torch.randint(3, mc.vocab_size, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.n):  # a GRPO group: n samples of one prompt
            prompts.append(p)
            responses.append(torch.randint(3, mc.vocab_size, (args.response_len,), generator=g).tolist())
    ids, attn, resp = build_rows(prompts, responses)
    actor = Actor(build_model(mc), trainer_cfg(args), AlgoConfig(**ALGO), total_steps=1)
    old = actor.compute_logprobs(TrainBatch(ids, attn, resp))
    adv = torch.randn(len(prompts), generator=g)
    noise = 0.02 * torch.randn(old.shape, generator=g) * resp
    return TrainBatch(ids, attn, resp, advantages=adv, old_logp=old, rollout_logp=old + noise, ref_logp=old.clone())


# ---------------------------------------------------------------------------------------------
# 2 + 3. one layout on its ranks


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _cpu_seconds() -> float:
    """CPU seconds this process has used (all its threads): over an update, divided by wall time x
    cores, it says how much of its cores the run actually got on a shared machine."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _reset_hwm() -> None:
    """Set the RSS high-water mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor: this rank's shard
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _held_bytes(model, optimizer) -> dict[str, int]:
    seen: set = set()
    params = list(model.parameters())
    return {
        "params": _storage_bytes(params, seen),
        "grads": _storage_bytes([p.grad for p in params], seen),
        "optim": _storage_bytes([v for st in optimizer.state.values() for v in st.values()
                                 if isinstance(v, torch.Tensor)], seen),
    }


def _rank_run(rank: int, world: int, layout: str, mc: ModelConfig, batch: TrainBatch, tcfg: TrainerConfig,
              steps: int, activation_checkpointing: bool) -> dict:
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up
    gc.collect()
    rss_base = _status()["VmRSS"]
    model = build_model(mc)
    dims = None
    rows = batch
    if layout == "single":
        if activation_checkpointing:
            apply_activation_checkpointing(model)
    else:
        dims = ParallelDims(world_size=world, **({"dp_shard": world} if layout == "fsdp" else {"dp_replicate": world}))
        mesh = dims.build_mesh("cpu")
        parallelize_model(model, dims, mesh, dp_mode=layout, activation_checkpointing=activation_checkpointing)
        rows = batch.split(len(batch) // dims.dp)[dims.dp_rank]
    actor = Actor(model, tcfg, AlgoConfig(**ALGO), total_steps=steps, dims=dims)

    rec: dict = {}
    inner_step = actor.optimizer.step

    def step(*a, **kw):  # split the update's peak: forward+backward+clip | optimiser step
        rec["fb_hwm"] = _status()["VmHWM"]
        _reset_hwm()
        rec["t_fb"] = time.perf_counter()
        out = inner_step(*a, **kw)
        rec["opt_hwm"] = _status()["VmHWM"]
        rec["t_opt"] = time.perf_counter() - rec["t_fb"]
        return out

    step._wrapped_by_lr_sched = True  # inner_step is the scheduler's wrapper: keep its check quiet
    actor.optimizer.step = step
    gc.collect()
    rss_built = _status()["VmRSS"]
    records = []
    for _ in range(steps):
        dist.barrier()
        gc.collect()
        rss_before = _status()["VmRSS"]
        _reset_hwm()
        cpu0 = _cpu_seconds()
        t0 = time.perf_counter()
        stats = actor.update(rows)
        dt = time.perf_counter() - t0
        cpu = _cpu_seconds() - cpu0
        rec["t_fb"] -= t0
        records.append(dict(time=dt, cpu=cpu, rss_before=rss_before, rss_after=_status()["VmRSS"],
                            t_fb=rec["t_fb"], t_opt=rec["t_opt"], fb_hwm=rec["fb_hwm"], opt_hwm=rec["opt_hwm"]))
    held = _held_bytes(model, actor.optimizer)
    return dict(rss_base=rss_base, rss_built=rss_built, steps=records, held=held, rows=len(rows),
                loss=stats["loss"], grad_norm=stats["grad_norm"])


LAYOUT_DOC = {"single": "1 process x 2 threads", "single1": "1 process x 1 thread",
              "fsdp": "FSDP=2, 2 x 1 thread", "ddp": "DDP=2, 2 x 1 thread"}


def run_layout(layout: str, args, mc, batch, *, steps: int, env: dict | None = None) -> list[dict]:
    """single: 1 rank x --threads threads; single1: 1 rank x 1 thread; fsdp / ddp: 2 ranks x threads/2;
    L@release: L under glibc's allocator defaults."""
    layout, _, policy = layout.partition("@")
    if policy:
        env = {**(env or {}), "RELAYRL_HOST_MEMORY": policy}
    world = 1 if layout.startswith("single") else 2
    threads = {"single": args.threads, "single1": 1}.get(layout, max(1, args.threads // 2))
    layout = "single" if layout == "single1" else layout
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # spawned ranks read it at exec (glibc reads MALLOC_* at start-up)
    try:
        return launch(_rank_run, world, layout, mc, batch, trainer_cfg(args), steps, args.activation_checkpointing,
                      threads=threads, timeout=3600)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------------------------
# report


def _mib(b: float) -> str:
    return f"{b / MiB:.0f}"


def summarise(times, shares, phases, tokens, flops, flops_6n, peak, peak1, min_share, title) -> None:
    """Medians per layout and ratios against `single`; with min_share, only updates that got at least
    that share of their cores (paired ratios then only where both updates of the pair qualify)."""
    keep = {k: [min_share is None or sh >= min_share for sh in shares[k]] for k in times}
    print(f"\nthroughput ({tokens} tokens per update; {title}; a data-parallel update's time is its slowest rank's):")
    med = {}
    for layout, ts in times.items():
        sel = [i for i, ok in enumerate(keep[layout]) if ok]
        if not sel:
            print(f"  {layout:7s}: no update qualifies")
            continue
        med[layout] = statistics.median(ts[i] for i in sel)
        fb = statistics.median(phases[layout][i][0] for i in sel)
        opt = statistics.median(phases[layout][i][1] for i in sel)
        doc = LAYOUT_DOC[layout.partition("@")[0]] + (", glibc's allocator defaults" if "@" in layout else "")
        line = (f"  {layout:7s} ({doc}): n={len(sel)}, {med[layout]:.2f} s/update (fwd+bwd+clip "
                f"{fb:.2f}, optimiser {opt:.3f}; CPU share {statistics.median(shares[layout][i] for i in sel):.2f}), "
                f"{tokens / med[layout]:.0f} tokens/s, {flops / med[layout] / 1e9:.1f} GFLOP/s")
        if peak:
            pk = peak1 if layout.startswith("single1") else peak
            line += (f", MFU {flops / med[layout] / 1e9 / pk:.1%} of {pk:.0f} "
                     f"(6N only: {flops_6n / med[layout] / 1e9 / pk:.1%})")
        print(line)
    if "single" in med:
        for layout in med:
            if layout == "single":
                continue
            rounds = zip(times["single"], times[layout], keep["single"], keep[layout], strict=True)
            paired = [s / f for s, f, ok1, ok2 in rounds if ok1 and ok2]
            print(f"  {layout} / single throughput: {med['single'] / med[layout]:.2f}x (ratio of medians); "
                  f"paired {[round(x, 2) for x in paired]}")
    for layout in med:
        base = layout.partition("@")[0]
        if "@" in layout and base in med:
            rounds = zip(times[base], times[layout], keep[base], keep[layout], strict=True)
            paired = [r / b for b, r, ok1, ok2 in rounds if ok1 and ok2]
            print(f"  {layout} / {base} time: {med[layout] / med[base]:.2f}x (the default allocator policy's "
                  f"speed-up; ratio of medians); paired {[round(x, 2) for x in paired]}")
    if "single1" in med:
        for layout in ("single", "fsdp", "ddp"):
            if layout in med:
                print(f"  2-core scaling of {layout}: {med['single1'] / med[layout] / 2:.0%} "
                      f"(throughput / (2 x one core's))")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=2, help="GRPO groups (default 2: 16 rows)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=192)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward, every layout")
    ap.add_argument("--bf16", action="store_true", help="autocast the forward to bf16 (TrainerConfig.bf16)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="cores: single process threads; FSDP ranks get threads/2")
    ap.add_argument("--warmup", type=int, default=1, help="untimed updates per launch")
    ap.add_argument("--repeats", type=int, default=2, help="timed updates per launch")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of alternating launches, one per --time-layouts")
    ap.add_argument("--time-layouts", nargs="+", default=["single", "single1", "fsdp"],
                    choices=[f"{b}{p}" for b in ("single", "single1", "fsdp", "ddp") for p in ("", "@release")],
                    help="single: 1 process x --threads; single1: 1 process x 1 thread (one core's rate); "
                         "L@release: L with glibc's allocator defaults (RELAYRL_HOST_MEMORY=release)")
    ap.add_argument("--quiet-share", type=float, default=0.9,
                    help="also summarise only updates whose processes got at least this share of their cores")
    ap.add_argument("--mem-steps", type=int, default=2, help="updates per memory run (the last is reported)")
    ap.add_argument("--mem-layouts", nargs="+", default=["ddp", "fsdp"], choices=["single", "ddp", "fsdp"])
    ap.add_argument("--mmap-threshold", type=int, default=65536,
                    help="MALLOC_MMAP_THRESHOLD_ for the memory runs (0: glibc default)")
    ap.add_argument("--matmul-sizes", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--matmul-reps", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], choices=["peak", "time", "mem"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads < 2:
        ap.error("--threads must be >= 2 (FSDP=2 needs a core per rank)")

    t_start = time.time()
    torch.set_num_threads(args.threads)
    configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up
    mc = model_config(args)
    probe = build_model(mc)
    n_params = sum(p.numel() for p in probe.parameters())
    n_mm = matmul_params(probe)
    del probe
    T = args.prompt_len + args.response_len
    B = args.prompts * args.n
    tokens = B * T
    flops_per_token = 6 * n_mm + 12 * args.layers * args.heads * args.head_dim * T
    flops = tokens * flops_per_token
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    print(f"model: {n_params / 1e6:.2f}M params ({n_mm / 1e6:.2f}M in matmuls); batch {B} rows x {T} tokens "
          f"= {tokens} tokens ({B * args.response_len} response); micro-batch {args.micro_batch}; "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}{', activation ckpt' if args.activation_checkpointing else ''}")
    print(f"model FLOPs per update: {tokens} x (6 x {n_mm} + 12 x {args.layers} x {args.heads} x {args.head_dim} x {T})"
          f" = {flops / 1e12:.3f} TFLOP ({6 * n_mm * tokens / flops:.1%} of it 6N)")

    peak = peak1 = None
    if "peak" not in args.skip:
        res = measure_peak(args)
        print("\nmatmul peak, best GFLOP/s (fp32):")
        for key, by_n in res.items():
            print(f"  {key:>5}: " + ", ".join(f"n={n}: {g:.1f}" for n, g in by_n.items()))
        peak1 = max(res["1t"].values())
        peak = max(max(res[f"{args.threads}t"].values()), max(res["2x1t"].values()), 2 * peak1)
        print(f"  peak used for MFU: {peak:.1f} GFLOP/s (the best of {args.threads} threads in one process, "
              f"2 processes x 1 thread, and 2 x the 1-thread peak: a busy core lowers the first two)")

    t = time.time()
    torch.set_num_threads(args.threads)
    batch = make_batch(args, mc)
    print(f"\nbatch built (old_logp pass) in {time.time() - t:.1f}s; load average {os.getloadavg()}")

    if "time" not in args.skip:
        steps = args.warmup + args.repeats
        layouts = args.time_layouts
        times: dict[str, list[float]] = {k: [] for k in layouts}
        shares: dict[str, list[float]] = {k: [] for k in layouts}
        cores = {"single": args.threads, "single1": 1, "fsdp": 2 * max(1, args.threads // 2),
                 "ddp": 2 * max(1, args.threads // 2)}
        phases: dict[str, list[tuple[float, float]]] = {k: [] for k in layouts}
        losses = {}
        for r in range(args.rounds):
            for layout in layouts:
                out = run_layout(layout, args, mc, batch, steps=steps)
                for i in range(args.warmup, steps):
                    times[layout].append(max(o["steps"][i]["time"] for o in out))
                    shares[layout].append(sum(o["steps"][i]["cpu"] for o in out) / times[layout][-1]
                                          / cores[layout.partition("@")[0]])
                    phases[layout].append((max(o["steps"][i]["t_fb"] for o in out),
                                           max(o["steps"][i]["t_opt"] for o in out)))
                losses[layout] = (round(out[0]["loss"], 6), round(out[0]["grad_norm"], 5))
                per_rank = [[round(x["time"], 2) for x in o["steps"]] for o in out]
                print(f"  round {r} {layout:7s}: update s per rank {per_rank}"
                      f"; CPU share of its cores {[round(x, 2) for x in shares[layout][-args.repeats:]]}"
                      f"; load {os.getloadavg()[0]:.2f}")
        print(f"  last update's loss / grad_norm: {losses}")
        summarise(times, shares, phases, tokens, flops, 6 * n_mm * tokens, peak, peak1, None,
                  f"all {args.rounds * args.repeats} timed updates")
        summarise(times, shares, phases, tokens, flops, 6 * n_mm * tokens, peak, peak1, args.quiet_share,
                  f"only the quiet updates: CPU share >= {args.quiet_share}")

    if "mem" not in args.skip:
        env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
        print(f"\nmemory per rank ({args.mem_steps} updates per layout, the last reported; env {env}):")
        arith = {"single": 16 * n_params, "ddp": 16 * n_params, "fsdp": 16 * n_params / 2}
        mem = {}
        for layout in args.mem_layouts:
            out = run_layout(layout, args, mc, batch, steps=args.mem_steps, env=env)
            mem[layout] = out
            for rank, o in enumerate(out):
                s = o["steps"][-1]
                h = o["held"]
                held = sum(h.values())
                peak_rise = max(s["fb_hwm"], s["opt_hwm"]) - o["rss_base"]
                print(f"  {layout:6s} rank {rank}: held params {_mib(h['params'])} + grads {_mib(h['grads'])} + "
                      f"AdamW {_mib(h['optim'])} = {_mib(held)} MiB ({held / n_params:.2f} B/param; arithmetic "
                      f"{_mib(arith[layout])} MiB); RSS base {_mib(o['rss_base'])}, after build "
                      f"+{_mib(o['rss_built'] - o['rss_base'])}, "
                      f"before update +{_mib(s['rss_before'] - o['rss_base'])}, "
                      f"peak fwd/bwd +{_mib(s['fb_hwm'] - o['rss_base'])}, peak optim step "
                      f"+{_mib(s['opt_hwm'] - o['rss_base'])} => peak rise {_mib(peak_rise)} MiB; "
                      f"update {s['time']:.2f}s; rows {o['rows']}; steps' peaks "
                      f"{[_mib(max(x['fb_hwm'], x['opt_hwm']) - o['rss_base']) for x in o['steps']]}")

        def worst(layout, f):
            return max(f(o) for o in mem[layout])

        if "ddp" in mem and "fsdp" in mem:
            held = {k: worst(k, lambda o: sum(o["held"].values())) for k in ("ddp", "fsdp")}
            rise = {k: worst(k, lambda o: max(o["steps"][-1]["fb_hwm"], o["steps"][-1]["opt_hwm"]) - o["rss_base"])
                    for k in ("ddp", "fsdp")}
            rest = {k: worst(k, lambda o: o["steps"][-1]["rss_before"] - o["rss_base"]) for k in ("ddp", "fsdp")}
            print(f"  DDP / FSDP (max over ranks): held states {held['ddp'] / held['fsdp']:.2f}x (ideal 2x); "
                  f"RSS between updates {rest['ddp'] / rest['fsdp']:.2f}x; "
                  f"peak RSS rise {rise['ddp'] / rise['fsdp']:.2f}x")
            act = rise["fsdp"] - held["fsdp"]
            print(f"  arithmetic with the FSDP rank's peak minus its held states as 'activations etc.' "
                  f"({_mib(act)} MiB): DDP {_mib(arith['ddp'] + act)} vs FSDP {_mib(arith['fsdp'] + act)} MiB "
                  f"-> {(arith['ddp'] + act) / (arith['fsdp'] + act):.2f}x")

    print(f"\ntotal {time.time() - t_start:.0f}s; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
