"""The agent loop: token-in token-out across turns, the observation ids, KV reuse between turns, budgets.

The tokenizer here merges digit pairs ("12" is one token), so a model that samples "1" then "2" writes
text whose re-encoding differs from what it sampled: the case where retokenizing between turns would
train on ids the engine never produced (verl #3720).
"""

import json
import threading
import time
from collections import Counter

import pytest
import torch

from relayrl.algorithms.config import AlgoConfig
from relayrl.data import Example, get_task
from relayrl.data.agent_tasks import PRINTABLE
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.envs.base import StepResult, register_env
from relayrl.envs.config import EnvConfig
from relayrl.errors import EnvError
from relayrl.models.tokenizer import build_char_tokenizer, load_tokenizer
from relayrl.rollout.agent_loop import POLL_S, AgentLoop
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig
from tests.helpers import perturbed_model, small_config

DIGITS = "0123456789"


def merging_tokenizer(tmp_path):
    """The tiny char tokenizer plus BPE merges of every digit pair (one token each)."""
    build_char_tokenizer(tmp_path, PRINTABLE, tool_tokens=True)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    # merged tokens take the ids after the characters; the added tool tags move after them (a loader
    # numbers added tokens from the vocabulary's end)
    next_id = max(vocab.values()) + 1
    merges = []
    for a in DIGITS:
        for b in DIGITS:
            vocab[a + b] = next_id
            next_id += 1
            merges.append([a, b])
    for t in spec["added_tokens"]:
        if t["id"] > 3:
            t["id"], next_id = next_id, next_id + 1
    spec["model"]["merges"] = merges
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return load_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = merging_tokenizer(tmp_path_factory.mktemp("tok"))
    assert tok("12", add_special_tokens=False)["input_ids"] != [tok.convert_tokens_to_ids("1"),
                                                                tok.convert_tokens_to_ids("2")]
    cfg = small_config(vocab_size=len(tok), max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    model = perturbed_model(cfg, seed=3).eval()
    return tok, model


class Spy:
    """Records what the engine produced and how much of each request's prefix was cached."""

    def __init__(self, engine):
        self.engine, self.outputs, self.allocations = engine, [], []
        bm = engine.block_manager
        allocate = bm.allocate

        def spy_allocate(seq):
            allocate(seq)
            self.allocations.append((list(seq.token_ids), seq.num_cached_tokens))

        bm.allocate = spy_allocate
        step = engine.step

        def spy_step():
            outs = step()
            self.outputs += outs
            return outs

        engine.step = spy_step


def mask_runs(mask):
    """(start, end, value) of each run of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


def run_guess(tok, model, n_prompts=4, G=4, **engine_kw):
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20, block_size=8, **engine_kw)
    spy = Spy(engine)
    loop = AgentLoop(engine, EnvConfig(name="guess", max_turns=3, max_total_tokens=200))
    examples = get_task("guess", high=99).generate(n_prompts, seed=1)
    params = [SamplingParams(n=G, temperature=1.0, max_tokens=12, seed=10 + i) for i in range(n_prompts)]
    try:
        trajs = loop.run(examples, params)
    finally:
        loop.close()
        engine.close()
    return trajs, spy


@pytest.mark.equivalence
@pytest.mark.parametrize("padding_free", [False, True])
def test_trained_ids_are_the_sampled_ids_and_logprobs_match_the_trainer(setup, padding_free):
    tok, model = setup
    trajs, spy = run_guess(tok, model)
    assert len(trajs) == 16 and max(t.turns for t in trajs) >= 2
    # every generated segment of every episode is one engine output, token for token (and nothing else)
    generated = Counter()
    for t in trajs:
        for a, b, v in mask_runs(t.mask):
            if v == 1:
                generated[tuple(t.response_ids[a:b])] += 1
    sampled = Counter(tuple(o.samples[0].token_ids) for o in spy.outputs)
    assert generated == sampled
    # the case is real: some sampled turns do not survive decode-then-encode
    drifted = [ids for ids in sampled if tok(tok.decode(list(ids)), add_special_tokens=False)["input_ids"] != list(ids)]
    assert drifted, "no sampled turn changes under decode-then-encode: the test would not catch retokenization"
    # the trainer's recomputed logprobs (its own path: micro-batches, and packed rows) equal the engine's
    # on every generated token of every turn
    ids, attn, resp = build_rows([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                                 pad_id=tok.pad_token_id, masks=[t.mask for t in trajs])
    actor = Actor(model, TrainerConfig(micro_batch_size=5, padding_free=padding_free), AlgoConfig(), total_steps=1)
    logp = actor.compute_logprobs(TrainBatch(ids, attn, resp))
    engine_logp = torch.zeros_like(logp)
    for i, t in enumerate(trajs):
        engine_logp[i, len(t.prompt_ids):len(t.prompt_ids) + len(t.logprobs)] = torch.tensor(t.logprobs)
    assert resp.sum() == sum(t.model_tokens for t in trajs)
    gap = ((logp - engine_logp) * resp).abs().max()
    assert gap <= 1e-5
    # had the text been re-encoded, the trained rows would differ from what was sampled
    retokenized = [tok(tok.decode(t.prompt_ids + t.response_ids), add_special_tokens=False)["input_ids"]
                   for t in trajs]
    assert any(r != t.prompt_ids + t.response_ids for r, t in zip(retokenized, trajs, strict=True))


@pytest.mark.equivalence
def test_observations_are_the_templates_continuation(setup):
    tok, model = setup
    trajs, _ = run_guess(tok, model)
    eos = tok.eos_token_id
    seen = 0
    for t in trajs:
        for a, b, v in mask_runs(t.mask):
            if v == 1:
                continue
            text = tok.decode(t.response_ids[a:b])
            # after a turn that ended with EOS only the newline of the turn's close is left; after one
            # cut by max_tokens the whole close ("<eos>\n") comes first, as the template renders it
            close = "\n" if t.response_ids[a - 1] == eos else "<eos>\n"
            assert text in {f"{close}user: {m}\nassistant: " for m in ("Higher.", "Lower.", "Answer with a number.")}
            seen += 1
    assert seen > 0
    # the prompt is the template's rendering of the first message with the generation prompt
    ex = get_task("guess", high=99).generate(4, seed=1)[0]
    assert tok.decode(trajs[0].prompt_ids) == f"user: {ex.prompt}\nassistant: "
    assert ex.prompt.startswith("Guess my number from ")


@pytest.mark.equivalence
def test_a_continuing_episode_reuses_its_kv_blocks(setup):
    """Each later turn's request is the conversation so far: its full blocks written in the previous
    turn (prompt and generated tokens but the last) come from the prefix cache."""
    tok, model = setup
    _, spy = run_guess(tok, model)
    bs = 8
    written: dict[tuple, int] = {}  # a request's ids + its output -> tokens with KV written
    for o in spy.outputs:
        full = tuple(o.prompt_token_ids + o.samples[0].token_ids)
        written[full] = len(full) - 1
    continuations = 0
    for ids, cached in spy.allocations:
        prev = [n for full, n in written.items() if len(full) < len(ids) and tuple(ids[:len(full)]) == full]
        if not prev:
            continue
        continuations += 1
        expect = min(max(prev) // bs, (len(ids) - 1) // bs) * bs
        assert cached >= expect, (cached, expect)
    assert continuations > 0
    # without prefix caching nothing is reused: the check above would fail
    _, spy_off = run_guess(tok, model, enable_prefix_caching=False)
    assert all(cached == 0 for _, cached in spy_off.allocations)


@pytest.mark.unit
def test_budgets_end_episodes(setup):
    tok, model = setup
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20)
    examples = get_task("guess", high=99).generate(2, seed=1)
    try:
        loop = AgentLoop(engine, EnvConfig(name="guess", max_turns=2, max_total_tokens=500))
        trajs = loop.run(examples, [SamplingParams(n=4, max_tokens=12, seed=i) for i in range(2)])
        assert all(t.turns <= 2 for t in trajs)
        assert all(t.finish == "max_turns" for t in trajs if not t.success)
        loop.close()
        loop = AgentLoop(engine, EnvConfig(name="guess", max_turns=10, max_total_tokens=90))
        trajs = loop.run(examples, [SamplingParams(n=4, max_tokens=12, seed=i) for i in range(2)])
        assert all(len(t.prompt_ids) + len(t.response_ids) <= 90 for t in trajs)
        assert any(t.finish == "max_total_tokens" for t in trajs)
        loop.close()
    finally:
        engine.close()


class Gate:
    """The slow episode's environment waits on `fast_done`, which the fast episodes set when they have all
    finished: had the loop waited for the slow environment, they never could, and the wait times out."""

    fast_done = threading.Event()
    fast_left = 3
    lock = threading.Lock()
    slow_saw_fast_done: bool | None = None
    slow_sleep_s = 0.0

    @classmethod
    def reset(cls, slow_sleep_s=0.0):
        cls.fast_done.clear()
        cls.fast_left, cls.slow_saw_fast_done, cls.slow_sleep_s = 3, None, slow_sleep_s


@register_env("test_slow")
class SlowEnv:
    """"slow": one turn whose step blocks (see Gate); "fast": three quick turns."""

    tools: list = []

    def reset(self, example: Example):
        self.name, self.turn = example.prompt, 0
        return [{"role": "user", "content": example.prompt}]

    def step(self, message):
        self.turn += 1
        if self.name == "slow":
            if Gate.slow_sleep_s:
                time.sleep(Gate.slow_sleep_s)
            else:
                Gate.slow_saw_fast_done = Gate.fast_done.wait(timeout=30)
            return StepResult(None, 1.0, True, {})
        if self.turn < 3:
            return StepResult([{"role": "user", "content": "again"}], 0.0, False, {})
        with Gate.lock:
            Gate.fast_left -= 1
            if Gate.fast_left == 0:
                Gate.fast_done.set()
        return StepResult(None, 1.0, True, {})


def slow_run(tok, model, step_timeout_s):
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20)
    examples = [Example("slow", "")] + [Example(f"fast{i}", "") for i in range(3)]
    loop = AgentLoop(engine, EnvConfig(name="test_slow", max_turns=3, step_timeout_s=step_timeout_s))
    try:
        t0 = time.perf_counter()
        trajs = loop.run(examples, [SamplingParams(n=1, max_tokens=8, seed=i, ignore_eos=True) for i in range(4)])
        return trajs, time.perf_counter() - t0
    finally:
        loop.close()
        engine.close()


@pytest.mark.unit
def test_a_slow_environment_does_not_stall_the_others(setup):
    tok, model = setup
    Gate.reset()
    trajs, _ = slow_run(tok, model, step_timeout_s=60)
    assert [t.turns for t in trajs] == [1, 3, 3, 3]
    # the fast episodes went through all their turns while the slow environment was still answering
    assert Gate.slow_saw_fast_done is True


@pytest.mark.faults
def test_an_environment_past_its_deadline_ends_its_episode(setup):
    tok, model = setup
    Gate.reset(slow_sleep_s=20.0)
    trajs, took = slow_run(tok, model, step_timeout_s=0.5)
    assert trajs[0].finish == "env_timeout" and trajs[0].reward == 0.0
    assert [t.finish for t in trajs[1:]] == ["done"] * 3
    assert took < 15  # the loop did not wait for the abandoned step


HANG_SCRIPT = """
import time
from relayrl.rollout.agent_loop import POLL_S, AgentLoop
from relayrl.data import Example
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.envs.config import EnvConfig
from relayrl.errors import EnvError
from relayrl.models.tokenizer import build_char_tokenizer
from tests.helpers import perturbed_model, small_config
import sys, tempfile
tok = build_char_tokenizer(tempfile.mkdtemp(), "abc")
engine = LLMEngine.from_model(perturbed_model(small_config(vocab_size=len(tok))), tok, kv_cache_bytes=8 << 20)
loop = AgentLoop(engine, EnvConfig(name="tests.fixtures.envs:Hang", step_timeout_s=0.3, workers=1))
trajs = loop.run([Example("a", "")], [SamplingParams(n=3, max_tokens=4, seed=0)])
print(" ".join(t.finish for t in trajs), flush=True)
loop.close()
engine.close()
"""


@pytest.mark.faults
def test_a_hung_environment_step_does_not_keep_the_process_alive():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # the repository: tests.fixtures imports from there
    out = subprocess.run([sys.executable, "-c", HANG_SCRIPT], cwd=root, capture_output=True, text=True, timeout=120)
    # the first step was abandoned at its deadline; with its one thread held, the two steps queued behind it
    # could never start and ended too (not a loop waiting forever); the interpreter exited with the thread
    # still blocked
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "env_timeout env_timeout env_timeout"


# ---------------------------------------------------------------------------- incremental: submit / advance


def drain(loop, done=None, limit_s=120.0):
    """advance() until nothing is in flight; each returned tag once -> its trajectories."""
    done = {} if done is None else done
    t0 = time.perf_counter()
    while loop.busy:
        for tag, trajs in loop.advance():
            assert tag not in done, f"tag {tag!r} returned twice"
            done[tag] = trajs
        assert time.perf_counter() - t0 < limit_s
    return done


def same_trajectories(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.prompt_ids, x.response_ids, x.mask, x.reward, x.turns, x.finish, x.versions) == \
               (y.prompt_ids, y.response_ids, y.mask, y.reward, y.turns, y.finish, y.versions)
        # the same tokens through batches of another make-up: equal up to float reassociation
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


@pytest.mark.unit
def test_submissions_come_back_once_each_as_run_makes_them(setup):
    tok, model = setup
    examples = get_task("guess", high=99).generate(4, seed=1)
    params = [SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=10 + i) for i in range(4)]
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20, block_size=8)
    loop = AgentLoop(engine, EnvConfig(name="guess", max_turns=3, max_total_tokens=200))
    try:
        ran = loop.run(examples, params)
        assert not loop.busy
        for i in range(4):  # one group (one example, its G episodes) per tag, as the driver submits
            loop.submit([examples[i]], [params[i]], tag=("group", i))
        assert loop.busy
        done = drain(loop)
    finally:
        loop.close()
        engine.close()
    assert sorted(done) == [("group", i) for i in range(4)]
    assert max(t.turns for t in ran) >= 2  # multi-turn: the comparison covers observations and later turns
    for i in range(4):
        same_trajectories(done[("group", i)], ran[3 * i:3 * i + 3])


HELD = threading.Event()


@register_env("test_held")
class HeldEnv:
    """Episodes of "held" block in their first step until the test sets HELD (or 30 s pass); the others
    take two quick turns."""

    tools: list = []
    released: list = []

    def reset(self, example: Example):
        self.name, self.turn = example.prompt, 0
        return [{"role": "user", "content": example.prompt}]

    def step(self, message):
        self.turn += 1
        if self.name == "held":
            HeldEnv.released.append(HELD.wait(timeout=30))
            return StepResult(None, 1.0, True, {})
        if self.turn < 2:
            return StepResult([{"role": "user", "content": "again"}], 0.0, False, {})
        return StepResult(None, 0.5, True, {})


@pytest.mark.unit
def test_a_group_completes_while_another_waits_on_its_environment(setup):
    tok, model = setup
    HELD.clear()
    HeldEnv.released = []
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20)
    loop = AgentLoop(engine, EnvConfig(name="test_held", max_turns=3, step_timeout_s=60))
    sp = SamplingParams(n=2, max_tokens=6, seed=0, ignore_eos=True)
    try:
        loop.submit([Example("held", "")], [sp], tag="held")
        loop.submit([Example("a", "")], [sp], tag="a")
        loop.submit([Example("b", "")], [sp], tag="b")
        done, t0 = {}, time.perf_counter()
        while set(done) != {"a", "b"}:
            for tag, trajs in loop.advance():
                done[tag] = trajs
            assert time.perf_counter() - t0 < 20, "the fast groups never came back"
        # the fast groups came back while the held one's environment was still blocked
        assert loop.busy and HeldEnv.released == []
        assert [t.turns for t in done["a"] + done["b"]] == [2] * 4
        assert [t.reward for t in done["a"] + done["b"]] == [0.5] * 4
        # with none of its requests in the engine, a call waits on the environments at most POLL_S:
        # it returns with nothing rather than running until the held group ends
        for _ in range(3):
            t1 = time.perf_counter()
            assert loop.advance() == []
            assert time.perf_counter() - t1 < POLL_S + 0.5
        HELD.set()
        drain(loop, done)
    finally:
        HELD.set()
        loop.close()
        engine.close()
    assert HeldEnv.released == [True, True]
    assert [(t.turns, t.reward, t.finish) for t in done["held"]] == [(1, 1.0, "done")] * 2


@pytest.mark.unit
@pytest.mark.parametrize("per_token", [True, False])
def test_tokens_carry_the_weights_version_that_sampled_them(setup, per_token):
    """The weights are reloaded (version + 1) after every engine step: each generated segment's last token
    has the version its output came out under, earlier tokens no later one; observed ids have -1. A backend
    whose samples give no versions (per_token=False) has each turn's tokens take its output's version."""
    tok, model = setup
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20, block_size=8)
    engine.partial = "keep_kv"  # requests in flight carry on through a weight update (asynchronous RL's mode)
    if not per_token:
        step = engine.step

        def silent_step():
            outs = step()
            for o in outs:
                for s in o.samples:
                    s.versions = []
            return outs

        engine.step = silent_step
    spy = Spy(engine)
    weights = model.state_dict()
    loop = AgentLoop(engine, EnvConfig(name="guess", max_turns=3, max_total_tokens=200))
    examples = get_task("guess", high=99).generate(2, seed=1)
    try:
        engine.load_weights(weights.items())
        start = engine.weights_version
        assert start >= 1
        loop.submit(examples, [SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5 + i) for i in range(2)],
                    tag="all")
        done = {}
        while loop.busy:
            done.update(loop.advance())
            engine.load_weights(weights.items())
    finally:
        loop.close()
        engine.close()
    came_out: dict[tuple, set] = {}  # a turn's ids -> the versions its outputs came out under
    for o in spy.outputs:
        came_out.setdefault(tuple(o.prompt_token_ids + o.samples[0].token_ids), set()).add(o.weights_version)
    seen, spans = set(), 0
    for t in done["all"]:
        assert len(t.versions) == len(t.response_ids)
        for a, b, v in mask_runs(t.mask):
            seg = t.versions[a:b]
            if v == 0:
                assert seg == [-1] * (b - a)
                continue
            # (two episodes may sample the same turn, e.g. a lone EOS, at different versions)
            last = seg[-1]
            assert last in came_out[tuple(t.prompt_ids + t.response_ids[:b])]
            assert all(start <= x <= last for x in seg) and seg == sorted(seg)
            if not per_token:
                assert seg == [last] * (b - a)
            seen.update(seg)
            spans += len(set(seg)) > 1
    assert len(seen) > 2  # turns were sampled under several versions
    assert (spans > 0) == per_token  # the engine's own record: a turn spans the updates made during it


@pytest.mark.unit
def test_outputs_of_requests_the_loop_did_not_add_are_left_alone(setup):
    tok, model = setup
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20, block_size=8)
    examples = get_task("guess", high=99).generate(2, seed=1)
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=20 + i) for i in range(2)]
    loop = AgentLoop(engine, EnvConfig(name="guess", max_turns=3, max_total_tokens=200))
    try:
        alone = loop.run(examples, params)
        spy = Spy(engine)
        loop.submit(examples, params, tag="g")
        loop.advance()
        foreign = engine.add_request(tok("user: hi\nassistant: ", add_special_tokens=False)["input_ids"],
                                     SamplingParams(n=2, max_tokens=5, seed=1, ignore_eos=True))
        done = drain(loop)
        # the foreign request ran in the loop's steps, and its output came out of one of them
        assert [len(s.token_ids) for o in spy.outputs if o.request_id == foreign for s in o.samples] == [5, 5]
    finally:
        loop.close()
        engine.close()
    same_trajectories(done["g"], alone)


@register_env("test_picky")
class PickyEnv:
    """Fails its step on the example "bad"; any other ends after one turn with reward 1."""

    tools: list = []

    def reset(self, example: Example):
        self.name = example.prompt
        return [{"role": "user", "content": example.prompt}]

    def step(self, message):
        if self.name == "bad":
            raise KeyError("score")
        return StepResult(None, 1.0, True, {})


@pytest.mark.unit
def test_an_environment_that_always_fails_stops_at_its_first_group_but_one_bad_group_does_not(setup):
    tok, model = setup
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20)
    sp = SamplingParams(n=2, max_tokens=4, seed=0, ignore_eos=True)
    try:
        loop = AgentLoop(engine, EnvConfig(name="test_picky"))
        loop.submit([Example("bad", "")], [sp], tag=0)
        loop.submit([Example("bad", "")], [sp], tag=1)
        with pytest.raises(EnvError, match=r"^environment 'test_picky' failed on every episode of the step, "
                                           r"e.g.: KeyError: 'score'$"):
            drain(loop)
        loop.abort_all()
        assert not loop.busy and not engine.has_unfinished()
        loop.close()
        # once an episode got through, a group whose every episode failed comes back like any other
        loop = AgentLoop(engine, EnvConfig(name="test_picky"))
        loop.submit([Example("good", "")], [sp], tag="good")
        done = drain(loop)
        loop.submit([Example("bad", "")], [sp], tag="bad")
        drain(loop, done)
        assert [t.finish for t in done["good"]] == ["done", "done"]
        assert [(t.finish, t.error) for t in done["bad"]] == [("env_error", "KeyError: 'score'")] * 2
        # run() still raises when every episode of its batch failed, whatever came before
        with pytest.raises(EnvError, match="failed on every episode"):
            loop.run([Example("bad", "")], [sp])
        assert len(loop.run([Example("bad", ""), Example("good", "")], [sp, sp])) == 4
        loop.close()
    finally:
        engine.close()


@pytest.mark.unit
def test_abort_all_drops_the_loops_requests_and_the_loop_serves_again(setup):
    tok, model = setup
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20, block_size=8)
    loop = AgentLoop(engine, EnvConfig(name="guess", max_turns=3, max_total_tokens=200))
    examples = get_task("guess", high=99).generate(2, seed=1)
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=30 + i) for i in range(2)]
    try:
        loop.submit(examples, params, tag="x")
        while not engine.has_unfinished():
            loop.advance()
        foreign = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, seed=0))
        loop.abort_all()
        assert not loop.busy and loop.advance() == []
        # only the foreign request is left in the engine
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert [o.request_id for o in outs] == [foreign]
        # the same loop runs a fresh batch exactly as a new loop would
        again = loop.run(examples, params)
    finally:
        loop.close()
    fresh = AgentLoop(engine, EnvConfig(name="guess", max_turns=3, max_total_tokens=200))
    try:
        same_trajectories(again, fresh.run(examples, params))
    finally:
        fresh.close()
        engine.close()
