"""`math`: is the completion's final answer mathematically equal to the gold answer? (math-verify)

Both sides go through `math_verify.parse`, which extracts `\\boxed{...}`, LaTeX and plain
expressions, then `verify` compares them symbolically/numerically ("1/2" equals "0.5" and
"\\frac{1}{2}"). A gold answer that does not parse raises, so the sample counts as a failure
instead of silently scoring 0.

math-verify times out with signal.alarm, which only works in the main thread. The reward pool
calls it in its workers' main threads, so its own timeout works there: TIMEOUT_S for the parse and
for each comparison, kept well below reward.timeout_s's default of 10 s so that a slow expression
normally scores 0 by math-verify's own timeout, without the pool killing (and restarting) the worker.
The pool's timeout stays the hard bound (a computation that ignores the alarm, a larger parse). Called
in a thread (in-process scoring from a thread), it runs without its timeout rather than crash.

It imports math-verify, the reward registry and relayrl.data only; like all of rewards, it must never
import the trainer, the engine, sync or the controller (rewards may use relayrl.data and the ground
floor only).
"""

from __future__ import annotations

import threading
from functools import lru_cache

from math_verify import parse, verify

from relayrl.data.tasks import Example
from relayrl.rewards.registry import register_reward

TIMEOUT_S = 3


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None):
    # The same gold answer is scored once per sample of its group: parse it once.
    parsed = parse(answer, parsing_timeout=timeout)
    if not parsed:
        raise ValueError(f"cannot parse the gold answer {answer!r} as math")
    return parsed


@register_reward("math")
def math_reward(completion: str, example: Example) -> float:
    timeout = _timeout()
    gold = _parse_gold(example.answer, timeout)
    pred = parse(completion, parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
