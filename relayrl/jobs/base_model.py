"""This module decides where the policy starts from: a given Hugging Face directory or GGUF file (converted once
into the cache, $RELAYRL_CACHE/gguf or ~/.cache/relayrl/gguf: resolve_model), or the tiny model of a built-in task,
which it builds into the run directory (nothing is downloaded).

Like the rest of relayrl.jobs, it may import every layer below the CLI; it must never import relayrl.cli.
"""

from __future__ import annotations

import os
from pathlib import Path

from relayrl.data import DataConfig, build_task
from relayrl.errors import ConfigError
from relayrl.models.config import TinyModelConfig
from relayrl.models.hf_io import resolve_model_path
from relayrl.models.tiny import build_tiny_model

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
    task = build_task(data)
    if task is None:
        raise ConfigError("model.path is required for file datasets (the tiny model is only built for built-in tasks)")
    out = run_dir / "base_model"
    if not (out / "config.json").is_file():
        build_tiny_model(out, task.alphabet, tiny, tool_tokens=task.tool_tokens)
    return out
