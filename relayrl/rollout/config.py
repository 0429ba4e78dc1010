"""How samples are produced: the batch's shape (prompts per step, group size), sampling, the engine's settings, and
the rollout mode (lockstep, one-step-off, asynchronous; relayrl.rollout.source).

It imports the config base only, so that loading a run's config stays cheap.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from relayrl.config import Config

Dtype = Literal["float32", "bfloat16"]


class RouterConfig(Config):
    """How a fleet's router (relayrl.rollout.router) weighs a replica's cached prefix against the load."""

    # the share of a prompt a replica must hold in its prefix cache (whole KV blocks) for the request to go there
    # rather than to the least loaded replica (SGLang's router: 0.3-0.5)
    cache_threshold: float = Field(0.5, ge=0, le=1)
    # tokens of outstanding work the replica holding the prefix may carry beyond the least loaded one...
    balance_abs: int = Field(256, ge=0)
    # ...or this multiple of the least loaded one's; past both, the request goes to the least loaded replica
    balance_rel: float = Field(1.25, ge=1)


class RolloutConfig(Config):
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=2)  # samples per prompt: a group of one has no baseline
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(16, ge=1)
    stop: list[str] = Field(default_factory=list)
    backend: Literal["relayrl", "vllm"] = "relayrl"  # vllm: GPU machines with vllm installed
    engine_dtype: Dtype = "float32"  # bfloat16: the engine rounds, the trainer keeps fp32 masters
    max_num_seqs: int = Field(256, ge=1)
    block_size: int = Field(16, ge=1)
    kv_cache_bytes: int | None = Field(None, ge=1)  # None: a share of free memory
    enable_prefix_caching: bool = True
    tp: int = Field(1, ge=1)  # the engine's tensor-parallel degree (its ranks: see parallel.placement)
    # engine replicas of rollout.tp ranks each, behind one router (relayrl.roles.fleet): each in a rollout worker of
    # its own (parallel.rollout_worker, placement disaggregated, backend local or ray; any rollout.mode: streaming,
    # the replicas are stepped together under the staleness bound, relayrl.roles.fleet_stepper), or colocated in
    # lockstep: replica k in trainer ranks k*tp..k*tp+tp-1 (relayrl.roles.fleet_colocated)
    replicas: int = Field(1, ge=1)
    # on a Ray cluster (parallel.backend ray, rollout workers): grow the fleet, one replica at a time between steps,
    # up to this many while Ray has room for another (nodes that join); None: the fleet's size changes only by
    # `relayrl fleet RUN_DIR --replicas N` (which also sets this ceiling on a growing fleet)
    replicas_max: int | None = Field(None, ge=1)
    # the CPUs Ray reserves for each replica's rollout worker (with a GPU each on cuda): on a CPU cluster, what one
    # replica uses (its torch threads), so that a node's room counts whole replicas; a fraction packs them
    replica_cpus: float = Field(0.1, gt=0)
    # how many times each replica of a fleet is restarted after its process died or stopped (then the run goes on
    # without it; none left: a checkpoint and a non-zero exit)
    replica_restarts: int = Field(2, ge=0)
    # with replicas > 1: how the router weighs a replica's cached prefix against its load
    router: RouterConfig = Field(default_factory=RouterConfig)
    # MoE models: where the engine's experts sit over its tp ranks, each expert's width sharded (tp) or whole experts
    # per rank (ep; relayrl.engine.moe). The same results either way
    expert_placement: Literal["tp", "ep"] = "tp"
    # free the KV cache (1) or also the weights (2) while the trainer updates; woken (and verified) at the next sync
    sleep_level: int = Field(0, ge=0, le=2)
    # sync: roll out, then train, in turn. async: the engine generates continuously while the trainer
    # updates; a batch is trained at most max_staleness policy versions after the weights that began
    # it (relayrl.rollout.source). one_step_off: async with max_staleness 1, one batch in
    # flight, and weights that change only between batches (no partial rollouts)
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    max_staleness: int = Field(1, ge=0)  # eta, in policy versions (async)
    max_inflight: int | None = Field(None, ge=1)  # groups generating at once (None: what staleness allows)
    # new weights arrive mid-generation (async): in-flight samples keep the KV the old weights computed,
    # or recompute it (prompt and tokens so far) under the new ones
    partial: Literal["keep_kv", "reprefill"] = "keep_kv"
    # an agent function (relayrl.serve.agents): 'pkg.module:run' or 'file.py:run', called per episode with an OpenAI
    # client bound to it; or an adapter: 'verifiers:ENV_ID', 'gym:pkg.module:Class', 'env:NAME'
    agent: str | None = None
    agent_params: dict[str, Any] = Field(default_factory=dict)  # keyword arguments of an adapter
    agent_concurrency: int = Field(64, ge=1)  # episodes in flight at once
    agent_timeout_s: float = Field(300.0, gt=0)  # an episode's deadline, from its start
    agent_max_total_tokens: int | None = Field(None, ge=2)  # an episode's prompt + replies, per call (None: context)

    @property
    def staleness(self) -> int:
        """The bound on the policy versions between a sample's first token and its update."""
        return {"sync": 0, "one_step_off": 1, "async": self.max_staleness}[self.mode]
