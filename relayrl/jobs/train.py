"""`relayrl train`: build the roles, run the driver for `run.steps` steps, log, evaluate,
checkpoint, and resume from the newest checkpoint that passes its manifest. What it checks before it writes or
starts anything is relayrl.jobs.preflight's. It may import every layer below the CLI, and it must
never import relayrl.cli.

    run_dir/
      run.lock             while a run (or resume) writes the directory: its lock, naming its pid, host and start
                           (relayrl.jobs.run_dir); a second run into the directory is refused in one line
      config.yaml          the resolved config (resume reads it back), written once the run is built and restored
      base_model/          the tiny model, when model.path is unset
      metrics.jsonl, tb/   one line / TensorBoard scalars per step (eval lines share the step)
      wandb/, mlruns/      with run.loggers [wandb, mlflow]: W&B offline run, MLflow file store (observe.loggers)
      eval.jsonl           held-out evaluations
      samples.jsonl        what the model said: every evaluation's completions (split eval), and every
                           run.samples_every steps the first run.samples_per_step trained samples (split train), each
                           with its prompt, reward, answer and correctness (relayrl.rollout.sample_rows); the same
                           rows as a table in each logger (relayrl.observe.samples)
      trained_prompts.jsonl per step, a digest of each prompt trained on; a resumed run continues it, so every
                           prompt the sampler drew is trained exactly once in every rollout mode, except that
                           DAPO's algo.filter_groups (sync only) drops the groups it filters
      sync_checksums.jsonl with sync.debug_checksums: per engine parameter, trainer vs engine checksum
      checkpoints/step_N/  model, optimizer, scheduler, sampler, RNG as data, a checksummed manifest
                           (atomic: temp name + rename)
      final_model/         the trained policy as a Hugging Face directory
      trace/               with run.trace: spans per process (<role>-<rank>-<host>-<pid>.jsonl), merged by
                           `relayrl report RUN --trace` into report/trace.json
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import yaml

from relayrl.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    latest_valid_checkpoint,
    restore_rng_state,
    step_dir_name,
)
from relayrl.controller.config import RunConfig
from relayrl.controller.driver import Driver
from relayrl.errors import UserError
from relayrl.jobs.build import Roles, build_driver, run_trace_dir
from relayrl.jobs.fleet_control import fleet_control
from relayrl.jobs.preflight import check_start
from relayrl.jobs.run_dir import RunDirLock, disk_error
from relayrl.models import load_pretrained, save_pretrained
from relayrl.models.lora import merge_lora_state_dict
from relayrl.observe import MetricsLogger, Progress
from relayrl.observe.loggers import LoggerOptions
from relayrl.observe.samples import SampleLog, samples_path
from relayrl.observe.trace import open_tracer
from relayrl.rewards import TrainerState
from relayrl.rewards.naming import held_out_metric
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.fleet_replicas import FleetLostError
from relayrl.rollout.evaluate import evaluate_set
from relayrl.rollout.sample_rows import train_rows
from relayrl.single_controller.process_setup import configure_process


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:  # a full disk: no temporary file left behind
        tmp.unlink(missing_ok=True)
        raise


def _save(driver: Driver, run_dir: Path, cfg: RunConfig, src: Path) -> None:
    extra = {**driver.state_dict(), "rng": capture_rng_state()}
    driver.policy.save(run_dir, driver.step, extra=extra, meta={"model_dir": str(src)}, keep_last=cfg.run.keep_last)


def _restore(driver: Driver, ckpt: Path) -> int:
    """Model and optimizer load into the current layout, whatever the saved one was; the driver loads its own."""
    extra = driver.policy.load(ckpt)
    driver.load_state_dict(extra)
    restore_rng_state(extra["rng"])
    return driver.step


def _eval(driver: Driver, roles: Roles, eval_set, cfg: RunConfig, run_dir: Path,
          logger: MetricsLogger, samples: SampleLog) -> dict[str, float]:
    driver.sync_weights()
    rows: list[dict] = []
    with roles.source.evaluation():
        # TRL's reward functions read the trainer state: after driver.step updates, with the sampler where they left it
        state = TrainerState.at(driver.step, cfg.run.steps, roles.source.sampler_state(driver.step),
                                cfg.rollout.prompts_per_step)
        res = evaluate_set(roles.engine, eval_set, data=cfg.data, scorer=roles.scorer, agent=roles.agent,
                           max_tokens=cfg.eval.max_tokens, temperature=cfg.eval.temperature, seed=cfg.run.seed,
                           stop=cfg.rollout.stop, state=state, rows=rows)
        # the engine's figures (engine/*) are training's: an evaluation's prefills and blocks are not the next
        # step's (a resumed run replays a step without the evaluation before it). In an asynchronous run this also
        # drops what the engine generated for coming batches since the last step's figures, before the drain
        roles.engine.reset_stats()
        # nor is its prefix cache: the next step's sync is skipped (the engine holds these weights already), and
        # its prompts must find the cache as that sync would have left it, empty
        roles.engine.reset_prefix_cache()
    logger.log(driver.step, res)
    samples.write(driver.step, rows)
    with open(run_dir / "eval.jsonl", "a") as f:
        f.write(json.dumps({"step": driver.step, **res}) + "\n")
    return res


def _train_samples(driver: Driver, roles: Roles, cfg: RunConfig, samples: SampleLog) -> None:
    """Every run.samples_every steps, the first run.samples_per_step samples the step trained on."""
    every = cfg.run.samples_every
    if every and driver.step % every == 0:
        samples.write(driver.step, train_rows(driver.last_samples, cfg.rollout.group_size, driver.last_advantages,
                                              roles.engine.tokenizer, cfg.run.samples_per_step))


def held_out(cfg: RunConfig) -> str:
    """The held-out figure the run reports first (relayrl.rewards.naming): eval/reward where the user's own reward
    scores it, else eval/accuracy."""
    return held_out_metric([f.name for f in cfg.reward.functions], env=cfg.env is not None)


def train(cfg: RunConfig, resume: bool = False, show_progress: bool = True) -> dict:
    """Run (or resume) the job of `cfg`; returns {"eval_first", "eval_last", "run_dir", ...}. One run per directory:
    the run holds run.out_dir's lock (relayrl.jobs.run_dir) from before its first check to its end, and a write
    the directory's disk refuses (full, read-only) ends it in one line."""
    run_dir = Path(cfg.run.out_dir)
    with RunDirLock(run_dir, "train") as lock:  # a live run in the directory: one line, before anything is read
        try:
            return _train(cfg, run_dir, resume, show_progress, lock)
        except OSError as e:
            err = disk_error(e, run_dir, f"resume with relayrl train --resume {run_dir}")
            if err is None:
                raise
            raise err from e


def _train(cfg: RunConfig, run_dir: Path, resume: bool, show_progress: bool, lock: RunDirLock) -> dict:
    check_start(cfg, run_dir, resume)  # one line, before anything is written
    configure_process()  # heap policy and the models' CPU kernels, once in this process (a bad variable: here)
    ckpt = resume_point(run_dir) if resume else None
    lock.create()
    # a start refused by build_driver's checks (the layout against the model, the data, the roles) writes nothing a
    # run had: config.yaml is written once the run is built and restored (_run), the driver's trace then too
    driver, roles, eval_set, src = build_driver(cfg, run_dir)
    tracer = None
    failed = True
    try:
        traces = run_trace_dir(cfg, run_dir)  # the worker groups got it in their options (build_driver)
        tracer = open_tracer(traces, "driver")
        driver.timer.tracer = tracer if traces is not None else None
        out = _run(driver, roles, cfg, run_dir, src, eval_set, ckpt, show_progress, tracer)
        failed = False
        return out
    finally:  # each closed on its own; on a failure, what closing raises (a full disk again) must not hide it
        first = None
        for close in (roles.close, tracer.close if tracer is not None else None):
            try:
                if close is not None:
                    close()
            except Exception as e:
                first = first or e
        if first is not None and not failed:
            raise first


def resume_point(run_dir: Path) -> Path:
    """The newest checkpoint whose every file passes its manifest (sizes and checksums); each newer one
    skipped is reported in one line with its reason (truncated, corrupt, crafted, incomplete)."""
    ckpt, skipped = latest_valid_checkpoint(run_dir)
    for s in skipped:
        print(f"relayrl: skipping checkpoint {s.path.name}: {s.reason}", file=sys.stderr)
    if ckpt is None:
        newest = f"; the newest: {skipped[0].reason}" if skipped else ""
        raise UserError(f"no valid checkpoint in {run_dir}/checkpoints to resume from{newest}")
    return ckpt


def _run(driver: Driver, roles: Roles, cfg: RunConfig, run_dir: Path, src: Path, eval_set, ckpt,
         show_progress: bool, tracer) -> dict:
    start = _restore(driver, ckpt) if ckpt is not None else 0
    # the run's settings, once it is built and restored: a refused start or --resume leaves the file as it was
    write_atomic(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    r = cfg.run
    logger = MetricsLogger(run_dir, resume_step=start if ckpt else None, loggers=r.sinks, config=cfg.to_dict(),
                           options=LoggerOptions(wandb_project=r.wandb_project, wandb_name=r.wandb_name,
                                                 mlflow_tracking_uri=r.mlflow_tracking_uri,
                                                 mlflow_experiment=r.mlflow_experiment))
    try:
        samples = SampleLog(samples_path(run_dir), logger, resume_step=start if ckpt else None)
    except BaseException:  # a damaged samples.jsonl: one line, and the loggers' runs closed
        logger.close()
        raise
    if ckpt is not None:
        _truncate_jsonl(run_dir / "eval.jsonl", start)
        _truncate_jsonl(run_dir / "trained_prompts.jsonl", start)
    progress = Progress(cfg.run.steps, desc="grpo", initial=start, disable=not show_progress)
    if isinstance(roles.engine, RolloutFleet):  # a replica lost, restarted, added: a line above the bar
        roles.engine.notice = lambda line: progress.write(f"relayrl: {line}")
    try:
        first = None
        try:
            if start == 0:
                with tracer.span("eval", step=0):
                    first = _eval(driver, roles, eval_set, cfg, run_dir, logger, samples)
            last = _steps(driver, roles, cfg, run_dir, src, eval_set, logger, samples, progress, tracer, first)
        except FleetLostError:  # no rollout replica is left: the trainer is whole at its last step; save it
            newest = latest_checkpoint(run_dir)
            if newest is None or newest.name != step_dir_name(driver.step):
                _save(driver, run_dir, cfg, src)
            raise
        final = load_pretrained(src)  # the policy's weights, wherever it runs, as a HF directory
        final.load_state_dict(final_weights(dict(driver.policy.weights()), cfg.trainer.lora))
        save_pretrained(final, run_dir / "final_model", tokenizer_dir=src)
    finally:
        progress.close()
        samples.close()
        logger.close()
    return {"run_dir": str(run_dir), "eval_first": first, "eval_last": last, "steps": driver.step,
            "held_out": held_out(cfg)}


def _steps(driver: Driver, roles: Roles, cfg: RunConfig, run_dir: Path, src: Path, eval_set, logger, samples,
           progress, tracer, last):
    """The steps to run.steps, each logged, evaluated and checkpointed as the config says; returns the last
    evaluation."""
    while driver.step < cfg.run.steps:
        fleet_control(roles.engine, run_dir)  # relayrl fleet RUN_DIR --replicas N, between two steps
        with tracer.span("step", step=driver.step + 1):  # the driver's stages nest inside it
            m = driver.train_step()
        logger.log(driver.step, m)
        with open(run_dir / "trained_prompts.jsonl", "a") as f:
            f.write(json.dumps({"step": driver.step, "prompts": [prompt_digest(ex) for ex in driver.last_prompts]})
                    + "\n")
        if cfg.sync.debug_checksums:  # per-tensor checksums, trainer vs engine, of this step's sync
            with open(run_dir / "sync_checksums.jsonl", "a") as f:
                f.write(json.dumps({"step": driver.step, "checksums": driver.weight_sync.last_table}) + "\n")
        _train_samples(driver, roles, cfg, samples)
        progress.update(driver.step, progress_figures(m))
        done = driver.step == cfg.run.steps
        if done or (cfg.eval.every and driver.step % cfg.eval.every == 0):
            with tracer.span("eval", step=driver.step):
                last = _eval(driver, roles, eval_set, cfg, run_dir, logger, samples)
        if done or (cfg.run.save_every and driver.step % cfg.run.save_every == 0):
            with tracer.span("checkpoint", step=driver.step):
                _save(driver, run_dir, cfg, src)
    return last


def progress_figures(m: dict[str, float]) -> dict[str, float]:
    """The progress bar's figures of a step: its reward, and its correctness under the name it was logged by
    (relayrl.rewards.naming): acc, or em for exact match beside the user's own reward."""
    out = {"reward": m["reward/mean"]}
    for key, short in (("reward/accuracy", "acc"), ("reward/exact_match", "em")):
        if key in m:
            out[short] = m[key]
    return out


def final_weights(weights: dict[str, torch.Tensor], lora) -> dict[str, torch.Tensor]:
    """The policy's full weights as the plain model's: with LoRA, each adapter merged into its base weight."""
    return weights if lora is None else merge_lora_state_dict(weights, lora.alpha / lora.rank)


def prompt_digest(ex) -> str:
    """A short, stable name for a prompt (text or chat messages) and its answer."""
    return hashlib.sha1(json.dumps([ex.prompt, ex.answer], sort_keys=True).encode()).hexdigest()[:16]


def _truncate_jsonl(path: Path, last_step: int) -> None:
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut short by a kill
    write_atomic(path, "".join(k + "\n" for k in keep))
