"""The driver runs one RL step, written as a single-machine program.

    sync ──> rollout ──> reward ──> advantage ──> old_logp (+ ref_logp) ──> update
    trainer   engine:     scorer:    group-        trainer recomputes        clipped loss,
    weights   G samples   rewards,   normalised    on its own weights;       IS-corrected
    → engine  per prompt  accuracy   (GRPO/RLOO)   gap to engine = mismatch  with engine logprobs

old_logp is recomputed only where it must be: an update that is one optimiser step on the batch (the default:
one PPO epoch, one mini-batch) takes it from its own forward, detached, and reports the mismatch from there
(RunConfig.old_logp_source).

An MoE model's samples carry the experts the engine routed each token to (batch.routing); with
algo.routing_replay the trainer's forwards replay them (relayrl.trainer.routing).

With an `env:` section a sample is an episode (relayrl.rollout.agent_loop): rollout and reward are one
stage, the environment's, and the loss mask keeps the observations between turns out of the update.

Every stage is timed (`time/<stage>`). Sampling seeds derive from (run seed, step, round, prompt),
so a run resumed from a checkpoint draws exactly the samples the uninterrupted run drew.

It is typed against the protocols the layers below own (Policy, RolloutEngine, Scorer, WeightSync). Like the
rest of the loop's package, it never imports the roles, the jobs or relayrl.cli.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace

import torch

from relayrl.algorithms import group_has_signal, mismatch_stats
from relayrl.algorithms.registry import advantage_needs_greedy_baseline
from relayrl.controller.advantage_step import compute_advantages
from relayrl.controller.config import RunConfig
from relayrl.controller.step_cost import StepCost
from relayrl.data import Example, PromptSampler
from relayrl.engine.outputs import CompletionSample, RequestOutput
from relayrl.engine.protocols import RolloutEngine
from relayrl.engine.sampling_params import SamplingParams
from relayrl.envs.episode import Trajectory
from relayrl.errors import DataError
from relayrl.models.config import ModelShape
from relayrl.observe import StageTimer
from relayrl.rewards.protocol import Scorer
from relayrl.rewards.result import ScoreResult
from relayrl.rollout.agent_loop import EpisodeRunner, episode_metrics
from relayrl.rollout.prompts import encode_prompt
from relayrl.sync.protocol import WeightSync
from relayrl.trainer.batch import TrainBatch, build_rows, scatter_per_token, scatter_routing
from relayrl.trainer.policy import Policy

STAGES = ("sync", "rollout", "reward", "old_logp", "ref_logp", "update")
CRITIC_STAGES = ("values", "critic_update")  # PPO with a critic


@dataclass(kw_only=True)
class Rollout:
    """G samples for each of a set of prompts (samples of one prompt are contiguous)."""

    examples: list[Example]  # one per sample
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logp: list[list[float]]
    texts: list[str]
    rewards: torch.Tensor
    correct: list[bool]
    reward_metrics: dict[str, float]
    response_mask: list[list[int]]  # 1 on the model's tokens; 0 on a multi-turn episode's observations
    versions: list[list[int]]  # per response token, the engine's weights version that sampled it (-1: observed)
    baseline: torch.Tensor | None = None  # ReMax: the reward of each prompt's greedy sample, [prompts]
    # MoE: per sample the engine's routing record [prompt + response tokens, n_moe, k] (relayrl.engine.routing);
    # None where it keeps none (a dense model, an episode; [] when no sample has one)
    routing: list[torch.Tensor | None] = field(default_factory=list)

    LISTS = ("examples", "prompt_ids", "response_ids", "rollout_logp", "texts", "correct",
             "response_mask", "versions")  # one item per sample (and routing, when it is kept)

    def select_groups(self, groups: list[int], G: int) -> Rollout:
        idx = [g * G + j for g in groups for j in range(G)]
        picked = {name: [getattr(self, name)[i] for i in idx] for name in self.LISTS}
        baseline = self.baseline[groups] if self.baseline is not None else None
        return Rollout(**picked, rewards=self.rewards[idx], reward_metrics=self.reward_metrics, baseline=baseline,
                       routing=[self.routing[i] for i in idx] if self.routing else [])

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        joined = {name: [x for p in parts for x in getattr(p, name)] for name in Rollout.LISTS}
        baseline = torch.cat([p.baseline for p in parts]) if parts[0].baseline is not None else None
        routing = [x for p in parts for x in p.routing] if all(p.routing for p in parts) else []
        return Rollout(**joined, rewards=torch.cat([p.rewards for p in parts]), reward_metrics=parts[0].reward_metrics,
                       baseline=baseline, routing=routing)


def prompt_budget(ex: Example | None):
    """A prompt's own `max_tokens`: a dataset file's column (meta["fields"]) or a generated task's meta."""
    if ex is None or not isinstance(ex.meta, dict):
        return None
    fields = ex.meta.get("fields")
    if isinstance(fields, dict) and "max_tokens" in fields:
        return fields["max_tokens"]
    return ex.meta.get("max_tokens")


def sample_versions(out: RequestOutput, sample: CompletionSample) -> list[int]:
    """The weights version of each of a sample's tokens (the output's version when the engine keeps none)."""
    return list(getattr(sample, "versions", None) or [out.weights_version] * len(sample.token_ids))


def trajectory_versions(t: Trajectory) -> list[int]:
    return list(getattr(t, "versions", None) or [-1] * len(t.response_ids))


def rollout_from_outputs(examples: list[Example], outs: list[RequestOutput], res: ScoreResult) -> Rollout:
    """One engine output per example (its G samples, contiguous) and their scores: a Rollout."""
    samples = [(ex, o, s) for ex, o in zip(examples, outs, strict=True) for s in o.samples]
    return Rollout(examples=[ex for ex, _, _ in samples], prompt_ids=[o.prompt_token_ids for _, o, _ in samples],
                   response_ids=[s.token_ids for _, _, s in samples],
                   rollout_logp=[s.logprobs for _, _, s in samples], texts=[s.text for _, _, s in samples],
                   rewards=torch.tensor(res.rewards, dtype=torch.float32), correct=res.correct,
                   reward_metrics=res.metrics(), response_mask=[[1] * len(s.token_ids) for _, _, s in samples],
                   versions=[sample_versions(o, s) for _, o, s in samples],
                   routing=[s.routing for _, _, s in samples])


def rollout_from_trajectories(examples: list[Example], trajs: list[Trajectory]) -> Rollout:
    """G finished episodes per example (contiguous), each rewarded by its environment: a Rollout."""
    G = len(trajs) // max(len(examples), 1)
    return Rollout(examples=[ex for ex in examples for _ in range(G)],
                   prompt_ids=[t.prompt_ids for t in trajs], response_ids=[t.response_ids for t in trajs],
                   rollout_logp=[t.logprobs for t in trajs], texts=[t.last_text for t in trajs],
                   rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
                   correct=[t.success for t in trajs], reward_metrics=episode_metrics(trajs),
                   response_mask=[t.mask for t in trajs], versions=[trajectory_versions(t) for t in trajs])


class Driver:
    """The RL loop over its roles, each behind the protocol of the layer that owns it:

        policy       relayrl.trainer.policy.Policy        where the trainer runs (LocalPolicy in this
                                                           process, GroupPolicy over worker groups)
        engine       relayrl.engine.protocols.RolloutEngine
        scorer       relayrl.rewards.protocol.Scorer      single-turn rewards
        agent        relayrl.rollout.agent_loop.EpisodeRunner   with an `env:` section: multi-turn
                                                           episodes, rewarded by their environment
        weight_sync  relayrl.sync.protocol.WeightSync     planned + verified (relayrl.roles.weight_sync)

    The driver code is the same for every placement and backend."""

    def __init__(self, cfg: RunConfig, *, policy: Policy, engine: RolloutEngine, scorer: Scorer | None,
                 sampler: PromptSampler, weight_sync: WeightSync, agent: EpisodeRunner | None = None,
                 model: ModelShape | None = None):
        self.cfg, self.policy, self.engine, self.scorer, self.sampler = cfg, policy, engine, scorer, sampler
        # the model's shape gives the step's FLOPs and MFU (relayrl.controller.step_cost); None: not counted
        self.cost = StepCost(cfg, model) if model is not None else None
        self.old_logp_source = cfg.old_logp_source()
        self.weight_sync, self.agent = weight_sync, agent
        self.step = 0
        self.timer = StageTimer()
        self.policy_versions: dict[int, int] = {}  # engine weights version -> policy version (updates applied)
        self.last_prompts: list[Example] = []  # the prompts of the last trained step, one per group

    def sync_weights(self) -> dict[str, float]:
        """Move the trainer's weights into the engine by the plan (an engine put to sleep after the last
        rollout wakes up), then let the canary check what the engine now computes. The engine's new
        weights version is recorded as policy version `step` (the updates applied so far)."""
        out = self.weight_sync.sync(f"before step {self.step + 1}")
        self.policy_versions[self.engine.weights_version] = self.step
        return out

    def _params(self, step: int, round_: int, i: int, ex: Example | None = None) -> SamplingParams:
        """Sampling settings of prompt i of a step's round. A prompt whose row sets `max_tokens` (a dataset
        file's column, or a task's meta) gets that budget, never more than rollout.max_tokens."""
        r = self.cfg.rollout
        seed = ((self.cfg.run.seed * 1_000_003 + step) * 101 + round_) * 100_003 + i
        own = prompt_budget(ex)
        if own is not None and (isinstance(own, bool) or not isinstance(own, int) or own < 1):
            raise DataError(f"a prompt's max_tokens must be a whole number >= 1, got {own!r} "
                            f"(prompt: {ex.prompt!r:.60})")
        max_tokens = min(own, r.max_tokens) if own is not None else r.max_tokens
        return SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=max_tokens, stop=list(r.stop), seed=seed)

    def rollout(self, examples: list[Example], round_: int = 0) -> Rollout:
        ro = self._episodes(examples, round_) if self.agent is not None else self._samples(examples, round_)
        if advantage_needs_greedy_baseline(self.cfg.algo.advantage):
            with self.timer.stage("baseline"):
                ro.baseline = self.greedy_rewards(examples, round_)
        return ro

    def greedy_rewards(self, examples: list[Example], round_: int) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy (temperature 0) sample of each prompt, scored like the rest."""
        params = [replace(self._params(self.step, round_, i, ex), n=1, temperature=0.0)
                  for i, ex in enumerate(examples)]
        if self.agent is not None:
            return torch.tensor([t.reward for t in self.agent.run(examples, params)], dtype=torch.float32)
        prompts = [encode_prompt(self.engine.tokenizer, ex, self.cfg.data) for ex in examples]
        outs = self.engine.generate(prompts, params)
        res = self.scorer.score([o.samples[0].text for o in outs], examples)
        return torch.tensor(res.rewards, dtype=torch.float32)

    def _samples(self, examples: list[Example], round_: int) -> Rollout:
        G = self.cfg.rollout.group_size
        tok = self.engine.tokenizer
        with self.timer.stage("rollout"):
            prompts = [encode_prompt(tok, ex, self.cfg.data) for ex in examples]
            params = [self._params(self.step, round_, i, ex) for i, ex in enumerate(examples)]
            outs = self.engine.generate(prompts, params)
        if self.cost is not None:
            self.cost.add(outs)
        assert sum(len(o.samples) for o in outs) == G * len(examples)
        with self.timer.stage("reward"):
            texts = [smp.text for o in outs for smp in o.samples]
            res = self.scorer.score(texts, [ex for ex in examples for _ in range(G)])
        return rollout_from_outputs(examples, outs, res)

    def _episodes(self, examples: list[Example], round_: int) -> Rollout:
        """G episodes per prompt in the environment; each episode's reward is its environment's."""
        with self.timer.stage("rollout"):
            trajs = self.agent.run(examples, [self._params(self.step, round_, i, ex) for i, ex in enumerate(examples)])
        return rollout_from_trajectories(examples, trajs)

    def collect(self) -> tuple[Rollout, float]:
        """Roll out prompts_per_step prompts; with DAPO dynamic sampling, keep drawing prompts until
        that many groups have reward spread (or the rounds run out). Returns (rollout, no-signal share)."""
        r, algo = self.cfg.rollout, self.cfg.algo
        first = self.rollout(self.sampler.next_batch(r.prompts_per_step))
        signal = group_has_signal(first.rewards, r.group_size)
        no_signal = 1.0 - float(signal.float().mean())
        if not algo.filter_groups:
            return first, no_signal
        kept = [first.select_groups(signal.nonzero().flatten().tolist(), r.group_size)]
        have = int(signal.sum())
        for round_ in range(1, algo.max_resample_rounds + 1):
            if have >= r.prompts_per_step:
                break
            more = self.rollout(self.sampler.next_batch(r.prompts_per_step), round_)
            sig = group_has_signal(more.rewards, r.group_size).nonzero().flatten().tolist()
            kept.append(more.select_groups(sig, r.group_size))
            have += len(sig)
        if have == 0:  # nothing to learn from: train on the first round (zero advantages)
            return first, no_signal
        merged = Rollout.concat(kept)
        merged.reward_metrics = first.reward_metrics
        return merged.select_groups(list(range(min(have, r.prompts_per_step))), r.group_size), no_signal

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        with self.timer.stage("sync"):
            sync_metrics = self.sync_weights()
        ro, no_signal = self.collect()
        if self.cfg.rollout.sleep_level:  # the KV cache (level 2: the weights too) is free while the trainer works
            self.engine.sleep(self.cfg.rollout.sleep_level)
        return self.learn(ro, no_signal, t0=t0, extra=sync_metrics)

    def learn(self, ro: Rollout, no_signal: float, *, t0: float, extra: dict[str, float]) -> dict[str, float]:
        """Advantages, old (proximal) and reference logprobs, the clipped update, and the step's metrics.
        The same for every rollout mode: what differs is only how `ro` was produced."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        ids, attn, resp = build_rows(ro.prompt_ids, ro.response_ids, pad_id=self.engine.pad_id, masks=ro.response_mask)
        rollout_logp = scatter_per_token(ro.rollout_logp, ro.prompt_ids, ids.shape[1])
        batch = TrainBatch(ids, attn, resp, rollout_logp=rollout_logp)
        if ro.routing and all(r is not None for r in ro.routing):  # MoE: what algo.routing_replay replays
            batch.routing = scatter_routing(ro.routing, ids.shape[1])
        source = self.old_logp_source  # RunConfig.old_logp_source: behaviour | engine | update | recompute
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
        updated = cfg.critic is None or self.step >= cfg.critic.warmup_updates  # the critic's warm-up: actor holds
        if updated:
            every = cfg.run.profile_every  # the update's collectives, timed every `every` steps (0: never)
            with self.timer.stage("update"):
                stats.update(self.policy.update(batch, profile=True) if every and (self.step + 1) % every == 0
                             else self.policy.update(batch))
        stages = STAGES + (CRITIC_STAGES if cfg.critic is not None else ())
        times = {f"time/{s}": 0.0 for s in stages} | self.timer.pop()
        times["time/step"] = time.perf_counter() - t0
        cost = self.cost.metrics(batch, times | extra, updated=updated) if self.cost is not None else {}
        lengths = [sum(m) for m in ro.response_mask]  # the model's tokens (not a multi-turn episode's observations)
        self.last_prompts = [ro.examples[i] for i in range(0, len(ro.examples), G)]
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
            "throughput/gen_tokens_per_s": sum(lengths) / max(times["time/rollout"], 1e-9),
            **self._engine_stats(),
            **cost,  # flops/*, rollout/straggler_share, throughput/mfu_* and the peaks
        }

    def staleness_metrics(self, ro: Rollout) -> dict[str, float]:
        """How many policy versions behind the one being updated each of the model's tokens was sampled:
        staleness/mean and /max over tokens, staleness/tokens_at_<d> per distance d."""
        ages: dict[int, int] = {}
        for vs, mask in zip(ro.versions, ro.response_mask, strict=True):
            for v, m in zip(vs, mask, strict=True):
                if m:
                    age = self.step - self.policy_versions.get(v, self.step)
                    ages[age] = ages.get(age, 0) + 1
        n = max(sum(ages.values()), 1)
        return {"staleness/mean": sum(a * c for a, c in ages.items()) / n,
                "staleness/max": float(max(ages, default=0)),
                **{f"staleness/tokens_at_{a}": float(c) for a, c in sorted(ages.items())}}

    def sampler_state(self) -> dict:
        """The sampler's position at the next untrained prompt (what a checkpoint saves)."""
        return self.sampler.state_dict()

    def stream_record(self) -> dict:
        """What a checkpoint records of the rollouts under way (none: a synchronous step completes them)."""
        return {}

    def restored(self) -> None:
        """After a checkpoint's state was loaded (step, sampler): nothing more to set up here."""

    def evaluation(self):
        """The context an evaluation runs in (nothing else uses the engine meanwhile)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Stop what the driver itself runs (the synchronous driver runs nothing of its own)."""

    def _engine_stats(self) -> dict[str, float]:
        """The engine's prefix-cache and block figures for this step (the vLLM backend has none: {})."""
        stats = self.engine.stats()
        self.engine.reset_stats()
        return stats
