"""Where the loop's batches come from: one protocol, two sources. The driver is the same for every rollout mode;
what differs is only when the samples of step k are generated and what weights generate them.

    rollout.mode   source            batch k is generated                       weights change
    sync           LockstepSource    now, by the weights the step just synced   between steps
    one_step_off   StreamingSource   beside step k-1's update (eta = 1)         between batches: a sync waits
                                                                                for the batch in flight
    async          StreamingSource   up to eta steps ahead                      between two engine steps

Both give the driver a Collected: the step's scored samples (a Rollout, G per prompt), the share of groups with no
reward spread, and the source's own figures. Each batch is scored with its completions' sampled ids and the trainer
state of its step (relayrl.rewards.state: global_step = the step, 0-based; epoch from the sampler before the draw),
so TRL's reward functions see what GRPOTrainer gives them, whatever the mode and however the stream is timed.
Sampling seeds derive from (run seed, step, round, prompt), so every source draws the same samples from the same
weights, and a resumed run draws exactly the samples the uninterrupted run drew.

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the
loop, the roles or the jobs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from relayrl.algorithms import group_has_signal
from relayrl.data import Example, PromptSampler
from relayrl.data.config import DataConfig
from relayrl.engine.protocols import RolloutEngine
from relayrl.engine.sampling_params import SamplingParams
from relayrl.errors import DataError, EnvError
from relayrl.observe import StageTimer
from relayrl.rewards.protocol import Scorer
from relayrl.rewards.result import ScoreResult
from relayrl.rewards.state import TrainerState
from relayrl.rollout.agent_loop import EpisodeRunner, StreamingEpisodeRunner, episode_metrics
from relayrl.rollout.agent_rewards import DROPPED, settle_rewards
from relayrl.rollout.config import RolloutConfig
from relayrl.rollout.prompts import encode_prompt
from relayrl.rollout.sample import Rollout, Sample, samples_of_episodes, samples_of_outputs, scored
from relayrl.rollout.stream import Group, RolloutStream

OnGenerated = Callable[[list[Sample]], None]  # told of every engine sample generated (the step's cost)


@dataclass
class Collected:
    """A step's batch as a source hands it to the driver."""

    rollout: Rollout
    no_signal: float  # the share of groups whose rewards have no spread (nothing to learn from)
    metrics: dict[str, float]  # the source's own figures (a stream: its queue and the waits on either side)


class RolloutSource(Protocol):
    """The driver's side of a rollout source."""

    streaming: bool  # generation runs beside the update (the step's tokens per second mean the pipeline's pace)
    sampler: PromptSampler

    def collect(self, step: int) -> Collected:
        """The scored groups that step `step` (0-based) trains on; the engine holds policy version `step`."""
        ...

    def weight_update(self) -> AbstractContextManager[None]:
        """The engine set aside for a weight sync (an evaluation's too)."""
        ...

    def evaluation(self) -> AbstractContextManager[None]:
        """The engine to an evaluation alone."""
        ...

    def quiet(self) -> AbstractContextManager[None]:
        """The engine's counters still while the driver reads them."""
        ...

    def sampler_state(self, step: int) -> dict:
        """The sampler's position before it drew step `step`'s prompts (what a checkpoint after step-1 saves)."""
        ...

    def record(self, step: int) -> dict:
        """What a checkpoint records of the rollouts under way (a record, not state: a resume regenerates them)."""
        ...

    def start_at(self, step: int) -> None:
        """Resume: the next step's batch is `step`'s (the sampler was loaded at its state before drawing it)."""
        ...

    def close(self) -> None: ...


def prompt_budget(ex: Example | None):
    """A prompt's own `max_tokens`: a dataset file's column (meta["fields"]) or a generated task's meta."""
    if ex is None or not isinstance(ex.meta, dict):
        return None
    fields = ex.meta.get("fields")
    if isinstance(fields, dict) and "max_tokens" in fields:
        return fields["max_tokens"]
    return ex.meta.get("max_tokens")


def sampling_params(r: RolloutConfig, run_seed: int, step: int, round_: int, i: int,
                    ex: Example | None = None) -> SamplingParams:
    """Sampling settings of prompt i of a step's round. A prompt whose row sets `max_tokens` (a dataset file's
    column, or a task's meta) gets that budget, never more than rollout.max_tokens."""
    seed = ((run_seed * 1_000_003 + step) * 101 + round_) * 100_003 + i
    own = prompt_budget(ex)
    if own is not None and (isinstance(own, bool) or not isinstance(own, int) or own < 1):
        raise DataError(f"a prompt's max_tokens must be a whole number >= 1, got {own!r} (prompt: {ex.prompt!r:.60})")
    max_tokens = min(own, r.max_tokens) if own is not None else r.max_tokens
    return SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_tokens=max_tokens, stop=list(r.stop), seed=seed)


class LockstepSource:
    """rollout.mode sync: each step's groups are generated and scored when the step asks, by the weights it just
    synced. With DAPO's dynamic sampling (filter_groups) it keeps drawing prompts until prompts_per_step groups
    have reward spread or the rounds run out; ReMax adds each prompt's greedy reward as its baseline."""

    streaming = False

    def __init__(self, engine: RolloutEngine, *, sampler: PromptSampler, rollout: RolloutConfig, data: DataConfig,
                 seed: int, scorer: Scorer | None = None, agent: EpisodeRunner | None = None,
                 filter_groups: bool = False, max_resample_rounds: int = 0, greedy_baseline: bool = False,
                 timer: StageTimer | None = None, on_generated: OnGenerated | None = None, total_steps: int = 0):
        if scorer is None and agent is None:  # with both: episodes, the scorer for the answers agents return
            raise ValueError("a rollout source scores single-turn samples (scorer) or runs episodes (agent)")
        self.engine, self.sampler, self.scorer, self.agent = engine, sampler, scorer, agent
        self.total_steps = total_steps  # the trainer state's max_steps
        self.r, self.data, self.seed = rollout, data, seed
        self.filter_groups, self.rounds, self.greedy_baseline = filter_groups, max_resample_rounds, greedy_baseline
        self.timer = timer or StageTimer()
        self.on_generated = on_generated

    def _params(self, step: int, round_: int, examples: list[Example]) -> list[SamplingParams]:
        return [sampling_params(self.r, self.seed, step, round_, i, ex) for i, ex in enumerate(examples)]

    def collect(self, step: int) -> Collected:
        r = self.r
        drawn_from = self.sampler.state_dict()
        state = TrainerState.at(step, self.total_steps, drawn_from, r.prompts_per_step)
        try:
            first = self.rollout(step, self.sampler.next_batch(r.prompts_per_step), state)
            signal = group_has_signal(first.rewards, r.group_size)
            no_signal = 1.0 - float(signal.float().mean())
            ro = self._filtered(step, first, signal, state) if self.filter_groups else first
        except BaseException:  # the step is not trained: its prompts stay the next untrained ones (a checkpoint
            self.sampler.load_state_dict(drawn_from)  # saved now resumes with them)
            raise
        if r.sleep_level:  # the KV cache (level 2: the weights too) is free while the trainer works
            self.engine.sleep(r.sleep_level)
        return Collected(ro, no_signal, {})

    def _filtered(self, step: int, first: Rollout, signal: torch.Tensor, state: TrainerState) -> Rollout:
        """DAPO's dynamic sampling: the first round's groups with spread, then more rounds' until there are
        prompts_per_step of them; with none at all, the first round (zero advantages)."""
        P, G = self.r.prompts_per_step, self.r.group_size
        kept = [first.select_groups(signal.nonzero().flatten().tolist(), G)]
        have = int(signal.sum())
        for round_ in range(1, self.rounds + 1):
            if have >= P:
                break
            more = self.rollout(step, self.sampler.next_batch(P), state, round_)
            sig = group_has_signal(more.rewards, G).nonzero().flatten().tolist()
            kept.append(more.select_groups(sig, G))
            have += len(sig)
        if have == 0:
            return first
        merged = Rollout.concat(kept)
        merged.reward_metrics = first.reward_metrics
        return merged.select_groups(list(range(min(have, P))), G)

    def rollout(self, step: int, examples: list[Example], state: TrainerState, round_: int = 0) -> Rollout:
        params = self._params(step, round_, examples)
        ro = (self._episodes(examples, params, state) if self.agent is not None
              else self._samples(examples, params, state))
        if self.greedy_baseline:
            with self.timer.stage("baseline"):
                ro.baseline = self._greedy_rewards(examples, params, state)
        return ro

    def _samples(self, examples: list[Example], params: list[SamplingParams], state: TrainerState) -> Rollout:
        G = self.r.group_size
        with self.timer.stage("rollout"):
            prompts = [encode_prompt(self.engine.tokenizer, ex, self.data) for ex in examples]
            outs = self.engine.generate(prompts, params)
        samples = samples_of_outputs(examples, outs)
        if self.on_generated is not None:
            self.on_generated(samples)
        assert len(samples) == G * len(examples)
        with self.timer.stage("reward"):
            res = self.scorer.score([s.text for s in samples], [s.example for s in samples],
                                    completion_ids=[s.response_ids for s in samples], state=state)
        return Rollout(scored(samples, res), res.metrics())

    def _episodes(self, examples: list[Example], params: list[SamplingParams], state: TrainerState) -> Rollout:
        """G episodes per prompt; each episode's reward is its environment's or its agent's (an answer an agent
        returned is scored by the run's reward functions, relayrl.rollout.agent_rewards)."""
        with self.timer.stage("rollout"):
            trajs = self.agent.run(examples, params)
        G = self.r.group_size
        with self.timer.stage("reward"):
            settle_rewards(trajs, [ex for ex in examples for _ in range(G)], G, self.scorer, state)
        return Rollout(samples_of_episodes(examples, trajs), episode_metrics(trajs))

    def _greedy_rewards(self, examples: list[Example], params: list[SamplingParams],
                        state: TrainerState) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy (temperature 0) sample of each prompt, scored like the rest."""
        greedy = [replace(p, n=1, temperature=0.0) for p in params]
        if self.agent is not None:
            trajs = self.agent.run(examples, greedy)
            settle_rewards(trajs, examples, 1, self.scorer, state)
            return torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        prompts = [encode_prompt(self.engine.tokenizer, ex, self.data) for ex in examples]
        outs = self.engine.generate(prompts, greedy)
        res = self.scorer.score([o.samples[0].text for o in outs], examples,
                                completion_ids=[o.samples[0].token_ids for o in outs], state=state)
        return torch.tensor(res.rewards, dtype=torch.float32)

    def weight_update(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def evaluation(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def quiet(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def sampler_state(self, step: int) -> dict:
        return self.sampler.state_dict()  # a lockstep step draws its prompts when it runs

    def record(self, step: int) -> dict:
        return {}  # nothing under way between two steps

    def start_at(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass  # the engine, scorer and agent are their owner's to close


class StreamingSource:
    """rollout.mode one_step_off or async: the rollout stream (relayrl.rollout.stream) generates batches beside
    the update, each at most eta policy versions ahead of the update that trains it. A weight sync pauses the
    engine between two of its steps (one_step_off: once the batch in flight is done), and admission moves on
    only when the step's collect() says which version the engine holds, so an evaluation's sync admits nothing."""

    streaming = True

    def __init__(self, engine, *, sampler: PromptSampler, rollout: RolloutConfig, data: DataConfig, seed: int,
                 total_steps: int, scorer: Scorer | None = None, agent: StreamingEpisodeRunner | None = None,
                 timer: StageTimer | None = None, on_generated: OnGenerated | None = None, env_name: str = ""):
        r = rollout
        self.engine, self.sampler, self.r, self.env_name = engine, sampler, r, env_name
        self.interrupt = r.mode == "async"  # weights change mid-generation, not only between batches
        self.engine.partial = r.partial if self.interrupt else None
        self.answers = scorer if agent is not None else None  # scores the answers agent functions return
        self.timer = timer or StageTimer()
        self.on_generated = on_generated
        self.stream = RolloutStream(
            engine, sampler=sampler, prompts_per_step=r.prompts_per_step, total_batches=total_steps,
            staleness=r.staleness, max_inflight=r.prompts_per_step if r.mode == "one_step_off" else r.max_inflight,
            make_params=lambda batch, i, ex: sampling_params(r, seed, batch, 0, i, ex),
            encode=lambda ex: encode_prompt(engine.tokenizer, ex, data), scorer=None if agent else scorer,
            agent=agent)

    def collect(self, step: int) -> Collected:
        self.stream.set_version(step)  # batches up to step + eta may now be admitted
        t0 = time.perf_counter()
        groups, queue_len = self.stream.take(step)  # the trainer waits for the oldest batch
        waited = time.perf_counter() - t0
        self.timer.add("rollout", waited)
        ro = self._assemble(groups)
        signal = group_has_signal(ro.rewards, self.r.group_size)
        return Collected(ro, 1.0 - float(signal.float().mean()),
                         {"time/wait_rollout": waited, "time/wait_train": self.stream.pop_idle(),
                          "rollout/queue_len": float(queue_len)})

    def _assemble(self, groups: list[Group]) -> Rollout:
        samples = [s for g in groups for s in g.samples]
        if groups[0].episodes is not None:
            for g in groups:
                settle_rewards(g.episodes, [g.example] * len(g.episodes), len(g.episodes), self.answers, g.state)
                for s, t in zip(g.samples, g.episodes, strict=True):
                    s.reward, s.correct = t.reward, t.success
            trajs = [t for g in groups for t in g.episodes]
            if all(t.finish == "env_error" or t.finish in DROPPED for t in trajs):  # per step, as in lockstep
                kind = "agent" if trajs[0].finish in DROPPED else "environment"
                raise EnvError(f"{kind} '{self.env_name}' failed on every episode of the step, "
                               f"e.g.: {trajs[0].error}")
            return Rollout(samples, episode_metrics(trajs))
        # scored group by group without the every-sample-failed check: it applies to the step, as in lockstep
        res = ScoreResult.merge([g.score for g in groups])
        if self.on_generated is not None:
            self.on_generated(samples)
        return Rollout(samples, res.metrics())

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        with self.stream.paused(drain=not self.interrupt):
            yield

    def evaluation(self) -> AbstractContextManager[None]:
        """An evaluation has the engine to itself: admissions stop and the groups in flight finish first."""
        return self.stream.paused(drain=True)

    def quiet(self) -> AbstractContextManager[None]:
        return self.stream.paused()  # the rollout thread updates the engine's counters as it steps

    def sampler_state(self, step: int) -> dict:
        return self.stream.sampler_state(step)

    def record(self, step: int) -> dict:
        return self.stream.describe(step)

    def start_at(self, step: int) -> None:
        self.stream.start_at(step)

    def close(self) -> None:
        self.stream.close()
