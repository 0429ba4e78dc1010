"""samples.jsonl and the loggers' tables (relayrl.observe.samples): rows appended with their step and flushed at
once; a resume drops the rows of the steps it replays (and a line cut by a kill) and the append-only sinks are not
sent those tables again; the same rows as TensorBoard text, a W&B Table and an MLflow table, read back with each
tool's own reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.errors import UserError
from relayrl.observe import MetricsLogger
from relayrl.observe.loggers import markdown
from relayrl.observe.samples import SampleLog, read_samples, samples_path, table

ROW = {"split": "eval", "index": 0, "prompt": [{"role": "user", "content": "a|b"}], "prompt_text": "<s>a|b",
       "completion": "x\ny", "reward": 1.5, "rewards": {"f": 1.0, "g": 0.5}, "answer": None, "correct": True}


def rows(step: int, split: str, n: int = 2) -> list[dict]:
    return [{"split": split, "index": i, "prompt": f"{step}+{i}=", "completion": str(step + i), "reward": float(i),
             "answer": str(step + i), "correct": True} for i in range(n)]


# ---------------------------------------------------------------------------- unit
@pytest.mark.unit
def test_rows_are_appended_with_their_step_and_readable_while_the_run_goes_on(tmp_path):
    path = samples_path(tmp_path)
    with SampleLog(path) as log:
        log.write(0, [])
        assert not path.exists()  # nothing recorded, no file
        log.write(0, rows(0, "eval"))
        assert read_samples(tmp_path) == [{"step": 0, **r} for r in rows(0, "eval")]  # flushed: a kill keeps it
        log.write(3, [ROW])
        assert read_samples(path)[-1] == {"step": 3, **ROW}
    with SampleLog(path) as log:  # another run (relayrl eval --samples) appends to the same file
        log.write(1, rows(1, "eval", 1))
    assert [r["step"] for r in read_samples(path)] == [0, 0, 3, 1]


@pytest.mark.unit
def test_a_resume_drops_the_replayed_steps_rows_and_a_cut_line(tmp_path):
    path = samples_path(tmp_path)
    with SampleLog(path) as log:
        for step in range(4):
            log.write(step, rows(step, "train") + rows(step, "eval"))
    with open(path, "a") as f:
        f.write('{"step": 4, "split": "tra')  # cut by the kill
    log = SampleLog(path, resume_step=1)
    assert log._replayed == {(2, "train"), (2, "eval"), (3, "train"), (3, "eval")}
    log.close()
    assert read_samples(path) == [{"step": s, **r} for s in (0, 1) for r in rows(s, "train") + rows(s, "eval")]
    path.write_text(path.read_text().replace('"step": 0', '"step": 0,,', 1))  # damage in the middle: not a kill
    with pytest.raises(UserError, match="line 1 is not valid JSON"):
        SampleLog(path, resume_step=1)


@pytest.mark.unit
def test_the_table_view_flattens_a_row_and_markdown_escapes_it():
    columns, data = table([ROW, {"split": "eval", "index": 1, "reward": 0.0, "extra": 2}])
    assert columns == ["index", "prompt", "prompt_text", "completion", "reward", "reward/f", "reward/g", "answer",
                       "correct", "extra"]
    assert data == [[0, '[{"role": "user", "content": "a|b"}]', "<s>a|b", "x\ny", 1.5, 1.0, 0.5, "", True, ""],
                    [1, "", "", "", 0.0, "", "", "", "", 2]]
    assert markdown(["a", "b|c"], [["<s>x\ny", "p\\q|r & s"]]) == (
        "| a | b\\|c |\n|---|---|\n| &lt;s&gt;x<br>y | p\\\\q\\|r &amp; s |")


# ---------------------------------------------------------------------------- the loggers' tables
def tensorboard_texts(run_dir: Path, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator  # the server's

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def wandb_tables(run_dir: Path, name: str) -> list[tuple[int, dict]]:
    """(step, table json) of every W&B table logged as `name`: its history items point at its file."""
    from test_loggers import wandb_records

    out = []
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for r in wandb_records(f):
            if r.WhichOneof("record_type") != "history":
                continue
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            if items.get(f"{name}/_type") == "table-file":  # W&B logs a table as its fields: the file's path, ...
                out.append((r.history.step.num, json.loads((f.parent / "files" / items[f"{name}/path"]).read_text())))
    return out


def mlflow_table(run_dir: Path, artifact: str) -> dict:
    from mlflow.tracking import MlflowClient

    saved = json.loads((run_dir / "mlflow_run.json").read_text())
    local = MlflowClient(tracking_uri=saved["tracking_uri"]).download_artifacts(saved["run_id"], artifact,
                                                                                 str(run_dir / "dl"))
    return json.loads(Path(local).read_text())


@pytest.mark.equivalence
def test_tensorboard_wandb_and_mlflow_show_the_rows_and_a_resume_sends_a_table_once(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    sinks = ["tensorboard", "wandb", "mlflow"]
    with MetricsLogger(tmp_path, loggers=sinks) as logger, SampleLog(samples_path(tmp_path), logger) as log:
        for step in range(3):  # killed after step 2's rows were logged, before its checkpoint
            logger.log(step, {"reward/mean": float(step)})
            log.write(step, rows(step, "train") + ([ROW] if step == 2 else []))
    with MetricsLogger(tmp_path, loggers=sinks, resume_step=1) as logger, \
            SampleLog(samples_path(tmp_path), logger, resume_step=1) as log:
        for step in (2, 3):  # step 2 replayed with its rows
            logger.log(step, {"reward/mean": float(step)})
            log.write(step, rows(step, "train") + ([ROW] if step == 2 else []))
    assert [(r["step"], r["split"]) for r in read_samples(tmp_path)] == [
        (0, "train"), (0, "train"), (1, "train"), (1, "train"), (2, "train"), (2, "train"), (2, "eval"),
        (3, "train"), (3, "train")]
    want = {s: table(rows(s, "train")) for s in range(4)}
    # TensorBoard: a Markdown table per (step, split). It is not append-only (the resumed writer's purge_step), so the
    # replayed step's table is written again, like its scalars; TensorBoard's reader keeps both (it purges only on a
    # second session start, and the first run's file has none), equal to each other
    texts = tensorboard_texts(tmp_path, "samples/train")
    assert sorted(set(texts)) == [(s, markdown(*want[s])) for s in range(4)] and len(texts) == 5
    assert set(tensorboard_texts(tmp_path, "samples/eval")) == {(2, markdown(*table([ROW])))}
    # W&B and MLflow are append-only: each step's table once, from the run that first logged it
    got = wandb_tables(tmp_path, "samples/train")
    assert [(s, t["columns"], t["data"]) for s, t in got] == [(s, *map(list, want[s])) for s in range(4)]
    assert [(s, t["data"]) for s, t in wandb_tables(tmp_path, "samples/eval")] == [(2, table([ROW])[1])]
    for s in range(4):
        assert mlflow_table(tmp_path, f"samples/train_step_{s:06d}.json") == {"columns": want[s][0],
                                                                              "data": want[s][1]}
    assert mlflow_table(tmp_path, "samples/eval_step_000002.json")["data"] == table([ROW])[1]
    # the run tag MLflow's UI reads its tables from (what MlflowClient.log_table sets), each table once
    from mlflow.tracking import MlflowClient

    saved = json.loads((tmp_path / "mlflow_run.json").read_text())
    tag = MlflowClient(tracking_uri=saved["tracking_uri"]).get_run(saved["run_id"]).data.tags["mlflow.loggedArtifacts"]
    assert sorted(t["path"] for t in json.loads(tag) if t["type"] == "table") == sorted(
        [f"samples/train_step_{s:06d}.json" for s in range(4)] + ["samples/eval_step_000002.json"])
