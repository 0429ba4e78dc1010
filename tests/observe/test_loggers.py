"""The metrics sinks beside metrics.jsonl: W&B offline and MLflow's file store get the same values, read
back with each tool's own format (W&B's .wandb record log, MLflow's client); a resumed run continues
the same runs without logging a step twice; a missing package is one line; run.loggers lists
each sink once, and the old run.tensorboard switch is refused naming run.loggers."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from relayrl.controller.config import RunConfig
from relayrl.errors import UserError
from relayrl.jobs.train import train
from relayrl.observe import MetricsLogger, read_metrics
from relayrl.observe.loggers import LoggerOptions, mlflow_key, require_loggers

from helpers import cfg_for


# ---------------------------------------------------------------------------- reading the tools' files back
def wandb_records(path: Path):
    """The records of a .wandb file: W&B's LevelDB-style log (7-byte file header ':W&B' 0xBEE1 v0, 32 KiB
    blocks, each chunk = crc32, length, type FULL/FIRST/MIDDLE/LAST) of wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def wandb_history(run_dir: Path) -> tuple[list[tuple[int, str, float]], set[str], dict]:
    """(step, key, value) of every history row in every offline run directory, the run ids, and the config."""
    rows, ids, config = [], set(), {}
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                ids.add(r.run.run_id)
                config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "history":
                step = r.history.step.num
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                # a table (samples/<split>: tests/observe/test_samples.py reads them) is logged as its fields
                tables = {k.removesuffix("/_type") for k, v in items.items() if k.endswith("/_type")}
                for key, value in items.items():
                    if not key.startswith("_") and key.rpartition("/")[0] not in tables:
                        rows.append((step, key, float(value)))
    return rows, ids, config


def mlflow_history(run_dir: Path) -> tuple[list[tuple[int, str, float]], dict[str, str], list[str]]:
    from mlflow.tracking import MlflowClient

    saved = json.loads((run_dir / "mlflow_run.json").read_text())
    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    run = client.get_run(saved["run_id"])
    rows = [(m.step, key, m.value) for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)]
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    return rows, run.data.params, artifacts


def jsonl_rows(run_dir: Path, key=lambda k: k) -> list[tuple[int, str, float]]:
    return [(r["step"], key(k), v) for r in read_metrics(run_dir) for k, v in r.items() if k != "step"]


# ---------------------------------------------------------------------------- unit
RECORDS = [  # (step, metrics): eval lines share the step of the training line before them
    (0, {"eval/accuracy": 0.25}),
    (1, {"loss": 1.5, "reward/tests.fixtures.rewards:share_of_sevens/mean": 0.5, "time/update": 0.01}),
    (1, {"eval/accuracy": 0.5}),
    (2, {"loss": 1.25, "reward/tests.fixtures.rewards:share_of_sevens/mean": 0.75, "time/update": 0.02}),
    (3, {"loss": 1.0, "reward/tests.fixtures.rewards:share_of_sevens/mean": 0.5, "time/update": 0.03}),
    (3, {"eval/accuracy": 0.75}),
]


@pytest.mark.equivalence
def test_wandb_offline_and_mlflow_file_store_hold_what_metrics_jsonl_holds(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    config = {"run": {"steps": 3, "out_dir": str(tmp_path)}, "trainer": {"lr": 0.001}}
    with MetricsLogger(tmp_path, loggers=["wandb", "mlflow"], config=config,
                       options=LoggerOptions(wandb_project="proj", mlflow_experiment="exp")) as log:
        for step, m in RECORDS:
            log.log(step, m)
    expected = sorted(jsonl_rows(tmp_path))
    assert len(expected) == 12 and not (tmp_path / "tb").exists()

    rows, ids, wb_config = wandb_history(tmp_path)
    assert sorted(rows) == expected and len(ids) == 1
    assert wb_config["run"] == config["run"] and wb_config["trainer"] == config["trainer"]

    rows, params, artifacts = mlflow_history(tmp_path)
    assert sorted(rows) == sorted(jsonl_rows(tmp_path, mlflow_key))
    # ':' is not allowed in MLflow names; '/' is a path in a file store (`loss` beside `loss/policy`)
    assert "reward.tests.fixtures.rewards_share_of_sevens.mean" in {k for _, k, _ in rows}
    assert params["trainer.lr"] == "0.001" and params["run.steps"] == "3"
    assert artifacts == ["config.json"]
    assert (tmp_path / "mlruns").is_dir()


@pytest.mark.equivalence
def test_a_resumed_logger_sends_each_step_once_to_the_append_only_sinks(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    with MetricsLogger(tmp_path, loggers=["wandb", "mlflow"], config={"a": 1}) as log:
        for step, m in RECORDS[:-1]:  # killed during step 3: its training line logged, its eval not
            log.log(step, m)
    # resumed from the checkpoint of step 1: steps 2 and 3 are replayed (with the same values)
    with MetricsLogger(tmp_path, loggers=["wandb", "mlflow"], config={"a": 1, "b": 2}, resume_step=1) as log:
        for step, m in RECORDS[3:]:
            log.log(step, m)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 1, 2, 3, 3]
    expected = sorted(jsonl_rows(tmp_path))

    rows, ids, _ = wandb_history(tmp_path)
    assert len(ids) == 1 and len(list(tmp_path.glob("wandb/offline-run-*"))) == 2  # one run, continued
    assert sorted(rows) == expected  # step 3's eval (new) logged, nothing twice

    rows, params, artifacts = mlflow_history(tmp_path)
    assert sorted(rows) == sorted(jsonl_rows(tmp_path, mlflow_key))
    assert params == {"a": "1", "b": "2"}  # the resume's new key added, none changed
    assert sorted(artifacts) == ["config.json", "config_resume_step_1.json"]


@pytest.mark.unit
def test_a_missing_package_is_one_line_naming_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install 'relayrl\[loggers\]'") as e:
        require_loggers(["tensorboard", "mlflow"])
    assert "\n" not in str(e.value) and "mlflow" in str(e.value)


@pytest.mark.unit
def test_run_loggers_name_each_sink_once_and_the_old_switch_is_refused_naming_them():
    from relayrl.errors import ConfigError

    run = RunConfig.from_dict({}).run
    assert run.sinks == ["tensorboard"]
    assert RunConfig.from_dict({"run": {"loggers": []}}).run.sinks == []
    both = RunConfig.from_dict({"run": {"loggers": ["wandb", "tensorboard", "wandb", "mlflow"]}}).run
    assert both.sinks == ["wandb", "tensorboard", "mlflow"]
    with pytest.raises(ConfigError, match=r"^config error: run: .*'tensorboard' was replaced: .*run\.loggers") as e:
        RunConfig.from_dict({"run": {"tensorboard": False}})
    assert "\n" not in str(e.value)
    with pytest.raises(Exception, match="run.loggers"):
        RunConfig.from_dict({"run": {"loggers": ["neptune"]}})


# ---------------------------------------------------------------------------- a real run, resumed
@pytest.mark.e2e
def test_a_resumed_run_logs_every_step_once_to_wandb_and_mlflow(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    cfg = cfg_for(tmp_path, "run", run={"steps": 2, "save_every": 1, "loggers": ["wandb", "mlflow"],
                                         "wandb_project": "relayrl-test"}, eval={"every": 1})
    train(cfg, show_progress=False)
    run_dir = Path(cfg.run.out_dir)
    # as if killed before step 2's checkpoint was written: the resume replays step 2
    shutil.rmtree(run_dir / "checkpoints" / "step_00000002")
    train(RunConfig.from_dict({**cfg.to_dict(), "run": {**cfg.to_dict()["run"], "steps": 3}}), resume=True,
          show_progress=False)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 1, 2, 2, 3, 3]  # eval 0, then train + eval per step
    rows, ids, config = wandb_history(run_dir)
    assert len(ids) == 1 and config["run"]["steps"] == 3  # W&B's config follows the resume; MLflow's params cannot
    # the wall-clock metrics of the replayed step differ between the two runs: compare keys and steps only
    # for time/throughput, values for the rest. So does sync/skipped: the first run's step 2 trained on the
    # evaluation's sync before it, the replay (resumed after that evaluation) syncs itself
    deterministic = lambda rows: sorted((s, k, round(v, 5)) for s, k, v in rows  # noqa: E731
                                        if not k.startswith(("time/", "throughput/", "time.", "throughput.",
                                                             "sync/skipped", "sync.skipped")))
    keys = lambda rows: sorted((s, k) for s, k, _ in rows)  # noqa: E731
    assert keys(rows) == keys(jsonl_rows(run_dir))  # every (step, metric) exactly once
    assert deterministic(rows) == deterministic(jsonl_rows(run_dir))
    rows, params, _ = mlflow_history(run_dir)
    assert keys(rows) == keys(jsonl_rows(run_dir, mlflow_key))
    assert deterministic(rows) == deterministic(jsonl_rows(run_dir, mlflow_key))
    assert params["run.steps"] == "2" and params["trainer.lr"] == "0.001"
