"""What `relayrl eval` evaluates and how (an EvalJob): a run's own settings, a config file's, or the command line's.
It imports config modules only, so a bad run directory or flag is refused before torch loads.

    relayrl eval --run RUN_DIR         (or --model RUN_DIR, or --model RUN_DIR/final_model) RUN_DIR/config.yaml:
                                       the final model (final_model/; an SFT run's model/), the data section (task,
                                       task_params, dataset file and format, chat_template, system_prompt, n_eval,
                                       seed), the reward (any function a training config can name; reward models
                                       included; an env section's environment instead), eval.max_tokens,
                                       eval.temperature, rollout.stop, run.seed and the engine's settings: the run's
                                       last evaluation, evaluated again
    relayrl eval --model DIR --config FILE.yaml
                                       a training (or SFT) config's settings, as a run's, on the model DIR
    relayrl eval --model DIR           a bare model directory: --task with --task-params (the task's defaults
                                       without it, which may not be the problems DIR was trained on: said on stderr)

key=value overrides (data.path=..., reward.functions=[...]) apply to the run's or the file's config as `relayrl
train`'s do (with a bare model directory, to a training config's defaults); flags given beside them override their
settings; a --task other than the config's starts from that task's defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from relayrl.config import apply_overrides, load_yaml
from relayrl.controller.config import RunConfig
from relayrl.data.config import FILE_TASK, DataConfig
from relayrl.envs.config import EnvConfig
from relayrl.errors import ConfigError, UserError
from relayrl.jobs.sft_config import SFTJobConfig
from relayrl.rewards.config import RewardConfig
from relayrl.rollout.config import RolloutConfig

RUN_MODELS = ("final_model", "model")  # where `relayrl train` and `relayrl sft` write their model in a run directory


@dataclass(frozen=True)
class EvalJob:
    model_dir: str
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig | None = None  # episodes in this environment, which rewards them (the reward is then unused)
    max_tokens: int = 16  # per turn, in an environment
    temperature: float = 0.0
    seed: int = 0  # sample i's seed is seed + i
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # the engine's settings and the stop strings
    device: str = "cpu"  # a parallel.device setting: where the engine and reward models compute


@dataclass(frozen=True)
class Flags:
    """The command line's settings; None: not given."""

    task: str | None = None
    task_params: dict[str, Any] | None = None
    path: str | None = None
    n: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    env: str | None = None


def run_job(run_dir: str | Path, overrides: Sequence[str] = ()) -> EvalJob:
    """The evaluation a run (`relayrl train`'s, or `relayrl sft`'s) made of its model: its config.yaml's settings
    (with `overrides` applied)."""
    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml); give --run the run's out_dir")
    raw = _renamed_settings(load_yaml(path))
    sft = isinstance(raw, dict) and "sft" in raw
    return config_job(apply_overrides(raw, list(overrides)), str(run_dir / ("model" if sft else "final_model")),
                      str(path))


def config_job(raw: dict[str, Any], model_dir: str, source: str) -> EvalJob:
    """The evaluation of `model_dir` with the settings of a training config (`raw`: a RunConfig's, or an SFT job's
    when it has an sft section); a bad config is one line naming `source`."""
    try:
        if "sft" in raw:  # relayrl sft's: rule functions only score its evaluation
            sft = SFTJobConfig.from_dict(raw)
            return EvalJob(model_dir, sft.data, sft.reward.rule_config(), sft.env, sft.eval.max_tokens,
                           sft.eval.temperature, sft.sft.seed, device=_here(sft.sft.device))
        cfg = RunConfig.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return EvalJob(model_dir, cfg.data, cfg.reward, cfg.env, cfg.eval.max_tokens, cfg.eval.temperature, cfg.run.seed,
                   cfg.rollout, device=_here(cfg.parallel.device))


def _renamed_settings(raw: Any) -> Any:
    """A run directory's config.yaml written by an earlier relayrl, in today's names: the record of a finished run
    is read as it was meant (a user's config with an old key is refused, naming the new one)."""
    data = raw.get("data") if isinstance(raw, dict) else None
    if isinstance(data, dict) and isinstance(data.get("use_chat_template"), bool) and "chat_template" not in data:
        data["chat_template"] = "always" if data.pop("use_chat_template") else "never"
    return raw


def _here(device: str) -> str:
    """A run's device setting on this machine: a run on cuda is evaluated on a GPU when there is one."""
    return "cpu" if device == "cpu" else "auto"


def eval_job(model: str | None, run: str | None, flags: Flags | None = None, config: str | None = None,
             overrides: Sequence[str] = ()) -> tuple[EvalJob, str | None]:
    """The job of `--model` / `--run` / `--config`, the key=value overrides and the other flags, and a one-line
    notice for stderr (or None):

        --run RUN [--model DIR]       RUN's settings; its model, or DIR
        --model RUN                   a run directory (config.yaml): as --run RUN
        --model RUN/final_model       a run's model: its run's settings, and a notice that says so
        --model DIR --config FILE     FILE's settings (a training or SFT config), on DIR
        --model DIR [key=value ...]   a bare model directory: the overrides on a training config's defaults and the
                                      flags' settings, and a notice when a built-in task's parameters are its
                                      defaults (defaults_notice)"""
    flags = flags or Flags()
    if config is not None and run is not None:
        raise UserError("--config and --run both give the settings; use one (key=value overrides apply to either)")
    if config is not None and model is None:
        raise UserError("--config gives the settings, not the model; add --model MODEL_DIR")
    if run is not None:
        job = run_job(run, overrides)
        return with_flags(job if model is None else replace(job, model_dir=model), flags), None
    if model is None:
        raise UserError("relayrl eval needs --model MODEL_DIR or --run RUN_DIR")
    if config is not None:
        return with_flags(config_job(apply_overrides(load_yaml(config), list(overrides)), model, config), flags), None
    d = Path(model)
    if (d / "config.yaml").is_file():
        return with_flags(run_job(d, overrides), flags), None
    if d.name in RUN_MODELS and (d.parent / "config.yaml").is_file():
        job = run_job(d.parent, overrides)
        if Path(job.model_dir) == d:
            return with_flags(job, flags), (f"relayrl: {model} is the model of run {d.parent}: evaluating with that "
                                            f"run's settings ({d.parent / 'config.yaml'}); flags given override them")
    if overrides:
        job = with_flags(config_job(apply_overrides({}, list(overrides)), model, "the key=value overrides"), flags)
        return job, None if "data.task_params" in _keys(overrides) else defaults_notice(job, flags)
    job = with_flags(EvalJob(model), flags)
    return job, defaults_notice(job, flags)


def _keys(overrides: Sequence[str]) -> set[str]:
    return {o.split("=", 1)[0].strip() for o in overrides}


def with_flags(job: EvalJob, f: Flags) -> EvalJob:
    """`job` with the flags given in place of its settings."""
    data = job.data.to_dict()
    if f.task is not None and f.task != data["task"]:  # another task: the run's parameters and file are not its
        data.update(task=f.task, task_params={}, path=None, eval_path=None, format="auto")
    for key, value in (("task_params", f.task_params), ("path", f.path), ("n_eval", f.n), ("seed", f.seed)):
        if value is not None:
            data[key] = value
    env = job.env
    if f.env is not None and (env is None or env.name != f.env):
        env = EnvConfig(name=f.env)
        data["chat_template"] = "always"  # episodes are conversations
    return replace(job, data=DataConfig.from_dict(data), env=env,
                   max_tokens=job.max_tokens if f.max_tokens is None else f.max_tokens,
                   temperature=job.temperature if f.temperature is None else f.temperature,
                   seed=job.seed if f.seed is None else f.seed)


def defaults_notice(job: EvalJob, f: Flags) -> str | None:
    """A bare model directory evaluated on a built-in task without --task-params: the problems are the task's
    defaults, which may not be those the model trained on (a run's arith range, say)."""
    if f.task_params is not None or job.data.task == FILE_TASK:
        return None
    return (f"relayrl: note: {job.model_dir} has no run config beside it, so task '{job.data.task}' uses its default "
            f"parameters, which may differ from the training run's; give --task-params, or --run RUN_DIR")
