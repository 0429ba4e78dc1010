"""Reward function forms told apart by parameter names (relayrl.rewards.forms), each scored by
relayrl.rewards.calls as its authors meant; a function that fits no form, or several, is refused at load
in one line; factories (`args`) are called once at load."""

import pytest

from relayrl.data import Example
from relayrl.errors import ConfigError, RewardError
from relayrl.rewards import RewardConfig, build_scorer

pytestmark = pytest.mark.unit

FORMS_MODULE = '''
def sample_len(completion, example, scale=1.0):
    return scale * len(completion) + len(example.answer)

def batch_len(completions, answer, **kwargs):
    return [len(c) + 10 * len(a) for c, a in zip(completions, answer)]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth) + (0.5 if data_source == "arith" else 0.0)}

def correct(completion, answer, **kwargs):
    return float(completion.strip() == answer)

def by_name(prompt, completion, info, level=0, example=None):
    return len(prompt) + 100 * level + (1000 if info.get("level") == level else 0) + (example is not None)

def needs_parser(completion, parser, answer):
    return 0.0

def no_form(text, ex):
    return 0.0

def two_forms(completion, example, completions):
    return 0.0

def batch_and_verl(completions, solution_str, ground_truth):
    return [0.0]

def logs_a_metric(completions, log_metric, **kwargs):
    return [0.0] * len(completions)

def make_bonus(scale):
    def bonus(completion, answer):
        return scale * len(completion)
    return bonus

def make_nothing(scale):
    return 3

def make_broken(scale):
    raise ValueError("scale must be positive")
'''


@pytest.fixture
def rw(tmp_path, monkeypatch):
    (tmp_path / "form_rewards.py").write_text(FORMS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))


def score(functions, completions, examples, workers=0):
    with build_scorer(RewardConfig.from_dict({"functions": functions, "workers": workers})) as s:
        return s.runner.forms[:len(functions)], s.score(completions, examples)


def refusal(functions, workers=0) -> str:
    with pytest.raises((ConfigError, RewardError)) as e:
        build_scorer(RewardConfig.from_dict({"functions": functions, "workers": workers})).close()
    assert "\n" not in str(e.value)
    return str(e.value)


def row(answer, **fields):
    return Example(prompt="3+4=", answer=answer, meta={"fields": {"answer": answer, **fields}})


def test_each_form_scores_by_its_parameter_names(rw):
    ex = Example(prompt="3+4=", answer="7", meta={"task": "arith"})
    forms, r = score([{"name": "form_rewards:sample_len", "params": {"scale": 2}},
                      {"name": "form_rewards:batch_len"},
                      {"name": "form_rewards:compute_score"},
                      {"name": "form_rewards:correct"}], ["7", " 7 ", "8"], [ex] * 3)
    assert forms == ["sample", "batch", "verl", "keyword"]
    assert r.per_function == {"form_rewards:sample_len": [3.0, 7.0, 3.0],  # 2 * len + len("7")
                              "form_rewards:batch_len": [11.0, 13.0, 11.0],  # len + 10 * len("7")
                              "form_rewards:compute_score": [1.5, 0.5, 0.5],  # exact + 0.5 for data source arith
                              "form_rewards:correct": [1.0, 1.0, 0.0]}
    assert r.failures == 0


@pytest.mark.parametrize("workers", [0, 1])
def test_keyword_form_gets_the_answer_string_not_the_example(rw, workers):
    # Before: `answer` received the Example object, every sample scored 0 and no failure was counted.
    forms, r = score([{"name": "form_rewards:correct"}], ["12", "13"], [row("12")] * 2, workers)
    assert forms == ["keyword"] and r.rewards == [1.0, 0.0] and r.failures == 0


def test_keyword_form_fills_prompt_info_and_columns_by_name(rw):
    _, r = score([{"name": "form_rewards:by_name"}], ["x", "y"], [row("1", level=2), row("1")])
    # len("3+4=") = 4; level=2 from the column (info is the row's columns), example passed by name
    assert r.rewards == [4 + 200 + 1000 + 1, 4 + 0 + 0 + 1]
    _, r = score([{"name": "form_rewards:by_name"}], ["x"], [row("1", level=2, info={"level": 0})])
    assert r.rewards == [4 + 200 + 0 + 1]  # an `info` column is passed as it is


@pytest.mark.parametrize("name, says", [
    ("no_form", "'form_rewards:no_form(text, ex)' fits no reward form; write it as relayrl's fn(completion, "
                "example), TRL's"),
    ("two_forms", "fits several reward forms (batch, sample)"),
    ("batch_and_verl", "fits several reward forms (batch, verl)"),
    ("logs_a_metric", "requires log_metric, which relayrl does not pass: relayrl logs each function's mean as "
                      "reward/<name>/mean and takes no other metric from it"),
    ("needs_parser", "(keyword form) requires parser, which is not filled; required parameters may be "
                     "completion, answer, prompt, info, example"),
])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_function_fitting_no_form_or_several_is_refused_in_one_line(rw, name, says, workers):
    line = refusal([{"name": f"form_rewards:{name}"}], workers)
    assert line.startswith("config error: reward.functions.0: reward function 'form_rewards:") and says in line


def test_batch_false_and_params_over_filled_names_are_refused(rw):
    assert "fits no reward form" in refusal([{"name": "form_rewards:batch_len", "batch": False}])
    line = refusal([{"name": "form_rewards:correct", "params": {"answer": "7"}}])
    assert "reward.functions.0.params: answer is filled from each sample, not set in params" in line


def test_factory_entry_is_called_once_at_load(rw):
    forms, r = score([{"name": "form_rewards:make_bonus", "args": {"scale": 0.5}}], ["abcd"], [row("1")])
    assert forms == ["keyword"] and r.rewards == [2.0]
    assert refusal([{"name": "form_rewards:make_nothing", "args": {"scale": 1}}]) == (
        "config error: reward.functions.0.args: factory 'form_rewards:make_nothing' returned 3 (int), "
        "not a reward function")
    assert refusal([{"name": "form_rewards:make_broken", "args": {"scale": -1}}]) == (
        "config error: reward.functions.0.args: factory 'form_rewards:make_broken' raised ValueError: "
        "scale must be positive")
    assert "unexpected keyword argument 'size'" in refusal([{"name": "form_rewards:make_bonus", "args": {"size": 1}}])
    with pytest.raises(ConfigError, match="args is for reward function factories"):
        RewardConfig.from_dict({"functions": [{"name": "model", "path": "d", "args": {}}]})


def test_trl_text_rewards_run_unchanged():
    pytest.importorskip("trl")
    chat = Example(prompt=[{"role": "user", "content": "2+2?"}], answer="4")
    forms, r = score([{"name": "trl.rewards:think_format_reward"}], ["<think>\nhm\n</think>4", "4"], [chat] * 2)
    assert forms == ["batch"] and r.rewards == [1.0, 0.0]
    # TRL's rewards that read completion_ids and trainer_state: tests/rewards/test_trl_kwargs.py
