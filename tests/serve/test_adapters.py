"""Environment libraries plugged into the endpoint (issue 34, deliverable 4): a verifiers v1 environment run by
verifiers' own harness, interception and scoring (relayrl.serve.adapters.verifiers_env, the `verifiers` data task)
and a Gymnasium text environment (relayrl.serve.adapters.gym_env), each against a tiny model served in-process.

The environments are small modules written here as a user would write them: the verifiers one is a taskset package
(a Taskset, its Task with @vf.reward functions, and an in-process Harness: verifiers' built-in harnesses install
their program with uv at run time, which tests cannot download) loaded by id through verifiers' loader; the
Gymnasium one a `gymnasium.Env` subclass.

References: the library's own scoring called directly on the completion (verifiers' Task.score on a trace it
builds; the environment's step rewards), hand-computed rewards from the reply text, and the ids and logprobs the
endpoint's responses returned (return_token_ids, logprobs) for every token the capture holds.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from relayrl.data.split import split_train_eval  # noqa: E402
from relayrl.data.tasks import Example, check_task, get_task  # noqa: E402
from relayrl.engine import LLMEngine  # noqa: E402
from relayrl.envs.episode import ChatFormat  # noqa: E402
from relayrl.errors import ConfigError, DataError  # noqa: E402
from relayrl.serve import Endpoint, ServerThread  # noqa: E402

MAX_LEN = 192
ENV_ID = "relayrl-vf-sums"  # verifiers imports it as the module relayrl_vf_sums

VF_ENV = textwrap.dedent('''
    """A verifiers v1 environment: sums to answer in one reply (or two: the harness's `turns`)."""
    import asyncio

    from openai import AsyncOpenAI

    import verifiers.v1 as vf

    RECORD = []  # what each model response returned to the harness, in order
    MODELS = []  # the model cards /v1/models listed (as verifiers' chat program reads the context window)


    class SumData(vf.TaskData):
        answer: str = ""


    class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
        @vf.reward
        async def correct(self, task, trace) -> float:
            return float(trace.last_reply == task.answer)

        @vf.reward(weight=0.5)
        async def brief(self, trace) -> float:
            return float(len(trace.last_reply) <= 2)


    class SumTasksetConfig(vf.TasksetConfig):
        n: int = 12


    class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
        def load(self):
            for i in range(self.config.n):
                a, b = i % 4, i // 4
                yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b), system_prompt="add"), self.config.task)


    class ChatHarnessConfig(vf.HarnessConfig):
        turns: int = 1
        stream_last: bool = False
        fail: bool = False
        sleep_s: float = 0.0
        list_models: bool = False


    class ChatHarness(vf.Harness[ChatHarnessConfig]):
        """A chat loop run in-process; every model call goes through the interception `endpoint` (verifiers'
        contract for a harness that needs no program)."""
        APPENDS_SYSTEM_PROMPT = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):
            if self.config.fail:
                raise RuntimeError("the harness broke")
            await asyncio.sleep(self.config.sleep_s)
            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
            async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
                if self.config.list_models:
                    MODELS.extend((m.id, m.model_extra["max_model_len"]) for m in (await client.models.list()).data)
                for turn in range(self.config.turns):
                    if turn:
                        messages.append({"role": "user", "content": "sure?"})
                    if self.config.stream_last and turn == self.config.turns - 1:
                        text, ids, lps = "", [], []
                        stream = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                      stream=True)
                        async for chunk in stream:
                            for ch in chunk.choices:
                                text += ch.delta.content or ""
                                ids += (ch.model_extra or {}).get("token_ids", [])
                                lps += [t.logprob for t in (ch.logprobs.content if ch.logprobs else None) or []]
                        message = {"role": "assistant", "content": text}
                    else:
                        r = await client.chat.completions.create(model=ctx.model, messages=messages)
                        ch = r.choices[0]
                        text, ids = ch.message.content, ch.model_extra["token_ids"]
                        lps = [t.logprob for t in ch.logprobs.content]
                        message = ch.message.model_dump(exclude_none=True)
                    RECORD.append({"content": text, "token_ids": ids, "logprobs": lps, "prompt": prompt})
                    messages.append(message)
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")


    __all__ = ["SumTaskset", "ChatHarness"]
''')

# the run's sampling as verifiers imposes it on every call: short replies, the ids and logprobs returned
SAMPLING = {"max_tokens": 3, "logprobs": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(tok, model):
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=4 << 20, block_size=8)
    with ServerThread(Endpoint(engine, "tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def vf_env(tmp_path_factory):
    """The environment module, importable by its id the way verifiers loads environments (an installed package)."""
    pytest.importorskip("verifiers.v1")
    d = tmp_path_factory.mktemp("vf_envs")
    (d / "relayrl_vf_sums.py").write_text(VF_ENV)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(d))
        import relayrl_vf_sums

        yield relayrl_vf_sums
    sys.modules.pop("relayrl_vf_sums", None)


def vf_agent(**params):
    from relayrl.serve.adapters.verifiers_env import make_agent

    return make_agent(ENV_ID, {"sampling": SAMPLING, **params})


def harness(**kw) -> dict:
    return {"agent": {"harness": {"id": ENV_ID, **kw}}}


def brief_sum(text: str, answer: str) -> float:
    """The environment's reward, by hand: correct (weight 1) + at most 2 characters (weight 0.5)."""
    reply = text.strip()
    return 1.0 * (reply == answer) + 0.5 * (len(reply) <= 2)


@pytest.mark.unit
def test_the_verifiers_task_yields_the_tasksets_rows_split_by_prompt(vf_env):
    task = get_task("verifiers", env=ENV_ID, taskset={"n": 12})
    rows = list(task.taskset)
    assert len(rows) == 12
    train, eval_set = split_train_eval(task, 20, 4, seed=7)
    held_out = {ex.prompt[1]["content"] for ex in eval_set}
    assert len(held_out) == 4 and not held_out & {ex.prompt[1]["content"] for ex in train}
    for ex in train + eval_set:
        row = rows[ex.meta["vf_task"]["idx"]]
        assert ex.prompt == [{"role": "system", "content": "add"}, {"role": "user", "content": row.data.prompt}]
        assert ex.answer == row.data.answer
        assert ex.meta["params"] == {"env": ENV_ID, "taskset": {"n": 12}, "limit": None}
    # the row a rollout rebuilds is the taskset's own, field for field
    from relayrl.data.verifiers_task import rebuild_task

    rebuilt = rebuild_task(task.taskset, eval_set[0])
    original = rows[eval_set[0].meta["vf_task"]["idx"]]
    assert type(rebuilt) is type(original) and rebuilt.data == original.data and rebuilt.key == original.key
    # a limit takes the first tasks of load()
    limited = get_task("verifiers", env=ENV_ID, taskset={"n": 12}, limit=3)
    assert sorted(ex.meta["vf_task"]["idx"] for ex in limited.generate(3, seed=1)) == [0, 1, 2]


@pytest.mark.faults
def test_verifiers_task_params_and_unknown_envs_are_one_line_config_errors(vf_env):
    cases = [({"env": ENV_ID, "n": 3}, "unknown task_params ['n']"), ({}, "task_params.env must name"),
             ({"env": ENV_ID, "limit": 0}, "limit must be a positive integer"),
             ({"env": ENV_ID, "taskset": {"id": "x"}}, "remove taskset.id")]
    for params, said in cases:
        with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("]", r"\]")):
            check_task("verifiers", params)
    for params, said in [({"env": "relayrl-no-such-env"}, "cannot load environment 'relayrl-no-such-env'"),
                         ({"env": ENV_ID, "taskset": {"nn": 3}}, "nn")]:
        with pytest.raises(ConfigError, match=said) as e:
            get_task("verifiers", **params)
        assert "\n" not in str(e.value)


@pytest.mark.equivalence
def test_a_verifiers_episode_is_verifiers_own_rollout_and_reward_and_capture_holds_what_it_sampled(
        vf_env, server, tok):
    task = get_task("verifiers", env=ENV_ID, taskset={"n": 12})
    _, eval_set = split_train_eval(task, 0, 3, seed=0)
    agent = vf_agent(**harness())
    for i, ex in enumerate(eval_set):
        vf_env.RECORD.clear()
        episode = f"vf-one-{i}"
        got = asyncio.run(agent(example=ex, base_url=server.episode_url(episode), model="tiny"))
        (call,) = vf_env.RECORD  # the harness made one call, through verifiers' interception
        # the reward is verifiers' own: Task.score on a trace built afresh from the reply, and the hand formula
        assert got == {"reward": task.score(call["content"], ex), "finish": "done", "counters": {"tool_calls": 0.0}}
        assert got["reward"] == brief_sum(call["content"], ex.answer)
        # the capture: the messages the harness sent, rendered by the template; the ids and logprobs returned
        (line,) = server.endpoint.trajectory(episode)
        assert line["prompt_ids"] == ChatFormat(tok).prompt_ids(ex.prompt)
        assert line["response_ids"] == call["token_ids"] and len(call["token_ids"]) == 3  # max_tokens imposed
        assert line["mask"] == [1] * 3 and line["logprobs"] == call["logprobs"]
    # the rewards differ across examples only through the replies: one example scored correct by hand too
    ex = eval_set[0]
    assert task.score(ex.answer, ex) == 1.5 and task.score(" x y ", ex) == 0.0


@pytest.mark.equivalence
def test_a_two_turn_verifiers_harness_streams_and_the_endpoint_reuses_the_sampled_ids(vf_env, server, tok):
    task = get_task("verifiers", env=ENV_ID, taskset={"n": 12})
    ex = task.generate(1, seed=3)[0]
    agent = vf_agent(**harness(turns=2, stream_last=True, list_models=True))
    vf_env.RECORD.clear()
    episode = asyncio.run(agent.spec.run(ex, server.episode_url("vf-two"), "tiny"))
    first, second = vf_env.RECORD
    assert vf_env.MODELS == [("tiny", MAX_LEN)]  # relayed by the interception from the episode's /v1/models
    (trace,) = episode.traces
    assert [m.content for m in trace.assistant_messages] == [first["content"], second["content"]]
    assert trace.reward == brief_sum(second["content"], ex.answer)  # scored on the last reply
    (line,) = server.endpoint.trajectory("vf-two")
    fmt = ChatFormat(tok)
    s1, s2 = first["token_ids"], second["token_ids"]
    obs = fmt.observation_ids([{"role": "user", "content": "sure?"}], s1[-1])
    assert line["prompt_ids"] == fmt.prompt_ids(ex.prompt)
    assert line["response_ids"] == s1 + obs + s2  # token in, token out: the streamed turn continued the line
    assert line["mask"] == [1] * len(s1) + [0] * len(obs) + [1] * len(s2)
    assert line["logprobs"] == first["logprobs"] + [0.0] * len(obs) + second["logprobs"]
    assert server.endpoint.recorder.counters("vf-two") == {"calls": 2, "retokenize_drift": 0}


@pytest.mark.e2e
def test_concurrent_verifiers_episodes_on_one_event_loop_keep_apart(vf_env, server, tok):
    """As the agent runner runs async agents: several episodes at once on one loop, each its own verifiers Env and
    interception, each capture holding its own episode's tokens."""
    task = get_task("verifiers", env=ENV_ID)
    examples = task.generate(6, seed=5)
    agent = vf_agent(**harness())
    vf_env.RECORD.clear()

    async def go():
        return await asyncio.gather(*(agent(example=ex, base_url=server.episode_url(f"vf-many-{i}"), model="tiny")
                                      for i, ex in enumerate(examples)))

    got = asyncio.run(go())
    by_prompt = {r["prompt"]: r for r in vf_env.RECORD}
    assert len(by_prompt) == len(examples) == len(vf_env.RECORD)
    fmt = ChatFormat(tok)
    for i, (ex, reward) in enumerate(zip(examples, got, strict=True)):
        call = by_prompt[ex.prompt[1]["content"]]
        assert reward["reward"] == brief_sum(call["content"], ex.answer)
        (line,) = server.endpoint.trajectory(f"vf-many-{i}")
        assert line["prompt_ids"] == fmt.prompt_ids(ex.prompt) and line["response_ids"] == call["token_ids"]


@pytest.mark.e2e
def test_a_run_trains_on_a_verifiers_tasksets_examples_scored_by_its_own_rewards(vf_env, tmp_path, monkeypatch):
    """`data.task: verifiers` in a plain run (relayrl's own sampling, the `task` reward): the examples are the
    taskset's, every sample's reward is the environment's, no eval prompt is trained on."""
    import json

    from relayrl.jobs.train import prompt_digest, train

    from helpers import cfg_for

    # the environment is importable in any worker process too, as an installed environment is
    here = str(Path(vf_env.__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    cfg = cfg_for(tmp_path, "vf", data={"task": "verifiers", "task_params": {"env": ENV_ID}, "n_train": 8, "n_eval": 4,
                                        "chat_template": "always"},
                  run={"steps": 1, "save_every": 0}, rollout={"prompts_per_step": 2, "group_size": 4, "max_tokens": 4})
    train(cfg, show_progress=False)
    samples = [json.loads(x) for x in (tmp_path / "vf" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and {s["step"] for s in samples} == {0, 1}
    for s in samples:
        a, b = s["prompt"][1]["content"].removesuffix("=").split("+")
        assert s["answer"] == str(int(a) + int(b)) and s["prompt"][0] == {"role": "system", "content": "add"}
        assert s["reward"] == brief_sum(s["completion"], s["answer"])
    # what was trained on: taskset examples, none of them an eval prompt
    digest = {prompt_digest(ex): ex.prompt[1]["content"] for ex in get_task("verifiers", env=ENV_ID).generate(12, 0)}
    assert len(digest) == 12
    trained = [d for x in (tmp_path / "vf" / "trained_prompts.jsonl").read_text().splitlines()
               for d in json.loads(x)["prompts"]]
    assert len(trained) == 2 and set(trained) <= set(digest)
    assert not {digest[d] for d in trained} & {s["prompt"][1]["content"] for s in samples}


@pytest.mark.e2e
def test_a_verifiers_environment_trains_by_name_through_its_own_harness(vf_env, tmp_path, monkeypatch):
    """rollout.agent: verifiers:ENV_ID, 2 steps: every episode is verifiers' two-turn harness run through the run's
    private endpoint; the run's max_tokens is imposed through verifiers' relay; the trained (and evaluated) rewards
    are the environment's own, recomputed by hand from each episode's last reply."""
    import json

    from relayrl.jobs.train import train
    from relayrl.observe import read_metrics

    from helpers import TINY_ENV_MODEL, cfg_for

    here = str(Path(vf_env.__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    cfg = cfg_for(tmp_path, "vf", model=TINY_ENV_MODEL,
                  data={"task": "verifiers", "task_params": {"env": ENV_ID}, "n_train": 8, "n_eval": 4,
                        "chat_template": "always"},
                  rollout={"prompts_per_step": 2, "group_size": 4, "max_tokens": 2, "agent": f"verifiers:{ENV_ID}",
                           "agent_params": {"sampling": {"logprobs": True, "return_token_ids": True},
                                            **harness(turns=2)}},
                  eval={"max_tokens": 2}, run={"steps": 2, "save_every": 0, "samples_every": 1})
    vf_env.RECORD.clear()
    train(cfg, show_progress=False)
    steps = [m for m in read_metrics(tmp_path / "vf") if "reward/mean" in m]
    assert len(steps) == 2
    for m in steps:
        assert (m["agent/calls"], m["agent/dropped"], m["agent/retokenize_drift"]) == (2.0, 0.0, 0.0)
    # 2 steps x 8 episodes + 2 evaluations x 4, two calls each, every reply within the run's max_tokens
    assert len(vf_env.RECORD) == 2 * (2 * 8 + 2 * 4)
    assert all(1 <= len(r["token_ids"]) <= 2 for r in vf_env.RECORD)
    samples = [json.loads(x) for x in (tmp_path / "vf" / "samples.jsonl").read_text().splitlines()]
    assert sorted({(s["split"], s["step"]) for s in samples}) == [("eval", 0), ("eval", 2), ("train", 1),
                                                                   ("train", 2)]
    for s in samples:
        assert s["reward"] == brief_sum(s["completion"], s["answer"]) >= 0.5
    train_rewards = {st: [s["reward"] for s in samples if s["split"] == "train" and s["step"] == st] for st in (1, 2)}
    for m in steps:
        assert m["reward/mean"] == pytest.approx(sum(train_rewards[m["step"]]) / 8)


@pytest.mark.faults
def test_a_failed_verifiers_episode_raises_and_bad_agent_params_are_one_line(vf_env, server):
    from relayrl.serve.adapters.verifiers_env import VerifiersEpisodeError

    ex = get_task("verifiers", env=ENV_ID).generate(1, seed=0)[0]
    with pytest.raises(VerifiersEpisodeError, match="the harness broke"):
        asyncio.run(vf_agent(**harness(fail=True))(example=ex, base_url=server.episode_url("vf-fail"), model="tiny"))
    for params, said in [({"agent": {"max_turnz": 2}}, "max_turnz"), ({"taskset": {"nn": 1}}, "nn"),
                         ({"sampling": {"max_tokens": "many"}}, "sampling"),
                         ({"agent": {"harness": {"id": "bash"}}}, "harness 'bash', which executes model-written")]:
        with pytest.raises(ConfigError, match=said) as e:
            vf_agent(**params)
        assert "\n" not in str(e.value)
    # a code-executing harness runs where its runtime is pinned; one that executes none defaults to this machine
    pinned = vf_agent(agent={"harness": {"id": "bash"}, "runtime": {"type": "docker"}}).spec.config({})
    assert (pinned.agent.harness.id, pinned.agent.runtime.type) == ("bash", "docker")
    for chat in (vf_agent(**harness()), vf_agent(agent={"harness": {"id": "null"}})):
        assert chat.spec.config({}).agent.runtime.type == "subprocess"
    # past its deadline the runner cancels the episode: verifiers unwinds it (interception down), nothing hangs
    async def cancelled():
        agent = vf_agent(**harness(sleep_s=60.0))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(agent(example=ex, base_url=server.episode_url("vf-late"), model="tiny"), 0.5)
        await asyncio.sleep(0.1)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(cancelled()) == []
    assert server.endpoint.recorder.counters("vf-late")["calls"] == 0
    # a verifiers limit that stops the episode short is the contract's `finish` (env/truncated); it still scores
    vf_env.RECORD.clear()
    short = vf_agent(agent={"max_turns": 1, "harness": {"id": ENV_ID, "turns": 2}})
    got = asyncio.run(short(example=ex, base_url=server.episode_url("vf-short"), model="tiny"))
    (call,) = vf_env.RECORD
    assert got == {"reward": brief_sum(call["content"], ex.answer), "finish": "max_turns",
                   "counters": {"tool_calls": 0.0}}
    # an example from another task: its prompt and answer become the row
    agent = vf_agent(**harness())
    other = Example(prompt="3+4=", answer="7")
    vf_env.RECORD.clear()
    reward = asyncio.run(agent(example=other, base_url=server.episode_url("vf-other"), model="tiny"))["reward"]
    assert reward == brief_sum(vf_env.RECORD[0]["content"], "7")


# ---------------------------------------------------------------------------- Gymnasium


GYM_ENV = textwrap.dedent('''
    """A Gymnasium text environment: say the answer; each wrong try scores its length / 100, 3 tries."""
    import gymnasium
    from gymnasium import spaces


    class Countdown(gymnasium.Env):
        metadata = {}
        observation_space = spaces.Text(max_length=200)
        action_space = spaces.Text(max_length=200)
        log = []

        def reset(self, seed=None, options=None):
            super().reset(seed=seed)
            self.answer, self.tries = options["answer"], 0
            self.log.append(("reset", seed, options["prompt"]))
            return f"say {options['answer']}", {}

        def step(self, action):
            self.tries += 1
            self.log.append(("step", action))
            hit = action.strip() == self.answer
            reward = 1.0 if hit else len(action) / 100
            return f"no, try {self.tries}", reward, hit, self.tries >= 3, {"success": hit}

        def close(self):
            self.log.append(("close",))


    class Broken(Countdown):
        def step(self, action):
            return {"board": [1, 2]}, 0.0, False, False, {}


    class NoStep:
        def reset(self, seed=None, options=None):
            return "x", {}
''')
# every call: short replies, and the ids and logprobs the endpoint returned
GYM_SAMPLING = {"max_tokens": 4, "logprobs": True, "extra_body": {"return_token_ids": True}}


@pytest.fixture(scope="module")
def gym_file(tmp_path_factory):
    pytest.importorskip("gymnasium")
    path = tmp_path_factory.mktemp("gym_envs") / "countdown.py"
    path.write_text(GYM_ENV)
    return str(path)


class Observed:
    """The episode's OpenAI client, keeping each response it returned."""

    def __init__(self, client):
        self.client, self.responses = client, []
        self.chat = self
        self.completions = self

    def create(self, **kw):
        r = self.client.chat.completions.create(**kw)
        self.responses.append(r)
        return r


@pytest.mark.equivalence
def test_a_gymnasium_text_env_episode_sums_its_rewards_and_capture_holds_what_was_sampled(server, tok, gym_file):
    from relayrl.serve.adapters import gym_env

    ref = f"{gym_file}:Countdown"
    agent = gym_env.make_agent(ref, {"max_turns": 5, "system_prompt": "be brief", "seed": 11,
                                     "sampling": GYM_SAMPLING})
    Countdown = gym_env.load_class(ref, "test")  # the class the agent runs (the file is imported once)
    ex = Example(prompt=[{"role": "user", "content": "count down"}], answer="0")
    client = Observed(openai.OpenAI(base_url=server.episode_url("gym-1"), api_key="x", max_retries=0))
    Countdown.log.clear()
    got = agent(example=ex, client=client, model="tiny")
    replies = [r.choices[0].message.content for r in client.responses]
    # the environment's own rewards, recomputed from the replies; 3 tries unless the answer came first
    want = [1.0 if a.strip() == "0" else len(a) / 100 for a in replies]
    assert len(replies) == (3 if 1.0 not in want else want.index(1.0) + 1)
    hit = want[-1] == 1.0
    assert got == {"reward": sum(want), "success": hit, "finish": "done" if hit else "max_turns"}
    assert Countdown.log == [("reset", 11, ex.prompt), *[("step", a) for a in replies], ("close",)]
    # the capture: one line, the sampled ids the responses returned (mask 1), the observations between (mask 0)
    fmt = ChatFormat(tok)
    (line,) = server.endpoint.trajectory("gym-1")
    assert line["prompt_ids"] == fmt.prompt_ids([{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "say 0"}])
    ids, mask, lps = [], [], []
    for k, r in enumerate(client.responses):
        if k:
            obs = fmt.observation_ids([{"role": "user", "content": f"no, try {k}"}], ids[-1])
            ids, mask, lps = ids + obs, mask + [0] * len(obs), lps + [0.0] * len(obs)
        sampled = r.choices[0].model_extra["token_ids"]
        assert 0 < len(sampled) <= 4
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        lps += [t.logprob for t in r.choices[0].logprobs.content]
    assert (line["response_ids"], line["mask"], line["logprobs"]) == (ids, mask, lps)
    assert server.endpoint.recorder.counters("gym-1")["retokenize_drift"] == 0


@pytest.mark.faults
def test_a_gym_env_that_misbehaves_fails_its_episode_and_bad_refs_are_one_line(server, gym_file):
    from relayrl.serve.adapters import gym_env

    agent = gym_env.make_agent(f"{gym_file}:Broken", {"max_turns": 2, "sampling": {"max_tokens": 2}})
    client = openai.OpenAI(base_url=server.episode_url("gym-bad"), api_key="x", max_retries=0)
    with pytest.raises(DataError, match="observation of type dict"):
        agent(example=Example(prompt="p", answer="a"), client=client, model="tiny")
    assert gym_env.load_class(f"{gym_file}:Broken", "test").log[-1] == ("close",)  # closed all the same
    for ref, params, said in [(f"{gym_file}:NoStep", {}, "has no step()"),
                              ("relayrl_no_such_module:Env", {}, "cannot import relayrl_no_such_module"),
                              ("not a ref", {}, "pkg.module:Class"),
                              (f"{gym_file}:Nothing", {}, "has no attribute 'Nothing'"),
                              (f"{gym_file}:Broken", {"max_turn": 2}, "unknown key 'max_turn'")]:
        with pytest.raises(ConfigError, match=said) as e:
            gym_env.make_agent(ref, params)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- the how-to page's examples


def doc_blocks(lang: str) -> list[str]:
    text = (Path(__file__).resolve().parents[2] / "docs/how-to/environment-libraries.md").read_text()
    return [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith(lang + "\n")]


@pytest.mark.e2e
def test_the_how_to_pages_environments_and_configs_run_as_written(server, tmp_path, monkeypatch):
    pytest.importorskip("verifiers.v1")
    pytest.importorskip("gymnasium")
    import yaml

    from relayrl.data.config import DataConfig, build_datasets
    from relayrl.serve.adapters import gym_env, verifiers_env

    sums, countdown = (b for b in doc_blocks("python") if "class " in b)
    (tmp_path / "my_sums.py").write_text(sums)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_sums", raising=False)
    vf_yaml, gym_yaml = (yaml.safe_load(b) for b in doc_blocks("yaml"))
    train, eval_set = build_datasets(DataConfig.from_dict(vf_yaml["data"]))
    assert (len(train), len(eval_set)) == (80, 20)
    for ex in train + eval_set:  # the taskset's sums, scored by its own reward
        a, b = ex.prompt[-1]["content"].removesuffix("=").split("+")
        assert ex.answer == str(int(a) + int(b))
    task = get_task("verifiers", **vf_yaml["data"]["task_params"])
    assert task.score(eval_set[0].answer, eval_set[0]) == 1.0 and task.score("-1", eval_set[0]) == 0.0
    agent = verifiers_env.make_agent(vf_yaml["rollout"]["agent"].removeprefix("verifiers:"),
                                     vf_yaml["rollout"]["agent_params"])
    config = agent.spec.config({})
    assert (config.agent.harness.id, config.agent.runtime.type, config.agent.max_turns) == ("null", "subprocess", 4)
    assert agent.spec.sampling.max_tokens == 64
    # the page's one episode by hand: its agent_params load as written
    import ast
    import re

    (by_hand,) = (b for b in doc_blocks("python") if "make_agent(" in b)
    env_id, params = re.search(r'make_agent\("([\w-]+)", (\{.*\})\)', by_hand).groups()
    config = verifiers_env.make_agent(env_id, ast.literal_eval(params)).spec.config({})
    assert (config.agent.harness.id, config.agent.runtime.type) == ("null", "subprocess")
    # the Gymnasium environment and its config, one episode against the served model
    (tmp_path / "countdown.py").write_text(countdown)
    params = gym_yaml["rollout"]["agent_params"]
    gym = gym_env.make_agent(f"{tmp_path}/countdown.py:Countdown", {**params, "sampling": {"max_tokens": 4}})
    client = Observed(openai.OpenAI(base_url=server.episode_url("doc-gym"), api_key="x", max_retries=0))
    got = gym(example=Example(prompt="count", answer="7"), client=client, model="tiny")
    replies = [r.choices[0].message.content for r in client.responses]
    hits = [float(r.strip() == "7") for r in replies]
    assert len(replies) == (3 if not any(hits) else hits.index(1.0) + 1)
    assert got == {"reward": sum(hits), "success": hits[-1] == 1.0, "finish": "done" if any(hits) else "max_turns"}
