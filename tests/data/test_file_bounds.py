"""Dataset answers as the rewards compare them (null refused or no answer, objects as JSON), and the bounds on a
row: its line's length, its prompt's length, its JSON's depth and digits (relayrl.data.files)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relayrl.data import files as data_files
from relayrl.data import load_dataset_file
from relayrl.errors import DataError

pytestmark = pytest.mark.unit


def _jsonl(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_answers_are_text_the_rewards_can_compare(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", *(json.dumps({"prompt": f"q{i}", "answer": a}) for i, a in enumerate(
        ["5", 5, 2.5, True, {"x": [1, "é"]}, [1, 2]])))
    # a number or boolean by str(); an object or list as JSON (never a Python repr like "{'x': [1, 'é']}")
    assert [r.answer for r in load_dataset_file(p)] == ["5", "5", "2.5", "True", '{"x": [1, "é"]}', "[1, 2]"]


def test_a_null_answer_is_refused_in_plain_and_no_answer_in_trl(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", '{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": null}')
    with pytest.raises(DataError) as e:
        load_dataset_file(p, format="plain")
    assert str(e.value) == (f"{p} line 2: answer field 'answer' is null; give the row its answer, or set "
                            "data.answer_field: null if the dataset has no answers (a null would become the text "
                            "'None')")
    assert [r.answer for r in load_dataset_file(p, format="trl")] == ["1", ""]  # TRL rows may lack an answer
    assert [r.answer for r in load_dataset_file(p, answer_field=None)] == ["", ""]


def test_a_parquet_null_answer_names_its_row(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", None]}), p)
    with pytest.raises(DataError, match=rf"^{p} row 1: answer field 'answer' is null; "):
        load_dataset_file(p)


def test_a_line_past_the_bound_is_refused_and_one_at_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files, "MAX_LINE_BYTES", 64)
    fits = '{"prompt": "' + "x" * (64 - 29) + '", "answer": "1"}'
    assert len(fits) == 64
    p = _jsonl(tmp_path / "d.jsonl", fits, fits + " ")
    with pytest.raises(DataError) as e:
        load_dataset_file(p)
    assert str(e.value) == (f"{p} line 2 is longer than 0 MiB, past what one row may hold; shorten the row (or "
                            "split the text over several rows)")
    assert len(load_dataset_file(_jsonl(tmp_path / "ok.jsonl", fits, fits))) == 2


@pytest.mark.parametrize("prompt", ["x" * 33, [{"role": "system", "content": "x" * 20},
                                               {"role": "user", "content": "y" * 13}]])
def test_a_prompt_past_the_bound_is_refused_before_any_tokenizer(tmp_path, monkeypatch, prompt):
    monkeypatch.setattr(data_files, "MAX_PROMPT_CHARS", 32)
    p = _jsonl(tmp_path / "d.jsonl", json.dumps({"prompt": prompt, "answer": "1"}))
    with pytest.raises(DataError) as e:
        load_dataset_file(p)
    assert str(e.value) == (f"{p} line 1: prompt field 'prompt' holds 33 characters, more than 32 (no model's "
                            "context holds it); shorten the prompt or drop the row")
    shorter = prompt[:-1] if isinstance(prompt, str) else [prompt[0], {"role": "user", "content": "y" * 12}]
    assert load_dataset_file(_jsonl(tmp_path / "ok.jsonl", json.dumps({"prompt": shorter, "answer": "1"})))


def test_json_depth_and_digits_are_bounded_at_the_limits(tmp_path):
    at = '{"prompt": "a", "answer": "1", "x": ' + "[" * 99 + "]" * 99 + "}"  # 100 levels with the row's object
    past = '{"prompt": "a", "answer": "1", "x": ' + "[" * 100 + "]" * 100 + "}"
    assert load_dataset_file(_jsonl(tmp_path / "ok.jsonl", at))
    with pytest.raises(DataError, match=r"at line 1: nested deeper than 100 levels \(column 1\)$"):
        load_dataset_file(_jsonl(tmp_path / "d.jsonl", past))
    assert load_dataset_file(_jsonl(tmp_path / "n.jsonl", '{"prompt": "a", "answer": ' + "9" * 4300 + "}"))
    with pytest.raises(DataError, match=r"at line 1: a number of 4301 digits is too long \(column 27\)$"):
        load_dataset_file(_jsonl(tmp_path / "m.jsonl", '{"prompt": "a", "answer": ' + "9" * 4301 + "}"))
