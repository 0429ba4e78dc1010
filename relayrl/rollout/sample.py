"""A sample in flight: one record per sample from the engine (or the environment) to the training batch.

    engine output (RequestOutput: G CompletionSamples) ──┐  converted once   Sample          scored: reward, correct
                                                         ├───────────────>  (per sample)  ──────────────────────────┐
    environment episode (Trajectory: turns, masks)    ───┘                                                          │
                                                                                                                    v
    a streaming Group (one prompt's G samples), a lockstep step's batch  =  lists of Samples  ──>  Rollout (a step)
                                                                                                         │ driver
                                                                                                         v
                                                                                 TrainBatch (relayrl.trainer.batch)

A sample has two forms only: this one while it is generated, scored and gathered, and its row of the TrainBatch
(batched, crossing to the trainer's workers as itself). A Rollout is a step's samples (G per prompt, contiguous)
with the figures that belong to the step, not to one sample: its reward metrics and ReMax's greedy baseline.

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the
loop, the roles or the jobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relayrl.data import Example
from relayrl.engine.outputs import CompletionSample, RequestOutput, SampleCost
from relayrl.envs.episode import Trajectory
from relayrl.rewards.result import ScoreResult


@dataclass(kw_only=True)
class Sample:
    """One sample: the prompt's ids and what followed them, as the engine produced them and the loss trains on."""

    example: Example
    prompt_ids: list[int]
    response_ids: list[int]  # every id after the prompt: sampled, and a multi-turn episode's observed ids
    logprobs: list[float]  # the engine's, per response id (0.0 on an observed id)
    mask: list[int]  # per response id: 1 where the model sampled it (gets loss), 0 on an observation
    versions: list[int]  # per response id, the engine's weights version that sampled it (-1: observed)
    text: str  # what the scorer (or an evaluator) reads: the completion, an episode's last assistant message
    # MoE: the engine's routing record [prompt + response ids, n_moe, k] (relayrl.engine.routing); None where it
    # keeps none (a dense model, an episode)
    routing: torch.Tensor | None = None
    cost: SampleCost | None = None  # what the engine spent on it (the step's FLOPs); None: not counted
    reward: float = 0.0  # set once scored (an episode: its environment's)
    correct: bool = False
    per_function: dict[str, float] | None = None  # each reward function's value, once scored (samples.jsonl's rows)

    @classmethod
    def of_completion(cls, example: Example, out: RequestOutput, s: CompletionSample) -> Sample:
        """One engine sample; without per-token versions (an engine that keeps none) every token takes its
        output's weights version."""
        return cls(example=example, prompt_ids=out.prompt_token_ids, response_ids=s.token_ids, logprobs=s.logprobs,
                   mask=[1] * len(s.token_ids), versions=list(s.versions or [out.weights_version] * len(s.token_ids)),
                   text=s.text, routing=s.routing, cost=s.cost)

    @classmethod
    def of_episode(cls, example: Example, t: Trajectory) -> Sample:
        """A finished episode, rewarded by its environment (an id with no recorded version counts as observed)."""
        return cls(example=example, prompt_ids=t.prompt_ids, response_ids=t.response_ids, logprobs=t.logprobs,
                   mask=t.mask, versions=list(t.versions or [-1] * len(t.response_ids)), text=t.last_text,
                   reward=t.reward, correct=t.success)


def samples_of_outputs(examples: list[Example], outs: list[RequestOutput]) -> list[Sample]:
    """One engine output per example (its G samples, contiguous), unscored."""
    return [Sample.of_completion(ex, o, s) for ex, o in zip(examples, outs, strict=True) for s in o.samples]


def samples_of_episodes(examples: list[Example], trajs: list[Trajectory]) -> list[Sample]:
    """G finished episodes per example (contiguous)."""
    G = len(trajs) // max(len(examples), 1)
    return [Sample.of_episode(ex, t) for ex, t in zip([ex for ex in examples for _ in range(G)], trajs, strict=True)]


def scored(samples: list[Sample], res: ScoreResult) -> list[Sample]:
    """The samples with their rewards (in order): set in place, returned for the caller's convenience."""
    for i, (s, r, c) in enumerate(zip(samples, res.rewards, res.correct, strict=True)):
        s.reward, s.correct = r, c
        s.per_function = {name: values[i] for name, values in res.per_function.items()}
    return samples


@dataclass
class Rollout:
    """A step's samples, G per prompt (a prompt's samples contiguous), and the step's own figures."""

    samples: list[Sample]
    reward_metrics: dict[str, float]  # reward/mean, reward/accuracy, ... (an episode step: its episode figures)
    baseline: torch.Tensor | None = None  # ReMax: the reward of each prompt's greedy sample, [prompts]

    @property
    def rewards(self) -> torch.Tensor:
        """[samples], float32."""
        return torch.tensor([s.reward for s in self.samples], dtype=torch.float32)

    def select_groups(self, groups: list[int], G: int) -> Rollout:
        baseline = self.baseline[groups] if self.baseline is not None else None
        return Rollout([self.samples[g * G + j] for g in groups for j in range(G)], self.reward_metrics, baseline)

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        baseline = torch.cat([p.baseline for p in parts]) if parts[0].baseline is not None else None
        return Rollout([s for p in parts for s in p.samples], parts[0].reward_metrics, baseline)
