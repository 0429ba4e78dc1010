"""This module runs the held-out evaluation: it generates one completion per eval prompt, scores them, and
reports accuracy, reward and response length.

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the
loop, the roles or the jobs.
"""

from __future__ import annotations

from relayrl.data import DataConfig, Example
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.rewards import Scorer
from relayrl.rollout.agent_loop import EpisodeRunner
from relayrl.rollout.prompts import encode_prompt


def evaluate(
    engine: LLMEngine, examples: list[Example], data: DataConfig, scorer: Scorer,
    max_tokens: int, temperature: float = 0.0, seed: int = 0, stop: list[str] = (),
) -> dict[str, float]:
    tok = engine.tokenizer
    prompts = [encode_prompt(tok, ex, data) for ex in examples]
    # a seed per prompt: at temperature > 0 one shared seed would draw the same uniforms for every prompt
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i, stop=list(stop))
              for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    texts = [o.samples[0].text for o in outs]
    res = scorer.score(texts, examples)
    n = max(len(examples), 1)
    lengths = [len(o.samples[0].token_ids) for o in outs]
    return {
        "eval/accuracy": sum(res.correct) / n,
        "eval/reward": sum(res.rewards) / n,
        "eval/response_length": sum(lengths) / n,
        "eval/n": float(len(examples)),
    }


def evaluate_episodes(agent: EpisodeRunner, examples: list[Example], max_tokens: int, temperature: float = 0.0,
                      seed: int = 0, stop: list[str] = ()) -> dict[str, float]:
    """One episode per eval example in its environment (greedy by default): success rate, reward, the
    model's tokens per episode, turns and tool calls per episode."""
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i, stop=list(stop))
              for i in range(len(examples))]
    trajs = agent.run(examples, params)
    n = max(len(trajs), 1)
    return {
        "eval/accuracy": sum(t.success for t in trajs) / n,
        "eval/reward": sum(t.reward for t in trajs) / n,
        "eval/response_length": sum(t.model_tokens for t in trajs) / n,
        "eval/turns": sum(t.turns for t in trajs) / n,
        "eval/tool_calls": sum(t.counters.get("tool_calls", 0.0) for t in trajs) / n,
        "eval/n": float(len(examples)),
    }
