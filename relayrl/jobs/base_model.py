"""This module decides where the policy starts from: a given Hugging Face directory or GGUF file (converted once
into the cache, $RELAYRL_CACHE/gguf or ~/.cache/relayrl/gguf: resolve_model), or a tiny model it builds into the run
directory (nothing is downloaded):
- a generated task's, over the task's alphabet (or, for a task without one, such as reasoning_gym or a user's
  factory, the generated examples' characters: data.tiny_alphabet);
- a dataset file's, over every character of its prompts as the model sees them (through the tiny tokenizer's chat
  template where one applies) and of its answers (dataset_alphabet), so a user's own data trains with no
  pretrained model and loses no character.
Then check_datasets refuses, before any work, text the chosen model's tokenizer cannot represent.

Like the rest of relayrl.jobs, it may import every layer below the CLI; it must never import relayrl.cli.
"""

from __future__ import annotations

import os
from pathlib import Path

from relayrl.data import DataConfig, build_datasets, build_task, tiny_alphabet
from relayrl.data.alphabet import alphabet_of
from relayrl.models.config import TinyModelConfig
from relayrl.models.hf_io import load_config, resolve_model_path
from relayrl.models.tiny import build_tiny_model
from relayrl.models.tokenizer import char_tokenizer, load_tokenizer
from relayrl.rollout.charset import ADVICE, check_representable
from relayrl.rollout.prompts import prompt_text

CACHE_ENV = "RELAYRL_CACHE"


def gguf_cache() -> Path:
    """Where GGUF files are converted to: $RELAYRL_CACHE/gguf, else ~/.cache/relayrl/gguf."""
    base = os.environ.get(CACHE_ENV)
    return (Path(base) if base else Path.home() / ".cache" / "relayrl") / "gguf"


def resolve_model(path: str | Path) -> Path:
    """The checked Hugging Face directory of a model path (relayrl.models.hf_io.resolve_model_path): a GGUF file is
    converted once into gguf_cache()."""
    return resolve_model_path(path, gguf_cache())


def base_model_dir(model_path: str | None, tiny: TinyModelConfig, data: DataConfig, run_dir: Path) -> Path:
    if model_path is not None:
        # a missing or malformed directory, or one without a tokenizer, fails here, before any work; a GGUF file is
        # converted here, before any worker starts
        return resolve_model(model_path)
    out = run_dir / "base_model"
    if not (out / "config.json").is_file():
        task = build_task(data)
        if task is None:
            build_tiny_model(out, dataset_alphabet(data), tiny)
        else:
            build_tiny_model(out, tiny_alphabet(data), tiny, tool_tokens=task.tool_tokens)
    return out


def dataset_alphabet(data: DataConfig) -> str:
    """Every character of the dataset's train and eval examples (alphabet_of) and of their prompts as rendered:
    the template's own text (role names, tags) included, which does not depend on the tokenizer's vocabulary, so
    a tokenizer without characters renders them."""
    train, held_out = build_datasets(data)
    examples = train + held_out
    renderer = char_tokenizer("")
    return alphabet_of(examples, *(prompt_text(renderer, ex, data) for ex in examples))


def check_datasets(data: DataConfig, model_path: str | None, src: Path, splits: dict[str, list]) -> None:
    """Refuse text the tokenizer of `src` (the policy's) cannot represent, before any work (relayrl.rollout.charset).
    A tiny model the run built itself covers its data: one that does not was built in this run directory for other
    data (a start that failed after building it, then the dataset changed)."""
    advice = ADVICE if model_path is not None else f"{src} was built for other data: start the run in a new run.out_dir"
    check_representable(load_tokenizer(src), splits, data, str(src), advice,
                        max_tokens=load_config(src).max_position_embeddings)  # too long: refused before tokenizing
