"""RunConfig describes the whole job; it is composed of each layer's own config section.

    model:    where the policy comes from (a Hugging Face directory, or the tiny model of the task)
    data:     relayrl.data.DataConfig        reward:  relayrl.rewards.RewardConfig
    algo:     relayrl.algorithms.AlgoConfig  trainer: relayrl.trainer.TrainerConfig
    rollout:  relayrl.rollout.config.RolloutConfig   eval: held-out evaluation
    env:      relayrl.envs.EnvConfig (optional): multi-turn episodes in an environment
    run:      steps, seed, output, checkpoints

It loads from YAML with dotted overrides (`trainer.lr=1e-4`); every error names the key. This module
imports config modules (and the registries their names are checked against) only; it must never import
the engine, trainer, checkpoint, sync or worker-group code, nor relayrl.cli, so that loading a RunConfig
stays cheap (tests/test_layering.py checks it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from relayrl.algorithms.config import AlgoConfig
from relayrl.config import Config, apply_overrides, load_yaml
from relayrl.data.config import DataConfig
from relayrl.envs.config import EnvConfig
from relayrl.models.config import TinyModelConfig
from relayrl.parallel.config import ParallelConfig
from relayrl.rewards.config import RewardConfig
from relayrl.rollout.config import RolloutConfig
from relayrl.sync.config import SyncConfig
from relayrl.trainer.config import CriticConfig, TrainerConfig


class ModelSection(Config):
    path: str | None = None  # a Hugging Face directory or a .gguf file (converted once); None: the task's tiny model
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)


class EvalConfig(Config):
    every: int = Field(0, ge=0)  # also before the first and after the last step; 0: only those
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0)  # 0: greedy, so accuracy is a property of the policy


class RunSection(Config):
    RENAMED = {"tensorboard": "list the loggers in run.loggers (loggers: [] for none beside metrics.jsonl)"}

    steps: int = Field(20, ge=1)
    seed: int = 0
    out_dir: str = "runs/grpo"
    save_every: int = Field(0, ge=0)  # 0: only at the end
    keep_last: int | None = Field(2, ge=1)
    # where metrics go besides metrics.jsonl (relayrl.observe.loggers): tensorboard, wandb (offline), mlflow
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["tensorboard"])
    wandb_project: str = "relayrl"
    wandb_name: str | None = None  # None: the name of run.out_dir
    mlflow_tracking_uri: str | None = None  # None: a file store in run_dir/mlruns
    mlflow_experiment: str = "relayrl"
    # spans of every stage and every worker call, per process, in run_dir/trace/ (`relayrl report RUN --trace`
    # merges them into one Perfetto timeline); a few microseconds per span
    trace: bool = True
    # what the model said (samples.jsonl, and a table in each logger: relayrl.observe.samples): every evaluation's
    # completions, and every this many steps the first samples_per_step samples the step trained on (0: none)
    samples_every: int = Field(10, ge=0)
    samples_per_step: int = Field(16, ge=1)
    # every this many steps the update runs under torch.profiler on trainer rank 0, which logs the seconds its
    # collectives ran (time/update_comm, comm/update_share: relayrl.observe.comm_profile); 0: never
    profile_every: int = Field(10, ge=0)

    @property
    def sinks(self) -> list[str]:
        """The loggers that run: run.loggers, each once."""
        return list(dict.fromkeys(self.loggers))


class RunConfig(Config):
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunSection = Field(default_factory=RunSection)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    env: EnvConfig | None = None
    critic: CriticConfig | None = None  # PPO's value model (algo.advantage: gae)

    @model_validator(mode="after")
    def _critic_fits(self) -> RunConfig:
        if self.algo.advantage == "gae" and self.critic is None:
            self.critic = CriticConfig()  # the defaults: from the policy, a zero head, trainer.* defaults
        if self.critic is not None and self.algo.advantage != "gae":
            raise ValueError(f"critic: a value model is trained only for algo.advantage=gae (got "
                             f"'{self.algo.advantage}'); remove the critic section or set algo.advantage=gae")
        return self

    @property
    def episodes(self) -> bool:
        """Multi-turn episodes: an environment (env:) or an agent function (rollout.agent)."""
        return self.env is not None or self.rollout.agent is not None

    @model_validator(mode="after")
    def _agent_fits(self) -> RunConfig:
        if self.rollout.agent is None:
            return self
        if self.env is not None:
            raise ValueError("rollout.agent runs your agent function's episodes, env: relayrl's own agent loop; set "
                             "one of them (an environment through the endpoint: rollout.agent=env:NAME)")
        if self.rollout.backend != "relayrl":
            raise ValueError("rollout.agent serves relayrl's engine to the agent, stepped between weight syncs; set "
                             "rollout.backend=relayrl")
        if self.algo.routing_replay:
            raise ValueError("algo.routing_replay replays the engine's routing record, which agent episodes "
                             "(rollout.agent) do not carry yet; set algo.routing_replay=false")
        return self

    @model_validator(mode="after")
    def _env_fits(self) -> RunConfig:
        if self.env is None:
            return self
        if self.rollout.backend != "relayrl":
            raise ValueError("env: multi-turn episodes drive relayrl's engine step by step; "
                             "set rollout.backend=relayrl")
        if self.data.chat_template == "never":
            raise ValueError("env: episodes are conversations, rendered through the chat template; "
                             "set data.chat_template=auto (or always)")
        return self

    @model_validator(mode="after")
    def _parallel_fits(self) -> RunConfig:
        p = self.parallel
        if p.backend == "none" and (p.world_size > 1 or p.rollout_worker or p.reward_workers):
            raise ValueError("worker groups (parallel degrees > 1, parallel.rollout_worker, parallel.reward_workers) "
                             "need parallel.backend=local (or ray)")
        if p.rollout_worker and self.rollout.backend != "relayrl":
            raise ValueError("parallel.rollout_worker runs relayrl's engine; the vllm backend manages its own workers")
        if self.rollout.backend == "vllm" and (self.rollout.sleep_level or self.rollout.tp > 1):
            raise ValueError("rollout.sleep_level and rollout.tp are relayrl engine settings; the vllm backend "
                             "takes its own")
        if self.rollout.backend == "relayrl" and p.placement == "colocated":
            if p.rollout_worker:
                raise ValueError("parallel.rollout_worker puts the engine in a process of its own: "
                                 "set parallel.placement=disaggregated")
            trainer_procs = 1 if p.backend == "none" else p.world_size
            if self.rollout.tp > trainer_procs:
                raise ValueError(f"colocated, the engine's {self.rollout.tp} tensor-parallel ranks run in the "
                                 f"trainer's {trainer_procs} process(es): lower rollout.tp, raise the trainer's "
                                 "degrees (parallel.backend=local), or set parallel.placement=disaggregated")
        return self

    @model_validator(mode="after")
    def _replicas_fit(self) -> RunConfig:
        r, p = self.rollout, self.parallel
        if r.replicas_max is not None:
            grow = f"rollout.replicas_max={r.replicas_max} grows a fleet of rollout workers on a Ray cluster"
            if r.replicas_max < r.replicas:
                raise ValueError(f"{grow}: it must be at least rollout.replicas={r.replicas}")
            if not (p.backend == "ray" and p.rollout_worker and p.placement == "disaggregated"):
                raise ValueError(f"{grow} (as its nodes join): set parallel.backend=ray parallel.rollout_worker=true "
                                 "parallel.placement=disaggregated; on local processes resize a live run with "
                                 "`relayrl fleet RUN_DIR --replicas N`")
        if r.replicas == 1 and r.replicas_max is None:
            return self
        if p.placement == "colocated" and not p.rollout_worker and r.backend == "relayrl":
            return self._colocated_replicas_fit()
        needs = {"parallel.backend=local (or ray)": p.backend in ("local", "ray"), "parallel.placement=disaggregated":
                 p.placement == "disaggregated", "parallel.rollout_worker=true": p.rollout_worker,
                 "rollout.backend=relayrl": r.backend == "relayrl"}
        missing = [k for k, ok in needs.items() if not ok]
        if missing:
            raise ValueError(f"rollout.replicas={r.replicas} runs each engine replica in a rollout worker of its own "
                             f"(local processes or Ray actors): set {', '.join(missing)} (or "
                             "rollout.replicas=1)")
        if self.episodes and r.mode != "sync":  # each replica's worker runs its own agent loop, in lockstep
            raise ValueError(f"rollout.replicas={r.replicas} runs multi-turn episodes (env:, rollout.agent) on its "
                             "replicas' agent loops in lockstep: set rollout.mode=sync (or rollout.replicas=1)")
        return self

    def _colocated_replicas_fit(self) -> RunConfig:
        """Colocated, replica k's rollout.tp ranks live in trainer ranks k*tp..k*tp+tp-1
        (relayrl.roles.fleet_colocated), on local processes or Ray actors, in lockstep."""
        r, p = self.rollout, self.parallel
        ranks = r.replicas * r.tp
        trainer_ranks = 1 if p.backend == "none" else p.world_size
        where = (f"rollout.replicas={r.replicas} colocated puts replica k's rollout.tp={r.tp} rank(s) in trainer ranks "
                 f"k*{r.tp}.., {ranks} in all")
        instead = ("; or give each replica a rollout worker of its own: parallel.placement=disaggregated "
                   "parallel.rollout_worker=true (or rollout.replicas=1)")
        if p.backend == "none":
            raise ValueError(f"{where}: set parallel.backend=local (or ray) with at least {ranks} trainer "
                             f"ranks{instead}")
        if ranks > trainer_ranks:
            raise ValueError(f"{where}, but the trainer has {trainer_ranks}: raise the trainer's degrees to "
                             f"{ranks} ranks or lower rollout.replicas{instead}")
        if r.mode != "sync":
            raise ValueError(f"{where}: set rollout.mode=sync{instead}")
        if self.episodes:
            raise ValueError(f"{where}: multi-turn episodes (env:, rollout.agent) on a fleet run in its replicas' "
                             f"rollout workers{instead}")
        return self

    @model_validator(mode="after")
    def _async_fits(self) -> RunConfig:
        r, p = self.rollout, self.parallel
        if r.mode == "sync":
            return self
        why = f"rollout.mode={r.mode} steps relayrl's engine from the driver while the trainer updates"
        if r.backend != "relayrl":
            raise ValueError(f"{why}; set rollout.backend=relayrl")
        if p.rollout_worker and r.replicas == 1:  # a fleet's replicas are stepped by relayrl.roles.fleet_stepper
            raise ValueError(f"{why}; drop parallel.rollout_worker and set parallel.placement=disaggregated "
                             "(the engine's ranks then run in a worker group of their own), or run rollout.replicas "
                             "> 1 engines in rollout workers")
        if p.backend != "none" and p.placement == "colocated":
            raise ValueError(f"{why}; colocated, its ranks share the trainer's processes and nothing overlaps: "
                             "set parallel.placement=disaggregated")
        if r.sleep_level:
            raise ValueError(f"{why}, so it never sleeps; set rollout.sleep_level=0")
        if self.algo.filter_groups:
            raise ValueError(f"rollout.mode={r.mode} does not resample groups yet; set algo.filter_groups=false "
                             "or rollout.mode=sync")
        if self.algo.advantage == "remax":
            raise ValueError(f"rollout.mode={r.mode} does not run ReMax's greedy baseline rollouts yet; "
                             "set rollout.mode=sync or another algo.advantage")
        return self

    @model_validator(mode="after")
    def _routing_replay_fits(self) -> RunConfig:
        if not self.algo.routing_replay:
            return self
        if self.env is not None:
            raise ValueError("algo.routing_replay replays the engine's routing record, which multi-turn episodes "
                             "(env:) do not carry yet; set algo.routing_replay=false")
        if self.rollout.backend != "relayrl":
            raise ValueError("algo.routing_replay needs the routing relayrl's engine records; set "
                             "rollout.backend=relayrl or algo.routing_replay=false")
        return self

    @model_validator(mode="after")
    def _old_logp_fits(self) -> RunConfig:
        if self.algo.old_logp != "engine":
            return self
        why = "algo.old_logp=engine trains against the engine's logprobs, equal to the trainer's only for an"
        if self.algo.proximal != "recompute":
            raise ValueError("algo.old_logp chooses how the proximal policy is computed; with algo.proximal="
                             f"{self.algo.proximal} there is none: drop algo.old_logp")
        if self.rollout.mode != "sync":
            raise ValueError(f"{why} engine synced before every batch: set rollout.mode=sync or algo.old_logp=auto")
        if self.rollout.engine_dtype != "float32" or self.rollout.backend != "relayrl" or self.trainer.bf16:
            raise ValueError(f"{why} fp32 relayrl engine and an fp32 trainer (the canary's tight bound): set "
                             "rollout.engine_dtype=float32, rollout.backend=relayrl and trainer.bf16=false, or "
                             "algo.old_logp=auto")
        return self

    def old_logp_source(self) -> str:
        """Where a step's proximal logprobs (old_logp) come from:

            behaviour   algo.proximal=behaviour: the engine's sampling logprobs (plain PPO)
            engine      algo.old_logp=engine: the same tensors, from an fp32 engine verified at every sync
            update      the update's own forward, detached (algo.old_logp=auto on a one-step update: trainer
                        ppo_epochs 1 and mini_batches 1, so the weights are those of the recompute; no LoRA
                        dropout, so the forward is the same function in train mode; no kl_in_reward and no
                        critic, so nothing needs them before the update)
            recompute   a no-grad forward before the update (any other case, or algo.old_logp=recompute)"""
        a, t = self.algo, self.trainer
        if a.proximal == "behaviour":
            return "behaviour"
        if a.old_logp == "engine":
            return "engine"
        one_step = t.ppo_epochs == 1 and t.mini_batches == 1
        dropout = t.lora is not None and t.lora.dropout > 0
        if a.old_logp == "auto" and one_step and not dropout and not a.kl_in_reward and self.critic is None:
            return "update"
        return "recompute"

    @model_validator(mode="after")
    def _lora_fits(self) -> RunConfig:
        lora = self.trainer.lora
        if lora is not None and lora.dropout > 0 and self.parallel.tp > 1:
            # each TP rank would draw its own dropout mask on the replicated input of a colwise linear
            raise ValueError(f"trainer.lora.dropout={lora.dropout} with parallel.tp={self.parallel.tp}: the TP ranks "
                             "would drop different inputs; set trainer.lora.dropout=0 or parallel.tp=1")
        return self

    @model_validator(mode="after")
    def _cp_fits(self) -> RunConfig:
        """parallel.cp > 1 shards padded rows over the sequence, in worker processes, for the actor and reference."""
        cp, p = self.parallel.cp, self.parallel
        if cp == 1:
            return self
        refusals = [
            (p.dp_mode != "fsdp", "its gradients are summed by FSDP over dp_shard x cp", "set parallel.dp_mode=fsdp"),
            (self.trainer.padding_free, "it shards padded rows over the sequence",
             "set trainer.padding_free=false"),
            (self.critic is not None, "the critic does not shard its rows over cp", "use cp with GRPO-style runs"),
            (self.trainer.lora is not None, "LoRA is not wired with it", "remove trainer.lora or set parallel.cp=1"),
            (self.algo.routing_replay, "the replayed routing is not sharded over cp",
             "set algo.routing_replay=false or parallel.cp=1"),
            (p.pp > 1 or p.ep > 1, "pipeline and expert parallelism are not combined with it",
             "set parallel.pp=1 and parallel.ep=1"),
        ]
        _refuse(f"parallel.cp={cp}", refusals)
        return self

    @model_validator(mode="after")
    def _pp_fits(self) -> RunConfig:
        """parallel.pp > 1 runs padded rows through the stages, in worker processes, for the actor and reference."""
        pp, p = self.parallel.pp, self.parallel
        if pp == 1:
            return self
        refusals = [
            (self.trainer.padding_free, "its stages run padded rows", "set trainer.padding_free=false"),
            (p.dp_mode != "fsdp" and p.dp_replicate * p.dp_shard > 1,
             "its stages are data-parallel by FSDP", "set parallel.dp_mode=fsdp"),
            (self.critic is not None, "the critic is not split into stages", "use pp with GRPO-style runs"),
            (self.trainer.lora is not None, "LoRA is not wired with it", "remove trainer.lora or set parallel.pp=1"),
            (self.algo.uses_router, "MoE routing does not cross stages yet (a dense model only)",
             "set parallel.pp=1 for MoE models"),
            (p.cp > 1 or p.ep > 1, "context and expert parallelism are not combined with it",
             "set parallel.cp=1 and parallel.ep=1"),
        ]
        _refuse(f"parallel.pp={pp}", refusals)
        return self

    @model_validator(mode="after")
    def _batch_fits(self) -> RunConfig:
        n = self.rollout.prompts_per_step * self.rollout.group_size
        if self.trainer.mini_batches > n:
            raise ValueError(
                f"trainer.mini_batches ({self.trainer.mini_batches}) exceeds the sequences per step "
                f"(rollout.prompts_per_step x rollout.group_size = {n})"
            )
        return self


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    data = load_yaml(path) if path is not None else {}
    return RunConfig.from_dict(apply_overrides(data, list(overrides)))


def _refuse(setting: str, refusals: list[tuple[bool, str, str]]) -> None:
    """The first (bad, why, fix) that holds, as one line: "<setting>: <why>; <fix>"."""
    for bad, why, fix in refusals:
        if bad:
            raise ValueError(f"{setting}: {why}; {fix}")
