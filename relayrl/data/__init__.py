"""This package provides the built-in tasks, user task factories and reasoning-gym, dataset loading, train/eval
splits, prompt formatting and the prompt sampler.

It imports the standard library, pydantic, pyarrow (for parquet files, on first use) and relayrl's
ground floor only; it must never import another relayrl layer: data is a leaf, which rewards and the
controller import.
"""

from relayrl.data.chat import format_prompt
from relayrl.data.config import DataConfig, build_datasets, build_task, tiny_alphabet
from relayrl.data.files import load_dataset_file
from relayrl.data.sampler import PromptSampler
from relayrl.data.split import split_train_eval
from relayrl.data.tasks import Example, Task, get_task, register_task, task_for_example, task_names

__all__ = [
    "DataConfig",
    "Example",
    "PromptSampler",
    "Task",
    "build_datasets",
    "build_task",
    "format_prompt",
    "get_task",
    "load_dataset_file",
    "register_task",
    "split_train_eval",
    "task_for_example",
    "task_names",
    "tiny_alphabet",
]
