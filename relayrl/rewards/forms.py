"""Which form a reward function has, told by its parameter names alone; a function that fits no form, or
more than one, is refused at load in one line naming the function and the forms.

    function_form(sig, name, batch=None) -> "sample" | "batch" | "verl" | "keyword"      ConfigError

    sample   the second positional parameter is named `example`: relayrl's fn(completion, example)
    batch    a parameter named `completions` (or `completion_ids`): TRL's fn(completions, **kwargs)
    verl     parameters named `solution_str` and `ground_truth`: verl's compute_score(data_source, ...)
    keyword  a parameter named `completion` (and no `example` second): fn(completion, answer, prompt, info, ...)
             filled by name; every required parameter must be one of KEYWORD_NAMES (a dataset column
             is filled too, when the function names it with a default or takes **kwargs)

`batch: true` in the config entry says batch whatever the names; `batch: false` rules batch out.
A callable without a signature (a C function) is taken as relayrl's form: nothing else can be told.
A batch function gets TRL's `completion_ids` and `trainer_state` (relayrl.rewards.calls); TRL's `log_extra`,
`log_metric` and `environments` are not passed, so a batch function that requires one is refused at load (one
that merely accepts them runs without).

It imports relayrl.errors only (rewards may use relayrl.data and the ground floor only).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from relayrl.errors import ConfigError

SAMPLE, BATCH, VERL, KEYWORD = "sample", "batch", "verl", "keyword"
KEYWORD_NAMES = ("completion", "answer", "prompt", "info", "example")
FORMS = ("relayrl's fn(completion, example), TRL's fn(completions, **kwargs), verl's compute_score(data_source, "
         "solution_str, ground_truth, extra_info), or the keyword form fn(completion, answer, prompt, info, ...)")
# What TRL's GRPOTrainer passes a reward function but relayrl does not, and why.
NOT_AVAILABLE = {
    "log_extra": "reward functions return values; relayrl keeps no extra completion columns of theirs",
    "log_metric": "relayrl logs each function's mean as reward/<name>/mean and takes no other metric from it",
    "environments": "single-turn samples have no environment (an env: section rewards its own episodes)",
}


def function_form(sig: inspect.Signature | None, name: str = "?", batch: bool | None = None,
                  params: Iterable[str] = ()) -> str:
    """The form of reward function `name` (`params`: the keys its config entry sets), or ConfigError when
    its parameters fit none or several."""
    if sig is None:
        return BATCH if batch else SAMPLE
    fits = [BATCH] if batch else [f for f in _fits(sig) if not (f == BATCH and batch is False)]
    params = ", ".join(str(p) for p in sig.parameters.values())
    if not fits:
        raise ConfigError(f"reward function '{name}({params})' fits no reward form; write it as {FORMS}")
    if len(fits) > 1:
        raise ConfigError(f"reward function '{name}({params})' fits several reward forms ({', '.join(fits)}); "
                          f"rename its parameters to fit one of {FORMS}")
    _check_required(sig, name, fits[0], set(params))
    return fits[0]


def _fits(sig: inspect.Signature) -> list[str]:
    names = set(sig.parameters)
    positional = [p.name for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    sample = len(positional) >= 2 and positional[1] == "example"
    return [form for form, ok in ((BATCH, bool({"completions", "completion_ids"} & names)),
                                  (VERL, {"solution_str", "ground_truth"} <= names),
                                  (SAMPLE, sample),
                                  (KEYWORD, "completion" in names and not sample)) if ok]


def _required(sig: inspect.Signature) -> list[str]:
    return [p.name for p in sig.parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _check_required(sig: inspect.Signature, name: str, form: str, params: set[str]) -> None:
    required = [k for k in _required(sig) if k not in params]
    if form == BATCH:
        for key, why in NOT_AVAILABLE.items():
            if key in required:
                raise ConfigError(f"reward function '{name}' requires {key}, which relayrl does not pass: {why}")
    if form == KEYWORD:
        unknown = [k for k in required if k not in KEYWORD_NAMES]
        if unknown:
            raise ConfigError(f"reward function '{name}' (keyword form) requires {', '.join(unknown)}, which "
                              f"is not filled; required parameters may be {', '.join(KEYWORD_NAMES)} (a dataset "
                              "column needs a default, or **kwargs)")
