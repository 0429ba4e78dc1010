"""Environments and episode bookkeeping: the built-in environments' steps, the registry's errors, the chat
template's continuation (tiny and Qwen-style templates), and demonstrations encoded as episodes."""

import json

import pytest

from relayrl.controller.config import RunConfig
from relayrl.data import Example, get_task
from relayrl.data.agent_tasks import PRINTABLE
from relayrl.envs.base import as_step_result, make_env
from relayrl.envs.config import EnvConfig
from relayrl.envs.episode import ChatFormat, Episode, encode_conversation
from relayrl.errors import ConfigError, EnvError
from relayrl.models.tokenizer import build_char_tokenizer
from relayrl.sandbox import sandbox_available
from tests.helpers import importable

pytestmark = pytest.mark.unit

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "482*37+905"}}</tool_call>'

# the shape of Qwen2.5's template: tools in a system turn, tool results wrapped in a user turn
QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- ' ' + t.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"), PRINTABLE, tool_tokens=True)


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    t = build_char_tokenizer(tmp_path_factory.mktemp("qtok"), PRINTABLE, tool_tokens=True)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = QWEN_LIKE
    return t


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def calculator_schema():
    return [t.schema() for t in make_env(EnvConfig(name="calculator")).tools]


# ---------------------------------------------------------------------------- the template's continuation
def test_tiny_template_continuation(tok):
    fmt = ChatFormat(tok, calculator_schema())
    assert fmt.close_text == "<eos>\n" and fmt.turn_end_ids == [tok.eos_token_id]
    assert tok.decode(fmt.prompt_ids([{"role": "user", "content": "What is 1+2?"}])) == (
        "tools: calculator(expression)\nuser: What is 1+2?\nassistant: ")
    obs = [{"role": "tool", "content": "3"}]
    # a turn that ended with EOS has said "<eos>": only its newline is left
    assert tok.decode(fmt.observation_ids(obs, tok.eos_token_id)) == (
        "\ntool: <tool_response>3</tool_response>\nassistant: ")
    # a turn that stopped at the closed tool call observes the whole close
    close_tag = ids_of(tok, "</tool_call>")[0]
    assert tok.decode(fmt.observation_ids(obs, close_tag)) == (
        "<eos>\ntool: <tool_response>3</tool_response>\nassistant: ")
    assert fmt.turn_stops(True) == ([], [tok.eos_token_id, close_tag])
    assert fmt.turn_stops(False) == ([], [tok.eos_token_id])


def test_qwen_like_template_continuation(qwen_tok):
    fmt = ChatFormat(qwen_tok, calculator_schema())
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    assert fmt.close_text == "<|im_end|>\n"
    assert fmt.turn_end_ids[0] == im_end and qwen_tok.eos_token_id in fmt.turn_end_ids
    obs = [{"role": "tool", "content": "3"}]
    expect = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert qwen_tok.decode(fmt.observation_ids(obs, im_end)) == expect
    assert qwen_tok.decode(fmt.observation_ids(obs, ids_of(qwen_tok, "</tool_call>")[0])) == "<|im_end|>" + expect
    assert qwen_tok.decode(fmt.prompt_ids([{"role": "user", "content": "hi"}])) == (
        "<|im_start|>system\nTools: calculator<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_demonstration_encodes_as_the_template_renders_it(tok):
    env = make_env(EnvConfig(name="calculator"))
    ex = get_task("calculator").generate(1, seed=0)[0]
    messages = env.demonstration(ex)
    fmt = ChatFormat(tok, calculator_schema())
    traj = encode_conversation(fmt, messages, fmt.turn_stops(True)[1])
    # the whole row reads as the template's rendering (whose last turn ends with a newline)
    assert tok.decode(traj.prompt_ids + traj.response_ids) + "\n" == fmt.render(messages)
    # loss on the assistant's two turns only: the tool call (ending at its closing tag) and the answer + EOS
    ones = [i for i, m in enumerate(traj.mask) if m]
    trained = tok.decode([traj.response_ids[i] for i in ones])
    assert trained == messages[1]["content"] + ex.answer + "<eos>"
    assert messages[1]["content"].startswith("<tool_call>") and messages[2]["content"] == ex.answer
    assert traj.turns == 2


# ---------------------------------------------------------------------------- built-in environments
def test_calculator_env_runs_the_tool_and_scores_the_answer():
    env = make_env(EnvConfig(name="calculator"))
    ex = Example("What is 482*37+905?", str(482 * 37 + 905), meta={"expression": "482*37+905"})
    assert env.reset(ex) == [{"role": "user", "content": "What is 482*37+905?"}]
    obs, reward, done, info = env.step({"role": "assistant", "content": CALL})
    assert (reward, done, info["tool_calls"], info["tool_errors"]) == (0.0, False, 1, 0)
    assert obs[0]["role"] == "tool" and obs[0]["content"] == "18739"
    assert env.step({"role": "assistant", "content": "It is 18739"}) == (None, 1.0, True, {"success": True})
    assert env.step({"role": "assistant", "content": "18738"})[1:3] == (0.0, True)


def test_calculator_env_returns_tool_errors_as_observations():
    env = make_env(EnvConfig(name="calculator"))
    env.reset(Example("What is 1+1?", "2"))
    for text, says in [('<tool_call>{"name": "calculator", "arguments": {"expression": "1+</tool_call>', "JSON"),
                       ('<tool_call>{"name": "abacus", "arguments": {}}</tool_call>', "unknown tool"),
                       ('<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>', "expression"),
                       ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>', "zero")]:
        obs, reward, done, info = env.step({"role": "assistant", "content": text})
        assert not done and reward == 0.0 and info["tool_errors"] == 1
        assert says.lower() in obs[0]["content"].lower()


def test_guess_env_and_its_demonstration():
    env = make_env(EnvConfig(name="guess"))
    env.reset(Example("Guess", "21", meta={"low": 1, "high": 32}))
    assert env.step({"role": "assistant", "content": "16"})[0] == [{"role": "user", "content": "Higher."}]
    assert env.step({"role": "assistant", "content": "30"})[0] == [{"role": "user", "content": "Lower."}]
    assert env.step({"role": "assistant", "content": "no idea"})[0][0]["content"] == "Answer with a number."
    assert env.step({"role": "assistant", "content": "21"}) == (None, 1.0, True, {"success": True})
    for ex in get_task("guess", high=32).generate(20, seed=0):
        trace = make_env(EnvConfig(name="guess")).demonstration(ex)
        guesses = [m["content"] for m in trace if m["role"] == "assistant"]
        assert guesses[-1] == ex.answer and len(guesses) <= 6  # binary search over 32 numbers
        assert ex.meta["low"] <= int(ex.answer) <= ex.meta["high"] == ex.meta["low"] + 31


# ---------------------------------------------------------------------------- registry and config errors
def test_unknown_env_and_bad_params_are_one_line():
    with pytest.raises(EnvError, match="unknown environment 'nope'.*calculator"):
        make_env(EnvConfig(name="nope"))
    with pytest.raises(EnvError, match="bad env.params"):
        make_env(EnvConfig(name="guess", params={"levels": 3}))
    with pytest.raises(EnvError, match="takes no tools"):
        make_env(EnvConfig(name="guess", tools=["calculator"]))


def test_user_env_class_by_module_path(tmp_path):
    source = (
        "class Echo:\n"
        "    tools = []\n"
        "    def __init__(self, bonus=0.0):\n"
        "        self.bonus = bonus\n"
        "    def reset(self, example):\n"
        "        return [{'role': 'user', 'content': example.prompt}]\n"
        "    def step(self, message):\n"
        "        return None, 1.0 + self.bonus, True, {}\n"
        "class NotAnEnv:\n"
        "    pass\n")
    with importable(tmp_path, "my_envs", source):
        env = make_env(EnvConfig(name="my_envs:Echo", params={"bonus": 0.5}))
        assert as_step_result(env.step({"role": "assistant", "content": "x"}), "e") == (None, 1.5, True, {})
        with pytest.raises(EnvError, match="without reset"):
            make_env(EnvConfig(name="my_envs:NotAnEnv"))
        with pytest.raises(EnvError, match="has no attribute 'Missing'"):
            make_env(EnvConfig(name="my_envs:Missing"))
    with pytest.raises(EnvError, match=r"step\(\) must return"):
        as_step_result(3, "e")
    with pytest.raises(EnvError, match="list of messages"):
        as_step_result(("hi", 0, True, {}), "e")


def test_env_config_needs_the_chat_template_and_relayrls_engine():
    base = {"data": {"task": "calculator", "chat_template": "never"}, "env": {"name": "calculator"}}
    with pytest.raises(ConfigError, match="env: episodes are conversations, rendered through the chat template; "
                                          "set data.chat_template=auto"):
        RunConfig.from_dict(base)
    assert RunConfig.from_dict({**base, "data": {"task": "calculator"}}).data.chat_template == "auto"
    with pytest.raises(ConfigError, match="rollout.backend=relayrl"):
        RunConfig.from_dict({**base, "data": {"task": "calculator", "chat_template": "always"},
                             "rollout": {"backend": "vllm"}})
    with pytest.raises(ConfigError, match="env.max_turns"):
        RunConfig.from_dict({**base, "env": {"name": "calculator", "max_turns": 0}})


def test_episode_observe_respects_the_token_budget(tok):
    fmt = ChatFormat(tok, None)
    ep = Episode(index=0, env=None, fmt=fmt)
    ep.start([{"role": "user", "content": "hi"}])
    ep.add_generated([tok.eos_token_id], [0.0], "")
    n = len(ep.ids)
    obs = [{"role": "user", "content": "x" * 10}]
    need = len(fmt.observation_ids(obs, tok.eos_token_id))
    assert not ep.observe(obs, max_total_tokens=n + need) and len(ep.ids) == n  # no room left to generate
    assert ep.observe(obs, max_total_tokens=n + need + 1) and len(ep.ids) == n + need
    assert ep.mask == [1] + [0] * need and json.dumps(ep.trajectory().mask)


@pytest.mark.skipif(sandbox_available() is not None, reason=f"sandbox unavailable: {sandbox_available()}")
def test_python_env_scores_hidden_tests_in_the_sandbox():
    ex = get_task("python", num_tests=3).generate(1, seed=0)[0]
    env = make_env(EnvConfig(name="python", params={"attempts": 2, "wall_s": 3.0}))
    assert env.reset(ex) == [{"role": "user", "content": ex.prompt}]
    wrong = "```python\ndef f(x):\n    return 12345\n```"
    obs, reward, done, info = env.step({"role": "assistant", "content": wrong})
    assert (reward, done, info["success"]) == (0.0, False, False)
    assert obs[0]["content"] == "3 of 3 tests failed. Try again."
    # the reference solution passes every hidden test (the tests were never shown to it)
    assert env.step({"role": "assistant", "content": ex.answer}) == (None, 1.0, True, {"success": True})
    once = make_env(EnvConfig(name="python"))
    once.reset(ex)
    assert once.step({"role": "assistant", "content": wrong})[1:3] == (0.0, True)


def test_two_assistant_turns_in_a_row_get_the_generation_prompt_between(tok):
    fmt = ChatFormat(tok, None)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": "b"}]
    traj = encode_conversation(fmt, messages)
    assert tok.decode(traj.prompt_ids + traj.response_ids) + "\n" == fmt.render(messages)


def test_without_the_sandbox_sandboxed_tasks_are_refused_in_one_line(monkeypatch):
    from relayrl.envs import python_env
    from relayrl.rewards import RewardConfig, build_scorer
    from relayrl.sandbox import SandboxUnavailable, availability

    reason = "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    monkeypatch.setattr(python_env, "sandbox_available", lambda: reason)
    monkeypatch.setattr(availability, "sandbox_available", lambda: reason)
    with pytest.raises(SandboxUnavailable, match="python environment runs code in the sandbox: bubblewrap"):
        make_env(EnvConfig(name="python"))
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        build_scorer(RewardConfig.from_dict({"functions": [{"name": "code_tests"}], "workers": 0}))


def test_a_tokenizer_without_a_chat_template_is_one_line(tmp_path):
    plain = build_char_tokenizer(tmp_path, "abc")
    plain.chat_template = None
    with pytest.raises(EnvError, match="need a tokenizer with a chat template"):
        ChatFormat(plain, None)
    with pytest.raises(EnvError, match="needs messages before its first assistant message"):
        encode_conversation(ChatFormat(build_char_tokenizer(tmp_path / "t", "abc"), None),
                            [{"role": "assistant", "content": "a"}])
