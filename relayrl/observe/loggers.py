"""This module holds the metrics sinks beside metrics.jsonl: TensorBoard, Weights & Biases (offline) and
MLflow (a local file store). MetricsLogger (relayrl.observe.metrics) fans each record out to them.

    run.loggers: [tensorboard, wandb, mlflow]
      tensorboard   run_dir/tb/                     torch's SummaryWriter
      wandb         run_dir/wandb/offline-run-*/    W&B in offline mode: no network, never a login prompt;
                                                    upload later with `wandb sync run_dir/wandb/offline-run-*`
      mlflow        run_dir/mlruns/ (file: store)   or run.mlflow_tracking_uri (sqlite:///..., a server); view with
                                                  MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri RUN/mlruns

Each run logs the resolved config: W&B's run config, MLflow's params (dotted keys) and a config.json artifact.

Tables (what the model said, relayrl.observe.samples: `samples/eval` at every evaluation, `samples/train` every
run.samples_every steps) go to each sink in its own table view: TensorBoard's text (a Markdown table), a
wandb.Table, an MLflow table artifact (samples/<split>_step_<step>.json: the file and the run tag that
MlflowClient.log_table writes, written without pandas).

Resuming: TensorBoard purges the events of the replayed steps (purge_step). W&B's offline files and MLflow's
metric histories are append-only, so a resumed run continues the same W&B run (the id is kept in
run_dir/wandb/run_id) and the same MLflow run (run_dir/mlflow_run.json), and MetricsLogger sends them only
the (step, metric) pairs the interrupted run had not logged: each step reaches them once, with the value
the interrupted run logged (relayrl's kill-and-resume replays those steps with equal values).

wandb and mlflow are imported only when listed (`pip install 'relayrl[loggers]'`); a missing one is refused
in one line before the run starts. It imports the standard library and relayrl.errors only (torch's
TensorBoard writer lazily); it must never import another relayrl layer: observe is a leaf.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import string
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from relayrl.errors import UserError

LOGGERS = ("tensorboard", "wandb", "mlflow")
TB_DIR = "tb"
WANDB_DIR = "wandb"
WANDB_ID_FILE = "run_id"  # in run_dir/wandb/
MLFLOW_DIR = "mlruns"
MLFLOW_RUN_FILE = "mlflow_run.json"
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Sink(Protocol):
    """One destination of the metrics. `append_only`: it cannot forget what a killed run logged, so a
    resumed run must not send it a (step, metric) pair twice."""

    append_only: bool

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def log_table(self, step: int, name: str, columns: list[str], data: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoggerOptions:
    """Names and places of the external sinks (run.wandb_*, run.mlflow_*)."""

    wandb_project: str = "relayrl"
    wandb_name: str | None = None  # None: the run directory's name
    mlflow_tracking_uri: str | None = None  # None: file: run_dir/mlruns
    mlflow_experiment: str = "relayrl"
    mlflow_run_name: str | None = None  # None: the run directory's name


def require_loggers(names: Sequence[str]) -> None:
    """Refuse, in one line, a listed logger whose package is not installed (called before any process starts)."""
    for name in names:
        if name not in LOGGERS:
            raise UserError(f"run.loggers: unknown logger {name!r}; use some of {list(LOGGERS)}")
        package = _PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise UserError(f"run.loggers lists {name} but the {package} package is not installed: "
                            f"pip install 'relayrl[loggers]' (or pip install {package}), or remove it from run.loggers")


def build_sinks(names: Sequence[str], run_dir: Path, options: LoggerOptions, config: Mapping[str, Any],
                resume_step: int | None) -> list[Sink]:
    """The sinks of `names`, in order; on a failure those already built are closed."""
    require_loggers(names)
    sinks: list[Sink] = []
    try:
        for name in dict.fromkeys(names):  # each once, in the given order
            if name == "tensorboard":
                sinks.append(TensorBoardSink(run_dir, resume_step))
            elif name == "wandb":
                sinks.append(WandbSink(run_dir, options, config))
            elif name == "mlflow":
                sinks.append(MlflowSink(run_dir, options, config, resume_step))
    except BaseException:
        for sink in sinks:
            try:
                sink.close()
            except Exception:
                pass
        raise
    return sinks


class TensorBoardSink:
    append_only = False  # purge_step hides the events a killed run wrote past the resume point

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # slow to import: only when used

        purge = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(log_dir=str(run_dir / TB_DIR), purge_step=purge)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def log_table(self, step: int, name: str, columns: list[str], data: list[list[Any]]) -> None:
        self._writer.add_text(name, markdown(columns, data), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def markdown(columns: Sequence[str], data: Sequence[Sequence[Any]]) -> str:
    """The table in Markdown (TensorBoard's text view renders it): `|` and backslashes escaped, `<`, `>` and `&` as
    HTML entities (a chat template's `<|im_end|>` stays visible), line breaks as <br>."""
    def esc(v: Any) -> str:
        text = str(v).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\\", "\\\\")
        return text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(esc(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(esc(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class WandbSink:
    """A W&B run in offline mode under run_dir/wandb; the same run id for every resume of the run."""

    append_only = True

    def __init__(self, run_dir: Path, options: LoggerOptions, config: Mapping[str, Any]) -> None:
        import wandb

        root = run_dir / WANDB_DIR
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's shape
            id_file.write_text(run_id + "\n")
        # offline: nothing leaves the machine and no login is asked for; silent, no console capture (the
        # run's own output stays as it is), no git probing, no system-metrics sampler process
        settings = wandb.Settings(mode="offline", silent=True, console="off", disable_git=True, save_code=False,
                                  x_disable_stats=True, x_disable_meta=True, reinit="create_new")
        self._run = wandb.init(project=options.wandb_project, name=options.wandb_name or run_dir.resolve().name,
                               id=run_id, resume="allow", dir=str(run_dir), config=dict(config),
                               settings=settings)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def log_table(self, step: int, name: str, columns: list[str], data: list[list[Any]]) -> None:
        import wandb

        # allow_mixed_types: a column of an empty answer ("") beside numbers is still one column
        self._run.log({name: wandb.Table(columns=list(columns), data=[list(r) for r in data], allow_mixed_types=True)},
                      step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() can return before W&B's service has written the offline run file out (seen once in a loaded
        # test suite: no history in run-*.wandb yet); teardown waits for the service to finish and exit, so the
        # directory is complete (for `wandb sync`, or a reader) when the run's logger is closed
        wandb.teardown()


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_key(key: str, file_store: bool = True) -> str:
    """MLflow accepts letters, digits, `_ - . /` and spaces in names; anything else (a reward function's
    `module:function`) becomes `_`. A file store keeps each metric in a file at the name's path, so `loss`
    and `loss/policy` cannot both exist there: in a file store `/` becomes `.` (loss.policy)."""
    key = _MLFLOW_BAD.sub("_", key)
    return key.replace("/", ".") if file_store else key


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[mlflow_key(name, False)] = json.dumps(value, default=str)[:6000]  # MLflow's limit on a param value
    return out


class MlflowSink:
    """An MLflow run in a local file store (or the configured tracking URI); resumed runs continue it."""

    append_only = True

    def __init__(self, run_dir: Path, options: LoggerOptions, config: Mapping[str, Any],
                 resume_step: int | None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = options.mlflow_tracking_uri or (run_dir / MLFLOW_DIR).resolve().as_uri()
        self._file_store = uri.startswith("file:")
        if self._file_store:
            # MLflow 3 keeps the file store in maintenance mode behind this switch; it is what needs no
            # database (a sqlite store's first creation takes seconds): set run.mlflow_tracking_uri=sqlite:///...
            # for that instead
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # a client of its own: no process-wide mlflow.set_tracking_uri / active run that another run could see
        self._client = client = MlflowClient(tracking_uri=uri)
        saved = _read_json(run_dir / MLFLOW_RUN_FILE)
        run_id = saved.get("run_id") if saved and saved.get("tracking_uri") == uri else None
        if run_id is not None:
            try:
                client.get_run(run_id)
            except Exception:  # the store was moved or cleared: start a new run
                run_id = None
        params = _flatten(config)
        if run_id is None:
            experiment = client.get_experiment_by_name(options.mlflow_experiment)
            exp_id = experiment.experiment_id if experiment is not None else \
                client.create_experiment(options.mlflow_experiment)
            run_id = client.create_run(exp_id, run_name=options.mlflow_run_name or run_dir.resolve().name).info.run_id
            _write_json(run_dir / MLFLOW_RUN_FILE, {"run_id": run_id, "tracking_uri": uri})
            artifact = "config.json"
        else:
            # params cannot change once logged: a resume's overrides (run.steps, layout) go to its own artifact
            have = client.get_run(run_id).data.params
            params = {k: v for k, v in params.items() if k not in have}
            artifact = f"config_resume_step_{resume_step}.json"
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's limit per batch
            client.log_batch(run_id, params=items[i:i + 100])
        client.log_dict(run_id, dict(config), artifact)
        self.run_id = run_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k, self._file_store), float(v), ms, int(step)) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_table(self, step: int, name: str, columns: list[str], data: list[list[Any]]) -> None:
        # MlflowClient.log_table needs pandas, which relayrl does not: the same artifact (pandas' "split" JSON) and the
        # same run tag (mlflow.loggedArtifacts, which the UI's table view reads) are written here directly.
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        artifact = f"samples/{name.rsplit('/', 1)[-1]}_step_{int(step):06d}.json"
        self._client.log_dict(self.run_id, {"columns": list(columns), "data": [list(r) for r in data]}, artifact)
        tags = self._client.get_run(self.run_id).data.tags
        logged = json.loads(tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
        if {"path": artifact, "type": "table"} not in logged:
            logged.append({"path": artifact, "type": "table"})
            self._client.set_tag(self.run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps(logged))

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
