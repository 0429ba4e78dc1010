"""The rollout stream against a scripted engine: the admission rule (batch j only once version >= j - eta),
max_inflight, oldest-first consumption, no engine step while the driver holds it paused, and the sampler
state a checkpoint saves."""

import threading

import pytest

from relayrl.data import Example, PromptSampler
from relayrl.engine.outputs import CompletionSample, RequestOutput
from relayrl.engine.sampling_params import SamplingParams
from relayrl.rewards.result import ScoreResult
from relayrl.rollout.stream import RolloutStream

pytestmark = pytest.mark.unit

P, G = 2, 2


class ScriptedEngine:
    """Each request finishes after `steps` engine steps; records what ran concurrently and when."""

    def __init__(self, steps: int = 3):
        self.steps, self.live, self.next_id = steps, {}, 0
        self.max_live, self.steps_taken, self.prompts = 0, 0, []
        self.weights_version = 0
        self.blocked = threading.Event()  # set: a step now would be a bug (the driver holds the engine)

    def add_request(self, prompt, params):
        rid, self.next_id = self.next_id, self.next_id + 1
        self.live[rid] = (prompt, params, self.steps)
        self.prompts.append(prompt)
        self.max_live = max(self.max_live, len(self.live))
        return rid

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        assert not self.blocked.is_set(), "the engine stepped while paused"
        self.steps_taken += 1
        out = []
        for rid, (prompt, params, left) in list(self.live.items()):
            if left == 1:
                del self.live[rid]
                samples = [CompletionSample([1], [-0.5], "7", finish_reason="length", versions=[self.weights_version])
                           for _ in range(params.n)]
                out.append(RequestOutput(rid, [prompt], samples, self.weights_version))
            else:
                self.live[rid] = (prompt, params, left - 1)
        return out

    def abort(self, ids):
        for rid in ids:
            self.live.pop(rid, None)
        return []


class Scorer:
    def score(self, texts, examples, check=True, completion_ids=None, state=None):
        return ScoreResult(rewards=[1.0] * len(texts), per_function={"f": [1.0] * len(texts)}, failures=0,
                           correct=[True] * len(texts))


def _stream(engine, staleness, max_inflight=None, total=6):
    examples = [Example(prompt=str(i), answer="") for i in range(10)]
    return RolloutStream(engine, sampler=PromptSampler(examples, seed=0), prompts_per_step=P, total_batches=total,
                         staleness=staleness, max_inflight=max_inflight,
                         make_params=lambda b, i, ex: SamplingParams(n=G, max_tokens=1, seed=b * 100 + i),
                         encode=lambda ex: int(ex.prompt), scorer=Scorer())


def _wait_until(cond, timeout=10.0):
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_admission_stops_at_version_plus_eta_and_batches_come_in_draw_order(eta):
    engine = ScriptedEngine()
    s = _stream(engine, eta)
    try:
        s.set_version(0)
        groups, _ = s.take(0)
        assert [(g.batch, g.index) for g in groups] == [(0, 0), (0, 1)]
        with s.paused(drain=True):  # everything admissible has finished: what was admitted is all there is
            assert s.next_batch == eta + 1  # batches 0 .. eta, never eta + 1 at version 0
            assert len(engine.prompts) == P * (eta + 1)
        s.set_version(1)
        groups, _ = s.take(1)
        assert [g.batch for g in groups] == [1, 1]
        _wait_until(lambda: s.next_batch == eta + 2)  # the thread admits the new batch on its own time
        with s.paused(drain=True):
            assert s.next_batch == eta + 2
    finally:
        s.close()


def test_max_inflight_caps_the_groups_generating_at_once():
    engine = ScriptedEngine(steps=4)
    s = _stream(engine, staleness=3, max_inflight=3)
    try:
        s.set_version(0)
        s.take(0)
        s.take(1)
        with s.paused(drain=True):
            pass
        assert engine.max_live == 3  # four batches (8 groups) admissible, at most 3 in the engine at once
    finally:
        s.close()


def test_paused_engine_takes_no_step_and_resumes_after():
    engine = ScriptedEngine(steps=50)
    s = _stream(engine, staleness=1)
    try:
        s.set_version(0)
        with s.paused():
            engine.blocked.set()
            before = engine.steps_taken
            threading.Event().wait(0.05)  # the rollout thread would step many times in 50 ms
            assert engine.steps_taken == before
            engine.blocked.clear()
        s.take(0)  # it resumed
        assert s.error is None
    finally:
        s.close()


def test_sampler_state_is_the_one_before_the_batch_was_drawn():
    engine = ScriptedEngine()
    s = _stream(engine, staleness=2)
    fresh = PromptSampler([Example(prompt=str(i), answer="") for i in range(10)], seed=0)
    try:
        s.set_version(0)
        s.take(0)
        fresh.next_batch(P)  # batch 0
        assert s.sampler_state(1) == fresh.state_dict()  # batches 1 and 2 were drawn since
    finally:
        assert s.close() == 2 * P  # batches 1 and 2, admitted and never taken, are counted as discarded


def test_a_dead_rollout_thread_is_reported_by_the_next_pause():
    class Broken(ScriptedEngine):
        def step(self):
            raise RuntimeError("an engine rank died")

    s = _stream(Broken(), staleness=1)
    try:
        s.set_version(0)
        _wait_until(lambda: s.error is not None)
        with pytest.raises(RuntimeError, match="an engine rank died"):
            with s.paused():  # the driver's next sync learns why, before touching the broken engine
                pass
        with pytest.raises(RuntimeError, match="an engine rank died"):
            s.take(0)
    finally:
        s.close()
