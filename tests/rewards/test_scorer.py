"""Built-in rewards, user reward functions, and the scorer's failure accounting."""

import math
import threading

import pytest

from relayrl.data import Example, get_task
from relayrl.errors import ConfigError, RewardError
from relayrl.rewards import (
    RewardConfig,
    build_scorer,
    exact_match,
    format_reward,
    get_reward_fn,
    math_reward,
    task_reward,
)

pytestmark = pytest.mark.unit


def ex(answer, **meta):
    return Example(prompt="q", answer=answer, meta=meta)


_open = []


def scorer(*functions):
    # One worker each: these tests check what is scored, tests/rewards/test_pool.py how the pool runs it.
    s = build_scorer(RewardConfig.from_dict({"functions": list(functions), "workers": 1}))
    _open.append(s)
    return s


@pytest.fixture(autouse=True)
def _close_scorers():
    yield
    while _open:
        _open.pop().close()


def test_exact_match():
    assert exact_match(" 19\nmore", ex("19")) == 1.0
    assert exact_match("19.0", ex("19")) == 0.0
    assert exact_match("", ex("19")) == 0.0
    assert exact_match("", ex("")) == exact_match(" \n", ex(" ")) == 0.0  # no answer: nothing is correct


def test_math_verify_plain_boxed_and_equivalent():
    assert math_reward("19", ex("19")) == 1.0
    assert math_reward("so the answer is \\boxed{19}.", ex("19")) == 1.0
    assert math_reward("0.5", ex("1/2")) == 1.0
    assert math_reward("\\boxed{\\frac{1}{2}}", ex("0.5")) == 1.0
    assert math_reward("\\boxed{20}", ex("19")) == 0.0
    assert math_reward("no idea", ex("19")) == 0.0


def test_math_outside_main_thread():
    # math-verify's signal-based timeout cannot run in a thread; the reward must still work there.
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("0.5", ex("1/2"))))
    t.start()
    t.join()
    assert out == [1.0]


def test_format_default_and_custom_pattern():
    assert format_reward("42", ex("")) == 1.0
    assert format_reward("42\n", ex("")) == 1.0
    assert format_reward("42\nand more", ex("")) == 0.0
    assert format_reward("", ex("")) == 0.0
    assert format_reward("<a>7</a>", ex(""), pattern=r"<a>\d+</a>") == 1.0
    assert format_reward("<a>x</a>", ex(""), pattern=r"<a>\d+</a>") == 0.0


def test_task_reward_delegates_to_task_and_falls_back_for_files():
    sort = get_task("sort")
    e = sort.generate(1, seed=0)[0]
    e.answer = "1234"
    assert task_reward("1243", e) == 0.5
    assert task_reward("1234", e) == 1.0
    assert task_reward("7", ex("7", row=0, fields={})) == 1.0  # file example: exact match


def test_scorer_weighted_sum_per_function_and_correct():
    task = get_task("arith")
    examples = task.generate(3, seed=0)
    completions = [examples[0].answer, examples[1].answer + "\nextra", "x"]
    r = scorer({"name": "task"}, {"name": "format", "weight": 0.5}).score(completions, examples)
    assert r.per_function == {"task": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0]}
    assert r.rewards == [1.5, 1.0, 0.5]
    assert r.correct == [True, True, False]
    assert r.failures == 0
    m = r.metrics()
    assert m["reward/failures"] == 0 and m["reward/accuracy"] == pytest.approx(2 / 3)


def test_scorer_params_and_duplicate_names():
    s = scorer({"name": "format"}, {"name": "format", "params": {"pattern": r"\d+"}})
    r = s.score(["a1"], [ex("1")])
    assert r.per_function == {"format": [1.0], "format#1": [0.0]}
    with pytest.raises(ConfigError, match=r"reward.functions.0.params"):
        scorer({"name": "format", "params": {"nope": 1}})


def test_reward_config_defaults_and_errors():
    cfg = RewardConfig.from_dict({})
    assert [f.name for f in cfg.functions] == ["task"]
    assert (cfg.timeout_s, cfg.workers, cfg.memory_mb, cfg.cpu_s, cfg.on_failure) == (10.0, 2, 4096, None, 0.0)
    assert cfg.cpu_limit_s() == 10 and RewardConfig.from_dict({"timeout_s": 2.5}).cpu_limit_s() == 3
    assert RewardConfig.from_dict({"cpu_s": 4, "memory_mb": None}).cpu_limit_s() == 4
    bad = {"nope": 1, "timeout_s": 0, "workers": -1, "memory_mb": 10, "cpu_s": 0, "on_failure": math.nan}
    for key, value in bad.items():
        with pytest.raises(ConfigError, match=f"unknown key '{key}'" if key == "nope" else f"^config error: {key}:"):
            RewardConfig.from_dict({key: value})
    with pytest.raises(ConfigError, match="functions.0.weight"):
        RewardConfig.from_dict({"functions": [{"name": "task", "weight": "heavy"}]})
    with pytest.raises(ConfigError, match="functions"):
        RewardConfig.from_dict({"functions": []})
    assert RewardConfig.from_dict({"functions": [{"name": "task", "weight": 2}]}).functions[0].weight == 2.0


USER_MODULE = '''
import math

def length_bonus(completion, example, scale=1.0):
    return scale * len(completion)

def picky(completion, example):
    if completion == "boom":
        raise ValueError("cannot score boom")
    if completion == "nan":
        return math.nan
    if completion == "str":
        return "1.0"
    return 1.0

def always_fails(completion, example):
    raise KeyError("no such field")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_rewards.py"


def test_user_function_by_module_and_by_path(user_module):
    r = scorer({"name": "my_rewards:length_bonus", "params": {"scale": 0.5}}).score(["abcd"], [ex("")])
    assert r.rewards == [2.0]
    fn = get_reward_fn(f"{user_module}:length_bonus")
    assert fn("abc", ex("")) == 3.0


def test_user_function_import_errors(tmp_path, user_module):
    cases = {
        "no_such_module_xyz:f": "ModuleNotFoundError",
        "my_rewards:missing": "no attribute 'missing'",
        "my_rewards:math": "not a function",
        f"{tmp_path}/absent.py:f": "no such file",
    }
    (tmp_path / "broken.py").write_text("def f(:\n")
    cases[f"{tmp_path}/broken.py:f"] = "SyntaxError"
    for spec, reason in cases.items():
        with pytest.raises(RewardError) as e:
            get_reward_fn(spec)
        msg = str(e.value)
        assert spec in msg and reason in msg and "\n" not in msg, msg
    with pytest.raises(RewardError, match="unknown reward function 'nope'"):
        get_reward_fn("nope")


def test_raising_nan_and_non_numbers_count_as_failures(user_module):
    s = scorer({"name": "my_rewards:picky"}, {"name": "exact_match"})
    completions = ["boom", "nan", "str", "fine"]
    r = s.score(completions, [ex("fine")] * 4)
    assert r.per_function["my_rewards:picky"] == [0.0, 0.0, 0.0, 1.0]
    assert r.failures == 3
    assert r.failures_per_function == {"my_rewards:picky": 3, "exact_match": 0}
    assert r.metrics()["reward/failures"] == 3
    assert all(math.isfinite(x) for x in r.rewards)


def test_every_sample_failing_raises(user_module):
    s = scorer({"name": "task"}, {"name": "my_rewards:always_fails"})
    with pytest.raises(RewardError) as e:
        s.score(["1", "2"], [ex("1"), ex("2")])
    assert str(e.value) == (
        "every sample failed to score in reward function my_rewards:always_fails: KeyError: 'no such field'"
    )
    # a gold answer math-verify cannot parse is a per-sample failure too
    with pytest.raises(RewardError, match="reward function math: ValueError: cannot parse the gold"):
        scorer({"name": "math"}).score(["1"], [ex("")])


def test_merge_of_shards_fails_only_when_the_whole_step_fails():
    from relayrl.errors import RewardError
    from relayrl.rewards import ScoreResult

    ok = ScoreResult(rewards=[1.0, 0.0], per_function={"f": [1.0, 0.0]}, failures=0, correct=[True, False],
                     failures_per_function={"f": 0})
    dead = ScoreResult(rewards=[0.0], per_function={"f": [0.0]}, failures=1, correct=[False],
                       failures_per_function={"f": 1}, timeouts=1, timeouts_per_function={"f": 1},
                       first_errors={"f": "timed out after 1 s (reward.timeout_s)"})
    merged = ScoreResult.merge([ok, dead])  # one shard failed whole, the step did not
    assert merged.rewards == [1.0, 0.0, 0.0] and merged.failures == 1 and merged.correct == [True, False, False]
    assert merged.timeouts == 1 and merged.metrics()["reward/timeouts"] == 1.0
    with pytest.raises(RewardError) as e:
        ScoreResult.merge([dead, dead])
    assert str(e.value) == "every sample failed to score in reward function f: timed out after 1 s (reward.timeout_s)"


def test_on_failure_value_is_the_same_in_process_and_in_the_pool(user_module):
    fns = [{"name": "my_rewards:picky", "weight": 2.0}, {"name": "exact_match"}]
    results = []
    for workers in (0, 1):
        cfg = RewardConfig.from_dict({"functions": fns, "on_failure": -1.0, "workers": workers})
        with build_scorer(cfg) as s:
            results.append(s.score(["boom", "nan", "fine"], [ex("fine")] * 3))
    assert results[0] == results[1]
    assert results[0].per_function["my_rewards:picky"] == [-1.0, -1.0, 1.0]
    assert results[0].rewards == [-2.0, -2.0, 3.0] and results[0].failures == 2 and results[0].timeouts == 0
    assert results[0].first_errors == {"my_rewards:picky": "ValueError: cannot score boom"}


def test_importing_the_config_loads_no_reward_function_and_no_torch():
    import subprocess
    import sys

    code = ("import sys; from relayrl.rewards import RewardConfig, RewardFunctionConfig; "
            "print(sorted(m for m in sys.modules if m in ('torch', 'math_verify', 'sympy', 'relayrl.rewards.builtin', "
            "'relayrl.rewards.math_answer', 'relayrl.rewards.scorer', 'relayrl.rewards.pool')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
