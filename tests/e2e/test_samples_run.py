"""What the model said, as a run records it (samples.jsonl), and metric names that say what they measure.

A run on a dataset file scored by a keyword-style user reward (`fn(completion, answer, **kwargs)`): the held-out line
reports the user's scorer (eval/reward), exact match is logged as exact_match and no accuracy at all; every row's
reward is the user's function applied here to the row's completion and answer, the eval rows average to the eval
figures, the train rows to the step's, with GRPO's advantages computed by hand; `relayrl eval --samples` writes the
rows the run's last evaluation wrote. A resumed run's samples.jsonl equals the uninterrupted run's, no step twice.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from relayrl.checkpoint.layout import step_dir_name
from relayrl.cli.main import main
from relayrl.data.tasks import first_line
from relayrl.models.config import TinyModelConfig
from relayrl.models.tiny import build_tiny_model
from relayrl.observe import read_metrics
from relayrl.observe.samples import read_samples
from tests.fixtures.rewards import answer_chars

pytestmark = pytest.mark.e2e

PROMPTS, GROUP, N_EVAL = 2, 4, 6
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(5)]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """A run config: a tiny model over the dataset's characters, the dataset file, the keyword reward."""
    d = tmp_path_factory.mktemp("samples_data")
    model = build_tiny_model(d / "model", "0123456789+=-: ", TinyModelConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        init_std=0.2))
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {"model": {"path": str(model)}, "data": {"task": "file", "path": str(data), "n_eval": N_EVAL},
           "reward": {"workers": 0, "functions": [{"name": "tests.fixtures.rewards:answer_chars"}]},
           "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_tokens": 4},
           "trainer": {"lr": 1e-3, "micro_batch_size": 8, "mini_batches": 1}, "eval": {"every": 1, "max_tokens": 3},
           "run": {"steps": 2, "save_every": 0, "loggers": [], "samples_every": 1, "samples_per_step": PROMPTS * GROUP}}
    path = d / "run.yaml"
    path.write_text(json.dumps(cfg))
    return path


def argv(config: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(config), f"run.out_dir={out}", *extra]


def test_a_keyword_reward_run_logs_its_scorer_and_the_rows_say_what_the_model_said(config, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(argv(config, out)) == 0
    printed = capsys.readouterr().out
    metrics = read_metrics(out)
    evals = [m for m in metrics if "eval/reward" in m]
    steps = [m for m in metrics if "reward/mean" in m]
    assert [m["step"] for m in evals] == [0, 1, 2] and [m["step"] for m in steps] == [1, 2]
    # the held-out line reports the user's scorer; exact match is not called accuracy, and no 0 accuracy is logged
    assert printed.strip() == f"run: {out}  steps: 2  held-out reward: {evals[-1]['eval/reward']:.3f}"
    assert not any(k.endswith("accuracy") for m in metrics for k in m)
    assert all("eval/exact_match" in m for m in evals) and all("reward/exact_match" in m for m in steps)

    rows = read_samples(out)
    source = {r["prompt"]: r["answer"] for r in ROWS}
    for r in rows:
        # the reward is the user's function applied here to the row; correct is exact match of the first line
        assert r["reward"] == answer_chars(r["completion"], r["answer"])
        assert r["correct"] == (first_line(r["completion"]) == r["answer"])
        assert source[r["prompt"]] == r["answer"] and r["prompt_text"].endswith(r["prompt"])
    for m in evals:
        got = [r for r in rows if r["step"] == m["step"] and r["split"] == "eval"]
        assert [r["index"] for r in got] == list(range(N_EVAL))
        assert sum(r["reward"] for r in got) / N_EVAL == pytest.approx(m["eval/reward"], abs=1e-12)
        assert sum(r["correct"] for r in got) / N_EVAL == m["eval/exact_match"]
        assert sum(r["tokens"] for r in got) / N_EVAL == pytest.approx(m["eval/response_length"], abs=1e-12)
    spread = False
    for m in steps:
        got = [r for r in rows if r["step"] == m["step"] and r["split"] == "train"]
        assert [r["index"] for r in got] == list(range(PROMPTS * GROUP))
        assert [r["group"] for r in got] == [i // GROUP for i in range(PROMPTS * GROUP)]
        assert sum(r["reward"] for r in got) / len(got) == pytest.approx(m["reward/mean"], abs=1e-12)
        for g in range(PROMPTS):
            group = got[g * GROUP:(g + 1) * GROUP]
            assert len({r["prompt"] for r in group}) == 1  # a group is one prompt's samples
            rewards = [r["reward"] for r in group]
            mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
            spread |= std > 0
            for r in group:  # GRPO: (r - mean) / (sample std + 1e-6), in float32
                assert r["advantage"] == pytest.approx((r["reward"] - mean) / (std + 1e-6), abs=1e-5)
    assert spread  # some group had rewards with spread: the advantages above are not all 0

    # relayrl eval of the run's model with its settings writes the rows its last evaluation wrote
    file = tmp_path / "eval_samples.jsonl"
    assert main(["eval", "--run", str(out), "--samples", str(file)]) == 0
    held, kv = capsys.readouterr().out.strip().splitlines()  # the held-out line, then the figures
    assert held.startswith("held-out: ")
    figures = dict(x.split("=") for x in kv.split())
    again = read_samples(file)
    last = [r for r in rows if r["step"] == 2 and r["split"] == "eval"]
    assert [{**r, "step": 2} for r in again] == last
    assert float(figures["eval/reward"]) == pytest.approx(evals[-1]["eval/reward"], abs=1e-3)


def test_a_resumed_run_writes_each_steps_rows_once_as_the_uninterrupted_run_did(config, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(argv(config, out, "run.steps=3", "run.save_every=1", "run.keep_last=3")) == 0
    whole = (out / "samples.jsonl").read_text()
    # killed after step 3's rows were written, before its checkpoint: resumed from step 2, step 3 replayed
    shutil.rmtree(out / "checkpoints" / step_dir_name(3))
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"step": 3, "split": "train", "ind')  # and a line cut by the kill
    assert main(["train", "--resume", str(out)]) == 0
    capsys.readouterr()
    assert (out / "samples.jsonl").read_text() == whole
    keys = [(r["step"], r["split"], r["index"]) for r in read_samples(out)]
    assert len(keys) == len(set(keys)) and {k[0] for k in keys} == {0, 1, 2, 3}


def test_sft_records_its_evaluations_and_a_tasks_correctness_stays_accuracy_beside_a_user_reward(tmp_path, capsys):
    """relayrl sft on the built-in arith task, its evaluations scored by the keyword reward: the task's own
    correctness is still accuracy, the line reports the user's scorer, and each evaluation's rows are its figures."""
    out = tmp_path / "sft"
    assert main(["sft", f"sft.out_dir={out}", "sft.steps=1", "sft.batch_size=8", "model.tiny.hidden_size=32",
                 "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=1", "data.n_train=16",
                 f"data.n_eval={N_EVAL}", "eval.max_tokens=3", "sft.tensorboard=false", "reward.workers=0",
                 "reward.functions=[{name: tests.fixtures.rewards:answer_chars}]"]) == 0
    evals = [m for m in read_metrics(out) if "eval/reward" in m]
    assert [m["step"] for m in evals] == [0, 1] and all("eval/accuracy" in m for m in evals)
    assert capsys.readouterr().out.strip() == (f"model: {out / 'model'}  held-out reward: "
                                               f"{evals[0]['eval/reward']:.3f} -> {evals[1]['eval/reward']:.3f}")
    rows = read_samples(out)
    for m in evals:
        got = [r for r in rows if r["step"] == m["step"]]
        assert [(r["split"], r["index"]) for r in got] == [("eval", i) for i in range(N_EVAL)]
        assert all(r["reward"] == answer_chars(r["completion"], r["answer"]) for r in got)
        assert sum(r["reward"] for r in got) / N_EVAL == pytest.approx(m["eval/reward"], abs=1e-12)
        assert sum(r["correct"] for r in got) / N_EVAL == m["eval/accuracy"]
