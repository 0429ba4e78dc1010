"""This module decides where the policy starts from: a given Hugging Face directory, or the tiny model of
a generated task, which it builds into the run directory (nothing is downloaded); its char tokenizer covers the
task's alphabet, or for a task without one (reasoning_gym, a user's factory) the generated examples' characters.

Like the rest of relayrl.jobs, it may import every layer below the CLI; it must never import relayrl.cli.
"""

from __future__ import annotations

from pathlib import Path

from relayrl.data import DataConfig, build_task, tiny_alphabet
from relayrl.errors import ConfigError
from relayrl.models import load_config
from relayrl.models.config import TinyModelConfig
from relayrl.models.tiny import build_tiny_model


def base_model_dir(model_path: str | None, tiny: TinyModelConfig, data: DataConfig, run_dir: Path) -> Path:
    if model_path is not None:
        load_config(model_path)  # a missing or malformed directory fails here, before any work
        return Path(model_path)
    task = build_task(data)
    if task is None:
        raise ConfigError("model.path is required for file datasets (the tiny model is only built for built-in tasks)")
    out = run_dir / "base_model"
    if not (out / "config.json").is_file():
        build_tiny_model(out, tiny_alphabet(data), tiny, tool_tokens=task.tool_tokens)
    return out
