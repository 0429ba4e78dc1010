"""`relayrl train`: build the roles, run the driver for `run.steps` steps, log, evaluate,
checkpoint, and resume from the newest checkpoint that passes its manifest. What it checks before it writes or
starts anything is relayrl.jobs.preflight's. It may import every layer below the CLI, and it must
never import relayrl.cli.

    run_dir/
      config.yaml          the resolved config (resume reads it back)
      base_model/          the tiny model, when model.path is unset
      metrics.jsonl, tb/   one line / TensorBoard scalars per step (eval lines share the step)
      wandb/, mlruns/      with run.loggers [wandb, mlflow]: W&B offline run, MLflow file store (observe.loggers)
      eval.jsonl           held-out evaluations
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
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from relayrl.algorithms.registry import advantage_needs_greedy_baseline
from relayrl.checkpoint import capture_rng_state, latest_valid_checkpoint, restore_rng_state
from relayrl.controller.config import RunConfig
from relayrl.controller.driver import Driver
from relayrl.controller.step_cost import StepCost
from relayrl.data import PromptSampler, build_datasets
from relayrl.engine import LLMEngine
from relayrl.engine.protocols import RolloutEngine
from relayrl.errors import UserError
from relayrl.jobs.base_model import base_model_dir
from relayrl.jobs.preflight import check_fits_model, check_roles, check_start, sync_transport
from relayrl.models import load_config, load_pretrained, save_pretrained
from relayrl.models.config import ModelConfig, MoEShape
from relayrl.models.lora import merge_lora_state_dict
from relayrl.models.tokenizer import load_tokenizer
from relayrl.observe import MetricsLogger, Progress, StageTimer
from relayrl.observe.loggers import LoggerOptions
from relayrl.observe.trace import open_tracer, trace_dir
from relayrl.parallel.device import resolve_device
from relayrl.rewards import RewardConfig, build_scorer
from relayrl.rewards.protocol import Scorer
from relayrl.roles.actor_workers import actor_model, critic_model
from relayrl.roles.group_policy import GroupPolicy, group_options
from relayrl.roles.local_policy import LocalPolicy
from relayrl.roles.remote import RemoteAgentLoop, RemoteEngine, RemoteScorer
from relayrl.roles.reward_model import CombinedScorer, ModelScorer, RemoteModelScorer, model_entries
from relayrl.roles.weight_sync import FullWeightSync, PlannedWeightSync, lora_options
from relayrl.rollout.agent_loop import AgentLoop, EpisodeRunner
from relayrl.rollout.evaluate import evaluate_set
from relayrl.rollout.source import LockstepSource, RolloutSource, StreamingSource
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.process_setup import configure_process
from relayrl.sync.experts import sync_shape
from relayrl.sync.layout import TrainerLayout
from relayrl.sync.protocol import WeightSync
from relayrl.trainer.actor import Actor
from relayrl.trainer.critic import Critic
from relayrl.trainer.policy import Policy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_engine(cfg: RunConfig, src: Path, model: ModelConfig, policy: LocalPolicy | GroupPolicy,
                 options: GroupOptions) -> RolloutEngine:
    """The rollout engine, its ranks where parallel.placement puts them:

        vllm                          vLLM's engine (its own workers; synced with full tensors)
        colocated                     in the trainer's processes: beside the actor in this one
                                      (backend none), or ranks 0..tp-1 of the actor workers
        disaggregated                 processes of its own (a worker group of its ranks; or the
                                      whole engine in a rollout worker)

    Colocated engines start empty: the first (verified) sync gives them the policy's weights."""
    r, par = cfg.rollout, cfg.parallel
    kwargs = dict(dtype=DTYPES[r.engine_dtype], enable_prefix_caching=r.enable_prefix_caching, seed=cfg.run.seed)
    if r.backend == "vllm":
        from relayrl.engine.vllm_backend import VLLMEngine

        return VLLMEngine(src, **kwargs)
    kwargs.update(max_num_seqs=r.max_num_seqs, block_size=r.block_size, kv_cache_bytes=r.kv_cache_bytes,
                  tensor_parallel_size=r.tp, expert_placement=r.expert_placement,
                  record_routing=records_routing(model))
    device = resolve_device(par.device)  # colocated ranks take the actor's device instead
    if par.rollout_worker:  # a tensor-parallel engine's own group, started in the worker, traces there too
        return RemoteEngine(src, {**kwargs, "group_options": GroupOptions(trace_dir=options.trace_dir)}, options,
                            device=device)
    tokenizer = load_tokenizer(src)
    if par.placement == "disaggregated":
        return LLMEngine(model, tokenizer, own_processes=True, group_options=options, device=device, **kwargs)
    hosted = policy.host_engine(model, kwargs["dtype"], r.tp, r.expert_placement)
    return LLMEngine(model, tokenizer, runner_group=hosted, **kwargs)


def records_routing(model: ModelConfig) -> bool:
    """relayrl's engine records an MoE model's routing always: algo.routing_replay replays it, and without replay
    the update still compares its own routing against it (moe/routing_mismatch). Its cost: a host int16 per (KV
    slot, MoE layer, slot k), and one more decode position per sample (its final token; relayrl.engine.routing)."""
    return isinstance(model, MoEShape)


def build_weight_sync(cfg: RunConfig, model: ModelConfig, policy: Policy, engine: RolloutEngine) -> WeightSync:
    """The planned, verified sync for relayrl's engine; vLLM's loader takes full tensors."""
    if cfg.rollout.backend == "vllm":
        return FullWeightSync(policy, engine, **lora_options(cfg.trainer.lora))
    par = cfg.parallel
    layout = (TrainerLayout() if par.backend == "none"
              else TrainerLayout(par.tp, par.dp_shard * par.cp, par.dp_replicate, pp=par.pp,  # FSDP: dp_shard x cp
                                 pp_schedule=par.pp_schedule, ep=par.ep))
    bf16_base = cfg.trainer.lora is not None and cfg.trainer.lora.base_dtype == "bfloat16"  # the trainer's compute
    # sync_shape keeps an MoE model's experts (ModelShape.of drops them)
    return PlannedWeightSync(policy, engine, shape=sync_shape(model), trainer_layout=layout,
                             engine_tp=cfg.rollout.tp, expert_placement=cfg.rollout.expert_placement,
                             ipc=sync_transport(cfg) == "ipc",
                             colocated=par.placement == "colocated" and not par.rollout_worker,
                             engine_dtype=DTYPES[cfg.rollout.engine_dtype],
                             trainer_dtype=torch.bfloat16 if cfg.trainer.bf16 or bf16_base else torch.float32,
                             temperature=cfg.rollout.temperature, cfg=cfg.sync, **lora_options(cfg.trainer.lora))


def build_scorer_for(cfg: RunConfig, options: GroupOptions | None = None) -> Scorer | None:
    """The run's reward scorer (reward_scorer); none for environments, which reward their own episodes."""
    if cfg.env is not None:
        return None
    groups = None if cfg.parallel.backend == "none" else options or group_options(cfg.parallel)
    return reward_scorer(cfg.reward, cfg.parallel.device, groups, cfg.parallel.reward_workers)


def reward_scorer(reward: RewardConfig, device: str, groups: GroupOptions | None = None,
                  reward_workers: int = 0) -> Scorer:
    """Rule functions run in the reward pool (or `reward_workers` reward workers); reward models (`name: model`
    entries) on `device` (a parallel.device setting), in this process without worker-group options (`groups`),
    else in a reward-model worker group of their own (relayrl.roles.reward_model)."""
    entries = model_entries(reward)  # a missing model directory fails here, before any process starts
    rule_cfg = reward.rule_config()
    if reward_workers:  # RunConfig allows them with worker groups only (not with parallel.backend none)
        rules: Scorer = RemoteScorer(rule_cfg, reward_workers, groups)
    else:
        rules = build_scorer(rule_cfg)
    if not entries:
        return rules
    device = resolve_device(device)  # reward models compute where the trainer does
    try:
        if groups is None:
            models: ModelScorer | RemoteModelScorer = ModelScorer(entries, device=device)
        else:
            models = RemoteModelScorer(entries, groups, device=device)
    except BaseException:
        rules.close()
        raise
    return CombinedScorer(rules, models, entries, on_failure=reward.on_failure)


def build_agent(cfg: RunConfig, engine: RolloutEngine) -> EpisodeRunner | None:
    """With an `env:` section, the agent loop: beside the engine in this process, or in the rollout worker."""
    if cfg.env is None:
        return None
    if isinstance(engine, RemoteEngine):
        return RemoteAgentLoop(engine, cfg.env)
    assert isinstance(engine, LLMEngine)  # RunConfig refuses env with the vllm backend
    return AgentLoop(engine, cfg.env)


def close_all(*roles) -> None:
    """Close every role, each on its own: one that fails (a dead worker group) must not keep the
    others (the engine's processes, the reward pool) from closing. The first error is re-raised
    after all were tried, unless an error is already on its way out."""
    first = None
    for role in roles:
        if role is None:
            continue
        try:
            role.close()
        except Exception as e:
            first = first or e
    if first is not None:
        raise first


@dataclass
class Roles:
    """What a run builds around its driver, each closed on its own at the end (close_all)."""

    policy: Policy
    engine: RolloutEngine
    weight_sync: WeightSync
    scorer: Scorer | None  # single-turn rewards; None with an environment
    agent: EpisodeRunner | None  # with an `env:` section: multi-turn episodes, rewarded by their environment
    source: RolloutSource

    def close(self) -> None:
        close_all(self.source, self.agent, self.weight_sync, self.scorer, self.engine, self.policy)


def build_source(cfg: RunConfig, engine: RolloutEngine, scorer: Scorer | None, agent: EpisodeRunner | None,
                 sampler: PromptSampler, timer: StageTimer, cost: StepCost | None) -> RolloutSource:
    """The rollout source of rollout.mode: lockstep (sync) or the stream (one_step_off, async)."""
    common = dict(sampler=sampler, rollout=cfg.rollout, data=cfg.data, seed=cfg.run.seed, scorer=scorer, agent=agent,
                  timer=timer, on_generated=cost.add if cost is not None else None)
    if cfg.rollout.mode == "sync":
        return LockstepSource(engine, filter_groups=cfg.algo.filter_groups,
                              max_resample_rounds=cfg.algo.max_resample_rounds,
                              greedy_baseline=advantage_needs_greedy_baseline(cfg.algo.advantage), **common)
    return StreamingSource(engine, total_steps=cfg.run.steps, env_name=cfg.env.name if cfg.env else "", **common)


def run_trace_dir(cfg: RunConfig, run_dir: Path) -> str | None:
    """Where the run's processes append their spans (run.trace), or None."""
    return str(trace_dir(run_dir).resolve()) if cfg.run.trace else None


def build_driver(cfg: RunConfig, run_dir: Path) -> tuple[Driver, Roles, list, Path]:
    src = base_model_dir(cfg.model.path, cfg.model.tiny, cfg.data, run_dir)
    model = load_config(src)  # read once: the checks, the engine, the sync plan and the driver share it
    check_fits_model(cfg, model)
    torch.manual_seed(cfg.run.seed)
    train_set, eval_set = build_datasets(cfg.data)
    check_roles(cfg)
    options = group_options(cfg.parallel, run_trace_dir(cfg, run_dir))  # every worker group's
    policy, engine, sync, scorer, agent, source = build_policy(cfg, src, options), None, None, None, None, None
    try:
        engine = build_engine(cfg, src, model, policy, options)
        sync = build_weight_sync(cfg, model, policy, engine)
        scorer = build_scorer_for(cfg, options)
        agent = build_agent(cfg, engine)
        timer, cost = StageTimer(), StepCost(cfg, model)
        source = build_source(cfg, engine, scorer, agent, PromptSampler(train_set, cfg.run.seed), timer, cost)
        driver = Driver(cfg, policy=policy, engine=engine, source=source, weight_sync=sync, cost=cost, timer=timer)
    except BaseException:
        try:  # no process outlives a failed start
            close_all(source, agent, sync, scorer, engine, policy)
        except Exception:
            pass
        raise
    return driver, Roles(policy, engine, sync, scorer, agent, source), eval_set, src


def build_policy(cfg: RunConfig, src: Path, options: GroupOptions | None = None) -> LocalPolicy | GroupPolicy:
    """The trainer in this process (parallel.backend none), or as worker groups (local / ray); with PPO's
    critic (algo.advantage gae) beside the actor, laid out like it."""
    with_ref = cfg.algo.kl_coef > 0
    # trainer.lora: the reference is the actor's frozen base (its adapters off), not a second model
    ref_in_actor = with_ref and cfg.trainer.lora is not None
    if cfg.parallel.backend == "none":
        device = resolve_device(cfg.parallel.device)  # every model on it before its optimiser is built
        actor = Actor(actor_model(str(src), cfg.trainer.lora, cfg.run.seed).to(device), cfg.trainer, cfg.algo,
                      total_steps=cfg.run.steps, temperature=cfg.rollout.temperature, seed=cfg.run.seed)
        ref = load_pretrained(src).to(device).eval().requires_grad_(False) if with_ref and not ref_in_actor else None
        critic = None
        if cfg.critic is not None:
            critic = Critic(critic_model(str(src), cfg.critic, cfg.run.seed).to(device), cfg.critic, cfg.algo,
                            total_steps=cfg.run.steps, seed=cfg.run.seed)
        return LocalPolicy(actor, ref, temperature=cfg.rollout.temperature,
                           micro_batch_size=cfg.trainer.micro_batch_size, critic=critic, ref_in_actor=ref_in_actor)
    return GroupPolicy(src, par=cfg.parallel, trainer_cfg=cfg.trainer, algo_cfg=cfg.algo, total_steps=cfg.run.steps,
                       temperature=cfg.rollout.temperature, seed=cfg.run.seed, with_reference=with_ref,
                       critic_cfg=cfg.critic, options=options)


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
          logger: MetricsLogger) -> dict[str, float]:
    driver.sync_weights()
    with roles.source.evaluation():
        res = evaluate_set(roles.engine, eval_set, data=cfg.data, scorer=roles.scorer, agent=roles.agent,
                           max_tokens=cfg.eval.max_tokens, temperature=cfg.eval.temperature, seed=cfg.run.seed,
                           stop=cfg.rollout.stop)
        # the engine's figures (engine/*) are training's: an evaluation's prefills and blocks are not the next
        # step's (a resumed run replays a step without the evaluation before it). In an asynchronous run this also
        # drops what the engine generated for coming batches since the last step's figures, before the drain
        roles.engine.reset_stats()
    logger.log(driver.step, res)
    with open(run_dir / "eval.jsonl", "a") as f:
        f.write(json.dumps({"step": driver.step, **res}) + "\n")
    return res


def train(cfg: RunConfig, resume: bool = False, show_progress: bool = True) -> dict:
    """Run (or resume) the job of `cfg`; returns {"eval_first", "eval_last", "run_dir", ...}."""
    run_dir = Path(cfg.run.out_dir)
    check_start(cfg, run_dir, resume)  # one line, before anything is written
    configure_process()  # heap policy and the models' CPU kernels, once in this process (a bad variable: here)
    ckpt = resume_point(run_dir) if resume else None
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    traces = run_trace_dir(cfg, run_dir)  # the worker groups get it in their options (build_driver)
    tracer = open_tracer(traces, "driver")
    try:
        driver, roles, eval_set, src = build_driver(cfg, run_dir)
        driver.timer.tracer = tracer if traces is not None else None
        failed = True
        try:
            out = _run(driver, roles, cfg, run_dir, src, eval_set, ckpt, show_progress, tracer)
            failed = False
            return out
        finally:
            try:
                roles.close()
            except Exception:
                if not failed:
                    raise
    finally:
        tracer.close()


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
    r = cfg.run
    logger = MetricsLogger(run_dir, resume_step=start if ckpt else None, loggers=r.sinks, config=cfg.to_dict(),
                           options=LoggerOptions(wandb_project=r.wandb_project, wandb_name=r.wandb_name,
                                                 mlflow_tracking_uri=r.mlflow_tracking_uri,
                                                 mlflow_experiment=r.mlflow_experiment))
    if ckpt is not None:
        _truncate_jsonl(run_dir / "eval.jsonl", start)
        _truncate_jsonl(run_dir / "trained_prompts.jsonl", start)
    progress = Progress(cfg.run.steps, desc="grpo", initial=start, disable=not show_progress)
    try:
        first = None
        if start == 0:
            with tracer.span("eval", step=0):
                first = _eval(driver, roles, eval_set, cfg, run_dir, logger)
        last = first
        while driver.step < cfg.run.steps:
            with tracer.span("step", step=driver.step + 1):  # the driver's stages nest inside it
                m = driver.train_step()
            logger.log(driver.step, m)
            with open(run_dir / "trained_prompts.jsonl", "a") as f:
                f.write(json.dumps({"step": driver.step, "prompts": [prompt_digest(ex) for ex in driver.last_prompts]})
                        + "\n")
            if cfg.sync.debug_checksums:  # per-tensor checksums, trainer vs engine, of this step's sync
                with open(run_dir / "sync_checksums.jsonl", "a") as f:
                    f.write(json.dumps({"step": driver.step, "checksums": driver.weight_sync.last_table}) + "\n")
            progress.update(driver.step, {"reward": m["reward/mean"], "acc": m["reward/accuracy"]})
            done = driver.step == cfg.run.steps
            if done or (cfg.eval.every and driver.step % cfg.eval.every == 0):
                with tracer.span("eval", step=driver.step):
                    last = _eval(driver, roles, eval_set, cfg, run_dir, logger)
            if done or (cfg.run.save_every and driver.step % cfg.run.save_every == 0):
                with tracer.span("checkpoint", step=driver.step):
                    _save(driver, run_dir, cfg, src)
        final = load_pretrained(src)  # the policy's weights, wherever it runs, as a HF directory
        final.load_state_dict(final_weights(dict(driver.policy.weights()), cfg.trainer.lora))
        save_pretrained(final, run_dir / "final_model", tokenizer_dir=src)
    finally:
        progress.close()
        logger.close()
    return {"run_dir": str(run_dir), "eval_first": first, "eval_last": last, "steps": driver.step}


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
