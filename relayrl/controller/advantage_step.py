"""The advantage half of a step: from a rollout's rewards to the advantages the update uses. The step gathers
what the run's estimator needs (relayrl.algorithms.estimate: the per-token KL in the reward, the critic's values,
the greedy baseline) and calls it; which formula runs is the estimator's, never branched on here.

It runs after the old and reference logprobs are in the batch (the KL in the reward needs them).

Like the rest of the loop's package, it reaches the layers below through their protocols; it never
imports the roles, the jobs or relayrl.cli.
"""

from __future__ import annotations

from torch import Tensor

from relayrl.algorithms.config import AlgoConfig
from relayrl.algorithms.estimate import AdvantageInputs, estimate_advantages
from relayrl.algorithms.kl import kl_penalty
from relayrl.algorithms.registry import advantage_needs_critic
from relayrl.observe import StageTimer
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.policy import Policy


def kl_in_reward(algo: AlgoConfig, batch: TrainBatch) -> Tensor | None:
    """The per-token KL(pi_old || ref) the reward is penalised by, when algo.kl_in_reward puts it there."""
    if not algo.kl_in_reward or batch.ref_logp is None:
        return None
    return kl_penalty(batch.old_logp, batch.ref_logp, algo.kl_kind).detach()


def compute_advantages(algo: AlgoConfig, policy: Policy, batch: TrainBatch, rewards: Tensor, group_size: int,
                       timer: StageTimer, baseline: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """(advantages [B] or [B, T], figures for the step's metrics); fills batch.values / batch.returns for an
    estimator with a critic. Token-level estimators see the whole step's batch at once (their whitening is over
    all its tokens)."""
    x = AdvantageInputs(rewards, batch.response_mask, group_size, kl=kl_in_reward(algo, batch), baseline=baseline)
    if advantage_needs_critic(algo.advantage):
        with timer.stage("values"):
            x.values = batch.values = policy.compute_values(batch)
    out = estimate_advantages(algo, x)
    batch.returns = out.returns
    return out.advantages, out.metrics
