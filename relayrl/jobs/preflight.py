"""The checks `relayrl train` makes before it starts: a run's config against itself, this machine and the model,
each refusal one line that names the key to change, so that no bad layout is found inside the workers.

    check_start(cfg, run_dir, resume)  before anything is written: a new run does not overwrite one, a resume
                                       does not change the model (model.*: relayrl.jobs.run_dir), the metrics
                                       loggers' packages are installed, the sync transport fits the device
                                       and backend (sync_transport, which also resolves `auto`)
    check_fits_model(cfg, model)       once the model's config is read, before any process starts: the
                                       trainer's and the engine's tensor-parallel degrees (and Ulysses' cp)
                                       against the heads, the MoE settings (check_fits_experts), the pipeline
                                       stages (check_fits_stages), an episode's budget against the model's length,
                                       the engines (rollout.replicas of rollout.tp ranks) against the machine's
                                       memory (check_fits_machine)
    check_roles(cfg)                   before any process starts: the environment builds, the reward models'
                                       directories exist

It may import every layer below the CLI (what it checks is theirs), and must never import relayrl.cli or the
train job (relayrl.jobs.train), which calls it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from relayrl.controller.config import RunConfig, load_run_config
from relayrl.engine.moe import check_expert_placement, dense_intermediate
from relayrl.engine.parallel_state import check_tp
from relayrl.envs.base import make_env
from relayrl.errors import ConfigError, UserError
from relayrl.jobs.run_dir import check_resume_model
from relayrl.models.config import ModelConfig, MoEShape
from relayrl.observe.loggers import require_loggers
from relayrl.parallel.context_parallel import check_ulysses_heads
from relayrl.parallel.device import resolve_device
from relayrl.parallel.expert_parallel import check_experts_divide
from relayrl.parallel.pipeline_stages import SCHEDULE_STAGES
from relayrl.parallel.tensor_parallel import check_tp_divisibility
from relayrl.planner.kv import engine_weight_bytes
from relayrl.planner.moe import plan_shape
from relayrl.planner.rollout import GIB
from relayrl.roles.reward_model import model_entries


def check_start(cfg: RunConfig, run_dir: Path, resume: bool) -> None:
    """Before anything is written (see the module docstring)."""
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise UserError(f"{run_dir} already holds a run; resume it with --resume {run_dir} or set run.out_dir to a "
                        "new directory")
    if resume and (run_dir / "config.yaml").is_file():  # the checkpoints hold the saved model's weights
        check_resume_model(load_run_config(run_dir / "config.yaml").model.to_dict(), cfg.model.to_dict())
    require_loggers(cfg.run.sinks)  # a missing wandb / mlflow package
    sync_transport(cfg)  # parallel.device=cuda without a GPU, ipc off CUDA


def sync_transport(cfg: RunConfig) -> str:
    """gloo or ipc: how the sync's buckets cross between processes (sync.transport; auto is ipc on CUDA with local
    processes, which see the same devices under the same numbers; Ray gives each worker a view of its own)."""
    transport, device = cfg.sync.transport, resolve_device(cfg.parallel.device)
    if transport == "ipc" and device != "cuda":
        raise ConfigError(f"sync.transport=ipc shares CUDA memory between processes; with parallel.device={device} "
                          "set sync.transport=gloo or auto")
    if transport == "ipc" and cfg.parallel.backend == "ray":
        raise ConfigError("sync.transport=ipc needs the processes of one machine (parallel.backend local or none); "
                          "with parallel.backend=ray set sync.transport=gloo or auto")
    if transport == "auto":
        return "ipc" if device == "cuda" and cfg.parallel.backend != "ray" else "gloo"
    return transport


def check_roles(cfg: RunConfig) -> None:
    """The roles' own inputs, before any process starts."""
    if cfg.env is not None:
        make_env(cfg.env)  # an unknown environment, bad params or a missing sandbox
    if cfg.rollout.agent is not None:  # an agent that cannot be loaded, or takes arguments relayrl does not pass
        from relayrl.serve.agents import resolve_agent  # the serve layer (the web stack) only for agent runs

        resolve_agent(cfg.rollout.agent, cfg.rollout.agent_params)
    model_entries(cfg.reward)  # a missing reward-model directory


def check_fits_model(cfg: RunConfig, model: ModelConfig) -> None:
    """Layout against the model, before any process starts (one line naming the key, not an error
    found inside the workers): the trainer's and the engine's tensor-parallel degrees must divide the
    heads, KV heads, intermediate size (and, for the trainer's vocab-parallel logprobs, the vocabulary);
    an episode's token budget must fit the model's maximum length."""
    try:
        check_tp_divisibility(model, cfg.parallel.tp)
    except ConfigError as e:
        raise ConfigError(f"parallel.tp: {e}") from None
    if cfg.parallel.cp > 1 and cfg.parallel.cp_mode == "ulysses":
        try:
            check_ulysses_heads(model.num_attention_heads // cfg.parallel.tp,
                                max(1, model.num_key_value_heads // cfg.parallel.tp), cfg.parallel.cp)
        except ConfigError as e:
            raise ConfigError(f"parallel.cp_mode: {e}") from None
    if cfg.rollout.backend == "relayrl":
        try:
            check_tp(model.num_attention_heads, model.num_key_value_heads, cfg.rollout.tp, dense_intermediate(model))
        except UserError as e:
            raise ConfigError(f"rollout.tp: {e}") from None
    check_fits_experts(cfg, model)
    check_fits_stages(cfg, model)
    if cfg.env is not None and cfg.env.max_total_tokens > model.max_position_embeddings:
        raise ConfigError(f"env.max_total_tokens={cfg.env.max_total_tokens} exceeds the model's maximum length "
                          f"({model.max_position_embeddings} tokens, max_position_embeddings): lower it")
    check_fits_machine(cfg, model)


def machine_memory(device: str) -> tuple[int, str]:
    """The bytes every engine of a run shares at most, and what they are: all the GPUs' memory on CUDA (wherever
    the replicas are placed, they are on these), the machine's physical memory on a CPU."""
    if device == "cuda":
        n = torch.cuda.device_count()
        return sum(torch.cuda.get_device_properties(i).total_memory for i in range(n)), f"its {n} GPUs' memory"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "its physical memory"


def check_fits_machine(cfg: RunConfig, model: ModelConfig, machine: tuple[int, str] | None = None) -> None:
    """relayrl's engines against the machine (`machine`: bytes and what they are; default machine_memory), as the
    plan counts them (relayrl.planner.rollout.fleet_option): rollout.replicas engines of rollout.tp ranks, each rank
    holding its share of the weights in rollout.engine_dtype (relayrl.planner.kv.engine_weight_bytes) and a KV
    cache of rollout.kv_cache_bytes (nothing counted when unset: the engine takes a share of what is free). What
    every engine needs at least must fit the machine's memory, or the run is refused before any process starts."""
    r = cfg.rollout
    if r.backend != "relayrl":
        return
    device = resolve_device(cfg.parallel.device)
    if device == "cuda" and machine is None:  # the engines' GPUs after the trainer's (relayrl.jobs.build.engine_gpus)
        from relayrl.jobs.build import engine_gpus

        engine_gpus(cfg, device)
    weights, kv = engine_weight_bytes(plan_shape(model), r.tp, r.engine_dtype), r.kv_cache_bytes or 0
    replica = r.tp * (weights + kv)
    have, what = machine or machine_memory(device)
    if r.replicas * replica > have:
        raise ConfigError(
            f"rollout.replicas={r.replicas} engines of rollout.tp={r.tp} ranks need {r.replicas * replica / GIB:.2f} "
            f"GiB ({replica / GIB:.2f} GiB each: per rank {weights / GIB:.2f} GiB of {r.engine_dtype} weights + "
            f"rollout.kv_cache_bytes {kv / GIB:.2f} GiB), more than this machine's {have / GIB:.2f} GiB ({what}): "
            "lower rollout.replicas or rollout.kv_cache_bytes (or set rollout.engine_dtype=bfloat16)")


def check_fits_experts(cfg: RunConfig, model: ModelConfig) -> None:
    """The MoE settings against the model, before any process starts: the router's options need experts, and
    parallel.ep and the engine's expert placement must divide them."""
    a = cfg.algo
    if not isinstance(model, MoEShape):
        for key, on in (("algo.routing_replay", a.routing_replay), ("algo.moe_aux_loss_coef", a.moe_aux_loss_coef),
                        ("algo.moe_z_loss_coef", a.moe_z_loss_coef), ("parallel.ep", cfg.parallel.ep > 1)):
            if on:
                raise ConfigError(f"{key} needs an MoE model (experts to route); {model.model_type} is dense: "
                                  f"remove {key}")
        return
    try:
        check_experts_divide(model.num_experts, cfg.parallel.ep)
        if cfg.rollout.backend == "relayrl":
            check_expert_placement(model, cfg.rollout.tp, cfg.rollout.expert_placement)
    except UserError as e:
        raise ConfigError(f"{'parallel.ep' if 'parallel.ep' in str(e) else 'rollout.expert_placement'}: {e}") from None


def check_fits_stages(cfg: RunConfig, model: ModelConfig) -> None:
    """parallel.pp against the model, before any process starts: every stage needs a decoder layer, and the
    stages hold dense layers only."""
    par = cfg.parallel
    if par.pp == 1:
        return
    stages = par.pp * SCHEDULE_STAGES[par.pp_schedule][0]
    if stages > model.num_hidden_layers:
        raise ConfigError(f"parallel.pp={par.pp}: {par.pp_schedule} cuts the model into {stages} stages, but it has "
                          f"{model.num_hidden_layers} decoder layers; lower parallel.pp or pick a schedule with one "
                          "stage per rank (1f1b, gpipe)")
    if isinstance(model, MoEShape):
        raise ConfigError(f"parallel.pp={par.pp}: {model.model_type} is an MoE model, and its routing does not cross "
                          "pipeline stages yet; set parallel.pp=1 (parallel.ep splits its experts)")
