"""This module runs the rule reward functions as one role, a RewardWorker group, wherever it runs:

    driver ── RuleScorer ──> RewardWorker x 1, inline: an object in the driver's process (parallel.reward_workers 0)
                         ──> RewardWorker x N, processes of their own (parallel.reward_workers N, backend local / ray)
             DP_SPLIT: each worker scores its share of a step's samples with its RewardScorer, whose reward pool
             (reward.workers processes, relayrl.rewards.pool) it owns and closes at teardown; the shares are merged
             in sample order, and a function failing on every sample of the step stops the run in one line

Inline, the worker group passes the same objects (no pickling, no process) and adds a few microseconds per call;
a user's error inside a worker (a reward function that cannot load) comes back as itself, one line
(relayrl.single_controller.worker_group).

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the
jobs.
"""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.data.tasks import Example
from relayrl.rewards import RewardConfig, ScoreResult, TrainerState, build_scorer
from relayrl.single_controller.batch import DataBatch
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup

INLINE = GroupOptions(backend="inline")  # a role's worker group in the driver's process (no trace of its own)


class RewardWorker(Worker):
    """The rule functions of reward_cfg, in this worker's reward pool."""

    def __init__(self, reward_cfg: RewardConfig):
        self.scorer = build_scorer(reward_cfg)

    @dispatch(Dispatch.DP_SPLIT)
    def score(self, batch: DataBatch) -> ScoreResult:
        return self.scorer.score(batch.non_tensors["texts"], batch.non_tensors["examples"], check=False,
                                 completion_ids=batch.non_tensors.get("completion_ids"),
                                 state=batch.meta.get("trainer_state"))

    def teardown(self) -> None:
        self.scorer.close()


class RuleScorer:
    """The rule reward functions as a worker group (a Scorer): one inline worker by default, or `workers`
    processes of their own with `options` (a run's local / ray worker-group options)."""

    def __init__(self, reward_cfg: RewardConfig, workers: int = 0, options: GroupOptions | None = None):
        inline = workers == 0
        self.group = WorkerGroup(ResourcePool([1 if inline else workers], name="reward"), RewardWorker, reward_cfg,
                                 options=INLINE if inline else options)

    def score(self, completions: Sequence[str], examples: Sequence[Example], check: bool = True, *,
              completion_ids: Sequence[Sequence[int]] | None = None, state: TrainerState | None = None) -> ScoreResult:
        rows = {"texts": list(completions), "examples": list(examples)}
        if completion_ids is not None:
            rows["completion_ids"] = list(completion_ids)  # split with the samples; the state goes to every worker
        batch = DataBatch({}, meta={"trainer_state": state}, non_tensors=rows)
        return ScoreResult.merge(self.group.call(RewardWorker.score, batch), check=check)

    def close(self) -> None:
        self.group.shutdown(raise_errors=False)
