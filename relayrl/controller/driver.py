"""The driver runs one RL step, written as a single-machine program.

    sync ──> collect ──────────────> advantage ──> old_logp (+ ref_logp) ──> update
    trainer   the rollout source:     group-        trainer recomputes        clipped loss,
    weights   G scored samples per    normalised    on its own weights;       IS-corrected
    → engine  prompt (relayrl.rollout (GRPO/RLOO)   gap to engine = mismatch  with engine logprobs
              .source)

There is one driver for every rollout mode: sync, one-step-off and async differ only in the rollout source it is
given (relayrl.rollout.source: LockstepSource generates the step's batch when asked; StreamingSource generates
batches beside the update under a staleness bound). With an `env:` section a sample is an episode: the source's
agent loop rewards it, and the loss mask keeps the observations between turns out of the update.

old_logp is recomputed only where it must be: an update that is one optimiser step on the batch (the default:
one PPO epoch, one mini-batch) takes it from its own forward, detached, and reports the mismatch from there
(RunConfig.old_logp_source). An MoE model's samples carry the experts the engine routed each token to
(batch.routing); with algo.routing_replay the trainer's forwards replay them (relayrl.trainer.routing).

Every stage is timed (`time/<stage>`). The driver's state (the step, the sampler's position, the policy version
of each engine weights version) is its own: state_dict() / load_state_dict(), as a checkpoint saves and loads it.

It is typed against the protocols the layers below own (Policy, RolloutEngine, WeightSync, RolloutSource). Like
the rest of the loop's package, it never imports the roles, the jobs or relayrl.cli.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from relayrl.algorithms import mismatch_stats
from relayrl.algorithms.config import AlgoConfig
from relayrl.controller.advantage_step import compute_advantages
from relayrl.controller.config import RunConfig
from relayrl.controller.step_cost import StepCost
from relayrl.engine.protocols import RolloutEngine
from relayrl.observe import StageTimer
from relayrl.rollout.sample import Rollout, Sample
from relayrl.rollout.source import RolloutSource
from relayrl.sync.protocol import WeightSync
from relayrl.trainer.batch import TrainBatch, build_rows, scatter_per_token, scatter_routing
from relayrl.trainer.policy import Policy

STAGES = ("sync", "rollout", "reward", "old_logp", "ref_logp", "update")
CRITIC_STAGES = ("values", "critic_update")  # PPO with a critic


@dataclass(frozen=True)
class LoopSettings:
    """What the loop reads of a run's configuration, and nothing else."""

    algo: AlgoConfig
    group_size: int  # rollout.group_size: samples per prompt, contiguous
    old_logp_source: str  # behaviour | engine | update | recompute (RunConfig.old_logp_source)
    rollout_mode: str  # sync | one_step_off | async: recorded in the checkpoint's loop state
    profile_every: int = 0  # run.profile_every: time the update's collectives every n steps (0: never)
    critic_warmup: int | None = None  # PPO's critic.warmup_updates (the actor holds until then); None: no critic

    @classmethod
    def of(cls, cfg: RunConfig) -> LoopSettings:
        return cls(algo=cfg.algo, group_size=cfg.rollout.group_size, old_logp_source=cfg.old_logp_source(),
                   rollout_mode=cfg.rollout.mode, profile_every=cfg.run.profile_every,
                   critic_warmup=cfg.critic.warmup_updates if cfg.critic is not None else None)


class Driver:
    """The RL loop over its roles, each behind the protocol of the layer that owns it:

        policy       relayrl.trainer.policy.Policy        where the trainer runs (relayrl.roles: in this process
                                                           or over worker groups)
        engine       relayrl.engine.protocols.RolloutEngine   what the source samples from (its pad id, its
                                                           weights version and its counters are the driver's too)
        source       relayrl.rollout.source.RolloutSource  the step's scored groups: lockstep or streaming
        weight_sync  relayrl.sync.protocol.WeightSync     planned + verified (relayrl.roles.weight_sync)

    The driver code is the same for every placement, backend and rollout mode. The source's stages (rollout,
    reward, baseline) are timed on the driver's timer (the one the source was built with: `timer=`)."""

    def __init__(self, settings: LoopSettings, *, policy: Policy, engine: RolloutEngine, source: RolloutSource,
                 weight_sync: WeightSync, cost: StepCost | None = None, timer: StageTimer | None = None):
        self.settings, self.policy, self.engine, self.source = settings, policy, engine, source
        self.cost = cost  # the step's FLOPs and MFU (relayrl.controller.step_cost); None: not counted
        self.weight_sync = weight_sync
        self.step = 0
        self.timer = timer or StageTimer()
        self.policy_versions: dict[int, int] = {}  # engine weights version -> policy version (updates applied)
        self.last_prompts = []  # the prompts of the last trained step, one per group
        self.last_samples: list[Sample] = []  # the last trained step's samples (G per prompt), scored
        self.last_advantages: list[float] = []  # each one's advantage (a per-token one: its mean over the response)
        self._holds: tuple[int, int] | None = None  # (policy version, engine weights version) of the last sync
        self._last_sync: dict[str, float] = {}

    def sync_weights(self) -> dict[str, float]:
        """Move the trainer's weights into the engine by the plan (an engine put to sleep after the last
        rollout wakes up; a streaming source pauses it between two of its steps), then let the canary check what
        the engine now computes. The engine's new weights version is recorded as policy version `step` (the
        updates applied so far).

        Skipped when the engine, awake, already holds policy version `step` (an evaluation synced it, and
        no update came since): the step then reports the figures of the sync that put these weights there, the
        canary's gap included, with sync/skipped 1."""
        if not self.engine.asleep and self._holds == (self.step, self.engine.weights_version):
            return {**self._last_sync, "sync/skipped": 1.0}
        with self.source.weight_update():
            out = self.weight_sync.sync(f"before step {self.step + 1}")
            self.policy_versions[self.engine.weights_version] = self.step
        self._holds = (self.step, self.engine.weights_version)
        self._last_sync = {k: 0.0 if k.startswith("time/") else v for k, v in out.items()}  # a skip takes no time
        return {**out, "sync/skipped": 0.0}

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        with self.timer.stage("sync"):
            sync_metrics = self.sync_weights()
        got = self.source.collect(self.step)
        return self.learn(got.rollout, got.no_signal, t0=t0, extra={**sync_metrics, **got.metrics})

    def state_dict(self) -> dict:
        """What a checkpoint after this step saves of the loop: the step, the sampler at the next untrained prompt
        (a streaming source's admitted batches are regenerated on resume), and a record of the rollouts under way."""
        return {"step": self.step, "sampler": self.source.sampler_state(self.step),
                "rollout_mode": self.settings.rollout_mode, "rollout_stream": self.source.record(self.step)}

    def load_state_dict(self, state: dict) -> None:
        self.source.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
        self.source.start_at(self.step)

    def learn(self, ro: Rollout, no_signal: float, *, t0: float, extra: dict[str, float]) -> dict[str, float]:
        """Advantages, old (proximal) and reference logprobs, the clipped update, and the step's metrics.
        The same for every rollout mode: what differs is only how `ro` was produced."""
        cfg, G, samples = self.settings, self.settings.group_size, ro.samples
        batch = rows_of(samples, self.engine.pad_id)
        rollout_logp, resp = batch.rollout_logp, batch.response_mask
        source = cfg.old_logp_source  # RunConfig.old_logp_source: behaviour | engine | update | recompute
        if source in ("behaviour", "engine"):  # plain PPO, or a verified fp32 engine's own logprobs
            batch.old_logp = rollout_logp
        elif source == "recompute":  # decoupled PPO: the trainer's weights before the update are the proximal policy
            with self.timer.stage("old_logp"):
                batch.old_logp = self.policy.compute_logprobs(batch)
        # "update": left None; the one optimiser step takes its own forward's logprobs (and reports the mismatch)
        if cfg.algo.kl_coef > 0:
            with self.timer.stage("ref_logp"):
                batch.ref_logp = self.policy.compute_ref_logprobs(batch)
        batch.advantages, adv_stats = compute_advantages(cfg.algo, self.policy, batch, ro.rewards, G, self.timer,
                                                         baseline=ro.baseline)
        mismatch = mismatch_stats(batch.old_logp, rollout_logp, resp) if batch.old_logp is not None else {}
        staleness = self.staleness_metrics(ro)
        stats: dict[str, float] = {}
        if batch.values is not None:  # PPO's critic learns from this batch's returns
            with self.timer.stage("critic_update"):
                stats.update({f"critic/{k}": v for k, v in self.policy.update_critic(batch).items()})
        updated = cfg.critic_warmup is None or self.step >= cfg.critic_warmup  # the critic's warm-up: actor holds
        if updated:
            every = cfg.profile_every  # the update's collectives, timed every `every` steps (0: never)
            with self.timer.stage("update"):
                stats.update(self.policy.update(batch, profile=True) if every and (self.step + 1) % every == 0
                             else self.policy.update(batch))
        stages = STAGES + (CRITIC_STAGES if cfg.critic_warmup is not None else ())
        times = {f"time/{s}": 0.0 for s in stages} | self.timer.pop()
        times["time/step"] = time.perf_counter() - t0
        cost = self.cost.metrics(batch, times | extra, updated=updated) if self.cost is not None else {}
        lengths = [sum(s.mask) for s in samples]  # the model's tokens (not a multi-turn episode's observations)
        self.last_prompts = [samples[i].example for i in range(0, len(samples), G)]
        self.last_samples, self.last_advantages = samples, sample_advantages(batch.advantages, resp)
        self.step += 1
        return {
            **ro.reward_metrics,  # reward/mean, reward/accuracy, reward/failures, reward/<fn>/mean
            "reward/std": float(ro.rewards.std()) if len(ro.rewards) > 1 else 0.0,
            "response_length/mean": sum(lengths) / len(lengths),
            "response_length/max": float(max(lengths)),
            "groups/no_signal_frac": no_signal,
            **{k: float(v) for k, v in mismatch.items()},
            **staleness,
            **adv_stats,
            **stats,
            **times,
            **extra,
            # the pipeline's pace: the model's tokens trained per second of step, in every mode
            "throughput/tokens_per_s": sum(lengths) / max(times["time/step"], 1e-9),
            # generation's, where the trainer waited for it (a streaming source generates beside the step, so its
            # wait is not generation time)
            **({} if self.source.streaming else
               {"throughput/gen_tokens_per_s": sum(lengths) / max(times["time/rollout"], 1e-9)}),
            **self._engine_stats(),
            **cost,  # flops/*, rollout/straggler_share, throughput/mfu_* and the peaks
        }

    def staleness_metrics(self, ro: Rollout) -> dict[str, float]:
        """How many policy versions behind the one being updated each of the model's tokens was sampled:
        staleness/mean and /max over tokens, staleness/tokens_at_<d> per distance d."""
        ages: dict[int, int] = {}
        for s in ro.samples:
            for v, m in zip(s.versions, s.mask, strict=True):
                if m:
                    age = self.step - self.policy_versions.get(v, self.step)
                    ages[age] = ages.get(age, 0) + 1
        n = max(sum(ages.values()), 1)
        return {"staleness/mean": sum(a * c for a, c in ages.items()) / n,
                "staleness/max": float(max(ages, default=0)),
                **{f"staleness/tokens_at_{a}": float(c) for a, c in sorted(ages.items())}}

    def _engine_stats(self) -> dict[str, float]:
        """The engine's prefix-cache and block figures for this step (the vLLM backend has none: {})."""
        with self.source.quiet():
            stats = self.engine.stats()
            self.engine.reset_stats()
        return stats


def sample_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> list[float]:
    """Each sample's advantage: itself ([B]), or its mean over the response's tokens ([B, T], PPO's GAE)."""
    if advantages.dim() == 1:
        return advantages.tolist()
    mask = response_mask.to(advantages.dtype)
    return ((advantages * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()


def rows_of(samples: list[Sample], pad_id: int) -> TrainBatch:
    """The samples batched: rows [prompt | response | padding] with the engine's logprobs at their tokens and
    (MoE, when every sample kept one) the engine's routing, what algo.routing_replay replays."""
    prompts = [s.prompt_ids for s in samples]
    ids, attn, resp = build_rows(prompts, [s.response_ids for s in samples], pad_id=pad_id,
                                 masks=[s.mask for s in samples])
    batch = TrainBatch(ids, attn, resp, rollout_logp=scatter_per_token([s.logprobs for s in samples], prompts,
                                                                       ids.shape[1]))
    if samples and all(s.routing is not None for s in samples):
        batch.routing = scatter_routing([s.routing for s in samples], ids.shape[1])
    return batch
