"""Metric names say what they measure (relayrl.rewards.naming): exact match is called accuracy only where nothing
but the built-in task / exact_match reward judges the answers; a task's own correctness stays accuracy whatever the
reward; the held-out figure reported first is the user's scorer's eval/reward."""

from __future__ import annotations

import pytest

from relayrl.data import Example
from relayrl.data.tasks import get_task
from relayrl.rewards import RewardConfig, ScoreResult, build_scorer
from relayrl.rewards.naming import held_out_metric, user_scored

pytestmark = pytest.mark.unit

KEYWORD = {"name": "tests.fixtures.rewards:answer_chars"}  # def answer_chars(completion, answer, **kwargs)


def score(functions: list[dict], completions: list[str], examples: list[Example]) -> ScoreResult:
    with build_scorer(RewardConfig.from_dict({"workers": 0, "functions": functions})) as s:
        return s.score(completions, examples)


def file_examples() -> list[Example]:  # loaded from a file: no task, correctness is exact match of the answer
    return [Example(prompt="2+3=", answer="5"), Example(prompt="4+4=", answer="8"), Example(prompt="1+9=", answer="10")]


def test_a_user_reward_on_a_file_logs_exact_match_not_accuracy():
    res = score([KEYWORD], ["5", "18", "x"], file_examples())
    # answer_chars by hand: "5" holds 5 (1/1); "18" holds 8 (1/1); "x" holds neither 1 nor 0 (0/2)
    assert res.rewards == [1.0, 1.0, 0.0] and res.correct == [True, False, False]
    m = res.metrics()
    assert m["reward/exact_match"] == pytest.approx(1 / 3) and "reward/accuracy" not in m
    assert m["reward/mean"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("functions", [[{"name": "format"}], [{"name": "task"}, {"name": "format", "weight": 0.5}],
                                       [{"name": "math"}]])
def test_every_reward_but_task_and_exact_match_is_the_users(functions):
    res = score(functions, ["5", "18", "x"], file_examples())
    assert res.correct_name == "exact_match" and "reward/exact_match" in res.metrics()


@pytest.mark.parametrize("functions", [[{"name": "task"}], [{"name": "exact_match", "weight": 2.0}]])
def test_the_built_in_reward_on_a_file_keeps_accuracy(functions):
    res = score(functions, ["5", "18", "x"], file_examples())
    assert res.metrics()["reward/accuracy"] == pytest.approx(1 / 3) and "reward/exact_match" not in res.metrics()


def test_a_tasks_own_correctness_stays_accuracy_beside_a_user_reward():
    examples = get_task("arith").generate(3, seed=0)
    completions = [examples[0].answer, "x", examples[2].answer + "\nmore"]
    res = score([KEYWORD], completions, examples)
    assert res.correct_name == "accuracy" and res.correct == [True, False, True]
    assert res.metrics()["reward/accuracy"] == pytest.approx(2 / 3)
    assert res.rewards == [answer_chars_by_hand(c, ex.answer) for c, ex in zip(completions, examples, strict=True)]


def answer_chars_by_hand(completion: str, answer: str) -> float:
    line = completion.strip().split("\n")[0]
    return sum(ch in line for ch in answer) / len(answer)


def test_merged_shards_keep_the_name_of_what_they_count():
    a = score([KEYWORD], ["5"], file_examples()[:1])
    b = score([KEYWORD], ["8", "1"], file_examples()[1:])
    merged = ScoreResult.merge([a, b])
    assert merged.correct_name == "exact_match" and merged.metrics()["reward/exact_match"] == pytest.approx(2 / 3)


def test_the_held_out_figure_is_the_users_scorer_where_there_is_one():
    assert held_out_metric(["task"]) == "eval/accuracy"
    assert held_out_metric(["exact_match", "task"]) == "eval/accuracy"
    assert held_out_metric(["task", "format"]) == "eval/reward"
    assert held_out_metric(["tests.fixtures.rewards:answer_chars"]) == "eval/reward"
    assert held_out_metric(["model"]) == "eval/reward"  # a reward model is the user's scorer too
    assert held_out_metric(["tests.fixtures.rewards:answer_chars"], env=True) == "eval/accuracy"  # success
    assert not user_scored(["task", "exact_match"]) and user_scored(["math"])
    assert RewardConfig.from_dict({"functions": [KEYWORD]}).user_scored() and not RewardConfig().user_scored()
