"""External task libraries as data sources: a user's task factory (`data.task: "pkg.module:factory"`) and
reasoning-gym (`data.task: reasoning_gym`), checked against the factory's and the library's own functions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.data import DataConfig, build_datasets, build_task, get_task, task_for_example, tiny_alphabet
from relayrl.data.chat import prompt_key
from relayrl.data.tasks import _cached_task
from relayrl.errors import ConfigError, DataError, RewardError
from relayrl.rewards import RewardConfig, build_scorer
from relayrl.rewards.builtin import task_reward
from tests.fixtures.tasks import CountTask

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SPEC = "tests.fixtures.tasks:make_count_task"
rg = pytest.importorskip("reasoning_gym")
from reasoning_gym.utils import extract_answer  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_task_cache():
    _cached_task.cache_clear()  # each test rebuilds tasks from meta, as a fresh reward worker would
    yield
    _cached_task.cache_clear()


# ---------------------------------------------------------------------------- a user's task factory
@pytest.mark.parametrize("as_dicts", [False, True])
def test_plugin_examples_are_the_factorys_with_task_and_params_in_meta(as_dicts):
    params = {"letters": "abc", "length": 6, "as_dicts": as_dicts}
    task = get_task(SPEC, **params)
    got = task.generate(20, seed=7)
    ref = CountTask(letters="abc", length=6).generate(20, seed=7)
    assert [(e.prompt, e.answer) for e in got] == [(r.prompt, r.answer) for r in ref]
    assert got[3].meta == {**ref[3].meta, "task": SPEC, "params": params}
    assert task.alphabet is None and task.tool_tokens is False


def test_plugin_reward_is_rebuilt_from_meta_and_equals_the_factorys_score():
    cfg = DataConfig(task=SPEC, task_params={"letters": "ab", "length": 5}, n_train=40, n_eval=10)
    train, eval_set = build_datasets(cfg)
    ref = CountTask(letters="ab", length=5)
    for ex in train[:5] + eval_set[:5]:
        for completion in (ex.answer, ex.answer + "x", "zz", "", f"{ex.answer}{ex.answer}\nmore"):
            assert task_reward(completion, ex) == ref.score(completion, ex)
    assert task_reward(eval_set[0].answer, eval_set[0]) == 1.0  # a hand-computed case: the count alone
    assert task_reward("q" + eval_set[0].answer, eval_set[0]) == 0.5
    assert task_for_example(eval_set[0]).name == SPEC  # the task came back from meta, by importing the factory


def test_plugin_splits_are_disjoint_and_eval_does_not_depend_on_n_train():
    small = DataConfig(task=SPEC, task_params={"letters": "abc", "length": 6}, n_train=30, n_eval=20)
    big = small.model_copy(update={"n_train": 300})
    (_, e1), (t2, e2) = build_datasets(small), build_datasets(big)
    assert [e.prompt for e in e1] == [e.prompt for e in e2]
    assert len({e.prompt for e in e1}) == 20 and len(t2) == 300
    assert not {e.prompt for e in e1} & {e.prompt for e in t2}


def test_a_plugin_with_an_alphabet_gives_it_to_the_tiny_tokenizer():
    cfg = DataConfig(task=SPEC, task_params={"alphabet": "abcount in=0123456789"})
    assert tiny_alphabet(cfg) == "abcount in=0123456789"


def test_config_validation_checks_the_spec_form_without_importing_it():
    cfg = DataConfig(task="tests.fixtures.no_such_module:make", task_params={"x": 1})  # loads: form only
    with pytest.raises(ConfigError, match=r"^task 'tests.fixtures.no_such_module:make': cannot import "
                                          r"tests.fixtures.no_such_module: ModuleNotFoundError"):
        build_task(cfg)
    for bad in ("tests.fixtures.tasks:", "tests fixtures:make", "tests.fixtures.tasks:make-it"):
        with pytest.raises(ValueError, match="pkg.module:factory"):
            DataConfig(task=bad)


@pytest.mark.parametrize("spec, params, error, message", [
    ("tests.fixtures.tasks:nothing_here", {}, ConfigError, "module 'tests.fixtures.tasks' has no attribute"),
    ("tests.fixtures.tasks:not_callable", {}, ConfigError, "'not_callable' is not callable"),
    ("tests.fixtures.tasks:raises", {"a": 1}, ConfigError, r"raised RuntimeError: no task for you"),
    (SPEC, {"colour": "red"}, ConfigError, "raised TypeError"),
    ("tests.fixtures.tasks:no_score", {}, ConfigError, r"without score\(\); it must return an object with"),
    (SPEC, {"alphabet": ""}, ConfigError, "alphabet must be a non-empty string"),
    ("tests.fixtures.tasks:wrong", {"mode": "short"}, DataError, r"returned 255 examples; it must return exactly"),
    ("tests.fixtures.tasks:wrong", {"mode": "string"}, DataError, "returned a str; it must return a list"),
    ("tests.fixtures.tasks:wrong", {"mode": "int_answer"}, DataError, "answer must be a string"),
    ("tests.fixtures.tasks:wrong", {"mode": "bad_prompt"}, DataError, "must be a string or a non-empty list of chat"),
    ("tests.fixtures.tasks:wrong", {"mode": "reserved_meta"}, DataError, r"meta key\(s\) \['task'\] are relayrl's"),
])
def test_a_broken_factory_is_one_line_naming_it(spec, params, error, message):
    cfg = DataConfig(task=spec, task_params=params, n_train=10, n_eval=5)
    with pytest.raises(error, match=message) as e:
        build_datasets(cfg)
    assert str(e.value).startswith(f"task '{spec}'") and "\n" not in str(e.value)


def test_a_score_that_is_not_a_number_is_a_reward_error_naming_the_factory():
    spec = "tests.fixtures.tasks:wrong"
    train, _ = build_datasets(DataConfig(task=spec, task_params={"mode": "score_string"}, n_train=4, n_eval=2))
    with pytest.raises(RewardError, match=rf"^task '{spec}': score\(\) returned str 'high'; it must return a number$"):
        task_reward("1", train[0])


def test_a_factory_in_a_file_and_one_that_fails_to_import(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("my_task.py").write_text("import random\n"
                                  "class T:\n"
                                  "    def generate(self, n, seed):\n"
                                  "        r = random.Random(seed)\n"
                                  "        return [{'prompt': f'{r.randint(0, 99)}=', 'answer': 'x'}\n"
                                  "                for _ in range(n)]\n"
                                  "    def score(self, completion, example):\n"
                                  "        return float(completion == example.answer)\n"
                                  "def make():\n"
                                  "    return T()\n")
    Path("broken.py").write_text("import no_such_package_here\n")
    train, _ = build_datasets(DataConfig(task="my_task.py:make", n_train=5, n_eval=3))
    assert task_reward("x", train[0]) == 1.0 and task_reward("y", train[0]) == 0.0
    with pytest.raises(ConfigError, match=r"^task 'broken.py:make': cannot import broken.py: ModuleNotFoundError"):
        build_task(DataConfig(task="broken.py:make"))


def test_the_reward_workers_rebuild_a_plugin_task_and_score_it_like_the_factory():
    train, _ = build_datasets(DataConfig(task=SPEC, task_params={"letters": "ab"}, n_train=6, n_eval=2))
    completions = [ex.answer if i % 2 else "q" + ex.answer for i, ex in enumerate(train)]
    ref = CountTask(letters="ab")
    with build_scorer(RewardConfig.from_dict({"functions": [{"name": "task"}], "workers": 1})) as s:
        res = s.score(completions, train)
    assert res.rewards == [ref.score(c, ex) for c, ex in zip(completions, train, strict=True)]
    assert res.rewards == [0.5, 1.0] * 3 and res.failures == 0


# ---------------------------------------------------------------------------- reasoning-gym
RG_CASES = [("basic_arithmetic", {}), ("chain_sum", {"min_terms": 2, "max_terms": 3}), ("leg_counting", {})]


def rg_cfg(dataset, config=None, **data) -> DataConfig:
    return DataConfig(task="reasoning_gym", task_params={"dataset": dataset, "config": config or {}},
                      **{"n_train": 20, "n_eval": 8, **data})


@pytest.mark.parametrize("dataset, config", RG_CASES)
def test_reasoning_gym_examples_are_the_librarys_entries(dataset, config):
    task = get_task("reasoning_gym", dataset=dataset, config=config)
    got = task.generate(6, seed=11)
    ref = list(rg.create_dataset(dataset, size=6, seed=11, **config))
    system = rg.utils.SYSTEM_PROMPTS["default"]
    assert [e.prompt for e in got] == [
        [{"role": "system", "content": system}, {"role": "user", "content": r["question"]}] for r in ref]
    assert [e.answer for e in got] == [r["answer"] for r in ref]
    assert [e.meta["entry"] for e in got] == ref  # metadata as the library made it (tuples included)


@pytest.mark.parametrize("dataset, config", RG_CASES)
def test_reasoning_gym_reward_equals_the_librarys_score_answer(dataset, config):
    _, eval_set = build_datasets(rg_cfg(dataset, config))
    lib = rg.create_dataset(dataset, **config)
    for ex in eval_set:
        entry = ex.meta["entry"]
        wrong = str(int(entry["answer"]) + 1)
        cases = {f"<think>so</think>\n<answer>{entry['answer']}</answer>": 1.0,  # correct
                 f"<answer>{wrong}</answer>": 0.0,  # wrong
                 entry["answer"]: 0.0,  # malformed: no answer tags
                 f"<answer>{entry['answer']}": 0.0}  # malformed: unclosed
        for completion, expected in cases.items():
            assert task_reward(completion, ex) == lib.score_answer(extract_answer(completion), entry) == expected


@pytest.mark.parametrize("dataset, config", RG_CASES[:2])
def test_reasoning_gym_scores_through_the_reward_workers(dataset, config):
    """The entry (with its tuples) crosses to a worker process pickled, which rebuilds the task from meta."""
    _, eval_set = build_datasets(rg_cfg(dataset, config))
    completions = [f"<answer>{ex.answer}</answer>" if i % 3 == 0 else f"<answer>{ex.answer}0</answer>"
                   if i % 3 == 1 else ex.answer for i, ex in enumerate(eval_set)]
    lib = rg.create_dataset(dataset, **config)
    with build_scorer(RewardConfig.from_dict({"functions": [{"name": "task"}], "workers": 1})) as s:
        res = s.score(completions, eval_set)
    assert res.rewards == [lib.score_answer(extract_answer(c), ex.meta["entry"])
                           for c, ex in zip(completions, eval_set, strict=True)]
    assert res.failures == 0 and res.correct == [i % 3 == 0 for i in range(len(eval_set))]


def test_reasoning_gym_train_and_eval_are_disjoint_draws_of_different_seeds():
    cfg = rg_cfg("basic_arithmetic", n_train=200, n_eval=50)
    train, eval_set = build_datasets(cfg)
    keys = {prompt_key(e.prompt) for e in eval_set}
    assert len(keys) == 50 and len(train) == 200 and not keys & {prompt_key(e.prompt) for e in train}
    # eval is the same whatever n_train, and a different seed gives different data
    assert [e.prompt for e in build_datasets(cfg.model_copy(update={"n_train": 20}))[1]] == [e.prompt for e in eval_set]
    other = build_datasets(cfg.model_copy(update={"seed": 1}))[1]
    assert len(keys & {prompt_key(e.prompt) for e in other}) < 5


def test_reasoning_gym_system_prompt_is_one_of_the_librarys_or_none():
    direct = get_task("reasoning_gym", dataset="leg_counting", system_prompt="direct").generate(1, 0)[0]
    assert direct.prompt[0] == {"role": "system", "content": rg.utils.SYSTEM_PROMPTS["direct"]}
    bare = get_task("reasoning_gym", dataset="leg_counting", system_prompt=None).generate(1, 0)[0]
    assert [m["role"] for m in bare.prompt] == ["user"]
    with pytest.raises(ConfigError, match="system_prompt 'terse' is not one of reasoning-gym's SYSTEM_PROMPTS"):
        get_task("reasoning_gym", dataset="leg_counting", system_prompt="terse")


@pytest.mark.parametrize("params, message", [
    ({"dataset": "leg_countin"}, "no dataset 'leg_countin' in reasoning-gym; did you mean leg_counting"),
    ({"dataset": "leg_counting", "config": {"max_legs": 3}}, "dataset 'leg_counting' refuses config .*TypeError"),
    ({"dataset": "chain_sum", "config": {"min_terms": 0}},
     "dataset 'chain_sum' refuses config .*AssertionError: min_terms must be"),
])
def test_reasoning_gym_bad_dataset_or_config_is_one_line_at_build(params, message):
    cfg = DataConfig(task="reasoning_gym", task_params=params)  # the library is not imported to load a config
    with pytest.raises(ConfigError, match=f"^task 'reasoning_gym': {message}") as e:
        build_task(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("params, message", [
    ({"dataset": "leg_counting", "size": 100}, "size is not a task parameter here; the number of examples is "
                                               "data.n_train / data.n_eval"),
    ({"dataset": "leg_counting", "config": {"seed": 3}}, "seed is not a task parameter here"),
    ({"dataset": "leg_counting", "max_animals": 3}, r"unknown task_params \['max_animals'\].*go under config"),
    ({}, "task_params.dataset must name a reasoning-gym dataset"),
    ({"dataset": "leg_counting", "config": [1]}, "task_params.config must be a mapping"),
])
def test_reasoning_gym_params_are_checked_when_the_config_loads(params, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(task="reasoning_gym", task_params=params)


def test_without_reasoning_gym_installed_the_task_is_one_line_saying_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an absent package looks like to import
    with pytest.raises(ValueError, match=r"needs the reasoning-gym package: pip install reasoning-gym"):
        DataConfig(task="reasoning_gym", task_params={"dataset": "leg_counting"})


def test_loading_a_reasoning_gym_config_imports_neither_the_library_nor_torch():
    code = ("import sys; from relayrl.data import DataConfig; "
            "DataConfig(task='reasoning_gym', task_params={'dataset': 'leg_counting'}); "
            "DataConfig(task='tests.fixtures.tasks:make_count_task'); "
            "print([m for m in ('reasoning_gym', 'numpy', 'torch', 'tests.fixtures.tasks') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------- the tiny model's characters
@pytest.mark.parametrize("task, params", [
    ("reasoning_gym", {"dataset": "leg_counting", "system_prompt": "direct"}),  # chat messages
    (SPEC, {"letters": "xyz"}),  # strings
])
def test_the_tiny_tokenizer_over_a_tasks_data_drops_no_character(tmp_path, task, params):
    from relayrl.models.tokenizer import build_char_tokenizer

    cfg = DataConfig(task=task, task_params=params, n_train=100, n_eval=20)
    alphabet = tiny_alphabet(cfg)
    assert alphabet == "".join(sorted(set(alphabet)))
    tok = build_char_tokenizer(tmp_path / "tok", alphabet, model_type="qwen2")  # qwen2 drops unknown characters
    train, eval_set = build_datasets(cfg)
    for ex in train + eval_set:
        text = ex.prompt if isinstance(ex.prompt, str) else tok.apply_chat_template(
            ex.prompt, add_generation_prompt=True, tokenize=False)  # as the model sees it
        answers = [ex.answer] + ([f"<answer>{ex.answer}</answer>"] if task == "reasoning_gym" else [])
        for t in (text, *answers):
            ids = tok(t, add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids and tok.decode(ids) == t
    # and nothing beyond the data: "~" is in no prompt of either task
    assert "~" not in alphabet and tok("~", add_special_tokens=False)["input_ids"] in ([], [tok.unk_token_id])
