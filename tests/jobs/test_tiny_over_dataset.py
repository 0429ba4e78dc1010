"""A user's own dataset with no pretrained model: the tiny model is built over the dataset's characters and trains;
a dataset the chosen model's tokenizer cannot represent is refused by `relayrl train`, `sft` and `eval` in one line,
exit 2, with nothing written that a corrected run loses."""

import json
import re

import pytest

from relayrl.cli.main import main
from relayrl.data import DataConfig, build_datasets
from relayrl.data.alphabet import alphabet_of
from relayrl.jobs.base_model import dataset_alphabet
from relayrl.models.config import TinyModelConfig
from relayrl.models.tiny import build_tiny_model
from relayrl.models.tokenizer import CHAT_TEMPLATE_CHARS, char_tokenizer, load_tokenizer
from relayrl.observe import read_metrics
from relayrl.rollout.charset import ADVICE
from relayrl.rollout.prompts import encode_answer, encode_prompt, prompt_text

from helpers import cfg_for

ROWS = [("Wie viel ist 3+4? Antwort:", "7"), ("Combien font 3×4 ? Réponse :", "12"), ("3 + 4 等于多少？", "七"),
        ("x² + 1 = 5, x = ?", "2"), ("Сколько будет 9 − 3?", "6"), ("What is 2+2? Answer:", "4"),
        ("emoji 🙂 + 🙂 =", "🙂🙂"), ("naïve café\tnext", "ok")]
ISSUE_PROMPT = "What is 3+4-2? Answer:"
TINY = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=1",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_tokens=4", "eval.max_tokens=4",
        "run.loggers=[]", "run.trace=false"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}, ensure_ascii=False) + "\n" for p, a in rows))
    return path


def _byte_symbols(chars: str) -> int:
    return len({b for ch in set(chars) for b in ch.encode()})


@pytest.mark.e2e
def test_the_tiny_model_over_a_file_dataset_trains_and_round_trips_every_prompt(tmp_path):
    from relayrl.jobs.train import train

    path = _jsonl(tmp_path / "mine.jsonl", ROWS)
    cfg = cfg_for(tmp_path, "run", data={"task": "file", "path": str(path), "n_eval": 2},
                  rollout={"prompts_per_step": 2, "group_size": 2, "max_tokens": 4},
                  run={"steps": 2, "save_every": 0, "trace": False})
    out = train(cfg, show_progress=False)
    assert out["steps"] == 2 and [m["step"] for m in read_metrics(tmp_path / "run") if "loss" in m] == [1, 2]
    tok = load_tokenizer(tmp_path / "run" / "base_model")
    # the vocabulary is exactly what the data need: the specials, then one token per UTF-8 byte of the dataset's
    # characters and the template's (the reference: counted here from the rows)
    chars = "".join(p + a for p, a in ROWS) + CHAT_TEMPLATE_CHARS
    assert len(tok) == 4 + _byte_symbols(chars)
    train_set, eval_set = build_datasets(cfg.data)
    assert len(train_set) + len(eval_set) == len(ROWS)
    for ex in train_set + eval_set:
        ids = encode_prompt(tok, ex, cfg.data)
        assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
        assert tok.decode(ids[1:]) == ex.prompt  # exactly, every character
        assert tok.decode(encode_answer(tok, ex.answer), skip_special_tokens=True) == ex.answer
    assert (tmp_path / "run" / "final_model" / "tokenizer.json").is_file()


@pytest.mark.unit
def test_the_dataset_alphabet_covers_prompts_as_the_template_renders_them(tmp_path):
    """Message prompts (a tool turn's tags included) and a system prompt, through the tiny tokenizer's template."""
    rows = [{"prompt": [{"role": "user", "content": "¿Cuánto es 2+2?"}, {"role": "assistant", "content": "4"},
                        {"role": "tool", "content": "ok"}, {"role": "user", "content": "Y 3×3?"}], "answer": "9"},
            {"prompt": "Ünïcödé", "answer": "ß"}, {"prompt": "plain", "answer": "p"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    data = DataConfig(task="file", path=str(path), n_eval=1, chat_template="always", system_prompt="Sé breve.")
    alphabet = dataset_alphabet(data)
    train_set, eval_set = build_datasets(data)
    assert set(alphabet_of(train_set + eval_set)) < set(alphabet)  # the template's own text adds characters
    assert {"<", "_", ">"} <= set(alphabet) - set(alphabet_of(train_set + eval_set))  # "<tool_response>"
    tok = char_tokenizer(alphabet)
    for ex in train_set + eval_set:
        text = prompt_text(tok, ex, data)
        assert text.startswith("system: Sé breve.\nuser: ")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and tok.decode(ids) == text


def _arith_model(tmp_path):
    d = tmp_path / "arith_model"
    build_tiny_model(d, "0123456789+-*=", TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    return d


def _run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


@pytest.mark.e2e
def test_train_sft_and_eval_refuse_the_issues_dataset_in_one_line(tmp_path, capsys):
    model = _arith_model(tmp_path)
    bad = _jsonl(tmp_path / "bad.jsonl", [("1+2=", "3"), (ISSUE_PROMPT, "5"), ("9-3=", "6")])
    good = _jsonl(tmp_path / "good.jsonl", [("7+1=", "8")])
    line = (f"relayrl: error: train example 1 (row 1 of {bad}, counting from 0): the prompt has characters the "
            f"tokenizer of {model} cannot represent ('W', 'h', '?', 'A', 'w'), which the model would never see; "
            f"{ADVICE}")
    data = ["data.task=file", f"data.path={bad}", f"data.eval_path={good}", "data.n_eval=1"]
    run, cfg = tmp_path / "run", tmp_path / "cfg.yaml"
    cfg.write_text("{}")
    code, err = _run(capsys, "train", str(cfg), f"model.path={model}", *data, f"run.out_dir={run}", "run.steps=1",
                     *TINY)
    assert (code, err) == (2, line)
    assert sorted(p.name for p in run.iterdir()) == []  # no config.yaml (written once built), metrics, model, lock

    sft = tmp_path / "sft"
    code, err = _run(capsys, "sft", f"model.path={model}", *data, f"sft.out_dir={sft}", "sft.steps=1")
    assert (code, err) == (2, line)
    assert not (sft / "model").exists() and not (sft / "metrics.jsonl").exists()

    # eval holds out n rows of a file (a shuffled split): every row here has the issue's characters
    questions = _jsonl(tmp_path / "questions.jsonl", [(ISSUE_PROMPT, "5"), ("What is 1+1? Answer:", "2"),
                                                      ("What is 2+5? Answer:", "7")])
    code, err = _run(capsys, "eval", "--model", str(model), "--task", "file", "--path", str(questions), "--n", "2")
    assert code == 2 and len(err.splitlines()) == 1
    assert re.fullmatch(rf"relayrl: error: eval example 0 \(row \d of {re.escape(str(questions))}, counting from 0\): "
                        rf"the prompt has characters the tokenizer of {re.escape(str(model))} cannot represent "
                        r"\('W', 'h', '\?', 'A', 'w'\), which the model would never see; 2 of the 2 eval examples "
                        r"have such characters; remove them from the data, or evaluate a model whose tokenizer has "
                        r"them", err), err

    # the data corrected, the same run directory trains: nothing the refusal left behind is in the way
    _jsonl(bad, [("1+2=", "3"), ("3+4-2=", "5"), ("9-3=", "6")])
    code, err = _run(capsys, "train", str(cfg), f"model.path={model}", *data, f"run.out_dir={run}", "run.steps=1",
                     *TINY)
    assert code == 0, err
    assert (run / "final_model" / "config.json").is_file()


@pytest.mark.unit
def test_a_tiny_model_left_by_a_start_on_other_data_is_named(tmp_path):
    """A run directory's base_model/ is reused (a resumed run must keep it): built over other data, the refusal
    says so, instead of advising to leave model.path unset (it is)."""
    from relayrl.errors import DataError
    from relayrl.jobs.base_model import check_datasets

    model = _arith_model(tmp_path)
    data = DataConfig(task="file", path=str(_jsonl(tmp_path / "d.jsonl", [("1+1=", "2"), ("¿1+1?", "2")])), n_eval=1)
    train_set, eval_set = build_datasets(data)
    with pytest.raises(DataError, match=rf"\('¿', '\?'\), .*; {model} was built for other data: start the run in a new "
                                        r"run.out_dir$"):
        check_datasets(data, None, model, {"train": train_set + eval_set})
    check_datasets(data, None, model, {"train": [ex for ex in train_set + eval_set if ex.prompt == "1+1="]})
