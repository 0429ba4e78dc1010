"""This module runs `relayrl sft`: a supervised warm-start on prompt/answer pairs (loss on the answer tokens
only). It writes this run directory:

    run_dir/  config.yaml  metrics.jsonl  eval.jsonl  model/ (Hugging Face directory)
              run.lock       while the job runs: its lock (relayrl.jobs.run_dir), naming its pid, host and start
              samples.jsonl  every evaluation's completions, scored (relayrl.observe.samples)

Like the rest of relayrl.jobs, it may import every layer below the CLI; it must never import relayrl.cli.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from relayrl.data import PromptSampler, build_datasets
from relayrl.engine import LLMEngine
from relayrl.envs.base import demonstration, make_env
from relayrl.envs.config import EnvConfig
from relayrl.envs.episode import ChatFormat, Trajectory, encode_conversation
from relayrl.errors import DataError, UserError
from relayrl.jobs.base_model import base_model_dir, check_datasets
from relayrl.jobs.run_dir import RunDirLock, disk_error
from relayrl.jobs.sft_config import SFTJobConfig
from relayrl.jobs.train import write_atomic
from relayrl.models import load_pretrained, save_pretrained
from relayrl.models.tokenizer import load_tokenizer
from relayrl.observe import MetricsLogger, Progress
from relayrl.observe.samples import SampleLog, samples_path
from relayrl.parallel.device import resolve_device
from relayrl.rewards import TrainerState, build_scorer
from relayrl.rewards.naming import held_out_metric
from relayrl.rollout.evaluate import episode_agent, evaluate_set
from relayrl.rollout.prompts import encode_answer, encode_prompt
from relayrl.single_controller.process_setup import configure_process
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.sft import SFTTrainer


def demonstrations(env_cfg: EnvConfig, tok):
    """example -> the environment's demonstration, encoded as an episode would hold it (loss on the
    assistant's turns only); encoded once per example."""
    env = make_env(env_cfg)
    fmt = ChatFormat(tok, [t.schema() for t in env.tools])
    _, stop_ids = fmt.turn_stops(bool(env.tools))
    cache: dict[int, Trajectory] = {}

    def trace(ex) -> Trajectory:
        key = id(ex)
        if key not in cache:
            cache[key] = encode_conversation(fmt, demonstration(env, ex, env_cfg.name), stop_ids)
        return cache[key]

    return trace


def run_sft(cfg: SFTJobConfig, show_progress: bool = True) -> dict:
    """One run per directory, as `relayrl train`'s (relayrl.jobs.run_dir): sft.out_dir's lock from before the first
    check to the end, and a write its disk refuses (full, read-only) in one line."""
    run_dir = Path(cfg.sft.out_dir)
    with RunDirLock(run_dir, "sft", key="sft.out_dir") as lock:  # a live run in it: one line, before anything
        try:
            return _run_sft(cfg, run_dir, show_progress, lock)
        except OSError as e:
            err = disk_error(e, run_dir, f"start again in a new sft.out_dir ({run_dir} holds a partial run)")
            if err is None:
                raise
            raise err from e


def _run_sft(cfg: SFTJobConfig, run_dir: Path, show_progress: bool, lock: RunDirLock) -> dict:
    if (run_dir / "metrics.jsonl").exists():
        raise UserError(f"{run_dir} already holds a run; set sft.out_dir to a new directory")
    device = resolve_device(cfg.sft.device, "sft.device")  # cuda without a GPU: one line, before anything is written
    configure_process()  # the models' CPU kernels, decided once in this process (relayrl.parallel.cpu_kernels)
    lock.create()
    write_atomic(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    src = base_model_dir(cfg.model.path, cfg.model.tiny, cfg.data, run_dir)
    torch.manual_seed(cfg.sft.seed)
    tok = load_tokenizer(src)
    train_set, eval_set = build_datasets(cfg.data)
    if any(ex.answer is None for ex in train_set):
        raise DataError("SFT needs an answer for every training example; set data.answer_field")
    check_datasets(cfg.data, cfg.model.path, src, {"train": train_set, "eval": eval_set})
    model = load_pretrained(src).to(device)
    trainer = SFTTrainer(model, cfg.trainer, cfg.sft.steps)
    sampler = PromptSampler(train_set, cfg.sft.seed)
    trace = demonstrations(cfg.env, tok) if cfg.env is not None else None
    # the held-out accuracy needs the rule functions only (a reward model's score is not accuracy); the pool
    # stops with the job, however it ends
    scorer = build_scorer(cfg.reward.rule_config())
    try:
        logger = MetricsLogger(run_dir, use_tensorboard=cfg.sft.tensorboard)
        samples = SampleLog(samples_path(run_dir), logger)

        def run_eval(step: int) -> dict:
            engine = LLMEngine.from_model(model, tok, max_num_seqs=len(eval_set), device=device)
            rows: list[dict] = []
            # TRL's reward functions read the trainer state, as in `relayrl train`: `step` updates done, of
            # sft.steps, with the sampler where they left it (batches of sft.batch_size examples)
            state = TrainerState.at(step, cfg.sft.steps, sampler.state_dict(), cfg.sft.batch_size)
            with episode_agent(engine, cfg.env) as agent:
                res = evaluate_set(engine, eval_set, data=cfg.data, scorer=scorer, agent=agent,
                                   max_tokens=cfg.eval.max_tokens, temperature=cfg.eval.temperature, seed=cfg.sft.seed,
                                   state=state, rows=rows)
            logger.log(step, res)
            samples.write(step, rows)
            with open(run_dir / "eval.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **res}) + "\n")
            return res

        first = run_eval(0)
        progress = Progress(cfg.sft.steps, desc="sft", disable=not show_progress)
        try:
            for step in range(1, cfg.sft.steps + 1):
                exs = sampler.next_batch(cfg.sft.batch_size)
                if cfg.env is not None:
                    traces = [trace(ex) for ex in exs]
                    ids, attn, resp = build_rows([t.prompt_ids for t in traces], [t.response_ids for t in traces],
                                                 pad_id=tok.pad_token_id or 0, masks=[t.mask for t in traces])
                else:
                    prompts = [encode_prompt(tok, ex, cfg.data) for ex in exs]
                    answers = [encode_answer(tok, ex.answer) for ex in exs]
                    ids, attn, resp = build_rows(prompts, answers, pad_id=tok.pad_token_id or 0)
                m = trainer.step(TrainBatch(ids, attn, resp))
                logger.log(step, m)
                progress.update(step, {"loss": m["sft/loss"]})
        finally:
            progress.close()
        last = run_eval(cfg.sft.steps)
        samples.close()
        logger.close()
        save_pretrained(model, run_dir / "model", tokenizer_dir=src)
    finally:
        scorer.close()
    # its evaluations score with the rule functions (relayrl.rewards.naming: the user's own, or the task's)
    held_out = held_out_metric([f.name for f in cfg.reward.rule_config().functions], env=cfg.env is not None)
    return {"run_dir": str(run_dir), "model_dir": str(run_dir / "model"), "eval_first": first, "eval_last": last,
            "held_out": held_out}
