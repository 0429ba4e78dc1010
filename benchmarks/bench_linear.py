"""The models' fp32 CPU linear (relayrl.models.linear) against torch's F.linear (MKL), side by side.

relayrl's linear runs each of its three products (forward, dx, dW) on oneDNN or on torch's kernel, whichever
relayrl.parallel.cpu_kernels chose for this CPU and handed the models (what and why, printed first; --kernels onednn
forces all three on oneDNN, as RELAYRL_CPU_LINEAR=onednn does). For each shape (rows M, out N, in K): forward,
and forward + backward (dx and dW) of y = x W^T, interleaved, the median of --repeats timings of each after a
warm-up, in GFLOP/s, and the ratio relayrl / torch. The shapes
are those of the trainer's micro-batches (2048 token rows) and of the engine's decode (8-128 rows) for the
benchmarks' models: the 27M model of bench_trainer.py (hidden 512, MLP 1536, vocab 4096), the 25m workload
(hidden 512, MLP 2816, vocab 8192) and the demo's tiny model (hidden 128). Also the square-matmul peak of each
kernel (the MFU denominator takes the better, relayrl.observe.peak).

    OMP_NUM_THREADS=1 python benchmarks/bench_linear.py
    OMP_NUM_THREADS=1 python benchmarks/bench_linear.py --kernels onednn   # every product on oneDNN
    OMP_NUM_THREADS=1 python benchmarks/bench_linear.py --update-ab 3   # also: bench_trainer's 27M actor update,
                                                                       # the chosen kernels and torch's, interleaved
    OMP_NUM_THREADS=1 python benchmarks/bench_linear.py --update-ab 3 --ab compile   # the same update with the
                                                   # pointwise kernels compiled (RELAYRL_COMPILE=auto) and eager (off)
    OMP_NUM_THREADS=1 python benchmarks/bench_linear.py --rollout-ab 5   # also: the 25m workload's rollout on the
                                                                        # engine, the chosen kernels and torch's
    OMP_NUM_THREADS=1 python benchmarks/bench_linear.py --update-ab 5 --ab filler   # the 25m workload's packed
                                                   # update without and with filler tokens (--ab adam: AdamW's
                                                   # foreach path and its fused kernel)
    OMP_NUM_THREADS=1 python benchmarks/bench_linear.py --floor   # also: the 25m step's matmuls alone against its
                                                                 # FLOP floor (floor_25m)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import relayrl.models.linear as lin
from relayrl.models.linear import linear, uses_onednn
from relayrl.parallel import host_memory
from relayrl.single_controller.process_setup import configure_process

SHAPES = [  # (label, M, N, K)
    ("27m qkv, train", 2048, 1024, 512), ("27m up, train", 2048, 1536, 512), ("27m down, train", 2048, 512, 1536),
    ("27m lm_head, train", 2048, 4096, 512), ("25m up, train", 2048, 2816, 512),
    ("25m lm_head, train", 2048, 8192, 512), ("25m up, decode 128", 128, 2816, 512),
    ("25m qkv, decode 32", 32, 1024, 512), ("27m up, decode 8", 8, 1536, 512),
    ("demo mlp, train", 2560, 512, 128), ("demo qkv, decode 256", 256, 256, 128),
]


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def fwd(fn, x, w, up):
    return lambda: fn(x, w)


def fwd_bwd(fn, x, w, up):
    def run():
        xs, ws = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        (fn(xs, ws) * up).sum().backward()
    return run


def update_ab(rounds: int, ab: str = "kernels") -> None:
    """bench_trainer.py's model, batch and Actor update in two arms, interleaved in this process (the arm switched
    between updates): the ratio of median update times. ab "kernels": the linear kernels chosen (as main() set them)
    against torch's alone; "compile": relayrl.models.pointwise compiled (RELAYRL_COMPILE=auto) against eager (off)."""
    import argparse as _ap
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import bench_trainer as bt

    from relayrl.algorithms import AlgoConfig
    from relayrl.models import pointwise
    from relayrl.trainer.actor import Actor

    args = _ap.Namespace(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536, vocab=4096,
                         prompts=2, n=8, prompt_len=64, response_len=192, micro_batch=8, bf16=False,
                         activation_checkpointing=False, seed=0)
    mc = bt.model_config(args)
    batch = bt.make_batch(args, mc)
    actor = Actor(bt.build_model(mc), bt.trainer_cfg(args), AlgoConfig(**bt.ALGO), total_steps=100)
    chosen, compile_before = lin.kernels(), pointwise._compile

    def kernels(choice):
        def set_arm():
            lin.use_kernels(choice)
        return set_arm

    def compile_mode(mode):
        def set_arm():
            pointwise.use_compile(mode == "auto")
        return set_arm

    # the baseline arm first: the ratio printed is baseline s / the other arm's s
    if ab == "kernels":
        arms = {"torch": kernels(dict.fromkeys(lin.PRODUCTS, False)), "relayrl": kernels(chosen)}
    else:
        arms = {"eager": compile_mode("off"), "compiled": compile_mode("auto")}
    try:
        times = interleaved(arms, lambda: actor.update(batch), rounds)
    finally:
        lin.use_kernels(chosen)
        pointwise.use_compile(compile_before)
    if ab == "compile" and pointwise._broken is not None:
        raise SystemExit(f"the compiled arm fell back to eager ({pointwise._broken}): no A/B to report")
    report("27M actor update (4096 tokens)", times)


def interleaved(arms: dict, run, rounds: int) -> dict[str, list[float]]:
    """Seconds of run() under each arm (set by arms[name]()), the arms alternating, rounds + 1 times over; round 0
    warms each arm up (and compiles) and is not kept."""
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(rounds + 1):
        for name, set_arm in arms.items():
            set_arm()
            t = time.perf_counter()
            run()
            if r:
                times[name].append(time.perf_counter() - t)
    return times


def report(what: str, times: dict[str, list[float]]) -> None:
    """The arms' times and the ratio of the first arm's (the baseline's) median to the second's."""
    med = {k: statistics.median(v) for k, v in times.items()}
    base, ours = list(times)
    print(f"{what}, s: {({k: [round(x, 2) for x in v] for k, v in times.items()})}; "
          f"{base} / {ours}: {med[base] / med[ours]:.2f}x")


def packed_update_ab(rounds: int, ab: str) -> None:
    """The 25m workload's update (bench_grpo_trl.py --workload 25m: its model shape, random weights; 16 prompts of
    11 tokens x 8 samples of 14-32 tokens, the trainer's defaults: packed rows, shared prompts) in two arms,
    interleaved: ab "filler": the packed row without filler tokens (each oneDNN product pads and copies) against with
    them (relayrl.trainer.logprobs._filler_tokens); "adam": AdamW's foreach path against its fused kernel
    (relayrl.trainer.optim.adam_kernel)."""
    from relayrl.algorithms import AlgoConfig
    from relayrl.models import CausalLM, ModelConfig
    from relayrl.trainer import logprobs
    from relayrl.trainer.actor import Actor
    from relayrl.trainer.batch import TrainBatch, build_rows
    from relayrl.trainer.config import TrainerConfig

    mc = ModelConfig(model_type="qwen2", vocab_size=32, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
    model = CausalLM(mc)
    model.reset_parameters(std=0.02, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for _ in range(16):
        p = torch.randint(3, 32, (11,), generator=g).tolist()
        for _ in range(8):
            prompts.append(p)
            n = int(torch.randint(14, 33, (1,), generator=g))
            responses.append(torch.randint(3, 32, (n,), generator=g).tolist())
    ids, attn, resp = build_rows(prompts, responses)
    actor = Actor(model, TrainerConfig(lr=1e-6, micro_batch_size=len(prompts)), AlgoConfig(kl_coef=0.0),
                  total_steps=100)
    old = actor.compute_logprobs(TrainBatch(ids, attn, resp))
    batch = TrainBatch(ids, attn, resp, advantages=torch.randn(len(prompts), generator=g), old_logp=old,
                       rollout_logp=old)
    filler = logprobs._filler_tokens

    def set_filler(on: bool):
        def set_arm():
            logprobs._filler_tokens = filler if on else (lambda *a: 0)
        return set_arm

    def set_adam(fused: bool):
        def set_arm():
            for group in actor.optimizer.param_groups:
                group.update(fused=fused, foreach=not fused)
        return set_arm

    arms = ({"no filler": set_filler(False), "filler": set_filler(True)} if ab == "filler"
            else {"foreach": set_adam(False), "fused": set_adam(True)})
    try:
        times = interleaved(arms, lambda: actor.update(batch), rounds)
    finally:
        logprobs._filler_tokens = filler
    report(f"25m actor update ({ab}), packed rows", times)


def rollout_ab(rounds: int) -> None:
    """The 25m workload's rollout (bench_grpo_trl.py's model shape, random weights: 16 prompts x n=8, 22 tokens
    each, ignore_eos) on relayrl's engine with the linear kernels chosen against torch's alone, interleaved in this
    process, each run from a cold KV cache: the ratio of median generate() times."""
    import random
    import tempfile

    from relayrl.engine import LLMEngine, SamplingParams
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model
    from relayrl.models.tokenizer import load_tokenizer

    cfg = TinyModelConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=4, init_std=0.02)
    chosen = lin.kernels()
    with tempfile.TemporaryDirectory() as tmp:
        d = build_tiny_model(Path(tmp) / "m25", "0123456789+-*= ", cfg)
        tok, rng = load_tokenizer(d), random.Random(0)
        prompts = [tok(f"{rng.randint(0, 999)}+{rng.randint(0, 999)}*{rng.randint(0, 99)}=",
                       add_special_tokens=False)["input_ids"] for _ in range(16)]
        engine = LLMEngine.from_pretrained(d, dtype=torch.float32, block_size=16, num_blocks=2048,
                                           enable_prefix_caching=True, max_num_seqs=256)
        params = [SamplingParams(n=8, temperature=1.0, max_tokens=22, ignore_eos=True, seed=i) for i in range(16)]
        arms = {"torch": dict.fromkeys(lin.PRODUCTS, False), "relayrl": chosen}
        times: dict[str, list[float]] = {k: [] for k in arms}
        try:
            for r in range(rounds + 1):  # round 0 warms each arm up (oneDNN compiles its shapes)
                for name, choice in arms.items():
                    lin.use_kernels(choice)
                    engine.sleep(1)
                    engine.wake()  # a cold KV and prefix cache, as a new RL step's prompts meet
                    t = time.perf_counter()
                    engine.generate(prompts, params)
                    if r:
                        times[name].append(time.perf_counter() - t)
        finally:
            lin.use_kernels(chosen)
            engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"25m rollout (16 x 8 x 22 tokens), s: {({k: [round(x, 2) for x in v] for k, v in times.items()})}; "
          f"torch / relayrl: {med['torch'] / med['relayrl']:.2f}x")


def floor_25m(repeats: int, trained: int, rollout: int, prompt_rows: int, decode_rows: int) -> None:
    """The 25m workload's matmuls alone (bench_grpo_trl.py --workload 25m), timed on the kernels relayrl runs, against
    that workload's FLOP floor: how close a step could come to the floor if everything but the linears (attention,
    norms, softmax, sampling, the optimiser, the host's bookkeeping) took no time at all.

    update   every trainer linear (q, k, v, o, gate, up, down; 8 layers) forward + dx + dW over the packed row of
             `trained` tokens, rounded up to the rows the trainer gives them (relayrl.models.linear.packed_rows)
    rollout  every engine linear (qkv_proj, o_proj, gate_up_proj, down_proj) forward: one prefill of
             `prompt_rows` rows, then the decode tokens in batches of `decode_rows` rows
    floor    2N per rollout token + 6N per trained token at this process's fp32 matmul peak (flop_floor), N the
             matmul weights; the lm_head (31 x 512, on torch's kernel) is counted in N and left out of the timing"""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_grpo_trl import flop_floor

    from relayrl.models.config import ModelShape
    from relayrl.models.flops import linear_dims, matmul_params
    from relayrl.observe.peak import matmul_peak

    shape = ModelShape(vocab_size=31, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, qkv_bias=True,
                       tie_word_embeddings=True)  # the 25m workload's model (its tokenizer's 31 ids)
    dims = linear_dims(shape)  # {name: (in, out)}
    train = [(o, i) for i, o in dims.values()]  # (out, in) of each trainer linear
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
             "o_proj": ("o_proj",), "down_proj": ("down_proj",)}  # the engine's linears, of the trainer's
    engine = [(sum(dims[p][1] for p in parts), dims[parts[0]][0]) for parts in fused.values()]
    N, H, layers = matmul_params(shape), shape.hidden_size, shape.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    rows = lin.packed_rows(trained, H, torch.float32, "cpu")

    def product_time(make, M, out, inp):
        x, w = torch.randn(M, inp, generator=g), torch.randn(out, inp, generator=g)
        return timed(make(linear, x, w, torch.randn(M, out, generator=g)), repeats)

    def fwd_dx_dw(fn, x, w, dy):  # the three products, nothing else (no loss's pointwise work)
        def run():
            fn(x.detach().requires_grad_(True), w.detach().requires_grad_(True)).backward(dy)
        return run

    t_update = layers * sum(product_time(fwd_dx_dw, rows, o, i) for o, i in train)
    decode = rollout - prompt_rows
    batches = [decode_rows] * (decode // decode_rows) + ([decode % decode_rows] if decode % decode_rows else [])
    with torch.no_grad():
        per_rows = {m: sum(product_time(fwd, m, o, i) for o, i in engine) for m in {prompt_rows, *batches}}
    t_rollout = layers * (per_rows[prompt_rows] + sum(per_rows[m] for m in batches))
    peak = matmul_peak("cpu", "float32", torch.get_num_threads())
    f_roll, f_upd = flop_floor(shape, peak, rollout, 0), flop_floor(shape, peak, 0, trained)
    floor = f_roll + f_upd
    print(f"25m matmuls alone (N = {N / 1e6:.2f}M, {trained} trained tokens as {rows} rows, {rollout} rollout tokens "
          f"= {prompt_rows} prefill rows + decode in batches of {decode_rows}; fp32 peak {peak:.1f} GFLOP/s):")
    print(f"  update  {t_update:.3f} s against its 6N floor {f_upd:.3f} s ({t_update / f_upd:.2f}x)")
    print(f"  rollout {t_rollout:.3f} s against its 2N floor {f_roll:.3f} s ({t_rollout / f_roll:.2f}x)")
    both = t_update + t_rollout
    print(f"  both {both:.3f} s against the floor {floor:.3f} s: **{both / floor:.2f}x** "
          f"with nothing else taking any time; a step at 1.2x the floor leaves "
          f"{1.2 * floor - both:.3f} s for everything else")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", choices=["auto", "onednn"], default="auto",
                    help="auto: the kernels relayrl chooses for this CPU; onednn: all three products on oneDNN")
    ap.add_argument("--update-ab", type=int, default=0, metavar="ROUNDS",
                    help="also time bench_trainer's actor update in two arms (--ab), ROUNDS interleaved rounds")
    ap.add_argument("--rollout-ab", type=int, default=0, metavar="ROUNDS",
                    help="also time the 25m rollout with the chosen kernels vs torch's, ROUNDS interleaved rounds")
    ap.add_argument("--floor", action="store_true",
                    help="also time the 25m workload's matmuls alone against its FLOP floor (floor_25m)")
    ap.add_argument("--floor-tokens", type=int, nargs=4, default=[3090, 3019, 176, 128],
                    metavar=("TRAINED", "ROLLOUT", "PROMPT_ROWS", "DECODE_ROWS"),
                    help="the 25m step's counts (defaults: the medians bench_grpo_trl.py prints)")
    ap.add_argument("--ab", choices=["kernels", "compile", "filler", "adam"], default="kernels",
                    help="the update A/B's arms: kernels: the chosen linear kernels vs torch's; "
                         "compile: the pointwise kernels compiled vs eager (both on bench_trainer's 27M update); "
                         "filler: the packed row without vs with filler tokens; adam: AdamW foreach vs fused "
                         "(both on the 25m workload's packed update)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"host memory: {host_memory.apply()} (this process; RELAYRL_HOST_MEMORY=release for glibc's)")
    decided = configure_process()  # as every relayrl process that runs models: the choice, handed to them
    if args.kernels == "onednn":
        lin.use_kernels(dict.fromkeys(lin.PRODUCTS, True))
    choice = lin.kernels()
    print(f"torch {torch.__version__}, {args.threads} thread(s); GFLOP/s, median of {args.repeats}")
    basis = "forced (--kernels onednn)" if args.kernels == "onednn" else decided.basis
    print(f"kernels: {', '.join(f'{p} on ' + ('oneDNN' if on else 'torch') for p, on in choice.items())} ({basis})")
    print("| shape | M x N x K | oneDNN (fwd, dx, dw) | fwd torch | fwd relayrl | ratio | fwd+bwd torch "
          "| fwd+bwd relayrl | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for label, M, N, K in SHAPES:
        g = torch.Generator().manual_seed(0)
        x, w, up = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(M, N, generator=g)
        fl = 2 * M * N * K
        row = []
        for make in (fwd, fwd_bwd):
            base, ours = make(F.linear, x, w, up), make(linear, x, w, up)
            tb, to = [], []
            for _ in range(args.repeats):  # interleaved
                tb.append(timed(base, 1))
                to.append(timed(ours, 1))
            mult = 1 if len(row) == 0 else 3
            b, o = fl * mult / statistics.median(tb) / 1e9, fl * mult / statistics.median(to) / 1e9
            row += [b, o, o / b]
        ratios += [row[2], row[5]]
        on = ", ".join("yes" if uses_onednn(x, w, p) else "no" for p in lin.PRODUCTS)
        print(f"| {label} | {M} x {N} x {K} | {on} | {row[0]:.1f} | {row[1]:.1f} | "
              f"**{row[2]:.2f}x** | {row[3]:.1f} | {row[4]:.1f} | **{row[5]:.2f}x** |")
    print(f"worst ratio {min(ratios):.2f}x, best {max(ratios):.2f}x")
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm = 2 * n**3 / timed(lambda: a @ b, args.repeats) / 1e9
    dnn = 2 * n**3 / timed(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""), args.repeats) / 1e9
    print(f"square {n} matmul: torch (MKL) {mm:.1f} GFLOP/s, oneDNN {dnn:.1f} GFLOP/s ({dnn / mm:.2f}x)")
    if args.update_ab:
        if args.ab in ("filler", "adam"):
            packed_update_ab(args.update_ab, args.ab)
        else:
            update_ab(args.update_ab, args.ab)
    if args.rollout_ab:
        rollout_ab(args.rollout_ab)
    if args.floor:
        floor_25m(args.repeats, *args.floor_tokens)


if __name__ == "__main__":
    main()
