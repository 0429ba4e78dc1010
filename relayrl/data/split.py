"""This module makes the train and held-out eval splits of a built-in task, disjoint by prompt.

    eval  = the first n_eval distinct prompts of the stream seeded "{seed}/eval"
    train = the first n_train examples of the stream seeded "{seed}/train" whose prompt is not in eval

The eval set depends only on (task, seed, n_eval), never on n_train, so eval numbers stay
comparable across runs that train on more or less data. Train may repeat a prompt (small tasks
have few distinct prompts); it never contains an eval prompt.

Streams are generated in chunks, each from its own string seed: `random.Random(str)` hashes the
string with SHA-512, so the data do not depend on PYTHONHASHSEED or on the chunk count asked for.

It imports the standard library, the task registry, the prompt key of chat.py and relayrl.errors only; it must
never import another relayrl layer: data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from relayrl.data.chat import prompt_key
from relayrl.data.tasks import Example, Task
from relayrl.errors import DataError

CHUNK = 256
# How many examples we are willing to draw per example wanted before deciding the task is too
# small; generous because duplicates are common in tiny tasks (e.g. 1-digit addition: 100 prompts).
DRAWS_PER_WANTED = 50


def split_train_eval(task: Task, n_train: int, n_eval: int, seed: int) -> tuple[list[Example], list[Example]]:
    eval_set: list[Example] = []
    seen: set = set()  # prompt keys: a task may generate chat-message prompts, which are not hashable
    for ex in _bounded(_stream(task, f"{seed}/eval"), n_eval, task, "n_eval", "distinct eval prompts"):
        if prompt_key(ex.prompt) not in seen:
            seen.add(prompt_key(ex.prompt))
            eval_set.append(ex)
            if len(eval_set) == n_eval:
                break

    train: list[Example] = []
    if n_train > 0:
        for ex in _bounded(_stream(task, f"{seed}/train"), n_train, task, "n_train", "training prompts outside eval"):
            if prompt_key(ex.prompt) not in seen:
                train.append(ex)
                if len(train) == n_train:
                    break
    return train, eval_set


def _stream(task: Task, seed_str: str) -> Iterator[Example]:
    chunk = 0
    while True:
        # Each chunk gets an integer seed derived from a string, since tasks take int seeds.
        chunk_seed = random.Random(f"{seed_str}/{chunk}").getrandbits(63)
        yield from task.generate(CHUNK, chunk_seed)
        chunk += 1


def _bounded(stream: Iterator[Example], wanted: int, task: Task, key: str, what: str) -> Iterator[Example]:
    limit = DRAWS_PER_WANTED * wanted + 10 * CHUNK
    for i, ex in enumerate(stream):
        if i >= limit:
            raise DataError(
                f"task '{task.name}' with params {task.params} has too few {what} for data.{key}={wanted}; "
                f"lower data.{key} or make the task larger (e.g. more digits)"
            )
        yield ex
