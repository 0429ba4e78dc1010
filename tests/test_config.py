"""Config input as people write it: numbers in every common spelling, on the command line and in YAML
files; a dataset that is not UTF-8 named with its byte offset; a tensor-parallel degree that does not
divide the model checked before any worker process starts. Each refusal is one line and exit 2."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.config import apply_overrides, parse_yaml
from relayrl.controller.config import RunConfig, load_run_config
from relayrl.data import DataConfig, build_datasets
from relayrl.errors import DataError

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "grpo_arith.yaml")
SPELLINGS = {  # as written -> the number meant
    "3e-3": 3e-3, "1E-5": 1e-5, ".5": 0.5, "1_000": 1000, "1e5": 1e5, "-2.5e+3": -2500.0, "+.5e1": 5.0,
    "1.": 1.0, "1_000.5e-2": 10.005, "010": 10, "0x10": 16, ".inf": float("inf"),
}


@pytest.mark.unit
@pytest.mark.parametrize("text", sorted(SPELLINGS))
def test_number_spellings(text):
    assert parse_yaml(text) == SPELLINGS[text]
    assert parse_yaml(f"x: {text}") == {"x": SPELLINGS[text]}
    assert apply_overrides({}, [f"a.b={text}"]) == {"a": {"b": SPELLINGS[text]}}


@pytest.mark.unit
def test_what_stays_a_string():
    for text in ("1:30", "abc", "1e", "e5", "._5", "nan", "inf", "v1.2"):  # no base-60, no bare nan / inf
        assert parse_yaml(text) == text


@pytest.mark.unit
def test_numbers_reach_the_run_config_from_files_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  lr: 3e-3\n  adam_eps: 1E-8\n  weight_decay: .5\n"
                    "data:\n  n_train: 1_000\n")
    cfg = load_run_config(path, ["algo.clip_low=.1", "rollout.temperature=7e-1", "run.steps=2_000"])
    assert (cfg.trainer.lr, cfg.trainer.adam_eps, cfg.trainer.weight_decay) == (3e-3, 1e-8, 0.5)
    assert (cfg.data.n_train, cfg.algo.clip_low, cfg.rollout.temperature, cfg.run.steps) == (1000, 0.1, 0.7, 2000)
    assert isinstance(cfg.data.n_train, int) and isinstance(cfg.run.steps, int)
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.e2e
def test_cli_takes_the_spellings(tmp_path, capsys):
    code = main(["train", CONFIG, "trainer.lr=3e-3", "run.steps=0", f"run.out_dir={tmp_path}"])  # steps must be >= 1
    err = capsys.readouterr().err
    assert code == 2 and "run.steps" in err and "trainer.lr" not in err  # 3e-3 was read as a number


@pytest.mark.unit
def test_a_non_utf8_dataset_is_named_with_its_byte_offset(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n')
    with pytest.raises(DataError) as err:
        build_datasets(DataConfig(task="file", path=str(data), n_eval=1))
    # line 1 is 34 bytes with its newline; the bad byte is at offset 15 of line 2
    assert str(err.value) == f"{data} is not UTF-8: byte 49 (line 2) is 0xe9; save the dataset as UTF-8"


@pytest.mark.e2e
def test_tensor_parallel_that_does_not_divide_the_model_is_refused_before_any_process(tmp_path, capsys):
    t0 = time.monotonic()
    code = main(["train", CONFIG, "parallel.backend=local", "parallel.tp=3", f"run.out_dir={tmp_path / 'a'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("relayrl: error: parallel.tp: tensor parallel degree 3 does not divide"), err
    code = main(["train", CONFIG, "rollout.tp=3", "parallel.backend=local", "parallel.dp_shard=3",
                 f"run.out_dir={tmp_path / 'b'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("relayrl: error: rollout.tp: "), err
    assert time.monotonic() - t0 < 30  # no worker was started (starting one takes seconds)
