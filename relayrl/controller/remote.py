"""The rollout and reward roles as worker groups, behind the interfaces the driver already uses.

    driver ── RemoteEngine ──> RolloutWorker (1 process: the engine, with its own TP workers below)
           ── RemoteScorer ──> RewardWorker x N (DP_SPLIT: each scores its share of a step's samples)

RemoteEngine looks like LLMEngine to the driver (generate, load_weights, run_on_ranks for the weight
sync, score, sleep / wake, stats, tokenizer, pad_id);
RemoteScorer like Scorer (score -> ScoreResult). With `parallel.rollout_worker` and
`parallel.reward_workers` the four roles of the loop (actor, rollout, reference, reward) each run in
their own worker group, on local processes or Ray.
"""

from __future__ import annotations

from relayrl.controller.batch import DataBatch
from relayrl.controller.dispatch import Dispatch, dispatch
from relayrl.controller.resource_pool import ResourcePool
from relayrl.controller.worker import Worker
from relayrl.controller.worker_group import WorkerGroup
from relayrl.engine import LLMEngine
from relayrl.errors import RewardError
from relayrl.models.tokenizer import load_tokenizer
from relayrl.parallel.launch import WorkerError
from relayrl.rewards import ScoreResult, build_scorer


class RolloutWorker(Worker):
    def __init__(self, model_dir: str, engine_kwargs: dict):
        self.engine = LLMEngine.from_pretrained(model_dir, **engine_kwargs)

    @dispatch(Dispatch.RANK_ZERO)
    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    @dispatch(Dispatch.RANK_ZERO)
    def load_weights(self, weights: list) -> int:
        return self.engine.load_weights(weights)

    @dispatch(Dispatch.RANK_ZERO)
    def engine_method(self, method: str, args: tuple):
        """run_on_ranks, begin/end_weight_update, score, sleep, wake: the engine's own methods."""
        return getattr(self.engine, method)(*args)

    @dispatch(Dispatch.RANK_ZERO)
    def stats(self, reset: bool) -> dict:
        out = self.engine.stats()
        if reset:
            self.engine.reset_stats()
        return out

    def teardown(self) -> None:
        self.engine.close()


class RewardWorker(Worker):
    def __init__(self, reward_cfg):
        self.scorer = build_scorer(reward_cfg)

    @dispatch(Dispatch.DP_SPLIT)
    def score(self, batch: DataBatch) -> ScoreResult:
        return self.scorer.score(batch.non_tensors["texts"], batch.non_tensors["examples"], check=False)


class RemoteEngine:
    def __init__(self, model_dir, engine_kwargs: dict, backend: str):
        self.group = WorkerGroup(ResourcePool([1], name="rollout"), RolloutWorker, str(model_dir), engine_kwargs,
                                 backend=backend)
        self.tokenizer = load_tokenizer(model_dir)  # prompts are encoded by the driver
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.weights_version = 0
        self.asleep = 0

    def generate(self, prompts, params):
        return self.group.generate(prompts, params)

    def load_weights(self, weights) -> int:
        self.weights_version = self.group.load_weights([(n, t) for n, t in weights])
        return self.weights_version

    def run_on_ranks(self, fn, *args) -> list:
        return self.group.engine_method("run_on_ranks", (fn, *args))

    def begin_weight_update(self) -> None:
        self.group.engine_method("begin_weight_update", ())

    def end_weight_update(self) -> int:
        self.weights_version = self.group.engine_method("end_weight_update", ())
        return self.weights_version

    def score(self, rows, temperature: float = 1.0):
        return self.group.engine_method("score", (rows, temperature))

    def sleep(self, level: int = 1) -> None:
        self.group.engine_method("sleep", (level,))
        self.asleep = max(self.asleep, level)

    def wake(self) -> None:
        self.group.engine_method("wake", ())
        self.asleep = 0

    def stats(self) -> dict:
        return self.group.stats(False)

    def reset_stats(self) -> None:
        self.group.stats(True)

    def close(self) -> None:
        self.group.shutdown()


class RemoteScorer:
    def __init__(self, reward_cfg, workers: int, backend: str):
        self.group = WorkerGroup(ResourcePool([workers], name="reward"), RewardWorker, reward_cfg, backend=backend)

    def score(self, completions: list[str], examples: list) -> ScoreResult:
        batch = DataBatch({}, non_tensors={"texts": list(completions), "examples": list(examples)})
        try:
            parts = self.group.score(batch)
        except WorkerError as e:  # a user's reward function that cannot run stays a one-line error
            if isinstance(e.__cause__, RewardError):
                raise e.__cause__ from None
            raise
        return ScoreResult.merge(parts)

    def close(self) -> None:
        self.group.shutdown()
