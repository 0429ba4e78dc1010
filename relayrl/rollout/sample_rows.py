"""What a run records of what its model said: one row per sample for samples.jsonl (and the loggers' tables),
built where the samples are (an evaluation's completions, a trained step's groups).

    field           every row
    split           eval | train
    index           the example's place in the held-out set (eval), the sample's in the step's batch (train)
    prompt          the example's prompt: its text, or its chat messages
    prompt_text     the prompt as the model saw it: its token ids decoded (a chat template's markup included)
    completion      the text the scorer read (an episode: its last assistant message)
    reward          the sample's reward
    rewards         {function: value} of each reward function, where the reward has several
    answer          the reference answer (None where the example has none)
    correct         what eval/accuracy (or eval/exact_match) counts: the task's own correctness, or exact match
                    (relayrl.rewards.naming); an episode's success
    tokens          the model's tokens in the completion
    finish_reason   eval rows: stop | length | abort (an episode: done | max_turns | ...)
    group, advantage   train rows only: the prompt's group in the step (its G samples share it), and the sample's
                    advantage (its mean over the response's trained tokens)

The writer (step added, append-only, resume) is relayrl.observe.samples'. Like the rest of relayrl.rollout, it
imports the engine, environments, rewards and data below it; never the loop, the roles or the jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relayrl.data import Example
from relayrl.engine.outputs import RequestOutput
from relayrl.envs.episode import Trajectory
from relayrl.rewards.result import ScoreResult
from relayrl.rollout.sample import Sample


def _text(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def _row(split: str, index: int, ex: Example, prompt_text: str, completion: str, reward: float,
         per_function: dict[str, float] | None, correct: bool, tokens: int, **more: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"split": split, "index": index, "prompt": ex.prompt, "prompt_text": prompt_text,
                           "completion": completion, "reward": reward}
    if per_function is not None and len(per_function) > 1:
        row["rewards"] = dict(per_function)
    row.update(answer=ex.answer, correct=bool(correct), tokens=tokens, **more)
    return row


def eval_rows(examples: Sequence[Example], outs: Sequence[RequestOutput], res: ScoreResult,
              tokenizer: Any) -> list[dict[str, Any]]:
    """One row per held-out example: its one completion (the first sample of its output), scored by `res`."""
    rows = []
    for i, (ex, o) in enumerate(zip(examples, outs, strict=True)):
        s = o.samples[0]
        rows.append(_row("eval", i, ex, _text(tokenizer, o.prompt_token_ids), s.text, res.rewards[i],
                         {k: v[i] for k, v in res.per_function.items()}, res.correct[i], len(s.token_ids),
                         finish_reason=s.finish_reason))
    return rows


def episode_rows(examples: Sequence[Example], trajs: Sequence[Trajectory], tokenizer: Any) -> list[dict[str, Any]]:
    """One row per held-out episode: its last assistant message, its environment's reward and success."""
    return [_row("eval", i, ex, _text(tokenizer, t.prompt_ids), t.last_text, t.reward, None, t.success,
                 t.model_tokens, finish_reason=t.finish) for i, (ex, t) in enumerate(zip(examples, trajs, strict=True))]


def train_rows(samples: Sequence[Sample], group_size: int, advantages: Sequence[float] | None, tokenizer: Any,
               limit: int) -> list[dict[str, Any]]:
    """The first `limit` samples of a trained step (whole groups when limit is a multiple of the group size), with
    their group and advantage."""
    rows = []
    for i, s in enumerate(samples[:limit]):
        more = {"group": i // group_size} | ({"advantage": advantages[i]} if advantages is not None else {})
        rows.append(_row("train", i, s.example, _text(tokenizer, s.prompt_ids), s.text, s.reward, s.per_function,
                         s.correct, sum(s.mask), **more))
    return rows
