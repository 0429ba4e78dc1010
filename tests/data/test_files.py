"""User datasets (.jsonl, .parquet) with their error messages, file splits, and prompt formatting."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relayrl.data import DataConfig, build_datasets, format_prompt, load_dataset_file
from relayrl.errors import DataError
from relayrl.models.tokenizer import build_char_tokenizer

pytestmark = pytest.mark.unit


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_loads_rows_and_keeps_other_fields(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"q": "1+1=", "a": 2, "id": 7}, {"q": "2+2=", "a": "4", "id": 8}])
    rows = load_dataset_file(p, prompt_field="q", answer_field="a")
    assert [(r.prompt, r.answer) for r in rows] == [("1+1=", "2"), ("2+2=", "4")]
    # every column but the prompt, as read (the answer's raw value too: TRL-style reward functions get the columns)
    assert rows[0].meta == {"row": 0, "fields": {"a": 2, "id": 7}}
    assert "task" not in rows[0].meta


def test_parquet_loads(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), p)
    rows = load_dataset_file(p)
    assert [(r.prompt, r.answer) for r in rows] == [("a", "1"), ("b", "2")]


def _one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_file_errors(tmp_path):
    assert "not found" in _one_line_error(load_dataset_file, tmp_path / "nope.jsonl")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": \n')
    assert "line 3" in _one_line_error(load_dataset_file, bad)

    p = _jsonl(tmp_path / "f.jsonl", [{"question": "a", "answer": "1"}])
    msg = _one_line_error(load_dataset_file, p)
    assert "'prompt'" in msg and "'question'" in msg and "line 1" in msg

    msg = _one_line_error(load_dataset_file, p, prompt_field="question", answer_field="solution")
    assert "'solution'" in msg and "'answer'" in msg
    assert load_dataset_file(p, prompt_field="question", answer_field=None)[0].answer == ""

    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    assert "empty" in _one_line_error(load_dataset_file, empty)

    pe = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), pe)
    assert "empty" in _one_line_error(load_dataset_file, pe)

    pm = tmp_path / "m.parquet"
    pq.write_table(pa.table({"text": ["a"], "answer": ["1"]}), pm)
    msg = _one_line_error(load_dataset_file, pm)
    assert "'prompt'" in msg and "'text'" in msg and "row 0" in msg

    junk = tmp_path / "j.parquet"
    junk.write_text("not parquet")
    assert "cannot read parquet" in _one_line_error(load_dataset_file, junk)

    assert "unsupported" in _one_line_error(load_dataset_file, _jsonl(tmp_path / "d.csv", []))


def test_file_split_holds_out_n_eval_rows_deterministically(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(20)] + [{"prompt": "p0", "answer": "0"}]
    p = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig.from_dict({"task": "file", "path": str(p), "n_eval": 5, "seed": 1})
    train, ev = build_datasets(cfg)
    assert len(ev) == 5
    assert not {e.prompt for e in ev} & {e.prompt for e in train}
    assert len(train) + len(ev) <= 21
    assert build_datasets(cfg) == (train, ev)

    small = DataConfig.from_dict({"task": "file", "path": str(p), "n_eval": 21})
    assert "data.n_eval" in _one_line_error(build_datasets, small)


def test_file_with_separate_eval(tmp_path):
    tr = _jsonl(tmp_path / "t.jsonl", [{"prompt": f"p{i}", "answer": "x"} for i in range(6)])
    ev = _jsonl(tmp_path / "e.jsonl", [{"prompt": "p0", "answer": "x"}, {"prompt": "q", "answer": "y"}])
    cfg = DataConfig.from_dict({"task": "file", "path": str(tr), "eval_path": str(ev), "n_eval": 10})
    train, held = build_datasets(cfg)
    assert [e.prompt for e in held] == ["p0", "q"]
    assert [e.prompt for e in train] == [f"p{i}" for i in range(1, 6)]


def test_format_prompt(tmp_path):
    tok = build_char_tokenizer(tmp_path, "0123456789+=", "llama")
    assert format_prompt(tok, "1+2=", "never", system=None) == "1+2="
    assert format_prompt(tok, "1+2=", "always", None) == "user: 1+2=\nassistant: "
    assert format_prompt(tok, "1+2=", "always", "sum") == "system: sum\nuser: 1+2=\nassistant: "
    with pytest.raises(DataError, match="data.chat_template is never"):
        format_prompt(tok, "1+2=", "never", "sum")
    tok.chat_template = None
    with pytest.raises(DataError, match="data.chat_template is always but the tokenizer has no chat template"):
        format_prompt(tok, "1+2=", "always", None)
