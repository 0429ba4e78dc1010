"""Rewards of agent functions' episodes (relayrl.serve.agents), settled where a batch of them is assembled.

    an agent returned ...        its trajectory                        here
    a number / {"reward": ...}   reward set                            kept
    an answer (or None)          needs_score, last_text = the answer   scored by the run's reward functions
    raised / timed out / no call finish in DROPPED, no sampled token   the mean reward of its group's others

A dropped episode trains no token; giving it its group's mean keeps it from moving the group's baseline (GRPO's
mean, RLOO's leave-one-out) or the sign of any other sample's advantage. A group with every episode dropped gets
0 everywhere: no spread, nothing learned from it.

It imports the rewards' protocol and state, and the trajectory type; never the serve layer.
"""

from __future__ import annotations

from relayrl.data import Example
from relayrl.envs.episode import Trajectory
from relayrl.errors import ConfigError
from relayrl.rewards.protocol import Scorer
from relayrl.rewards.state import TrainerState

DROPPED = ("agent_error", "agent_timeout", "agent_no_calls")  # relayrl.serve.agents ends dropped episodes so


def settle_rewards(trajs: list[Trajectory], examples: list[Example], group_size: int, scorer: Scorer | None,
                   state: TrainerState | None = None) -> None:
    """Score the answers and fill the dropped episodes' rewards, in place. trajs[i] is an episode of examples[i]
    (groups of `group_size` contiguous)."""
    todo = [i for i, t in enumerate(trajs) if t.needs_score and t.finish not in DROPPED]
    if todo:
        if scorer is None:
            raise ConfigError("the agent returned an answer (a string or None) but the run has no reward functions "
                              "to score it: return a number, or set reward.functions")
        res = scorer.score([trajs[i].last_text for i in todo], [examples[i] for i in todo], state=state)
        for k, i in enumerate(todo):
            trajs[i].reward, trajs[i].success = float(res.rewards[k]), bool(res.correct[k])
            trajs[i].needs_score = False
    for g in range(0, len(trajs), max(group_size, 1)):
        group = trajs[g:g + group_size]
        kept = [t.reward for t in group if t.finish not in DROPPED]
        mean = sum(kept) / len(kept) if kept else 0.0
        for t in group:
            if t.finish in DROPPED:
                t.reward = mean


def agent_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """agent/* figures of a step's episodes (empty for environments' episodes): dropped share (and why), calls per
    episode, re-tokenized calls and lines left untrained, summed."""
    if not any("agent/calls" in t.counters for t in trajs):
        return {}
    n = max(len(trajs), 1)
    out = {"agent/dropped": sum(t.finish in DROPPED for t in trajs) / n}
    for why in DROPPED:
        out[f"agent/{why.removeprefix('agent_')}"] = sum(t.finish == why for t in trajs) / n
    out["agent/calls"] = sum(t.counters.get("agent/calls", 0.0) for t in trajs) / n
    out["agent/retokenize_drift"] = sum(t.counters.get("agent/retokenize_drift", 0.0) for t in trajs)
    out["agent/lines_dropped"] = sum(t.counters.get("agent/lines_dropped", 0.0) for t in trajs)
    return out
