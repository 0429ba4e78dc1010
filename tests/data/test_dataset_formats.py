"""Datasets as users have them: string and chat-message prompts, verl parquet, TRL conversational jsonl;
TRL-style batch and verl-style reward functions beside relayrl's per-sample ones; and each format through
`relayrl train` with the rewards the run logged checked against the functions' own values."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relayrl.data import DataConfig, Example, build_datasets, format_prompt, load_dataset_file
from relayrl.errors import ConfigError, DataError, RewardError
from relayrl.models.tokenizer import build_char_tokenizer
from relayrl.rollout.prompts import encode_prompt

from helpers import importable, scorer

MSG = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _verl_rows(n: int, truth=lambda i: str(i + 3)):
    """Rows laid out as verl's data preparation writes them (docs/preparation/prepare_data.rst)."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{i}+3="}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": truth(i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def _verl_parquet(path, rows):
    """The verl schema exactly: prompt a list of {content, role} structs, reward_model and extra_info structs."""
    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    truth_type = pa.infer_type([r["reward_model"]["ground_truth"] for r in rows])
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.list_(message)), ("ability", pa.string()),
                        ("reward_model", pa.struct([("ground_truth", truth_type), ("style", pa.string())])),
                        ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())]))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def _one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------- loading, field by field
@pytest.mark.unit
def test_jsonl_string_prompts(tmp_path):
    rows = [{"prompt": "1+2=", "answer": 3, "level": "easy"}, {"prompt": "2+2=", "answer": "4"}]
    p = _jsonl(tmp_path / "s.jsonl", rows)
    a, b = load_dataset_file(p)
    assert (a.prompt, a.answer, a.meta) == ("1+2=", "3", {"row": 0, "fields": {"answer": 3, "level": "easy"}})
    assert (b.prompt, b.answer, b.meta) == ("2+2=", "4", {"row": 1, "fields": {"answer": "4"}})


@pytest.mark.unit
def test_jsonl_message_prompts(tmp_path):
    tool_turn = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                 {"role": "tool", "content": "12:00"}]
    p = _jsonl(tmp_path / "m.jsonl", [{"prompt": MSG, "answer": "3"}, {"prompt": tool_turn, "answer": "noon"}])
    a, b = load_dataset_file(p)
    assert (a.prompt, a.answer, a.meta) == (MSG, "3", {"row": 0, "fields": {"answer": "3"}})
    assert (b.prompt, b.answer) == (tool_turn, "noon")


@pytest.mark.unit
def test_verl_parquet_loads_as_verl_documents_it(tmp_path):
    rows = _verl_rows(3)
    exs = load_dataset_file(_verl_parquet(tmp_path / "v.parquet", rows))  # data.format auto: detected
    assert [e.prompt for e in exs] == [r["prompt"] for r in rows]
    assert [e.answer for e in exs] == ["3", "4", "5"]  # reward_model.ground_truth
    assert exs[2].meta == {"row": 2, "fields": {
        "data_source": "openai/gsm8k", "ability": "math", "reward_model": {"ground_truth": "5", "style": "rule"},
        "extra_info": {"index": 2, "split": "train"}}}
    # a number is stringified, a list (verl's README writes ["72"]) becomes JSON; the raw value stays in fields
    nums = load_dataset_file(_verl_parquet(tmp_path / "n.parquet", _verl_rows(2, truth=lambda i: i + 0.5)))
    assert [e.answer for e in nums] == ["0.5", "1.5"] and nums[0].meta["fields"]["reward_model"]["ground_truth"] == 0.5
    lists = load_dataset_file(_verl_parquet(tmp_path / "l.parquet", _verl_rows(1, truth=lambda i: ["72"])))
    assert lists[0].answer == '["72"]'
    # forced plain: verl's file has no answer column, so it says so and how to fix it
    assert "data.format=trl" in _one_line_error(load_dataset_file, tmp_path / "v.parquet", format="plain")


@pytest.mark.unit
def test_trl_conversational_jsonl(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{i}*2="}], "ground_truth": str(2 * i), "id": i} for i in range(3)]
    p = _jsonl(tmp_path / "t.jsonl", rows)
    exs = load_dataset_file(p, format="trl")
    assert [(e.prompt, e.answer) for e in exs] == [(r["prompt"], "") for r in rows]  # no answer column: ""
    assert exs[1].meta == {"row": 1, "fields": {"ground_truth": "2", "id": 1}}
    # its reference column named as the answer: the task reward's exact match can use it too
    assert [e.answer for e in load_dataset_file(p, answer_field="ground_truth", format="trl")] == ["0", "2", "4"]
    assert "has no answer field 'answer'" in _one_line_error(load_dataset_file, p)  # auto is plain: no silent ""


@pytest.mark.unit
def test_bad_rows_are_one_line_naming_file_row_and_problem(tmp_path):
    cases = [
        ([], "empty list of messages"),
        ("x", None),
        (7, "must be a string or a list of chat messages, got int"),
        (["hi"], "message 0 is a str, not an object"),
        ([{"role": "bot", "content": "x"}], "message 0 has role 'bot'; use one of system, user, assistant, tool"),
        ([{"content": "x"}], "message 0 has role None"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}],
         "message 1 (user) needs a string 'content'"),
    ]
    for prompt, reason in cases:
        p = _jsonl(tmp_path / "b.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": prompt, "answer": "1"}])
        if reason is None:
            assert load_dataset_file(p)[1].prompt == "x"
            continue
        msg = _one_line_error(load_dataset_file, p)
        assert msg.startswith(f"{p} line 2: prompt field 'prompt'") and reason in msg, msg
    rows = _verl_rows(2)
    del rows[1]["reward_model"]
    p = _jsonl(tmp_path / "v.jsonl", rows)
    msg = _one_line_error(load_dataset_file, p)  # auto: the first row says verl, the second breaks it
    assert msg.startswith(f"{p} line 2: a verl row needs a 'reward_model' object with a 'ground_truth'"), msg
    pbad = _verl_parquet(tmp_path / "bad.parquet", _verl_rows(2))
    table = pq.read_table(pbad)
    pq.write_table(table.set_column(1, "prompt", pa.array([[], [{"content": "x", "role": "user"}]],
                                                          table.schema.field("prompt").type)), pbad)
    assert _one_line_error(load_dataset_file, pbad).startswith(f"{pbad} row 0: prompt field 'prompt' is an empty list")
    with pytest.raises(ConfigError, match="format"):
        DataConfig.from_dict({"task": "file", "path": str(p), "format": "csv"})
    with pytest.raises(ConfigError, match="format is only used with task 'file'"):
        DataConfig.from_dict({"task": "arith", "format": "verl"})


@pytest.mark.unit
def test_held_out_message_prompts_are_dropped_from_train(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(6)]
    tr, ev = _jsonl(tmp_path / "tr.jsonl", rows), _jsonl(tmp_path / "ev.jsonl", [rows[2], rows[4]])
    train, held = build_datasets(DataConfig.from_dict({"task": "file", "path": str(tr), "eval_path": str(ev)}))
    assert [e.answer for e in held] == ["2", "4"] and [e.answer for e in train] == ["0", "1", "3", "5"]
    # the same messages with their keys in another order are the same prompt
    swapped = [{"content": m["content"], "role": m["role"]} for m in rows[1]["prompt"]]
    _jsonl(ev, [{"prompt": swapped, "answer": "1"}])
    train, _ = build_datasets(DataConfig.from_dict({"task": "file", "path": str(tr), "eval_path": str(ev)}))
    assert [e.answer for e in train] == ["0", "2", "3", "4", "5"]


@pytest.mark.unit
def test_message_prompts_render_through_the_chat_template(tmp_path):
    tok = build_char_tokenizer(tmp_path, "0123456789+=abeirfsy", "llama")
    want = "system: be brief\nuser: 1+2=\nassistant: "
    # under every data.chat_template: messages have no text form but the template's
    assert {format_prompt(tok, MSG, mode) for mode in ("never", "auto", "always")} == {want}
    assert format_prompt(tok, MSG[1:], "always", system="sum") == "system: sum\nuser: 1+2=\nassistant: "
    assert format_prompt(tok, MSG, "auto", system="sum") == want  # the messages' own system message wins
    plain = DataConfig()
    # the template decides the BOS for messages; a plain string prompt gets the tokenizer's BOS
    assert encode_prompt(tok, Example(MSG, "3"), plain) == tok(want, add_special_tokens=False)["input_ids"]
    assert encode_prompt(tok, Example("1+2=", "3"), plain) == [tok.bos_token_id] + tok("1+2=")["input_ids"]
    tok.chat_template = None
    assert "no chat template" in _one_line_error(format_prompt, tok, MSG, "never")
    assert format_prompt(tok, "1+2=", "never") == format_prompt(tok, "1+2=", "auto") == "1+2="


# ---------------------------------------------------------------------------- reward function forms
REWARDS = '''
import json, math, os, time

def overlap(completions, prompts, column="ground_truth", **columns):
    """TRL's form: half the share of the reference's characters found in each completion, half the share of
    the completion's characters in a..m (so a random tiny model's samples get rewards with spread)."""
    out = []
    for c, p, ref in zip(completions, prompts, columns[column], strict=True):
        if isinstance(p, list):  # conversational: TRL passes [{"role": "assistant", "content": ...}]
            (msg,) = c
            assert msg["role"] == "assistant", msg
            c = msg["content"]
        assert isinstance(c, str), c
        ref = ref["ground_truth"] if isinstance(ref, dict) else str(ref)
        found, early = sum(ch in c for ch in ref) / len(ref), sum("a" <= ch <= "m" for ch in c) / max(len(c), 1)
        out.append(0.5 * found + 0.5 * early)
    return out

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's form (docs/preparation/reward_function.rst); a dict with "score" as verl's managers accept."""
    index = (extra_info or {}).get("index", 0)
    return {"score": float(solution_str.strip().startswith(str(ground_truth))) + 0.01 * index, "acc": 1}

def record(completions, prompts, log, trainer_state, **columns):  # trainer_state: TRL passes it; not a column
    with open(log, "a") as f:
        f.write(json.dumps({"completions": completions, "prompts": prompts, "columns": columns}) + "\\n")
    return [len(c) if isinstance(c, str) else -len(c[0]["content"]) for c in completions]

def anything(**kwargs):
    return [1.0] * len(kwargs["completions"])

def wrong(completions, **kwargs):
    n = len(completions)
    if completions[0] == "short":
        return [1.0] * (n - 1)
    if completions[0] == "scalar":
        return 1.0
    if completions[0] == "raise":
        raise ValueError("bad batch")
    if completions[0] == "hang":
        time.sleep(3600)
    return [None, math.nan, True, 2][:n]

def named_only(completions, answer):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]
'''


@pytest.fixture(scope="module")
def rw(tmp_path_factory):
    with importable(tmp_path_factory.mktemp("fmt_rewards"), "fmt_rewards", REWARDS) as d:
        import importlib

        yield importlib.import_module("fmt_rewards"), d


def _group(ex, texts):
    return texts, [ex] * len(texts)  # one prompt's G samples: the same Example object, as the driver passes


@pytest.mark.unit
@pytest.mark.parametrize("workers", [0, 2])
def test_batch_function_gets_trl_arguments_once_per_prompt_group(rw, tmp_path, workers):
    log = tmp_path / "calls.jsonl"
    a = Example(MSG, "3", meta={"fields": {"answer": "3", "solution": "x3", "id": 1}})
    b = Example("2+2=", "4", meta={"fields": {"solution": "x4", "extra": [1, 2]}})
    c = Example("5+5=", "10", meta={"task": "arith"})  # a built-in task's example: its answer is its column
    comps = ["3", "33", "4", "44", "444", "10"]
    exs = [a, a, b, b, b, c]
    with scorer([{"name": "fmt_rewards:record", "params": {"log": str(log)}}], workers=workers) as s:
        r = s.score(comps, exs)
    assert r.rewards == [-1.0, -2.0, 1.0, 2.0, 3.0, 2.0]  # message prompts' completions came as messages
    calls = sorted((json.loads(line) for line in log.read_text().splitlines()), key=lambda d: len(d["prompts"]))
    assert [len(d["prompts"]) for d in calls] == [1, 2, 3]
    as_messages = [[{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "33"}]]
    assert calls[1] == {"completions": as_messages,
                        "prompts": [MSG, MSG],
                        "columns": {"answer": ["3", "3"], "solution": ["x3", "x3"], "id": [1, 1]}}
    assert calls[2] == {"completions": ["4", "44", "444"], "prompts": ["2+2="] * 3,
                        "columns": {"solution": ["x4"] * 3, "extra": [[1, 2]] * 3}}
    assert calls[0] == {"completions": ["10"], "prompts": ["5+5="], "columns": {"answer": ["10"]}}


@pytest.mark.unit
def test_batch_values_failures_and_forms(rw):
    fns = [{"name": "fmt_rewards:wrong"}, {"name": "fmt_rewards:anything", "batch": True, "weight": 0.5}]
    x, y = Example("q", "1"), Example("r", "2")
    for workers in (0, 1):
        with scorer(fns, workers=workers, on_failure=-1.0) as s:
            assert s.runner.forms[:2] == ["batch", "batch"]  # `anything` has only **kwargs: batch said so
            r = s.score(*_group(x, ["a", "b", "c", "d"]), check=False)
            # None: the function does not apply (adds 0, no failure); NaN: that sample fails; True is 1.0
            assert r.per_function["fmt_rewards:wrong"] == [0.0, -1.0, 1.0, 2.0] and r.failures == 1
            assert r.first_errors["fmt_rewards:wrong"] == "item 1: returned nan, expected a finite real number"
            assert r.rewards == [0.5, -0.5, 1.5, 2.5]
            # groups are runs of the same Example object: [x x] returns one value short and fails whole,
            # [y y] returns [None, nan]
            r = s.score(["short", "s2", "ok", "ok2"], [x, x, y, y], check=False)
            assert r.per_function["fmt_rewards:wrong"] == [-1.0, -1.0, 0.0, -1.0] and r.failures == 3
            assert r.first_errors["fmt_rewards:wrong"] == (
                "returned 1 values for 2 completions, expected one per completion")
            assert r.per_function["fmt_rewards:anything"] == [1.0] * 4
            r = s.score(["scalar", "raise"], [y, x], check=False)  # two groups of one
            assert r.per_function["fmt_rewards:wrong"] == [-1.0, -1.0] and r.failures == 2
            assert r.first_errors["fmt_rewards:wrong"] == "returned 1.0 (float), expected a list of 1 numbers"
            with pytest.raises(RewardError) as e:
                s.score(["raise", "raise"], [x, x])
            assert str(e.value) == (
                "every sample failed to score in reward function fmt_rewards:wrong: ValueError: bad batch")


@pytest.mark.faults
def test_batch_call_timeout_fails_its_group_only(rw):
    x, y = Example("q", "1"), Example("r", "2")
    with scorer([{"name": "fmt_rewards:wrong"}], workers=1, timeout_s=1.0) as s:
        r = s.score(["hang", "h2", "a", "b"], [x, x, y, y], check=False)
        assert r.per_function["fmt_rewards:wrong"] == [0.0, 0.0, 0.0, 0.0]
        assert (r.failures, r.timeouts) == (3, 2)  # the hung group's 2 samples time out; y's NaN item fails
        assert r.first_errors["fmt_rewards:wrong"] == "timed out after 1 s (reward.timeout_s)"


@pytest.mark.unit
def test_verl_function_and_keyword_filtering(rw):
    (row,) = _verl_rows(1)
    verl = Example(row["prompt"], "3", meta={"row": 0, "fields": {k: v for k, v in row.items() if k != "prompt"}})
    task = Example("1+2=", "3", meta={"task": "arith", "params": {}})
    fns = [{"name": "fmt_rewards:compute_score"}, {"name": "fmt_rewards:named_only"}]
    for workers in (0, 1):
        with scorer(fns, workers=workers) as s:
            assert s.runner.forms[:2] == ["verl", "batch"]
            r = s.score(["3 apples", "4"], [verl, verl], check=False)
            assert r.per_function["fmt_rewards:compute_score"] == [1.0, 0.0]
            r = s.score(["3", "x"], [task, task])  # no reward_model: the answer is the ground truth
            assert r.per_function["fmt_rewards:compute_score"] == [1.0, 0.0]
            assert r.per_function["fmt_rewards:named_only"] == [1.0, 0.0]  # only `answer` passed: no **kwargs
            trl = Example("7-2=", "", meta={"row": 0, "fields": {"ground_truth": "5", "extra_info": {"index": 3}}})
            r = s.score(["5", "4"], [trl, trl], check=False)  # a TRL file's ground_truth column
            assert r.per_function["fmt_rewards:compute_score"] == [1.03, 0.03]
    with pytest.raises(ConfigError, match=r"reward.functions.0.params: .*'scale'"):
        scorer([{"name": "fmt_rewards:named_only", "params": {"scale": 2}}], workers=0)
    with pytest.raises(ConfigError, match="batch"):
        scorer([{"name": "fmt_rewards:overlap", "batch": "maybe"}], workers=0)


# ---------------------------------------------------------------------------- end to end: relayrl train
ALPHABET = "0123456789+=*?:abcdefghijklmnopqrstuvwxyz "


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, init_std=0.2)
    return build_tiny_model(tmp_path_factory.mktemp("fmt_model") / "model", ALPHABET, cfg)


def _datasets(d):
    """The four layouts, each with 6 rows: (path, data.* overrides, the column per row the TRL reward reads)."""
    plain = [{"prompt": f"{i}+3=", "answer": str(i + 3)} for i in range(6)]
    msgs = [{"prompt": [{"role": "user", "content": f"{i}+3="}], "answer": str(i + 3)} for i in range(6)]
    trl = [{"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": f"{i}+4="}],
            "ground_truth": str(i + 4)} for i in range(6)]
    verl = _verl_rows(6)
    return {
        "plain": (_jsonl(d / "plain.jsonl", plain), [], "answer", plain),
        "messages": (_jsonl(d / "messages.jsonl", msgs), [], "answer", msgs),
        "trl": (_jsonl(d / "trl.jsonl", trl), ["data.format=trl"], "ground_truth", trl),
        "verl": (_verl_parquet(d / "verl.parquet", verl), [], "reward_model", verl),
    }


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["plain", "messages", "trl", "verl"])
def test_each_layout_trains_and_logs_the_functions_rewards(rw, tiny_model, tmp_path, monkeypatch, capsys, layout):
    from relayrl.cli.main import main
    from relayrl.data.chat import prompt_key
    from relayrl.observe import read_metrics
    from relayrl.rewards.scorer import RewardScorer

    module, rdir = rw
    path, extra, column, rows = _datasets(tmp_path)[layout]
    by_prompt = {prompt_key(r["prompt"]): r for r in rows}
    seen = []  # every scoring call of the run: (completions, examples, result)
    real = RewardScorer.score

    def spy(self, completions, examples, check=True, **ids_and_state):
        res = real(self, completions, examples, check, **ids_and_state)
        seen.append((list(completions), list(examples), res))
        return res

    monkeypatch.setattr(RewardScorer, "score", spy)
    (tmp_path / "run.yaml").write_text(json.dumps({
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_tokens": 5, "temperature": 1.0},
        "trainer": {"micro_batch_size": 8, "mini_batches": 1}, "eval": {"max_tokens": 3},
        "reward": {"workers": 1, "functions": [
            {"name": f"{rdir}/fmt_rewards.py:overlap", "params": {"column": column}},
            {"name": f"{rdir}/fmt_rewards.py:compute_score", "weight": 0.5}]},
    }))
    argv = ["train", str(tmp_path / "run.yaml"), "data.task=file", f"data.path={path}", "data.n_eval=2",
            f"model.path={tiny_model}", "run.steps=1", "run.save_every=0", "run.loggers=[]",
            f"run.out_dir={tmp_path / 'run'}", *extra]
    assert main(argv) == 0, capsys.readouterr().err
    (step,) = [m for m in read_metrics(tmp_path / "run") if "reward/mean" in m]
    train_calls = [c for c in seen if len(c[0]) == 8]
    assert len(train_calls) == 1 and len(seen) >= 2  # the step's 2 x 4 samples, and the held-out eval
    for completions, examples, res in seen:
        # what the functions return on these samples, called here on arguments built from the rows written above
        sources = [by_prompt[prompt_key(ex.prompt)] for ex in examples]
        want_trl = []
        for text, src in zip(completions, sources, strict=True):
            c = text if isinstance(src["prompt"], str) else [{"role": "assistant", "content": text}]
            want_trl += module.overlap([c], [src["prompt"]], column=column, **{column: [src[column]]})
        # verl's ground truth: reward_model.ground_truth, else a ground_truth column, else the answer
        truths = [s["reward_model"]["ground_truth"] if "reward_model" in s else s.get("ground_truth", s.get("answer"))
                  for s in sources]
        want_verl = [module.compute_score(s.get("data_source"), c, t, s.get("extra_info"))["score"]
                     for s, c, t in zip(sources, completions, truths, strict=True)]
        assert res.per_function[f"{rdir}/fmt_rewards.py:overlap"] == want_trl
        assert res.per_function[f"{rdir}/fmt_rewards.py:compute_score"] == want_verl
        assert res.rewards == [t + 0.5 * v for t, v in zip(want_trl, want_verl, strict=True)]
        assert res.failures == 0
    comps, _, res = train_calls[0]
    assert len(set(comps)) > 1 and len(set(res.rewards)) > 1  # sampled text, rewards with spread: not a constant
    assert step[f"reward/{rdir}/fmt_rewards.py:overlap/mean"] == pytest.approx(
        sum(res.per_function[f"{rdir}/fmt_rewards.py:overlap"]) / 8, abs=1e-12)
    assert step["reward/mean"] == pytest.approx(sum(res.rewards) / 8, abs=1e-12)
    assert step["reward/failures"] == 0.0
