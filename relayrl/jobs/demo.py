"""This module runs `relayrl demo`: the whole story on a laptop CPU, on built-in defaults.

`relayrl demo` (arith, single-turn):
    tiny model (char tokenizer) ──SFT warm-start on arith──> accuracy_before
                                 ──GRPO──────────────────> accuracy_after ──> report PNGs

`relayrl demo --algo ppo`: the same job with PPO and a learned critic instead of GRPO's group baseline.

`relayrl demo --lora`: GRPO trains LoRA adapters on the SFT model (base frozen); the weight sync sends the
adapters only.

`relayrl demo --env calculator` (an agent with a tool, multi-turn):
    tiny model ──SFT on the environment's tool-use traces──> success_before (held-out, greedy, with the tool)
               ──GRPO on episodes in the environment────> success_after ──> report PNGs (episodes.png)

`relayrl demo --agent react` (bring your own agent: a program written against the openai client only):
    tiny model ──SFT on the calculator environment's traces──> the SFT model
               ──GRPO on the episodes of examples/agents/react_calculator.py:run, through the OpenAI endpoint
                 (rollout.agent; relayrl.serve.agents)──> success before (the first evaluation, the agent on the SFT
                 model) and after (the last), both held-out, greedy, run by the same agent

It writes OUT/sft, OUT/grpo (a full run directory) and OUT/summary.json with accuracy_before,
accuracy_after and seconds (for an environment, accuracy is held-out success). The settings below are
the demo's own; `relayrl train` and `relayrl sft` take the same sections from YAML.

Like the rest of relayrl.jobs, it may import every layer below the CLI; it must never import relayrl.cli.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from relayrl.controller.config import RunConfig
from relayrl.errors import UserError
from relayrl.jobs.sft import SFTJobConfig, run_sft
from relayrl.jobs.train import train, write_atomic
from relayrl.single_controller.process_setup import configure_process

# one-digit operands, three of them ("7-3+8="): a tiny char model learns the format and part of the
# skill in a short SFT; GRPO then sharpens what it samples into what it answers greedily.
DATA = {"task": "arith", "task_params": {"digits": 1, "ops": "+-", "num_operands": 3},
        "n_train": 3000, "n_eval": 200, "seed": 0}

SFT = {
    "data": DATA,
    "trainer": {"lr": 3e-3, "warmup_steps": 20, "schedule": "cosine", "min_lr_ratio": 0.1, "micro_batch_size": 64},
    "eval": {"max_tokens": 6},
    "sft": {"steps": 300, "batch_size": 64},
}

GRPO = {
    "data": DATA,
    "rollout": {"prompts_per_step": 32, "group_size": 8, "temperature": 1.0, "max_tokens": 6},
    "algo": {"advantage": "grpo", "loss": "ppo", "clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0},
    # 1e-4 for 800 steps: the gain held over seeds and roundings (seeds 0-2: +17.5, +21.5, +19.0 points; 5e-5 for
    # 600 steps gave +11.5, +13.0, +14.5, and +5.0 to +22.5 across machines); 2e-4 and up lost accuracy
    "trainer": {"lr": 1e-4, "micro_batch_size": 256, "mini_batches": 2, "warmup_steps": 10,
                "schedule": "cosine", "min_lr_ratio": 0.1},  # a decaying step settles the end
    "eval": {"max_tokens": 6, "every": 50},
    "run": {"steps": 800},
}


# calculator: two-digit operands ("What is 48*37+95?"), beyond a tiny model's head but not its copying.
# The SFT traces are the environment's demonstrations, but only a few use the tool: three in four answer
# in the head (direct_share). The warm-started model calls the tool now and then; GRPO has to find out that
# calling it pays.
CALC_DATA = {"task": "calculator", "task_params": {"digits": [2, 2, 2]}, "n_train": 3000, "n_eval": 100,
             "seed": 0, "chat_template": "always"}
CALC_ENV = {"name": "calculator", "max_turns": 3, "max_total_tokens": 224}
CALC_MODEL = {"tiny": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2}}
CALC_SFT = {
    "data": {**CALC_DATA, "n_train": 512},
    "model": CALC_MODEL,
    "env": {**CALC_ENV, "params": {"direct_share": 0.75}},
    "trainer": {"lr": 3e-3, "warmup_steps": 20, "schedule": "cosine", "min_lr_ratio": 0.1, "micro_batch_size": 32},
    "eval": {"max_tokens": 96},
    "sft": {"steps": 800, "batch_size": 32},
}
CALC_GRPO = {
    "data": CALC_DATA,
    "env": CALC_ENV,
    "rollout": {"prompts_per_step": 16, "group_size": 8, "temperature": 1.0, "max_tokens": 96},
    "algo": {"advantage": "grpo", "loss": "ppo", "clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0},
    "trainer": {"lr": 1e-4, "micro_batch_size": 64, "mini_batches": 2, "warmup_steps": 5,
                "schedule": "cosine", "min_lr_ratio": 0.1},
    "eval": {"max_tokens": 96, "every": 10},
    "run": {"steps": 60},
}
RECIPES = {None: (SFT, GRPO, "arith"), "calculator": (CALC_SFT, CALC_GRPO, "the calculator environment")}

# `--agent react`: the calculator demo's data and SFT warm-start, then GRPO on the episodes of a ReAct agent written
# only against the openai client (examples/agents/react_calculator.py): it offers the calculator as an OpenAI tool,
# evaluates the calls itself and returns 1.0 for a right answer. The endpoint imposes the run's sampling and caps each
# reply at rollout.max_tokens; agent_max_total_tokens is the environment's episode budget, so episodes are as long
# as the calculator demo's. All of a step's 128 episodes run at once. 20 steps, not 60: a step through the endpoint
# costs about twice the agent loop's (benchmarks/bench_agent_endpoint.py), and the gain is made early (seed 0, three
# runs: held-out success 0.22 -> 0.66 after 10 steps -> 0.72-0.73 after 20, in 379-652 s on a shared 2-core machine).
REACT_AGENT = Path(__file__).resolve().parents[2] / "examples" / "agents" / "react_calculator.py"
REACT_GRPO = {**{k: v for k, v in CALC_GRPO.items() if k != "env"},
              "rollout": {**CALC_GRPO["rollout"], "agent": f"{REACT_AGENT}:run", "agent_concurrency": 128,
                          "agent_max_total_tokens": CALC_ENV["max_total_tokens"]},
              "run": {**CALC_GRPO["run"], "steps": 20}}
AGENTS = {"react": (CALC_SFT, REACT_GRPO, "the calculator environment's traces, for the ReAct agent")}

# `--algo ppo`: the same job with PPO's learned value function instead of the group baseline. The critic
# starts from the SFT model with a zero head and trains alone for its first steps (its early values are
# noise); GAE with lam = 1 on the outcome reward makes each token's advantage the return minus its value.
# The critic's forward and update cost about as much as the actor's (measured: 0.36 of 0.84 s a step), so
# PPO gets 360 steps: the wall time of the GRPO demo's 600 steps when it was measured (benchmarks/RESULTS.md).
PPO = {"algo": {"advantage": "gae", "gamma": 1.0, "lam": 1.0, "value_clip": 0.2, "whiten_advantages": True},
       "critic": {"lr": 1e-4, "micro_batch_size": 256, "mini_batches": 2, "warmup_steps": 10,
                  "schedule": "cosine", "min_lr_ratio": 0.1, "warmup_updates": 10},
       "run": {"steps": 360}}
ALGOS = ("grpo", "ppo")

# `--lora`: only rank-8 adapters on every projection train (the base stays the SFT model). Adapters start at
# zero (B = 0) and move the weights through a low-rank product, so they take a larger step than full training.
# Its figures (README, benchmarks/RESULTS.md) were measured with 600 steps, which it keeps.
LORA = {"trainer": {"lora": {"rank": 8, "alpha": 16.0}, "lr": 5e-4}, "run": {"steps": 600}}


def recipe(env: str | None, algo: str, lora: bool = False, seed: int = 0,
           agent: str | None = None) -> tuple[dict, dict, str]:
    """(SFT recipe, RL recipe, what it trains on) for the demo of `env` (or of the agent function `agent`) with `algo`
    (LoRA adapters: `lora`). `seed` seeds everything random: the task's data, the tiny model's initial weights, the
    SFT batches and the RL run's sampling (the recipes' own seeds are all 0)."""
    sft, rl, what = AGENTS[agent] if agent else RECIPES[env]
    if algo == "ppo":
        rl = {**rl, "algo": {**rl["algo"], **PPO["algo"]}, "critic": PPO["critic"], "run": {**rl["run"], **PPO["run"]}}
    if lora:
        rl = {**rl, "trainer": {**rl["trainer"], **LORA["trainer"]}, "run": {**rl["run"], **LORA["run"]}}
    if seed:
        model = sft.get("model", {})
        sft = {**sft, "data": {**sft["data"], "seed": seed}, "sft": {**sft["sft"], "seed": seed},
               "model": {**model, "tiny": {**model.get("tiny", {}), "seed": seed}}}
        rl = {**rl, "data": {**rl["data"], "seed": seed}, "run": {**rl["run"], "seed": seed}}
    return sft, rl, what


def run_demo(out: Path, steps: int | None = None, show_progress: bool = True, env: str | None = None,
             algo: str = "grpo", lora: bool = False, seed: int = 0, agent: str | None = None) -> dict:
    from relayrl.observe.report import make_report

    if agent is not None:
        if agent not in AGENTS:
            raise UserError(f"relayrl demo has no recipe for agent '{agent}': use one of {', '.join(AGENTS)}")
        if env or algo != "grpo" or lora:
            raise UserError("relayrl demo --agent react has one recipe: the calculator's SFT warm-start, then GRPO "
                            "with full fine-tuning; drop --env, --algo and --lora")
        if not REACT_AGENT.is_file():
            raise UserError(f"relayrl demo --agent react runs {REACT_AGENT}, which is not there: run it from a "
                            "checkout of the relayrl repository (the agent is an example, not part of the package)")
    if env not in RECIPES:
        raise UserError(f"relayrl demo has no recipe for env '{env}': use one of "
                        f"{', '.join(k for k in RECIPES if k)} (or none, for arith)")
    if algo not in ALGOS:
        raise UserError(f"relayrl demo has no recipe for algo '{algo}': use one of {', '.join(ALGOS)}")
    if lora and algo == "ppo":
        raise UserError("relayrl demo --lora trains the policy's adapters with GRPO; drop --algo ppo "
                        "(the critic trains in full)")
    sft_recipe, grpo_recipe, what = recipe(env, algo, lora, seed, agent)
    configure_process()  # a bad RELAYRL_HOST_MEMORY / RELAYRL_CPU_LINEAR is one line here, before anything is written
    measure = "success" if env or agent else "accuracy"
    start = time.perf_counter()
    for sub in ("sft", "grpo"):
        shutil.rmtree(out / sub, ignore_errors=True)  # the demo always starts fresh
    out.mkdir(parents=True, exist_ok=True)

    print(f"[1/3] SFT warm-start of the tiny model on {what}")
    sft_cfg = SFTJobConfig.from_dict({**sft_recipe, "sft": {**sft_recipe["sft"], "out_dir": str(out / "sft")}})
    sft = run_sft(sft_cfg, show_progress=show_progress)
    before = sft["eval_last"]["eval/accuracy"]
    print(f"      held-out {measure} after SFT: {before:.3f}" + (" (the environment's agent loop)" if agent else ""))

    print(f"[2/3] {algo.upper()}" + (" (LoRA adapters, base frozen)" if lora else "")
          + (f" on the episodes of {grpo_recipe['rollout']['agent']}, through the OpenAI endpoint" if agent else ""))
    run = {**grpo_recipe["run"], "out_dir": str(out / "grpo"), **({"steps": steps} if steps else {})}
    grpo_cfg = RunConfig.from_dict({**grpo_recipe, "model": {"path": sft["model_dir"]}, "run": run})
    res = train(grpo_cfg, show_progress=show_progress)
    after = res["eval_last"]["eval/accuracy"]
    sft_env = None
    if agent:  # before: the same agent on the SFT model (the run's first evaluation), as after is measured
        sft_env, before = before, res["eval_first"]["eval/accuracy"]

    print("[3/3] report")
    plots = make_report(out / "grpo")
    seconds = time.perf_counter() - start
    summary = {"env": env, "agent": agent, "algo": algo, "lora": lora, "seed": seed, "accuracy_before": before,
               "accuracy_after": after, **({"accuracy_sft_env": sft_env} if agent else {}),
               "seconds": round(seconds, 1),
               "sft_dir": str(out / "sft"), "grpo_dir": str(out / "grpo"), "plots": [str(p) for p in plots]}
    write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    print(f"held-out {measure}: before {algo.upper()} {before:.3f} -> after {algo.upper()} {after:.3f} "
          f"({100 * (after - before):+.1f} points) in {seconds:.0f} s; plots in {out / 'grpo' / 'report'}")
    return summary
