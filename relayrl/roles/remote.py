"""This module runs the rollout role as a worker group, behind the protocol the driver already uses.

    driver ── RemoteEngine ──> RolloutWorker (1 process: the engine, with its own TP workers below)

RemoteEngine is a relayrl.engine.protocols.RolloutEngine (generate, load_weights, run_on_ranks for
the weight sync, score, sleep / wake, stats, tokenizer, pad_id). With `parallel.rollout_worker` and
`parallel.reward_workers` (relayrl.roles.rule_scorer) the four roles of the loop (actor, rollout,
reference, reward) each run in their own worker group, on local processes or Ray. A user error inside
a worker (a bad prompt) comes back as itself, one line (relayrl.single_controller.worker_group).

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the
jobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from relayrl.data.tasks import Example
from relayrl.engine import LLMEngine
from relayrl.engine.sampling_params import SamplingParams
from relayrl.envs.config import EnvConfig
from relayrl.envs.episode import Trajectory
from relayrl.models.tokenizer import load_tokenizer
from relayrl.rollout.agent_loop import AgentLoop
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup


class RolloutWorker(Worker):
    def __init__(self, model_dir: str, engine_kwargs: dict):
        self.engine = LLMEngine.from_pretrained(model_dir, device=self.device, **engine_kwargs)  # its pool's device
        self.agent: AgentLoop | None = None

    @dispatch(Dispatch.RANK_ZERO)
    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    @dispatch(Dispatch.RANK_ZERO)
    def run_episodes(self, examples, params, env_cfg: EnvConfig) -> list[Trajectory]:
        """Multi-turn episodes run beside the engine, in this worker: only finished trajectories travel."""
        if self.agent is None:
            self.agent = AgentLoop(self.engine, env_cfg)
        return self.agent.run(examples, params)

    @dispatch(Dispatch.RANK_ZERO)
    def load_weights(self, weights: list) -> int:
        return self.engine.load_weights(weights)

    @dispatch(Dispatch.RANK_ZERO)
    def run_on_engine(self, fn: Callable, args: tuple):
        """fn(this worker's engine, *args): LLMEngine.score, .sleep, .wake, .run_on_ranks, the weight-update
        bracket — the engine's own methods, passed by reference."""
        return fn(self.engine, *args)

    @dispatch(Dispatch.RANK_ZERO, deadline="control")
    def stats(self, reset: bool) -> dict:
        out = self.engine.stats()
        if reset:
            self.engine.reset_stats()
        return out

    def teardown(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.engine.close()


class RemoteEngine:
    """The engine in a rollout worker of its own (a RolloutEngine)."""

    def __init__(self, model_dir, engine_kwargs: dict, options: GroupOptions, device: str = "cpu"):
        self.group = WorkerGroup(ResourcePool([1], device=device, name="rollout"), RolloutWorker, str(model_dir),
                                 engine_kwargs, options=options)
        self.tokenizer = load_tokenizer(model_dir)  # prompts are encoded by the driver
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.weights_version = 0
        self.asleep = 0

    def _engine(self, fn: Callable, *args):
        """fn(the worker's LLMEngine, *args), e.g. LLMEngine.score."""
        return self.group.call(RolloutWorker.run_on_engine, fn, args)

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams]):
        return self.group.call(RolloutWorker.generate, prompts, params)

    def load_weights(self, weights) -> int:
        self.weights_version = self.group.call(RolloutWorker.load_weights, [(n, t) for n, t in weights])
        return self.weights_version

    def run_on_ranks(self, fn: Callable, *args) -> list:
        return self._engine(LLMEngine.run_on_ranks, fn, *args)

    def begin_weight_update(self) -> None:
        self._engine(LLMEngine.begin_weight_update)

    def end_weight_update(self) -> int:
        self.weights_version = self._engine(LLMEngine.end_weight_update)
        return self.weights_version

    def score(self, rows, temperature: float = 1.0):
        return self._engine(LLMEngine.score, rows, temperature)

    def sleep(self, level: int = 1) -> None:
        self._engine(LLMEngine.sleep, level)
        self.asleep = max(self.asleep, level)

    def wake(self) -> None:
        self._engine(LLMEngine.wake)
        self.asleep = 0

    def stats(self) -> dict:
        return self.group.call(RolloutWorker.stats, False)

    def reset_stats(self) -> None:
        self.group.call(RolloutWorker.stats, True)

    def close(self) -> None:
        self.group.shutdown(raise_errors=False)


class RemoteAgentLoop:
    """Episodes run by the rollout worker's own agent loop (an EpisodeRunner)."""

    def __init__(self, engine: RemoteEngine, env_cfg: EnvConfig):
        self.engine, self.env_cfg = engine, env_cfg

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        return self.engine.group.call(RolloutWorker.run_episodes, examples, params, self.env_cfg)

    def close(self) -> None:
        pass  # the worker's loop stops with the worker
