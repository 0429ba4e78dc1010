"""The `RewardScorer`: a weighted sum of reward functions over a batch, every call run in the reward pool.

    reward[i]  = sum_f weight_f * value_f[i]
    value_f[i] = fn_f(completion[i], example[i], **params_f), or reward.on_failure when the call raises,
                 times out, kills its worker or returns something that is not a finite real number
                 (counted in `failures`; timeouts also in `timeouts`; both count samples)
                 A batch function (TRL's form, see relayrl.rewards.calls) is called once per prompt group,
                 the consecutive samples of one Example object (the G samples the driver drew for it),
                 with their completion_ids and the caller's trainer state, and gives value_f for each; a
                 failure of the whole call fails each sample of the group.
    correct[i] = task score of sample i >= 1.0  (the `task` reward, always computed, for accuracy)
                 named exact_match, not accuracy, where it is exact match (an example without a task) while the
                 user's own reward scores the run (relayrl.rewards.naming)

One sample failing is tolerated (a user function may choke on odd model output); every sample of
one function failing in one call means the function itself is broken, so the run stops with a
RewardError carrying the first failure's message.

`build_scorer(cfg)` starts the pool (reward.workers processes; relayrl.rewards.pool) and loads the
functions in it, so a function that cannot be imported, or params that do not fit it, fail here, in
one line. With reward.workers = 0 the functions run in this process instead: no isolation and no
timeout, for debugging and for measuring what the pool costs. The scorer owns the pool: `close()`
(or leaving a `with` block) stops its workers.

It imports the reward modules, relayrl.data and relayrl.errors only; like all of rewards, it must never
import the trainer, the engine, sync or the controller (rewards may use relayrl.data and the ground
floor only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from relayrl.data.tasks import Example, task_for_example
from relayrl.errors import RewardError
from relayrl.rewards.calls import BATCH, LoadedFunction, call_batch, call_one, load_functions
from relayrl.rewards.config import RewardConfig
from relayrl.rewards.naming import correct_name
from relayrl.rewards.pool import Outcome, RewardPool
from relayrl.rewards.result import ScoreResult
from relayrl.rewards.state import TrainerState


class Runner(Protocol):
    """Runs (function index, completion, example) calls, returning one Outcome per call, in order; a batch
    function's call is (function index, completions, examples, completion_ids or None, TrainerState or None) of
    one group. `forms` is each function's form (relayrl.rewards.calls)."""

    forms: list[str]

    def run(self, calls: list[tuple]) -> list[Outcome]: ...

    def pids(self) -> list[int]: ...

    def close(self) -> None: ...


class InProcessRunner:
    """reward.workers = 0: the functions run in the calling thread, unbounded."""

    def __init__(self, fns: list[LoadedFunction]):
        self.fns = fns
        self.forms = [f.form for f in fns]

    def run(self, calls: list[tuple]) -> list[Outcome]:
        return [self._run(self.fns[f], c, ex, *extra) for f, c, ex, *extra in calls]

    @staticmethod
    def _run(f: LoadedFunction, c: Any, ex: Any, *extra: Any) -> Outcome:
        if f.form != BATCH:
            return Outcome(*call_one(f, c, ex))
        items, error = call_batch(f, c, ex, *extra)
        return Outcome(None, error) if items is None else Outcome(None, items=[Outcome(*i) for i in items])

    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


@dataclass
class BoundFunction:
    name: str  # the metric name: the config's name, with #i for a second entry of the same name
    weight: float


class RewardScorer:
    """`score(completions, examples, check=True, completion_ids=None, state=None) -> ScoreResult`; `close()`;
    a context manager."""

    def __init__(self, functions: list[BoundFunction], runner: Runner, correct_index: int, on_failure: float = 0.0,
                 user_reward: bool = False):
        self.functions, self.runner = functions, runner
        self.correct_index, self.on_failure = correct_index, on_failure
        self.user_reward = user_reward  # reward.functions is the user's own: exact match is not called accuracy

    def score(self, completions: list[str], examples: list[Example], check: bool = True, *,
              completion_ids: Sequence[Sequence[int]] | None = None, state: TrainerState | None = None) -> ScoreResult:
        """check=False: leave the every-sample-failed check to the caller (a shard of a step's
        samples may fail whole while the step does not; see ScoreResult.merge). completion_ids (each
        completion's sampled ids) and state go to batch functions (TRL's completion_ids and trainer_state)."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        if completion_ids is not None and len(completion_ids) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(completion_ids)} completion_ids")
        n = len(completions)
        n_fns = max(len(self.functions), self.correct_index + 1)
        groups = _groups(examples)
        calls, spans = [], []  # function f's calls are calls[spans[f]:spans[f + 1]]
        for f in range(n_fns):
            spans.append(len(calls))
            if self.runner.forms[f] == BATCH:
                calls += [(f, completions[a:b], examples[a:b],
                           None if completion_ids is None else completion_ids[a:b], state) for a, b in groups]
            else:
                calls += [(f, c, ex) for c, ex in zip(completions, examples, strict=True)]
        spans.append(len(calls))
        raw = self.runner.run(calls)
        outs = [o for f in range(n_fns) for o in self._per_sample(raw[spans[f]:spans[f + 1]], groups, f)]
        rewards = [0.0] * n
        per_function: dict[str, list[float]] = {}
        failures: dict[str, int] = {}
        timeouts: dict[str, int] = {}
        first_errors: dict[str, str] = {}
        for i, f in enumerate(self.functions):
            block = outs[i * n:(i + 1) * n]
            errors = [o.error for o in block if o.error is not None]
            if check and n and len(errors) == n:
                raise RewardError(f"every sample failed to score in reward function {f.name}: {errors[0]}")
            values = [self.on_failure if o.error is not None else o.value for o in block]
            per_function[f.name], failures[f.name] = values, len(errors)
            timeouts[f.name] = sum(o.timed_out for o in block)
            if errors:
                first_errors[f.name] = errors[0]
            rewards = [r + f.weight * v for r, v in zip(rewards, values, strict=True)]
        # A sample the task cannot score is simply not correct: accuracy is a metric, not a reward.
        block = outs[self.correct_index * n:(self.correct_index + 1) * n]
        correct = [o.error is None and o.value >= 1.0 for o in block]
        return ScoreResult(rewards=rewards, per_function=per_function, failures=sum(failures.values()),
                           correct=correct, failures_per_function=failures, timeouts=sum(timeouts.values()),
                           timeouts_per_function=timeouts, first_errors=first_errors,
                           correct_name=correctness(examples, self.user_reward))

    def _per_sample(self, outs: list[Outcome], groups: list[tuple[int, int]], f: int) -> list[Outcome]:
        """One Outcome per sample: a batch call's items, or its failure repeated for each sample of its group."""
        if self.runner.forms[f] != BATCH:
            return outs
        per_sample = []
        for o, (a, b) in zip(outs, groups, strict=True):
            if o.items is not None and len(o.items) != b - a:  # calls.call_batch checks it: a worker bug
                o = Outcome(None, f"the reward worker returned {len(o.items)} values for {b - a} samples")
            per_sample += o.items if o.items is not None else [Outcome(None, o.error, o.timed_out)] * (b - a)
        return per_sample

    def pids(self) -> list[int]:
        """The worker processes' ids (none in process): for tests and diagnostics."""
        return self.runner.pids()

    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def correctness(examples: Sequence[Example], user_reward: bool) -> str:
    """What `correct` measures for these examples (relayrl.rewards.naming): exact match where one has no task."""
    return correct_name(user_reward, any(task_for_example(ex) is None for ex in examples))


def _groups(examples: list[Example]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive samples of the same Example object (one prompt's group)."""
    bounds = [i for i in range(1, len(examples)) if examples[i] is not examples[i - 1]]
    return list(zip([0, *bounds], [*bounds, len(examples)], strict=True)) if examples else []


def build_scorer(cfg: RewardConfig) -> RewardScorer:
    if any(fc.name == "code_tests" for fc in cfg.functions):
        from relayrl.sandbox import require_sandbox

        require_sandbox()  # without bubblewrap every sample would fail: say so once, before any work
    specs = [(fc.name, dict(fc.params), fc.batch, fc.args) for fc in cfg.functions]
    bound, seen = [], set()
    for i, fc in enumerate(cfg.functions):
        # Two entries may use the same function with different params; keep their metrics apart.
        name = fc.name if fc.name not in seen else f"{fc.name}#{i}"
        seen.add(name)
        bound.append(BoundFunction(name=name, weight=fc.weight))
    # Accuracy needs the task score: reuse a plain `task` entry's values, else score it as one more function.
    correct_index = next((i for i, (n, p, _, a) in enumerate(specs) if n == "task" and not p and a is None), None)
    if correct_index is None:
        correct_index = len(specs)
        specs.append(("task", {}, None))
    if cfg.workers == 0:
        runner: Runner = InProcessRunner(load_functions(specs))
    else:
        runner = RewardPool(specs, workers=cfg.workers, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb,
                            cpu_s=cfg.cpu_limit_s(), max_reply_mb=cfg.max_reply_mb)
    return RewardScorer(bound, runner, correct_index, cfg.on_failure, user_reward=cfg.user_scored())
