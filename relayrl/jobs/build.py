"""What a run is built of: its roles, where each runs, and the driver over them.

    build_driver(cfg, run_dir)
      base model ──> policy (worker groups, inline in this process for backend none: build_policy)
                 ──> engine (colocated on the policy's ranks, in processes of its own, in a rollout worker, or
                             vLLM: build_engine)
                 ──> weight sync (planned and verified, or full tensors for vLLM: build_weight_sync)
                 ──> reward scorer (rule functions, reward models: build_scorer_for) or the agent loop (env:)
                 ──> rollout source (lockstep or streaming: build_source) ──> Driver

Every worker group gets the run's options (deadlines, heartbeat, trace directory: run_trace_dir). A failed start
closes what was built, so no process outlives it. relayrl.jobs.train runs what this builds.

Like the rest of relayrl.jobs, it may import every layer below the CLI; it must never import relayrl.cli.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from relayrl.algorithms.registry import advantage_needs_greedy_baseline
from relayrl.controller.config import RunConfig
from relayrl.controller.driver import Driver, LoopSettings
from relayrl.controller.step_cost import StepCost
from relayrl.data import PromptSampler, build_datasets
from relayrl.engine import LLMEngine
from relayrl.engine.protocols import RolloutEngine
from relayrl.engine.tp_workers import RunnerWorker, colocated_ranks
from relayrl.errors import ConfigError
from relayrl.jobs.base_model import base_model_dir, check_datasets
from relayrl.jobs.preflight import check_fits_model, check_roles, sync_transport
from relayrl.models import load_config
from relayrl.models.config import ModelConfig, MoEShape
from relayrl.models.tokenizer import load_tokenizer
from relayrl.observe import StageTimer
from relayrl.observe.trace import trace_dir
from relayrl.parallel.device import resolve_device
from relayrl.rewards import RewardConfig
from relayrl.rewards.protocol import Scorer
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.fleet_colocated import ColocatedFleetWeightSync, colocated_fleet
from relayrl.roles.fleet_episodes import FleetEpisodes
from relayrl.roles.fleet_replicas import replica_devices
from relayrl.roles.fleet_stepper import FleetStepper
from relayrl.roles.fleet_sync import FleetWeightSync
from relayrl.roles.group_policy import GroupPolicy, group_options
from relayrl.roles.reward_model import CombinedScorer, ModelScorer, model_entries
from relayrl.roles.rollout_worker import EpisodeRole, RolloutRole
from relayrl.roles.rule_scorer import RuleScorer
from relayrl.roles.weight_sync import FullWeightSync, PlannedWeightSync, lora_options
from relayrl.rollout.agent_loop import EpisodeRunner
from relayrl.rollout.source import LockstepSource, RolloutSource, StreamingSource
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.worker import RoleSpec
from relayrl.sync.experts import sync_shape
from relayrl.sync.layout import TrainerLayout
from relayrl.sync.protocol import WeightSync
from relayrl.trainer.policy import Policy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_gpus(cfg: RunConfig, device: str, count: int | None = None) -> list[int] | None:
    """Disaggregated engines on one node's GPUs as local processes: the first GPU of each engine replica's
    rollout.tp GPUs, after the trainer's ranks on cuda:0.. (relayrl.roles.fleet_replicas.replica_devices); None
    where the device is not a GPU or Ray places the processes (each actor sees its own GPUs as cuda:0..). count:
    the node's GPUs (default: torch's count)."""
    par = cfg.parallel
    if device != "cuda" or par.backend == "ray" or (par.placement == "colocated" and not par.rollout_worker):
        return None
    count = torch.cuda.device_count() if count is None else count
    try:
        return replica_devices(count, 1 if par.backend == "none" else par.world_size, cfg.rollout.tp)
    except ValueError as e:
        raise ConfigError(f"rollout.tp: {e}") from None


def build_engine(cfg: RunConfig, src: Path, model: ModelConfig, policy: GroupPolicy,
                 options: GroupOptions) -> RolloutEngine:
    """The rollout engine, its ranks where parallel.placement puts them:

        vllm                          vLLM's engine (its own workers; synced with full tensors)
        colocated                     in the trainer's processes: the engine role (RunnerWorkers) the
                                      policy's groups were spawned with (colocated_engine), ranks 0..tp-1
                                      hosting it (backend none: its one rank beside the actor, in this one);
                                      rollout.replicas > 1: replica k on ranks k*tp..k*tp+tp-1, behind a
                                      router (relayrl.roles.fleet_colocated)
        disaggregated                 processes of its own (a worker group of its ranks; or the
                                      whole engine in a rollout worker; rollout.replicas > 1: a fleet of
                                      rollout workers behind a router, relayrl.roles.fleet)

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
    tokenizer = load_tokenizer(src)
    gpus = engine_gpus(cfg, device)  # local processes on GPUs: the engines' after the trainer's
    first = device if gpus is None else f"{device}:{gpus[0]}"
    if par.rollout_worker:  # a tensor-parallel engine's own group, started in the worker, traces there too
        worker_kwargs = {**kwargs, "group_options": GroupOptions(trace_dir=options.trace_dir)}
        if r.replicas > 1 or r.replicas_max is not None:  # a fleet: replicas in rollout workers, behind a router
            return RolloutFleet.own_processes(r.replicas, src, worker_kwargs, options, tokenizer, device=device,
                                              block_size=r.block_size, router=r.router.to_dict(),
                                              max_restarts=r.replica_restarts, replicas_max=r.replicas_max,
                                              cpus_per_replica=r.replica_cpus, gpus=gpus, tp=r.tp)
        return RolloutRole.own_process(src, worker_kwargs, options, tokenizer, device=first, gpus=r.tp)
    if par.placement == "disaggregated":
        if par.backend == "none":  # the trainer is in this process; the engine's ranks are processes all the same
            options = dataclasses.replace(options, backend="local")
        return RolloutRole.inline(partial(LLMEngine, model, tokenizer, own_processes=True, group_options=options,
                                          device=first, **kwargs), tokenizer)
    if r.replicas > 1:
        return colocated_fleet(policy.roles["engine"], r.replicas, r.tp, partial(LLMEngine, model, tokenizer, **kwargs),
                               tokenizer, r.block_size)
    hosted = colocated_ranks(policy.roles["engine"], r.tp)
    return RolloutRole.inline(partial(LLMEngine, model, tokenizer, runner_group=hosted, **kwargs), tokenizer)


def colocated_engine(cfg: RunConfig, model: ModelConfig) -> RoleSpec | None:
    """The engine's rank role to place in the actor's processes (parallel.placement colocated, relayrl's engine
    beside the driver), or None: its ranks live elsewhere (build_engine)."""
    r, par = cfg.rollout, cfg.parallel
    if r.backend == "vllm" or par.rollout_worker or par.placement != "colocated":
        return None
    return RoleSpec(RunnerWorker, (model, DTYPES[r.engine_dtype], r.expert_placement, r.tp, r.replicas))


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
    planned = dict(shape=sync_shape(model), trainer_layout=layout, engine_tp=cfg.rollout.tp,
                   expert_placement=cfg.rollout.expert_placement, ipc=sync_transport(cfg) == "ipc",
                   engine_dtype=DTYPES[cfg.rollout.engine_dtype],
                   trainer_dtype=torch.bfloat16 if cfg.trainer.bf16 or bf16_base else torch.float32,
                   temperature=cfg.rollout.temperature, cfg=cfg.sync, **lora_options(cfg.trainer.lora))
    if isinstance(engine, RolloutFleet):  # one sync fanned out: each replica by the plan, each verified
        colocated = par.placement == "colocated" and not par.rollout_worker  # replica k on trainer ranks k*tp..
        return (ColocatedFleetWeightSync if colocated else FleetWeightSync)(policy, engine, **planned)
    return PlannedWeightSync(policy, engine, colocated=par.placement == "colocated" and not par.rollout_worker,
                             **planned)


def build_scorer_for(cfg: RunConfig, options: GroupOptions | None = None) -> Scorer | None:
    """The run's reward scorer (reward_scorer); none for environments, which reward their own episodes. With an
    agent function (rollout.agent) it scores the answers an agent returns instead of a reward."""
    if cfg.env is not None:
        return None
    groups = None if cfg.parallel.backend == "none" else options or group_options(cfg.parallel)
    return reward_scorer(cfg.reward, cfg.parallel.device, groups, cfg.parallel.reward_workers)


def reward_scorer(reward: RewardConfig, device: str, groups: GroupOptions | None = None,
                  reward_workers: int = 0) -> Scorer:
    """Rule functions run in their reward worker group: one worker inline in this process, or `reward_workers`
    processes of their own (relayrl.roles.rule_scorer), each with its reward pool; reward models (`name: model`
    entries) on `device` (a parallel.device setting), in their worker group: inline in this process without
    worker-group options (`groups`), else in a process of their own (relayrl.roles.reward_model)."""
    entries = model_entries(reward)  # a missing model directory fails here, before any process starts
    # RunConfig allows reward_workers with worker groups only (not with parallel.backend none)
    rules = RuleScorer(reward.rule_config(), reward_workers, groups)
    if not entries:
        return rules
    device = resolve_device(device)  # reward models compute where the trainer does
    try:
        models = ModelScorer(entries, groups, device=device)
    except BaseException:
        rules.close()
        raise
    return CombinedScorer(rules, models, entries, on_failure=reward.on_failure)


def build_agent(cfg: RunConfig, engine: RolloutEngine, model: ModelConfig) -> EpisodeRunner | None:
    """With an `env:` section, the agent loop; with rollout.agent, the agent function's runner and its endpoint: in
    the rollout worker, beside the engine (inline or its own process); on a fleet, in every replica's worker."""
    if not cfg.episodes:
        return None
    if isinstance(engine, RolloutFleet):  # every replica's worker runs its own; the router spreads the examples
        return FleetEpisodes(engine, cfg.env or cfg.rollout, cfg.data, episode_budget(cfg, model))
    assert isinstance(engine, RolloutRole)  # RunConfig refuses env and rollout.agent with the vllm backend
    return EpisodeRole(engine, cfg.env or cfg.rollout)


def episode_budget(cfg: RunConfig, model: ModelConfig) -> int:
    """An episode's tokens at most (prompt + every turn): env.max_total_tokens, rollout.agent_max_total_tokens, or
    the model's length (an agent's own budget, an adapter's parameter, is its worker's to know)."""
    if cfg.env is not None:
        return cfg.env.max_total_tokens
    return cfg.rollout.agent_max_total_tokens or model.max_position_embeddings


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
    """The rollout source of rollout.mode: lockstep (sync) or the stream (one_step_off, async), over one engine or
    over a fleet's replicas (relayrl.roles.fleet_stepper)."""
    common = dict(sampler=sampler, rollout=cfg.rollout, data=cfg.data, seed=cfg.run.seed, scorer=scorer, agent=agent,
                  timer=timer, on_generated=cost.add if cost is not None else None, total_steps=cfg.run.steps)
    if cfg.rollout.mode == "sync":
        return LockstepSource(engine, filter_groups=cfg.algo.filter_groups,
                              max_resample_rounds=cfg.algo.max_resample_rounds,
                              greedy_baseline=advantage_needs_greedy_baseline(cfg.algo.advantage), **common)
    if isinstance(engine, RolloutFleet):  # replicas in rollout workers: stepped together, one advance call each
        return StreamingSource(FleetStepper(engine), **common)
    assert isinstance(engine, RolloutRole)  # RunConfig refuses streaming with vllm, and with one rollout worker
    # the stream steps the engine (and the agent loop) itself, from a thread of the driver, between weight syncs
    common["agent"] = agent.local_agent() if isinstance(agent, EpisodeRole) else None
    name = cfg.env.name if cfg.env else cfg.rollout.agent or ""
    return StreamingSource(engine.local_engine(), env_name=name, **common)


def run_trace_dir(cfg: RunConfig, run_dir: Path) -> str | None:
    """Where the run's processes append their spans (run.trace), or None."""
    return str(trace_dir(run_dir).resolve()) if cfg.run.trace else None


def build_driver(cfg: RunConfig, run_dir: Path) -> tuple[Driver, Roles, list, Path]:
    src = base_model_dir(cfg.model.path, cfg.model.tiny, cfg.data, run_dir)
    model = load_config(src)  # read once: the checks, the engine, the sync plan and the driver share it
    check_fits_model(cfg, model)
    torch.manual_seed(cfg.run.seed)
    train_set, eval_set = build_datasets(cfg.data)
    check_datasets(cfg.data, cfg.model.path, src, {"train": train_set, "eval": eval_set})  # before any process starts
    check_roles(cfg)
    options = group_options(cfg.parallel, run_trace_dir(cfg, run_dir))  # every worker group's
    policy = build_policy(cfg, src, options, engine=colocated_engine(cfg, model))
    engine, sync, scorer, agent, source = None, None, None, None, None
    try:
        engine = build_engine(cfg, src, model, policy, options)
        sync = build_weight_sync(cfg, model, policy, engine)
        scorer = build_scorer_for(cfg, options)
        agent = build_agent(cfg, engine, model)
        timer, cost = StageTimer(), StepCost(cfg, model)
        source = build_source(cfg, engine, scorer, agent, PromptSampler(train_set, cfg.run.seed), timer, cost)
        driver = Driver(LoopSettings.of(cfg), policy=policy, engine=engine, source=source, weight_sync=sync,
                        cost=cost, timer=timer)
    except BaseException:
        try:  # no process outlives a failed start
            close_all(source, agent, sync, scorer, engine, policy)
        except Exception:
            pass
        raise
    return driver, Roles(policy, engine, sync, scorer, agent, source), eval_set, src


def build_policy(cfg: RunConfig, src: Path, options: GroupOptions | None = None,
                 engine: RoleSpec | None = None) -> GroupPolicy:
    """The trainer's worker groups: inline in this process (parallel.backend none, a world of 1) or on local / Ray
    processes; with PPO's critic (algo.advantage gae) beside the actor, laid out like it; with `engine`
    (colocated_engine) the engine's ranks in the actor's processes too."""
    return GroupPolicy(src, par=cfg.parallel, trainer_cfg=cfg.trainer, algo_cfg=cfg.algo, total_steps=cfg.run.steps,
                       temperature=cfg.rollout.temperature, seed=cfg.run.seed, with_reference=cfg.algo.kl_coef > 0,
                       critic_cfg=cfg.critic, options=options, colocated_engine=engine)
