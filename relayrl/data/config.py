"""This module defines `DataConfig` and `build_datasets`, which turn the `data:` config section into train
and eval examples.

Built-in task (`task: arith`, `sort`, ...), reasoning-gym (`task: reasoning_gym`) or the user's own task factory
(`task: "pkg.module:factory"`, see `plugin.py`): both splits are generated, see `split.py`.

File (`task: file`, `path: train.jsonl`; `format: auto | plain | trl | verl`, see `files.py`):
    with `eval_path`: train = every row of `path`, eval = the first `n_eval` rows of `eval_path`;
    without:          rows are shuffled with `seed` and the last `n_eval` become eval, the rest train.
    In both cases train rows whose prompt appears in eval are dropped, so eval is truly held out
    (message prompts compare as canonical JSON).
    `n_train` applies to built-in tasks only: a file's train split is all of its remaining rows
    (the sampler cycles through them for as many steps as the run takes).

Prompts are returned raw (a string or chat messages); the driver applies `format_prompt` with the policy's
tokenizer. Message prompts are always rendered through the chat template; `chat_template` (auto | always |
never) decides for string prompts (see `chat.py`).

It imports pydantic, relayrl's ground floor and the data modules only; it must never import another
relayrl layer: data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from relayrl.config import Config
from relayrl.data.alphabet import alphabet_of
from relayrl.data.chat import ChatTemplateMode, prompt_key
from relayrl.data.files import load_dataset_file
from relayrl.data.split import split_train_eval
from relayrl.data.tasks import Example, check_task, get_task, task_names
from relayrl.errors import ConfigError, DataError

FILE_TASK = "file"
# generated examples are held in memory (a few hundred bytes each, more for long prompts): a bound with a clear line
# instead of 6 GB and no word for n_train=1e10; a run samples rollout.prompts_per_step x run.steps prompts, cycling
MAX_GENERATED = 1_000_000


class DataConfig(Config):
    RENAMED = {"use_chat_template": "set data.chat_template: always (was true) or never (was false); auto, the "
                                    "default, renders string prompts through the model's chat template where it "
                                    "has one"}

    task: str = "arith"
    task_params: dict[str, Any] = Field(default_factory=dict)
    path: str | None = None
    eval_path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str | None = "answer"
    format: Literal["auto", "plain", "trl", "verl"] = "auto"
    n_train: int = Field(default=2000, gt=0)
    n_eval: int = Field(default=200, gt=0)
    seed: int = 0
    chat_template: ChatTemplateMode = "auto"
    system_prompt: str | None = None

    @field_validator("n_train", "n_eval")
    @classmethod
    def _bounded(cls, v: int) -> int:
        if v > MAX_GENERATED:
            raise ValueError(f"at most {MAX_GENERATED:,} generated examples are held in memory, got {v:,}; a run "
                             "samples rollout.prompts_per_step x run.steps prompts and cycles through the set, so "
                             "a smaller set loses nothing but variety")
        return v

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        known = task_names()
        if v != FILE_TASK and v not in known and ":" not in v:  # 'pkg.module:factory': its form is checked below
            raise ValueError(f"unknown task '{v}': use one of {', '.join(known + [FILE_TASK])}, "
                             "or your own task factory as 'pkg.module:factory'")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if self.task == FILE_TASK and not self.path:
            raise ValueError("task 'file' needs path: set data.path to a .jsonl or .parquet file")
        if self.task != FILE_TASK and (self.path or self.eval_path):
            raise ValueError(
                f"path/eval_path are only used with task 'file' (task is '{self.task}'); set data.task=file"
            )
        if self.task != FILE_TASK and self.format != "auto":
            raise ValueError(f"format is only used with task 'file' (task is '{self.task}'); set data.task=file")
        if self.system_prompt is not None and self.chat_template == "never":
            raise ValueError("system_prompt needs a chat template (with chat_template: never it would be dropped); "
                             "set chat_template: auto or always, or drop system_prompt")
        if self.task != FILE_TASK:
            try:  # bad task_params fail when the config loads, not after the model is built
                check_task(self.task, self.task_params)
            except ConfigError as e:
                raise ValueError(f"task_params: {e}") from None
        return self


def build_task(cfg: DataConfig):
    """The generated task of `cfg` (None for files), e.g. to get `task.alphabet` for a tokenizer."""
    return None if cfg.task == FILE_TASK else get_task(cfg.task, **cfg.task_params)


def tiny_alphabet(cfg: DataConfig) -> str | None:
    """The characters a tiny char tokenizer needs for the task of `cfg` (None for files): the task's own
    `alphabet` when it declares one, else every character of the generated train and eval examples, as the
    model sees them (string prompts, chat messages' roles and contents) and of their answers, and of the system
    prompt. The chat template's own characters are the tokenizer's to add (relayrl.models.tokenizer)."""
    task = build_task(cfg)
    if task is None:
        return None
    if task.alphabet is not None:
        return task.alphabet
    train, eval_set = build_datasets(cfg)
    return alphabet_of(train + eval_set, cfg.system_prompt or "")


def build_datasets(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    if cfg.task != FILE_TASK:
        return split_train_eval(build_task(cfg), cfg.n_train, cfg.n_eval, cfg.seed)
    rows = load_dataset_file(cfg.path, cfg.prompt_field, cfg.answer_field, cfg.format)
    if cfg.eval_path:
        train = rows
        eval_set = load_dataset_file(cfg.eval_path, cfg.prompt_field, cfg.answer_field, cfg.format)[: cfg.n_eval]
    else:
        if len(rows) <= cfg.n_eval:
            raise DataError(
                f"dataset {cfg.path} has {len(rows)} rows, not enough to hold out data.n_eval={cfg.n_eval} "
                f"for eval and still train; lower data.n_eval or set data.eval_path"
            )
        order = list(range(len(rows)))
        random.Random(f"{cfg.seed}/file-split").shuffle(order)
        eval_set = [rows[i] for i in order[-cfg.n_eval :]]
        train = [rows[i] for i in order[: -cfg.n_eval]]
    held_out = {prompt_key(ex.prompt) for ex in eval_set}
    train = [ex for ex in train if prompt_key(ex.prompt) not in held_out]
    if not train:
        raise DataError(
            f"every training prompt in {cfg.path} also appears in the eval split; use a different data.eval_path"
        )
    return train, eval_set
