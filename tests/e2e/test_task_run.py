"""`relayrl train` on tasks from outside relayrl: reasoning-gym's basic_arithmetic and a user's task factory
(tests.fixtures.tasks), each a 2-step run of a tiny model built over the task's characters. A reward of weight 0
(tests.fixtures.tasks:record) writes down every completion the run scores, in the order the run scores them:
the evaluation before step 1, step 1's samples, step 2's, the evaluation after. Each phase's recorded
completions, scored by hand with the library's own function (reasoning-gym's score_answer on extract_answer, the
factory's score), give the run's logged figure for that phase."""

from __future__ import annotations

import json

import pytest

from relayrl.data import build_datasets
from relayrl.data.chat import prompt_key
from relayrl.jobs.train import train
from relayrl.observe import read_metrics

from helpers import cfg_for

SPEC = "tests.fixtures.tasks:make_count_task"
TINY = {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "init_std": 0.2}}
P, G = 2, 4  # prompts per step, group size


def _run(tmp_path, data, max_tokens):
    rec = tmp_path / "scored.jsonl"
    cfg = cfg_for(tmp_path, "run", model=TINY, data=data,
                  reward={"functions": [{"name": "task"},
                                        {"name": "tests.fixtures.tasks:record", "weight": 0.0,
                                         "params": {"path": str(rec)}}]},
                  rollout={"prompts_per_step": P, "group_size": G, "max_tokens": max_tokens},
                  eval={"max_tokens": max_tokens, "every": 0}, run={"steps": 2, "save_every": 0})
    res = train(cfg, show_progress=False)
    records = [json.loads(line) for line in rec.read_text().splitlines()]
    train_set, eval_set = build_datasets(cfg.data)
    n_eval = len(eval_set)
    phases = [records[:n_eval], records[n_eval:n_eval + P * G], records[n_eval + P * G:n_eval + 2 * P * G],
              records[n_eval + 2 * P * G:]]
    assert [len(p) for p in phases] == [n_eval, P * G, P * G, n_eval]
    by_prompt = {prompt_key(ex.prompt): ex for ex in train_set + eval_set}
    eval_keys = {prompt_key(ex.prompt) for ex in eval_set}
    for i, phase in enumerate(phases):
        keys = [prompt_key(r["prompt"]) for r in phase]
        if i in (0, 3):
            assert sorted(map(str, keys)) == sorted(map(str, eval_keys))  # each held-out example once
        else:
            assert not set(keys) & eval_keys  # training never sees a held-out prompt
    steps = [m for m in read_metrics(res["run_dir"]) if "reward/mean" in m]
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and len(evals) == 2
    return phases, by_prompt, steps, evals


def _check(phases, by_prompt, steps, evals, score):
    hand = [[score(r["completion"], by_prompt[prompt_key(r["prompt"])]) for r in phase] for phase in phases]
    means = [sum(h) / len(h) for h in hand]
    assert means[0] == pytest.approx(evals[0]["eval/reward"], rel=1e-12, abs=1e-15)
    assert means[3] == pytest.approx(evals[1]["eval/reward"], rel=1e-12, abs=1e-15)
    for m, step in zip(means[1:3], steps, strict=True):
        assert m == pytest.approx(step["reward/task/mean"], rel=1e-12, abs=1e-15)
        assert m == pytest.approx(step["reward/mean"], rel=1e-12, abs=1e-15)  # the recorder weighs 0
        assert step["reward/failures"] == 0
    return hand


@pytest.mark.e2e
def test_a_reasoning_gym_run_logs_the_librarys_own_scores(tmp_path):
    rg = pytest.importorskip("reasoning_gym")
    from reasoning_gym.utils import extract_answer

    data = {"task": "reasoning_gym", "task_params": {"dataset": "basic_arithmetic", "system_prompt": "direct",
                                                     "config": {"min_terms": 2, "max_terms": 2}},
            "n_train": 64, "n_eval": 6}
    phases, by_prompt, steps, evals = _run(tmp_path, data, max_tokens=8)
    lib = rg.create_dataset("basic_arithmetic", min_terms=2, max_terms=2)
    _check(phases, by_prompt, steps, evals, lambda c, ex: lib.score_answer(extract_answer(c), ex.meta["entry"]))
    # the scorer is the library's: a right and a wrong answer in its format, on the run's own held-out examples
    ex = by_prompt[prompt_key(phases[0][0]["prompt"])]
    assert lib.score_answer(extract_answer(f"<answer>{ex.answer}</answer>"), ex.meta["entry"]) == 1.0
    # the tiny model's tokenizer covers the prompts: the system prompt's characters reached the engine whole
    tok_vocab = json.loads((tmp_path / "run" / "base_model" / "tokenizer.json").read_text())["model"]["vocab"]
    assert {"<", ">", "/", "D"} <= set(tok_vocab)


@pytest.mark.e2e
def test_a_task_factory_run_logs_the_factorys_own_scores(tmp_path):
    from tests.fixtures.tasks import CountTask

    data = {"task": SPEC, "task_params": {"letters": "ab", "length": 4}, "n_train": 64, "n_eval": 8}
    phases, by_prompt, steps, evals = _run(tmp_path, data, max_tokens=6)
    hand = _check(phases, by_prompt, steps, evals, CountTask(letters="ab", length=4).score)
    # partial credit from the first step: the comparison is between numbers that vary, not zeros
    assert len({round(v, 9) for phase in hand for v in phase}) > 2
