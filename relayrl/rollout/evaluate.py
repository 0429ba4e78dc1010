"""This module runs the held-out evaluation: one greedy (by default) sample per eval example, scored, and
reported as accuracy, reward and response length. `evaluate_set` is the one path every evaluation takes
(`relayrl train`'s, `relayrl sft`'s and `relayrl eval`'s):

    evaluate_set(engine, examples, data=, scorer=, agent=, max_tokens=, temperature=, seed=, stop=, rows=)
        agent given   one episode per example in its environment, rewarded by it    (evaluate_episodes)
        else          one completion per example, rewarded by the scorer              (evaluate)
        rows          a list given: one row per example appended to it, what the model said and its score
                      (relayrl.rollout.sample_rows; the run's samples.jsonl)

The correctness figure is eval/accuracy, or eval/exact_match where it is exact match beside the user's own reward
(relayrl.rewards.naming).

Example i samples with seed + i: at temperature > 0 one shared seed would draw the same uniforms for every prompt.

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the
loop, the roles or the jobs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from relayrl.data import DataConfig, Example
from relayrl.engine import SamplingParams
from relayrl.engine.protocols import RolloutEngine, StepEngine
from relayrl.envs.config import EnvConfig
from relayrl.rewards import Scorer, TrainerState
from relayrl.rollout.agent_loop import AgentLoop, EpisodeRunner
from relayrl.rollout.agent_rewards import settle_rewards
from relayrl.rollout.prompts import encode_prompt
from relayrl.rollout.sample_rows import episode_rows, eval_rows


def evaluate_set(
    engine: RolloutEngine, examples: list[Example], *, data: DataConfig, scorer: Scorer | None = None,
    agent: EpisodeRunner | None = None, max_tokens: int, temperature: float = 0.0, seed: int = 0,
    stop: Sequence[str] = (), state: TrainerState | None = None, rows: list[dict] | None = None,
) -> dict[str, float]:
    """The eval/* figures of `examples`: episodes with `agent` (an environment's, on `engine`), else single
    completions from `engine` scored by `scorer` (`state`: the trainer state its TRL reward functions read); with
    `rows`, each example's row appended to it."""
    if agent is not None:
        return evaluate_episodes(agent, examples, max_tokens, temperature, seed, stop, rows=rows,
                                 tokenizer=engine.tokenizer, scorer=scorer, state=state)
    if scorer is None:
        raise ValueError("evaluate_set needs a scorer, or an agent whose environment rewards its episodes")
    return evaluate(engine, examples, data, scorer, max_tokens, temperature, seed, stop, state, rows=rows)


@contextmanager
def episode_agent(engine: StepEngine, env: EnvConfig | None) -> Iterator[EpisodeRunner | None]:
    """An agent loop of `env` on `engine` for an evaluation (None without an environment), closed after it."""
    if env is None:
        yield None
        return
    agent = AgentLoop(engine, env)
    try:
        yield agent
    finally:
        agent.close()


def sampling(n: int, max_tokens: int, temperature: float, seed: int, stop: Sequence[str]) -> list[SamplingParams]:
    """One sample for each of n examples, example i seeded with seed + i."""
    return [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i, stop=list(stop))
            for i in range(n)]


def evaluate(
    engine: RolloutEngine, examples: list[Example], data: DataConfig, scorer: Scorer,
    max_tokens: int, temperature: float = 0.0, seed: int = 0, stop: Sequence[str] = (),
    state: TrainerState | None = None, rows: list[dict] | None = None,
) -> dict[str, float]:
    """One completion per example: accuracy (or exact match) and reward (the scorer's), response length in tokens;
    with `rows`, each example's row appended to it."""
    tok = engine.tokenizer
    prompts = [encode_prompt(tok, ex, data) for ex in examples]
    outs = engine.generate(prompts, sampling(len(prompts), max_tokens, temperature, seed, stop))
    texts = [o.samples[0].text for o in outs]
    res = scorer.score(texts, examples, completion_ids=[o.samples[0].token_ids for o in outs], state=state)
    n = max(len(examples), 1)
    lengths = [len(o.samples[0].token_ids) for o in outs]
    if rows is not None:
        rows += eval_rows(examples, outs, res, tok)
    return {
        f"eval/{res.correct_name}": sum(res.correct) / n,
        "eval/reward": sum(res.rewards) / n,
        "eval/response_length": sum(lengths) / n,
        "eval/n": float(len(examples)),
    }


def evaluate_episodes(agent: EpisodeRunner, examples: list[Example], max_tokens: int, temperature: float = 0.0,
                      seed: int = 0, stop: Sequence[str] = (), rows: list[dict] | None = None,
                      tokenizer=None, scorer: Scorer | None = None, state: TrainerState | None = None
                      ) -> dict[str, float]:
    """One episode per eval example in its environment (greedy by default): success rate, reward, the
    model's tokens per episode, turns and tool calls per episode; with `rows` (and the engine's `tokenizer`), each
    episode's row appended to it."""
    trajs = agent.run(examples, sampling(len(examples), max_tokens, temperature, seed, stop))
    settle_rewards(trajs, examples, 1, scorer, state)  # an agent function's answers; a dropped episode: 0
    if rows is not None:
        rows += episode_rows(examples, trajs, tokenizer)
    n = max(len(trajs), 1)
    return {
        "eval/accuracy": sum(t.success for t in trajs) / n,
        "eval/reward": sum(t.reward for t in trajs) / n,
        "eval/response_length": sum(t.model_tokens for t in trajs) / n,
        "eval/turns": sum(t.turns for t in trajs) / n,
        "eval/tool_calls": sum(t.counters.get("tool_calls", 0.0) for t in trajs) / n,
        "eval/n": float(len(examples)),
    }
