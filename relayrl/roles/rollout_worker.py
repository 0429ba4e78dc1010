"""This module runs the rollout role, relayrl's engine and the agent loop beside it, as one worker group, wherever
the engine runs:

    driver ── RolloutRole ──> RolloutWorker x 1, inline: an object in the driver's process, holding the engine the
              (a RolloutEngine,            driver built (colocated on the trainer's ranks, or with TP ranks in
               + run_episodes)             processes of their own: placement disaggregated)
                           ──> RolloutWorker x 1, a process of its own (parallel.rollout_worker): it loads the
                                           engine from the model directory, its TP workers below it
           ── EpisodeRole ──> the same worker's AgentLoop (env:), or AgentRunner (rollout.agent: the agent functions
                              behind the worker's private OpenAI endpoint): only finished trajectories travel

Inline, the group passes the same objects (no pickling, no process): the colocated engine's runner group, a handle
to the actor's group, never leaves the driver. The handle mirrors the engine's weights_version and asleep after
every call that may change them. The rollout stream (rollout.mode one_step_off / async) steps the engine and its
agent loop from a driver thread between weight syncs: it takes them from an inline worker (local_engine,
local_agent); a fleet's replicas in rollout workers of their own it steps through `advance` (one call per replica
per stream step, relayrl.roles.fleet_stepper); RunConfig refuses streaming with one engine in a rollout worker.
vLLM's adapter is a RolloutEngine of its own and stays outside this role. A user error inside the worker (a bad
prompt) comes back as itself, one line, and a lost engine rank as the fault it is
(relayrl.single_controller.worker_group).

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the
jobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from relayrl.data.tasks import Example
from relayrl.engine import LLMEngine
from relayrl.engine.outputs import RequestOutput
from relayrl.engine.sampling_params import SamplingParams
from relayrl.envs.config import EnvConfig
from relayrl.envs.episode import Trajectory
from relayrl.rollout.agent_loop import AgentLoop, EpisodeRunner, StreamingEpisodeRunner
from relayrl.rollout.config import RolloutConfig
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup


class Advanced(NamedTuple):
    """What one RolloutWorker.advance call did: the requests it finished and those it aborted (what they produced so
    far), the engine steps it ran, the engine's queue after it (sequences waiting, sequences running), and the tokens
    each request still running generated since the last call (its progress: per sample (token ids, logprobs,
    versions)), which the fleet keeps so that a request whose replica is lost resumes from them on another."""

    finished: list[RequestOutput]
    aborted: list[RequestOutput]
    steps: int
    waiting: int
    running: int
    progress: dict | None = None


def set_partial(engine: LLMEngine, partial: str | None) -> None:
    """What the engine does with requests in flight across a weight update (LLMEngine.partial)."""
    engine.partial = partial


class RolloutWorker(Worker):
    """The engine, and its agent loop once start_agent() built one."""

    def __init__(self, engine: Callable[[], LLMEngine] | str, engine_kwargs: dict | None = None):
        """engine: how the driver builds it (inline), or a model directory this worker loads on its device."""
        if callable(engine):
            self.engine = engine()
        else:
            self.engine = LLMEngine.from_pretrained(engine, device=self.device, **(engine_kwargs or {}))
        self.agent: EpisodeRunner | None = None

    @dispatch(Dispatch.RANK_ZERO)
    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    @dispatch(Dispatch.RANK_ZERO)
    def run_on_engine(self, fn: Callable, args: tuple) -> tuple:
        """fn(this worker's engine, *args) — LLMEngine.score, .sleep, .wake, .run_on_ranks, .load_weights, the
        weight-update bracket, passed by reference — with the engine's weights_version and asleep after it."""
        out = fn(self.engine, *args)
        return out, self.engine.weights_version, self.engine.asleep

    @dispatch(Dispatch.RANK_ZERO, deadline="control")
    def state(self) -> tuple[int, int, int]:
        return self.engine.pad_id, self.engine.weights_version, self.engine.asleep

    @dispatch(Dispatch.RANK_ZERO, deadline="control")
    def stats(self, reset: bool) -> dict:
        out = self.engine.stats()
        if reset:
            self.engine.reset_stats()
        return out

    @dispatch(Dispatch.RANK_ZERO)
    def advance(self, new: list[tuple], aborts: list[int], max_steps: int, until_done: bool = False) -> Advanced:
        """A fleet's stepper (relayrl.roles.fleet_stepper) in one call, not one per engine step: queue the new
        requests (rid, prompt, params[, prior]: each under the stepper's id, resumed from `prior` when another
        replica had begun it), drop the aborted ones, then step the engine until a request finishes (until_done:
        until none is left) or `max_steps` steps have run (engine steps, not seconds: what each call returns does
        not depend on timing). The running requests' new tokens since the last call come back as their progress."""
        engine = self.engine
        reported = self.__dict__.setdefault("_reported", {})  # rid -> tokens each sample has reported
        for rid, ids, params, *rest in new:
            prior = rest[0] if rest else None
            engine.add_request(ids, params, request_id=rid, prior=prior)
            reported[rid] = [len(p[0]) for p in prior] if prior else [0] * params.n
        aborted = engine.abort(aborts) if aborts else []
        finished: list = []
        steps = 0
        while (until_done or not finished) and steps < max_steps and engine.has_unfinished():
            finished += engine.step()
            steps += 1
        for o in finished + aborted:
            reported.pop(o.request_id, None)
        progress = {}
        for rid, seqs in engine.requests.samples.items():
            seen = reported.get(rid)
            if seen is None or not any(q.num_completion_tokens > k for q, k in zip(seqs, seen, strict=True)):
                continue
            start = [q.num_prompt_tokens + k for q, k in zip(seqs, seen, strict=True)]  # the new tokens only
            progress[rid] = [(q.token_ids[i:], q.logprobs[k:], q.versions[k:])
                             for q, i, k in zip(seqs, start, seen, strict=True)]
            reported[rid] = [q.num_completion_tokens for q in seqs]
        s = engine.scheduler
        return Advanced(finished, aborted, steps, len(s.waiting), len(s.running), progress)

    @dispatch(Dispatch.RANK_ZERO, deadline="control")
    def start_agent(self, cfg: EnvConfig | RolloutConfig) -> None:
        """relayrl's agent loop over an environment (EnvConfig), or the agent function's runner (rollout.agent)."""
        if self.agent is None:
            self.agent = AgentLoop(self.engine, cfg) if isinstance(cfg, EnvConfig) else agent_runner(self.engine, cfg)

    @dispatch(Dispatch.RANK_ZERO)
    def run_episodes(self, examples, params) -> list[Trajectory]:
        """Multi-turn episodes run beside the engine, in this worker: only finished trajectories travel."""
        if self.agent is None:
            raise RuntimeError("run_episodes before start_agent: the rollout worker has no agent loop")
        return self.agent.run(examples, params)

    @dispatch(Dispatch.RANK_ZERO, deadline="control")
    def local(self) -> tuple[LLMEngine, EpisodeRunner | None]:
        """The engine and agent loop themselves: an inline worker's only (they cannot leave a process)."""
        return self.engine, self.agent

    def teardown(self) -> None:
        try:
            if self.agent is not None:
                self.agent.close()
        finally:
            self.engine.close()


class RolloutRole:
    """The rollout role's handle: a RolloutEngine (relayrl.engine.protocols), and run_episodes."""

    def __init__(self, group: WorkerGroup, tokenizer):
        self.group, self.tokenizer = group, tokenizer  # prompts are encoded by the driver
        try:
            self.pad_id, self.weights_version, self.asleep = group.call(RolloutWorker.state)
        except BaseException:
            group.shutdown(raise_errors=False)
            raise

    @classmethod
    def inline(cls, build: Callable[[], LLMEngine], tokenizer) -> RolloutRole:
        """The engine `build()` makes, in the driver's process (its ranks wherever it puts them)."""
        group = WorkerGroup(ResourcePool([1], name="rollout"), RolloutWorker, build,
                            options=GroupOptions(backend="inline"))
        return cls(group, tokenizer)

    @classmethod
    def own_process(cls, model_dir, engine_kwargs: dict, options: GroupOptions, tokenizer,
                    device: str = "cpu", gpus: int = 1) -> RolloutRole:
        """The engine loaded from `model_dir` in a rollout worker of its own, on `device` (start_process)."""
        return cls.ready(cls.start_process(model_dir, engine_kwargs, options, device, gpus=gpus), tokenizer)

    @staticmethod
    def start_process(model_dir, engine_kwargs: dict, options: GroupOptions, device: str = "cpu",
                      name: str = "rollout", cpus: float = 0.1, gpus: int = 1) -> WorkerGroup:
        """own_process's start without the wait: a fleet starts every replica's worker, then waits for all
        (from the driver's thread: a worker dies with the thread that started it, relayrl.parallel.launch).
        device: "cpu", "cuda" or "cuda:i" (local processes: the worker on cuda:i, its engine's tensor-parallel ranks
        on cuda:i..); cpus / gpus: what Ray reserves for it (a GPU per tensor-parallel rank of its engine)."""
        kind, _, first = device.partition(":")
        pool = ResourcePool([1], device=kind, name=name, cpus_per_process=cpus, gpus_per_process=gpus,
                            device_offset=[int(first or 0)])
        return WorkerGroup.start(pool, RolloutWorker, (str(model_dir), engine_kwargs), options=options)

    @classmethod
    def ready(cls, group: WorkerGroup, tokenizer) -> RolloutRole:
        """The handle of a started rollout worker, once it has built its engine (its group stopped on failure)."""
        try:
            group.wait_ready()
        except BaseException:
            group.shutdown(raise_errors=False)
            raise
        return cls(group, tokenizer)

    def _engine(self, fn: Callable, *args):
        """fn(the worker's LLMEngine, *args), e.g. LLMEngine.score."""
        out, self.weights_version, self.asleep = self.group.call(RolloutWorker.run_on_engine, fn, args)
        return out

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams]):
        return self.group.call(RolloutWorker.generate, prompts, params)

    def load_weights(self, weights) -> int:
        return self._engine(LLMEngine.load_weights, [(n, t) for n, t in weights])

    def run_on_ranks(self, fn: Callable, *args) -> list:
        return self._engine(LLMEngine.run_on_ranks, fn, *args)

    def begin_weight_update(self) -> None:
        self._engine(LLMEngine.begin_weight_update)

    def end_weight_update(self) -> int:
        return self._engine(LLMEngine.end_weight_update)

    def score(self, rows, temperature: float = 1.0):
        return self._engine(LLMEngine.score, rows, temperature)

    def reset_prefix_cache(self) -> None:
        self._engine(LLMEngine.reset_prefix_cache)

    def sleep(self, level: int = 1) -> None:
        self._engine(LLMEngine.sleep, level)

    def wake(self) -> None:
        self._engine(LLMEngine.wake)

    def advance(self, new: list[tuple], aborts: list[int], max_steps: int, until_done: bool = False) -> Advanced:
        """RolloutWorker.advance: new requests in, aborted ones out, engine steps until one (or every one) finishes."""
        return self.group.call(RolloutWorker.advance, new, aborts, max_steps, until_done)

    def set_partial(self, partial: str | None) -> None:
        self._engine(set_partial, partial)

    def stats(self) -> dict:
        return self.group.call(RolloutWorker.stats, False)

    def reset_stats(self) -> None:
        self.group.call(RolloutWorker.stats, True)

    def run_episodes(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        """params[i].n finished episodes of examples[i], by the worker's agent loop (EpisodeRole started it)."""
        return self.group.call(RolloutWorker.run_episodes, examples, params)

    def local_engine(self) -> LLMEngine:
        """The engine itself, for a caller that steps it (the rollout stream): an inline role's only."""
        return self.local()[0]

    def local(self) -> tuple[LLMEngine, EpisodeRunner | None]:
        if self.group.backend_name != "inline":
            raise RuntimeError("the engine runs in a rollout worker of its own: it cannot be stepped from the driver "
                               "(drop parallel.rollout_worker)")
        return self.group.call(RolloutWorker.local)

    def close(self) -> None:
        self.group.shutdown(raise_errors=False)


def agent_runner(engine, r: RolloutConfig) -> EpisodeRunner:
    """rollout.agent's runner on `engine` (the serve layer and the openai client are imported only here)."""
    from relayrl.serve.agents import AgentRunner, resolve_agent

    fn = resolve_agent(r.agent, r.agent_params, engine.tokenizer)
    budget = r.agent_max_total_tokens or getattr(fn, "max_total_tokens", None)  # env:NAME: its env's budget
    return AgentRunner(engine, fn, name=r.agent, concurrency=r.agent_concurrency, timeout_s=r.agent_timeout_s,
                       max_total_tokens=budget)


class EpisodeRole:
    """Episodes run by the rollout worker's agent loop (`cfg` an EnvConfig) or agent runner (a RolloutConfig with
    rollout.agent): an EpisodeRunner either way."""

    def __init__(self, rollout: RolloutRole, cfg: EnvConfig | RolloutConfig):
        self.rollout = rollout
        rollout.group.call(RolloutWorker.start_agent, cfg)

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        return self.rollout.run_episodes(examples, params)

    def local_agent(self) -> StreamingEpisodeRunner:
        """The agent loop itself, for a caller that drives it step by step (the rollout stream): inline only."""
        agent = self.rollout.local()[1]
        assert agent is not None  # start_agent built it
        return agent

    def close(self) -> None:
        pass  # the worker's loop closes with the worker, before its engine
