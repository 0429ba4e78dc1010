"""Built-in tasks, held-out splits, DataConfig and the resumable prompt sampler."""

import pytest

from relayrl.data import DataConfig, PromptSampler, build_datasets, build_task, get_task, split_train_eval
from relayrl.data.arith import evaluate
from relayrl.data.sort import position_credit
from relayrl.errors import ConfigError, DataError

pytestmark = pytest.mark.unit


def test_arith_is_deterministic_and_correct():
    task = get_task("arith", digits=2, ops="+-*", num_operands=3)
    a = task.generate(300, seed=7)
    assert a == task.generate(300, seed=7)
    assert a != task.generate(300, seed=8)
    for ex in a:
        assert ex.prompt.endswith("=")
        assert int(ex.answer) == eval(ex.prompt[:-1])  # Python's precedence is the reference
        assert set(ex.prompt + ex.answer) <= set(task.alphabet)
        assert ex.meta == {"task": "arith", "params": task.params}
    assert any(ex.answer.startswith("-") for ex in a)  # negative answers occur


def test_arith_evaluate_precedence():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4], ["*", "-"]) == 2
    assert evaluate([5, 7], ["-"]) == -2


def test_arith_score_uses_first_stripped_line():
    task = get_task("arith")
    ex = task.generate(1, seed=0)[0]
    assert task.score(ex.answer, ex) == 1.0
    assert task.score(f"  {ex.answer} \nblah", ex) == 1.0
    assert task.score(ex.answer + "0", ex) == 0.0
    assert task.score("", ex) == 0.0


def test_arith_bad_params():
    with pytest.raises(ConfigError, match="ops"):
        get_task("arith", ops="/")
    with pytest.raises(ConfigError, match="num_operands"):
        get_task("arith", num_operands=1)
    with pytest.raises(ConfigError, match="bad task_params"):
        get_task("arith", nope=1)
    with pytest.raises(ConfigError, match="unknown task 'zzz'"):
        get_task("zzz")


def test_sort_partial_credit_by_hand():
    task = get_task("sort")
    ex = task.generate(1, seed=0)[0]
    assert ex.answer == "".join(sorted(ex.prompt[len("sort ") : -1]))
    assert position_credit("1234", "1234") == 1.0
    assert position_credit("1243", "1234") == 0.5
    assert position_credit("12345", "1234") == 0.8
    assert position_credit("123", "1234") == 0.75
    assert position_credit("", "1234") == 0.0
    assert position_credit("4321", "1234") == 0.0
    ex.answer = "1234"
    assert task.score(" 1243\n99", ex) == 0.5


def test_split_is_disjoint_and_eval_fixed():
    task = get_task("arith", digits=1, ops="+")  # only 100 distinct prompts: forces collisions
    train_a, eval_a = split_train_eval(task, n_train=50, n_eval=30, seed=3)
    train_b, eval_b = split_train_eval(task, n_train=400, n_eval=30, seed=3)
    assert eval_a == eval_b  # eval does not depend on n_train
    assert len({e.prompt for e in eval_a}) == 30
    assert (len(train_a), len(train_b)) == (50, 400)
    held = {e.prompt for e in eval_a}
    assert not held & {e.prompt for e in train_b}
    assert split_train_eval(task, 50, 30, seed=4)[1] != eval_a


def test_split_too_small_task_is_a_data_error():
    task = get_task("arith", digits=1, ops="+")
    with pytest.raises(DataError, match="n_eval"):
        split_train_eval(task, n_train=10, n_eval=101, seed=0)


def test_build_datasets_builtin():
    params = {"min_len": 2, "max_len": 3}
    cfg = DataConfig.from_dict({"task": "sort", "task_params": params, "n_train": 40, "n_eval": 10})
    train, ev = build_datasets(cfg)
    assert (len(train), len(ev)) == (40, 10)
    assert build_task(cfg).alphabet == "0123456789sort ="


def test_data_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="n_eval"):
        DataConfig.from_dict({"n_eval": 0})
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        DataConfig.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        DataConfig.from_dict({"task": "nope"})
    with pytest.raises(ConfigError, match="data.path"):
        DataConfig.from_dict({"task": "file"})
    with pytest.raises(ConfigError, match="task_params.*ops"):
        DataConfig.from_dict({"task_params": {"ops": "%"}})


def test_sampler_covers_epochs_and_resumes_exactly():
    examples = get_task("arith").generate(10, seed=0)
    s = PromptSampler(examples, seed=5)
    first_epoch = s.next_batch(10)
    assert sorted(e.prompt for e in first_epoch) == sorted(e.prompt for e in examples)
    s.next_batch(3)
    state = s.state_dict()
    assert state == {"epoch": 1, "position": 3, "seed": 5, "num_examples": 10}
    expected = [e.prompt for e in s.next_batch(25)]  # crosses two epoch boundaries

    resumed = PromptSampler(examples, seed=0)  # seed comes from the state
    resumed.load_state_dict(state)
    assert [e.prompt for e in resumed.next_batch(25)] == expected


def test_sampler_refuses_other_dataset():
    s = PromptSampler(get_task("arith").generate(10, seed=0))
    with pytest.raises(DataError, match="same data config"):
        PromptSampler(get_task("arith").generate(11, seed=0)).load_state_dict(s.state_dict())
