"""A step's samples as the loop trains on them: G per prompt, contiguous, each with the tokens the engine sampled,
their logprobs and weight versions, the loss mask, the reward, and (MoE) the experts the engine routed to.

    engine output (RequestOutput: G CompletionSamples)  ──┐
                                                          ├──> Rollout ──> TrainBatch (relayrl.trainer.batch)
    environment episode (Trajectory: turns, masks)     ──┘     one list item per sample

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the
loop, the roles or the jobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relayrl.data import Example
from relayrl.engine.outputs import RequestOutput
from relayrl.envs.episode import Trajectory
from relayrl.rewards.result import ScoreResult
from relayrl.rollout.agent_loop import episode_metrics


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


def rollout_from_outputs(examples: list[Example], outs: list[RequestOutput], res: ScoreResult) -> Rollout:
    """One engine output per example (its G samples, contiguous) and their scores: a Rollout. A sample without
    per-token versions (an engine that keeps none) takes its output's weights version for every token."""
    samples = [(ex, o, s) for ex, o in zip(examples, outs, strict=True) for s in o.samples]
    return Rollout(examples=[ex for ex, _, _ in samples], prompt_ids=[o.prompt_token_ids for _, o, _ in samples],
                   response_ids=[s.token_ids for _, _, s in samples],
                   rollout_logp=[s.logprobs for _, _, s in samples], texts=[s.text for _, _, s in samples],
                   rewards=torch.tensor(res.rewards, dtype=torch.float32), correct=res.correct,
                   reward_metrics=res.metrics(), response_mask=[[1] * len(s.token_ids) for _, _, s in samples],
                   versions=[list(s.versions or [o.weights_version] * len(s.token_ids)) for _, o, s in samples],
                   routing=[s.routing for _, _, s in samples])


def rollout_from_trajectories(examples: list[Example], trajs: list[Trajectory]) -> Rollout:
    """G finished episodes per example (contiguous), each rewarded by its environment: a Rollout (a token with no
    recorded version counts as observed, -1)."""
    G = len(trajs) // max(len(examples), 1)
    return Rollout(examples=[ex for ex in examples for _ in range(G)],
                   prompt_ids=[t.prompt_ids for t in trajs], response_ids=[t.response_ids for t in trajs],
                   rollout_logp=[t.logprobs for t in trajs], texts=[t.last_text for t in trajs],
                   rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
                   correct=[t.success for t in trajs], reward_metrics=episode_metrics(trajs),
                   response_mask=[t.mask for t in trajs],
                   versions=[list(t.versions or [-1] * len(t.response_ids)) for t in trajs])
