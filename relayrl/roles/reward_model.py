"""This module scores samples with reward *models* (`reward.functions: [{name: model, path: DIR}]`) and combines
them with the rule functions into the one Scorer the driver uses.

    completion + example.prompt ──render──> text ──DIR's tokenizer──> ids (left-truncated to the model's
    max_position_embeddings) ──right-padded batches of params.batch_size──> ScoreModel ──> the logit at each
    row's last real token = the reward

What a reward model reads: a prompt of chat messages, when DIR's tokenizer has a chat template, is the
conversation [prompt messages..., {"role": "assistant", "content": completion}] rendered by that template
(which decides the special tokens); a string prompt is the prompt text followed by the completion, tokenized
with the tokenizer's own special tokens (a BOS where the tokenizer adds one), as a classifier trained with
`tokenizer(text)` saw it. A message prompt with a template-less tokenizer is refused in one line.

    CombinedScorer (a relayrl.rewards.protocol.Scorer)
      rules:  RuleScorer over the rule entries (roles.rule_scorer) ──> their weighted sum, per function, correct
      models: ModelScorer, the reward models' worker group: inline in the driver's process (parallel.backend
              none) or one process of its own (backend local / ray)
      reward[i]  = rules' sum[i] + sum_m weight_m * logit_m[i]
      correct[i] = the task's score >= 1.0, from the rule side as always (accuracy is a metric, not a reward):
                   with only model entries configured the pool still computes the task score for it; where it is
                   exact match (examples without a task) it is named exact_match (relayrl.rewards.naming)

A non-finite logit (a model in bfloat16 that overflowed) scores reward.on_failure and counts in
reward/failures, like a rule function's failure. Metrics name the first model entry `model` and later ones
`model#<index in reward.functions>`, as the rule scorer names repeated functions.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the
jobs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.data.tasks import Example
from relayrl.errors import DataError, ModelDirError, RewardError
from relayrl.models.hf_io import load_config
from relayrl.models.score import last_token_scores, load_score_model
from relayrl.models.tokenizer import load_tokenizer
from relayrl.rewards.config import MODEL, RewardConfig
from relayrl.rewards.protocol import Scorer
from relayrl.rewards.result import ScoreResult
from relayrl.rewards.scorer import correctness
from relayrl.rewards.state import TrainerState
from relayrl.single_controller.batch import DataBatch
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import GroupOptions
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelEntry:
    """One `name: model` entry of reward.functions, as the scorer needs it."""

    name: str  # the metric name
    key: str  # the config key of its path, for messages: reward.functions.<i>.path
    path: str
    weight: float
    batch_size: int = 16
    dtype: str = "float32"


def model_entries(cfg: RewardConfig) -> list[ModelEntry]:
    """The reward-model entries of `cfg`, named for metrics; a directory that does not exist or has no
    readable config.json is refused here, in one line, before any process starts."""
    out = []
    for n, (i, fc) in enumerate(cfg.model_entries()):
        key = f"reward.functions.{i}.path"
        assert fc.path is not None  # RewardFunctionConfig requires it for name: model
        if not Path(fc.path).is_dir():
            raise ModelDirError(f"{key}: no directory {fc.path} (a sequence-classification model directory)")
        try:
            load_config(fc.path)
        except ModelDirError as e:
            raise ModelDirError(f"{key}: {e}") from None
        out.append(ModelEntry(name=MODEL if n == 0 else f"{MODEL}#{i}", key=key, path=fc.path, weight=fc.weight,
                              batch_size=fc.params.get("batch_size", 16), dtype=fc.params.get("dtype", "float32")))
    return out


def render(tokenizer: Any, prompt: str | list[dict[str, Any]], completion: str) -> list[int]:
    """The ids a reward model reads for one sample (see the module doc)."""
    if isinstance(prompt, str):
        return tokenizer(prompt + completion)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the prompts are chat messages, but the reward model's tokenizer has no chat template to "
                        "render them with; add a chat_template to its tokenizer or use string prompts")
    messages = [dict(m) for m in prompt] + [{"role": "assistant", "content": completion}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class RewardModel:
    """One reward model on one device: `scores(completions, examples) -> list[float]`, the logits."""

    def __init__(self, entry: ModelEntry, device: str = "cpu"):
        self.entry, self.device = entry, device
        try:
            self.model = load_score_model(entry.path, dtype=DTYPES[entry.dtype], device=device).eval()
            self.tokenizer = load_tokenizer(entry.path)
        except ModelDirError as e:
            raise ModelDirError(f"{entry.key}: {e}") from None
        if self.model.num_labels != 1:
            raise ModelDirError(f"{entry.key}: {entry.path} is a classifier with {self.model.num_labels} labels "
                                "(num_labels); a reward model has one, whose logit is the reward")
        tok = self.tokenizer
        self.pad_id = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
        self.max_len = self.model.config.max_position_embeddings

    def ids(self, completions: Sequence[str], examples: Sequence[Example]) -> list[list[int]]:
        """Each sample's ids, keeping the last max_position_embeddings (the completion's end is what is judged)."""
        return [render(self.tokenizer, ex.prompt, c)[-self.max_len:] for c, ex in zip(completions, examples,
                                                                                       strict=True)]

    @torch.no_grad()
    def scores(self, completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
        rows = self.ids(completions, examples)
        # batches of similar length waste less compute on padding; each row's score does not depend on its batch
        order = sorted(range(len(rows)), key=lambda j: len(rows[j]))
        out = [0.0] * len(rows)
        for a in range(0, len(order), self.entry.batch_size):
            chunk = order[a:a + self.entry.batch_size]
            width = max(max(len(rows[j]) for j in chunk), 1)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, j in enumerate(chunk):
                ids[r, :len(rows[j])] = torch.tensor(rows[j], dtype=torch.long)
                mask[r, :len(rows[j])] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            logits = last_token_scores(self.model(ids, mask), mask)[:, 0].float().cpu().tolist()
            for j, v in zip(chunk, logits, strict=True):
                out[j] = v
        return out


class RewardModelWorker(Worker):
    """Every reward model of the run, on the worker's device: `score(...) -> {name: logits}`."""

    def __init__(self, entries: list[ModelEntry]):
        self.models = [RewardModel(e, self.device) for e in entries]

    @dispatch(Dispatch.DP_SPLIT)
    def score(self, batch: DataBatch) -> dict[str, list[float]]:
        texts, examples = batch.non_tensors["texts"], batch.non_tensors["examples"]
        return {m.entry.name: m.scores(texts, examples) for m in self.models}

    def teardown(self) -> None:
        self.models = []


class ModelScorer:
    """The reward models as a worker group: inline in the driver's process by default (parallel.backend none),
    or `workers` processes of their own (local / ray; each holds every model)."""

    def __init__(self, entries: list[ModelEntry], options: GroupOptions | None = None, workers: int = 1,
                 device: str = "cpu"):
        self.names = [e.name for e in entries]
        self.group = WorkerGroup(ResourcePool([workers], device=device, name="reward-model"), RewardModelWorker,
                                 list(entries), options=options or GroupOptions(backend="inline"))

    def score(self, completions: Sequence[str], examples: Sequence[Example]) -> dict[str, list[float]]:
        batch = DataBatch({}, non_tensors={"texts": list(completions), "examples": list(examples)})
        parts = self.group.call(RewardModelWorker.score, batch)  # one dict per worker, in sample order
        return {k: [v for p in parts for v in p[k]] for k in self.names}

    def close(self) -> None:
        self.group.shutdown(raise_errors=False)


class CombinedScorer:
    """Rule functions and reward models as one Scorer (see the module doc for the sum and the names)."""

    def __init__(self, rules: Scorer, models: ModelScorer, entries: Sequence[ModelEntry],
                 on_failure: float = 0.0):
        self.rules, self.models, self.entries, self.on_failure = rules, models, list(entries), on_failure

    def score(self, completions: Sequence[str], examples: Sequence[Example], check: bool = True, *,
              completion_ids: Sequence[Sequence[int]] | None = None, state: TrainerState | None = None) -> ScoreResult:
        res = self.rules.score(completions, examples, check=check, completion_ids=completion_ids, state=state)
        logits = self.models.score(completions, examples) if len(completions) else {e.name: [] for e in self.entries}
        rewards = list(res.rewards)
        per_function, fails = dict(res.per_function), dict(res.failures_per_function)
        timeouts, first = dict(res.timeouts_per_function), dict(res.first_errors)
        for e in self.entries:
            raw = logits[e.name]
            bad = [j for j, v in enumerate(raw) if not math.isfinite(v)]
            if bad:
                first[e.name] = f"the reward model gave a non-finite score ({raw[bad[0]]}) to sample {bad[0]}"
            if check and raw and len(bad) == len(raw):
                raise RewardError(f"every sample failed to score in reward function {e.name}: {first[e.name]}")
            values = [self.on_failure if not math.isfinite(v) else v for v in raw]
            per_function[e.name], fails[e.name], timeouts[e.name] = values, len(bad), 0
            rewards = [r + e.weight * v for r, v in zip(rewards, values, strict=True)]
        return ScoreResult(rewards=rewards, per_function=per_function, failures=sum(fails.values()),
                           correct=list(res.correct), failures_per_function=fails, timeouts=sum(timeouts.values()),
                           timeouts_per_function=timeouts, first_errors=first,
                           # a reward model is the user's own reward: exact match is not called accuracy beside it
                           correct_name=correctness(examples, user_reward=True))

    def close(self) -> None:
        try:
            self.models.close()
        finally:
            self.rules.close()
