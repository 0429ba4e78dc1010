"""Agents as functions (relayrl.serve.agents): the runner against a tiny engine, and training runs through it.

References: a second engine on the same weights called directly with the run's sampling settings and the per-call
seed (what the endpoint must impose, whatever the agent asks); the chat template's own ids (ChatFormat); relayrl's
own agent loop on the same environment (env: NAME vs rollout.agent: env:NAME train on the same tokens); hand-computed
group means for dropped episodes.
"""

from __future__ import annotations

import threading
import time

import pytest

openai = pytest.importorskip("openai")

from relayrl.controller.config import RunConfig  # noqa: E402
from relayrl.data import Example  # noqa: E402
from relayrl.engine import LLMEngine, SamplingParams  # noqa: E402
from relayrl.engine.sampling_params import turn_seed  # noqa: E402
from relayrl.envs.episode import ChatFormat  # noqa: E402
from relayrl.errors import ConfigError, EnvError  # noqa: E402
from relayrl.jobs.train import train  # noqa: E402
from relayrl.rollout.agent_rewards import settle_rewards  # noqa: E402
from relayrl.serve.agents import AgentRunner, outcome, resolve_agent  # noqa: E402
from tests.helpers import (  # noqa: E402
    TINY_ENV_MODEL,
    assert_same_metrics,
    cfg_for,
    perturbed_model,
    small_config,
    step_metrics,
)

MAX_LEN = 192
SEED = 17
RUN = SamplingParams(n=4, temperature=1.0, top_p=0.9, max_tokens=10, seed=SEED)  # what the run says


def engine_of(model, tok):
    return LLMEngine.from_model(model, tok, kv_cache_bytes=4 << 20, block_size=8)


EX = Example(prompt="what is 2+3?", answer="5")


def two_calls(example, client, model):
    """Asks greedy and short (the run's settings override both), then goes on with a user turn."""
    msgs = [{"role": "user", "content": example.prompt}]
    r = client.chat.completions.create(model=model, messages=msgs, temperature=0.0, max_tokens=500,
                                       extra_body={"return_token_ids": True})
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    r2 = client.chat.completions.create(model=model, messages=msgs, extra_body={"return_token_ids": True})
    got = [r.choices[0].model_extra["token_ids"], r2.choices[0].model_extra["token_ids"]]
    return {"reward": float(len(got[1]) % 3), "counters": {"replies": 2}}, got


async def two_calls_async(example, client, model):
    msgs = [{"role": "user", "content": example.prompt}]
    r = await client.chat.completions.create(model=model, messages=msgs, temperature=0.0)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    r2 = await client.chat.completions.create(model=model, messages=msgs, extra_body={"return_token_ids": True})
    return float(len(r2.choices[0].model_extra["token_ids"]) % 3)


def run_episodes(engine, fn, examples, params, **kw):
    runner = AgentRunner(engine, fn, **kw)
    try:
        return runner.run(examples, params), runner
    finally:
        runner.close()


@pytest.mark.equivalence
def test_episodes_sample_what_the_engine_samples_under_the_runs_settings(model, tok):
    """Each call gets the run's temperature/top_p/max_tokens and the seed turn_seed(seed, sample, call), whatever
    the agent asked; the trajectory is call 1's prompt, its reply, the template's ids for the new turn, reply 2."""
    seen = {}

    def agent(example, client, model):
        out, got = two_calls(example, client, model)
        seen[threading.get_ident(), len(seen)] = got
        return out

    trajs, _ = run_episodes(engine_of(model, tok), agent, [EX], [RUN])
    ref = engine_of(model, tok)
    fmt = ChatFormat(tok)
    stop, stop_ids = fmt.turn_stops(False)
    msgs = [{"role": "user", "content": EX.prompt}]
    prompt = fmt.prompt_ids(msgs)
    assert len(trajs) == 4
    for j, t in enumerate(trajs):
        p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, stop=stop, stop_token_ids=stop_ids)
        (first,) = ref.generate([prompt], [SamplingParams(**{**p.__dict__, "seed": turn_seed(SEED, j, 0)})])
        s1 = first.samples[0]
        obs = fmt.observation_ids([{"role": "user", "content": "again"}], s1.token_ids[-1])
        (second,) = ref.generate([prompt + s1.token_ids + obs],
                                 [SamplingParams(**{**p.__dict__, "seed": turn_seed(SEED, j, 1)})])
        s2 = second.samples[0]
        assert t.prompt_ids == prompt
        assert t.response_ids == s1.token_ids + obs + s2.token_ids
        assert t.mask == [1] * len(s1.token_ids) + [0] * len(obs) + [1] * len(s2.token_ids)
        assert t.reward == float(len(s2.token_ids) % 3) and t.turns == 2 and t.finish == "done"
        assert t.counters["replies"] == 2.0 and t.counters["agent/calls"] == 2.0
        assert t.counters["agent/retokenize_drift"] == 0.0
        want_lp = s1.logprobs + [0.0] * len(obs) + s2.logprobs
        assert t.logprobs == pytest.approx(want_lp, abs=1e-5)
        assert t.versions == [0] * len(s1.token_ids) + [-1] * len(obs) + [0] * len(s2.token_ids)
    # the ids each response carried are the ones recorded (token in, token out)
    assert sorted(g[0] + g[1] for g in seen.values()) == sorted(
        [x for x, m in zip(t.response_ids, t.mask, strict=True) if m] for t in trajs)


@pytest.mark.equivalence
def test_an_async_agent_records_what_a_sync_one_does(model, tok):
    sync, _ = run_episodes(engine_of(model, tok), lambda example, client, model: two_calls(example, client, model)[0]
                           ["reward"], [EX], [RUN])
    asy, runner = run_episodes(engine_of(model, tok), two_calls_async, [EX], [RUN])
    assert runner.is_async
    assert [(t.prompt_ids, t.response_ids, t.mask, t.reward) for t in asy] == \
           [(t.prompt_ids, t.response_ids, t.mask, t.reward) for t in sync]


@pytest.mark.faults
def test_failing_agents_are_dropped_and_take_their_groups_mean(model, tok):
    def agent(example, client, model):
        kind = example.meta["kind"]
        if kind == "raise":
            raise ValueError("the agent broke")
        if kind == "silent":
            return 1.0  # never called the model
        if kind == "bad":
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
            return float("nan")
        if kind == "slow":
            time.sleep(5.0)  # past the deadline: the call after it is refused (its episode is closed)
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
            return 1.0
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
        return float(kind)

    kinds = ["1.0", "0.0", "raise", "silent", "bad", "slow"]
    exs = [Example(prompt="p", answer="", meta={"kind": k}) for k in kinds]
    params = [SamplingParams(n=1, max_tokens=4, seed=i) for i in range(len(kinds))]
    engine = engine_of(model, tok)
    t0 = time.monotonic()
    trajs, runner = run_episodes(engine, agent, exs, params, timeout_s=2.0)
    assert time.monotonic() - t0 < 4.5  # the slow one was not waited for
    assert [t.finish for t in trajs] == ["done", "done", "agent_error", "agent_no_calls", "agent_error",
                                         "agent_timeout"]
    assert "ValueError: the agent broke" in trajs[2].error and "finite number" in trajs[4].error
    for t in trajs[2:]:  # dropped: nothing trained on
        assert t.mask == [] and t.response_ids == []
    # one group of six: the dropped ones take the mean of the two that worked, (1 + 0) / 2
    settle_rewards(trajs, exs, 6, None)
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.5, 0.5, 0.5, 0.5]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


@pytest.mark.faults
def test_an_agent_that_always_fails_stops_at_its_first_submission(model, tok):
    def broken(example):
        raise KeyError("nope")

    with pytest.raises(EnvError, match="agent '.*' failed on every episode of the step, e.g.: KeyError"):
        run_episodes(engine_of(model, tok), broken, [EX], [RUN])


@pytest.mark.unit
def test_episodes_in_flight_stay_under_the_bound(model, tok):
    lock, now, peak = threading.Lock(), [0], [0]

    def agent(example, client, model):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        try:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
            time.sleep(0.05)
            return 1.0
        finally:
            with lock:
                now[0] -= 1

    trajs, _ = run_episodes(engine_of(model, tok), agent, [EX, EX], [RUN, RUN], concurrency=3)
    assert len(trajs) == 8 and all(t.finish == "done" for t in trajs)
    assert peak[0] == 3


@pytest.mark.unit
def test_what_an_agent_returns_is_read_or_refused():
    assert outcome(2).reward == 2.0 and outcome({"reward": 1, "success": False}).success is False
    assert outcome("42").answer == "42" and outcome(None).answer is None and outcome(None).error is None
    for bad, why in [(True, "bool"), ({"score": 1}, "without 'reward'"), ({"reward": float("inf")}, "finite"),
                     ({"reward": 1, "extra": 2}, "unknown key 'extra'"), ([1], "list"),
                     ({"reward": 1, "finish": "crashed"}, "finish")]:
        assert why in outcome(bad).error


@pytest.mark.unit
def test_agent_references_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="argument 'foo' is not one relayrl passes"):
        resolve_agent("tests.fixtures.agents:takes_foo")
    with pytest.raises(ConfigError, match="cannot load agent 'tests.fixtures.agents:missing'"):
        resolve_agent("tests.fixtures.agents:missing")
    with pytest.raises(ConfigError, match="rollout.agent_params go to an adapter"):
        resolve_agent("tests.fixtures.agents:answers", {"x": 1})
    with pytest.raises(ConfigError, match="set one of them"):
        RunConfig.from_dict({"env": {"name": "calculator"}, "rollout": {"agent": "env:calculator"}})


CALC = {"task": "calculator", "task_params": {}, "chat_template": "always", "n_train": 32, "n_eval": 4}


def agent_run(tmp_path, name, mode="sync", sections=None, **rollout):
    return cfg_for(tmp_path, name, model=TINY_ENV_MODEL, data=CALC,
                   rollout={"prompts_per_step": 2, "group_size": 4, "max_tokens": 12, "mode": mode, **rollout},
                   eval={"max_tokens": 12}, run={"steps": 2, "save_every": 0}, **(sections or {}))


WORKER = {"parallel": {"backend": "local", "rollout_worker": True, "placement": "disaggregated"}}


@pytest.mark.equivalence
@pytest.mark.parametrize("mode,sections", [
    ("sync", {}), ("one_step_off", {}), ("sync", {"trainer": {"lora": {"rank": 4}}}),
    pytest.param("sync", WORKER, marks=pytest.mark.slow)],  # 16 s (worker processes): `make bench` runs it
    ids=["sync", "one_step_off", "lora", "rollout_worker"])
def test_an_environment_through_the_endpoint_trains_as_relayrls_agent_loop(tmp_path, mode, sections):
    """rollout.agent: env:calculator (the calculator's episodes through the OpenAI endpoint, tokens captured) and
    env: calculator (relayrl's agent loop) sample the same tokens, so they train the same: in lockstep and
    one-step-off, with LoRA adapters, and with the engine (and the endpoint) in a rollout worker process."""
    env = {"name": "calculator", "max_total_tokens": 160}
    loop = cfg_for(tmp_path, "loop", model=TINY_ENV_MODEL, env=env, data=CALC,
                   rollout={"prompts_per_step": 2, "group_size": 4, "max_tokens": 12, "mode": mode},
                   eval={"max_tokens": 12}, run={"steps": 2, "save_every": 0}, **sections)
    a = step_metrics(train(loop, show_progress=False)["run_dir"])
    b = step_metrics(train(agent_run(tmp_path, "agent", mode, sections, agent="env:calculator",
                                     agent_params={"max_total_tokens": 160}), show_progress=False)["run_dir"])
    # the prefix cache's hit rate depends on when each episode's next call arrives (HTTP, threads), not on what
    # is sampled: the one figure of the engine's left out
    assert_same_metrics(a, b, skip=("engine/prefix_hit_rate",))
    for x, y in zip(a, b, strict=True):
        for k in ("tools/calls", "tools/errors", "env/truncated", "turns/mean"):
            assert x[k] == y[k], k
        assert y["agent/calls"] >= 1.0 and y["agent/dropped"] == 0.0 and y["agent/retokenize_drift"] == 0.0


@pytest.mark.e2e
def test_an_async_run_keeps_the_staleness_bound_and_scores_answers(tmp_path):
    """An agent that returns its answer as text is scored by the run's reward function (the calculator task's
    own); rollout.mode async with max_staleness 1: no token trained is more than one version old."""
    res = train(agent_run(tmp_path, "async", "async", agent="tests.fixtures.agents:answers", max_staleness=1),
                show_progress=False)
    lines = step_metrics(res["run_dir"])
    assert len(lines) == 2
    for m in lines:
        assert m["agent/dropped"] == 0.0 and m["agent/calls"] == 1.0
        assert not [k for k in m if k.startswith("staleness/tokens_at_") and int(k.rsplit("_", 1)[1]) > 1]
        assert 0.0 <= m["reward/mean"] <= 1.0


@pytest.mark.equivalence
def test_a_weight_update_between_two_pumps_pauses_serving_and_the_next_call_samples_the_new_weights(model, tok):
    """The driver owns the engine between two advance() calls: an agent's request that arrives meanwhile waits, and
    is sampled by the weights loaded in between (the version its tokens carry), as a second engine holding those
    weights samples it."""
    new = perturbed_model(small_config(vocab_size=len(tok), max_position_embeddings=MAX_LEN,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), seed=4).eval()
    first_done, go = threading.Event(), threading.Event()

    def agent(example, client, model):
        msgs = [{"role": "user", "content": example.prompt}]
        r = client.chat.completions.create(model=model, messages=msgs)
        first_done.set()
        go.wait(30)  # sent once the test has stopped pumping: it then waits, unserved, through the update
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        client.chat.completions.create(model=model, messages=msgs)
        return 1.0

    engine = engine_of(model, tok)
    runner = AgentRunner(engine, agent)
    try:
        runner.submit([EX], [SamplingParams(n=1, max_tokens=6, seed=SEED)], "t")
        while not first_done.is_set():
            assert runner.advance(block=True) == []
        go.set()
        time.sleep(0.2)  # the second call reaches the engine loop's queue; nothing pumps it
        assert engine.has_unfinished() is False
        engine.load_weights(new.state_dict().items())
        done = []
        while not done:
            done = runner.advance(block=True)
    finally:
        runner.close()
    ((_, (t,)),) = done
    sampled = [i for i, m in enumerate(t.mask) if m]
    n1 = next(k for k in range(len(sampled)) if k + 1 == len(sampled) or sampled[k + 1] != sampled[k] + 1) + 1
    assert [t.versions[i] for i in sampled] == [0] * n1 + [1] * (len(sampled) - n1)
    fmt = ChatFormat(tok)
    stop, stop_ids = fmt.turn_stops(False)
    start = sampled[n1]  # the second reply, sampled by the new weights from the recorded prefix
    (want,) = engine_of(new, tok).generate([t.prompt_ids + t.response_ids[:start]], [SamplingParams(
        max_tokens=6, seed=turn_seed(SEED, 0, 1), stop=stop, stop_token_ids=stop_ids)])
    assert t.response_ids[start:] == want.samples[0].token_ids
