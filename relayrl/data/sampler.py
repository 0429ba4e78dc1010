"""This module iterates over the training prompts, seeded and resumable.

Epoch e visits every example once, in the order of a permutation seeded by "{seed}/epoch/{e}";
a batch may straddle two epochs. The whole position is (epoch, position, seed), so saving
`state_dict()` with a checkpoint and loading it on resume continues at exactly the next prompt.

It imports the standard library, the Example type and relayrl.errors only; it must never import another relayrl layer:
data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import random
from typing import Any

from relayrl.data.tasks import Example
from relayrl.errors import DataError


class PromptSampler:
    def __init__(self, examples: list[Example], seed: int = 0):
        if not examples:
            raise DataError("no training examples to sample from; check data.n_train or the dataset file")
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}/epoch/{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Example]:
        batch = []
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(batch), len(self._order) - self.position)
            batch.extend(self.examples[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A different dataset size means the permutations differ: resuming would silently replay or
        # skip prompts, so refuse.
        n = state.get("num_examples", len(self.examples))
        if n != len(self.examples):
            raise DataError(
                f"cannot resume the prompt sampler: the checkpoint saw {n} training examples, now there are "
                f"{len(self.examples)}; resume with the same data config"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
