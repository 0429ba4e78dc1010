"""The rollout stream: the engine generating continuously, in a thread of the driver, under a staleness bound.

    driver (main thread)                               rollout thread                     scorer thread
    ────────────────────                               ──────────────                     ─────────────
    paused(): the engine stops between two steps  ┐    admit: draw batch j once j <= version + eta,
      weight sync (planned, verified)             │      submit its groups (oldest first) while fewer
    set_version(v)  ──────────────────────────────┘      than max_inflight are generating
    take(k): the P groups of batch k, once all           step the engine (one batch of tokens)    score one
      are scored (oldest first: batch k holds the        a finished group ───────────────────────> group
      k-th P prompts the sampler drew)                   (multi-turn: the agent loop's episodes)   ──> ready

Admission is AReaL's capacity rule at batch granularity: batch j is trained by the update from policy
version j to j+1, and its prompts are admitted only when the engine holds version >= j - eta. Every token
is sampled after its prompt was admitted, so none is more than eta versions older than the update that
trains it. Batches are consumed in the order they were drawn, so nothing is skipped, reordered or dropped;
with eta = 0 a batch is admitted only after the weights of its own step arrived, which is the synchronous
loop, step for step.

The engine is used from one thread at a time: the rollout thread holds `engine_lock` around each step, and
the driver takes it (paused()) to sync weights or evaluate. paused(drain=True) first lets every admitted
group finish (no new admissions): one_step_off syncs that way, at batch boundaries, and so does an
evaluation. What the engine does with requests in flight across a sync (keep their KV or recompute it) is
its `partial` setting.

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the
loop, the roles or the jobs.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from relayrl.data import Example, PromptSampler
from relayrl.engine.sampling_params import SamplingParams
from relayrl.envs.episode import Trajectory
from relayrl.rewards.protocol import Scorer
from relayrl.rewards.result import ScoreResult
from relayrl.rewards.state import TrainerState
from relayrl.rollout.agent_loop import StreamingEpisodeRunner
from relayrl.rollout.sample import Sample, samples_of_episodes, samples_of_outputs, scored

IDLE_POLL_S = 0.005  # how often the thread looks again while only environments have work


@dataclass
class Group:
    """One prompt's G samples, from its admission until the trainer takes them."""

    batch: int
    index: int  # within its batch
    example: Example
    params: SamplingParams
    samples: list[Sample] = field(default_factory=list)  # once generated (scored once in `ready`)
    score: ScoreResult | None = None  # single-turn: the scorer's figures of them (the step's reward metrics)
    state: TrainerState | None = None  # what a TRL reward function reads: its batch's step, not the scoring time's
    episodes: list[Trajectory] | None = None  # multi-turn: the episodes they are (the step's episode figures)

    @property
    def key(self) -> tuple[int, int]:
        return (self.batch, self.index)


class RolloutStream:
    """Feeds complete, scored groups to the trainer; see the module docstring."""

    def __init__(self, engine, *, sampler: PromptSampler, prompts_per_step: int, total_batches: int,
                 staleness: int, max_inflight: int | None, make_params: Callable[[int, int, Example], SamplingParams],
                 encode: Callable[[Example], Any], scorer: Scorer | None = None,
                 agent: StreamingEpisodeRunner | None = None):
        if (scorer is None) == (agent is None):
            raise ValueError("a rollout stream scores single-turn samples (scorer) or runs episodes (agent)")
        self.engine, self.sampler, self.scorer, self.agent = engine, sampler, scorer, agent
        self.P, self.total, self.staleness, self.max_inflight = prompts_per_step, total_batches, staleness, max_inflight
        self.make_params, self.encode = make_params, encode
        if agent is not None:  # an environment failing everywhere is judged per step (StreamingSource), as in sync
            agent.check_failures = False
        self.engine_lock = threading.Lock()
        self.cv = threading.Condition()
        # everything below is guarded by cv
        self.version = -1  # the policy version the engine holds (-1: no weights published yet)
        self.next_batch = 0
        self.draw_states: dict[int, dict] = {}  # batch -> the sampler's state before drawing it
        self.waiting: deque[Group] = deque()  # admitted, not yet submitted (max_inflight)
        self.running: dict[Any, Group] = {}  # request id (single-turn) or tag (episodes) -> group
        self.inflight = 0  # submitted and not yet scored (what a drain waits for)
        # submitted and not yet returned by the engine (what max_inflight bounds). Counted down by the rollout
        # thread itself, between two engine steps, never by the scorer: which groups the next step admits must
        # not depend on how far the scorer thread has got, or a run would depend on timing
        self.generating = 0
        self.ready: dict[tuple[int, int], Group] = {}
        self.pauses = self.drains = 0
        self.idle_s = 0.0  # the engine had nothing admissible to do: it waited for the trainer
        self.error: BaseException | None = None
        self.stopping = False
        self._threads: list[threading.Thread] = []
        self._to_score: queue.Queue[Group | None] = queue.Queue()

    # ---- the driver's side ----
    def start_at(self, batch: int) -> None:
        """Resume: the next batch to draw (the sampler is at its state before drawing it)."""
        with self.cv:
            self.next_batch = batch

    def set_version(self, version: int) -> None:
        """The engine now holds policy `version`: batches up to version + eta are admitted, and their groups
        submitted (up to max_inflight), before this returns. So what a batch is generated by never depends on
        whether the rollout thread got there before the driver's next sync (an evaluation's, say)."""
        with self.paused():
            with self.cv:
                self.version = version
            self._submit(self._admit())
        with self.cv:
            self.cv.notify_all()
        if not self._threads:
            self._start()

    @contextlib.contextmanager
    def paused(self, drain: bool = False) -> Iterator[None]:
        """The engine between two steps, for the caller alone; with drain, also with nothing in flight."""
        with self.cv:
            self.drains += drain
            try:
                while drain and self.inflight and self.error is None and self._alive():
                    self.cv.wait(0.1)
                self._raise_error()  # a dead rollout thread: say why now, not after a sync on a broken engine
            except BaseException:
                self.drains -= drain
                raise
            self.pauses += 1
        self.engine_lock.acquire()
        try:
            yield
        finally:
            self.engine_lock.release()
            with self.cv:
                self.pauses -= 1
                self.drains -= drain
                self.cv.notify_all()

    def take(self, batch: int) -> tuple[list[Group], int]:
        """Wait for the P groups of `batch`; returns them in order and how many later groups are ready."""
        keys = [(batch, i) for i in range(self.P)]
        with self.cv:
            while not all(k in self.ready for k in keys):
                self._raise_error()
                if not self._alive():
                    raise RuntimeError("the rollout stream stopped before batch "
                                       f"{batch} was complete (was it started with set_version?)")
                self.cv.wait(0.1)
            self._raise_error()
            groups = [self.ready.pop(k) for k in keys]
            self.draw_states = {b: s for b, s in self.draw_states.items() if b > batch}
            return groups, len(self.ready)

    def sampler_state(self, batch: int) -> dict:
        """The sampler's state before it drew `batch` (a checkpoint after batch - 1 resumes there)."""
        with self.cv:
            if batch in self.draw_states:
                return self.draw_states[batch]
            if batch == self.next_batch:
                return self.sampler.state_dict()
            raise RuntimeError(f"no sampler state for batch {batch}: drawn up to {self.next_batch - 1}")

    def describe(self, batch: int) -> dict:
        """The queue as a checkpoint after `batch` - 1 records it: what was admitted past it (regenerated on
        resume, so this is a record, not a state to load) and the policy version the engine held."""
        with self.cv:
            return {"next_batch": batch, "admitted_through": self.next_batch - 1, "engine_version": self.version,
                    "ready_groups": sorted(list(k) for k in self.ready), "generating_groups": self.inflight}

    def pop_idle(self) -> float:
        with self.cv:
            out, self.idle_s = self.idle_s, 0.0
            return out

    def close(self) -> int:
        """Stop both threads and abort whatever is in flight; returns the groups discarded (admitted, never
        taken), which a resume regenerates. The agent loop is the run's (it evaluates too): its owner closes it."""
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        for t in self._threads:
            if t.name.endswith("score"):
                self._to_score.put(None)
        for t in self._threads:
            t.join(timeout=30)
        with self.cv:
            discarded = len(self.waiting) + self.inflight + len(self.ready)
            running = list(self.running)
            self.waiting.clear()
            self.running.clear()
            self.ready.clear()
            self.inflight = self.generating = 0
        if self.engine_lock.acquire(timeout=30):  # a thread stuck in a step keeps it: leave the engine be
            try:
                if self.agent is not None:
                    self.agent.abort_all()
                elif running:
                    self.engine.abort(running)
            finally:
                self.engine_lock.release()
        if discarded:
            print(f"relayrl: rollout stream: {discarded} admitted group(s) discarded at shutdown "
                  "(a resume regenerates them)", file=sys.stderr)
        return discarded

    # ---- the threads ----
    def _start(self) -> None:
        self._threads = [threading.Thread(target=self._guard, args=(self._generate,), name="rl-rollout", daemon=True)]
        if self.scorer is not None:
            self._threads.append(threading.Thread(target=self._guard, args=(self._score,), name="rl-score",
                                                  daemon=True))
        for t in self._threads:
            t.start()

    def _alive(self) -> bool:
        return all(t.is_alive() for t in self._threads) and bool(self._threads)

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # handed to the driver, which raises it from take() / paused()
            with self.cv:
                self.error = self.error or e
                self.cv.notify_all()

    def _generate(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and (self.pauses or not self._has_work()):
                    idle = not self.pauses and not self.drains  # a drain or a sync is not waiting for the trainer
                    t0 = time.perf_counter()
                    self.cv.wait(IDLE_POLL_S if self.agent is not None and self.agent.busy else 0.1)
                    if idle:
                        self.idle_s += time.perf_counter() - t0
                if self.stopping:
                    return
            with self.engine_lock:
                self._submit(self._admit())
                done = self._advance()
            with self.cv:
                self.generating -= len(done)
                for g in done:
                    if self.scorer is not None:
                        self._to_score.put(g)
                    else:
                        self._finish(g)
                self.cv.notify_all()
                if not done and self.agent is not None and not self.engine.has_unfinished():
                    self.cv.wait(IDLE_POLL_S)  # only environments are working: do not spin on them

    def _has_work(self) -> bool:  # under cv
        if self.agent is not None and self.agent.busy:
            return True
        return self.engine.has_unfinished() or bool(self._admissible())

    def _open(self) -> bool:  # under cv: admission is neither stopped (drain) nor waiting for weights
        return not self.drains and self.version >= 0

    def _drawable(self) -> bool:  # under cv: the next batch exists and the bound allows it
        return self.next_batch < self.total and self.next_batch <= self.version + self.staleness

    def _capacity(self) -> bool:  # under cv
        return self.max_inflight is None or self.generating < self.max_inflight

    def _admissible(self) -> bool:  # under cv
        return self._open() and self._capacity() and (bool(self.waiting) or self._drawable())

    def _admit(self) -> list[Group]:
        """Draw the batches the bound allows, then take groups oldest first while there is capacity."""
        with self.cv:
            if not self._open():
                return []
            while self._drawable():
                j = self.next_batch
                self.draw_states[j] = self.sampler.state_dict()
                state = TrainerState.at(j, self.total, self.draw_states[j], self.P)
                for i, ex in enumerate(self.sampler.next_batch(self.P)):
                    self.waiting.append(Group(j, i, ex, self.make_params(j, i, ex), state=state))
                self.next_batch += 1
            out = []
            while self.waiting and self._capacity():
                out.append(self.waiting.popleft())
                self.inflight += 1
                self.generating += 1
            return out

    def _submit(self, groups: list[Group]) -> None:  # under engine_lock
        for g in groups:
            if self.agent is not None:
                self.agent.submit([g.example], [g.params], g.key)
                key = g.key
            else:
                key = self.engine.add_request(self.encode(g.example), g.params)
            with self.cv:
                self.running[key] = g

    def _advance(self) -> list[Group]:  # under engine_lock
        if self.agent is not None:
            finished = self.agent.advance(block=False)
            with self.cv:
                done = [self.running.pop(tag) for tag, _ in finished]
            for g, (_, trajs) in zip(done, finished, strict=True):
                g.samples, g.episodes = samples_of_episodes([g.example], trajs), trajs
            return done
        if not self.engine.has_unfinished():
            return []
        done = []
        for out in self.engine.step():
            with self.cv:
                g = self.running.pop(out.request_id, None)
            if g is not None:  # another caller's request (none while the stream runs): not ours to keep
                g.samples = samples_of_outputs([g.example], [out])
                done.append(g)
        return done

    def _score(self) -> None:
        while True:
            g = self._to_score.get()
            if g is None or self.stopping:  # at shutdown, groups still queued are discarded, not scored
                return
            texts = [s.text for s in g.samples]
            g.score = self.scorer.score(texts, [g.example] * len(texts), check=False,
                                        completion_ids=[s.response_ids for s in g.samples], state=g.state)
            scored(g.samples, g.score)
            with self.cv:
                self._finish(g)
                self.cv.notify_all()

    def _finish(self, g: Group) -> None:  # under cv
        self.inflight -= 1
        self.ready[g.key] = g
