"""One reward call, the same in a worker process and in the driver: load the configured functions,
call one on one sample (or on one prompt's group of samples), and accept only finite real numbers.

    load_functions([(name, params, batch), ...]) -> [LoadedFunction, ...]   RewardError / ConfigError naming the entry
    call_one(f, completion, example) -> (value, None) or (None, "what went wrong")
    call_batch(f, completions, examples, completion_ids, state)
                                            -> ([(value, error), ...], None) or (None, "what went wrong")

A function has one of four forms, told apart by its parameter names (relayrl.rewards.forms, which
refuses a function that fits none or several; `batch: true | false` in the config entry says batch or not):

    sample   relayrl's fn(completion, example, **params) -> float; its second parameter is named `example`.
    batch    a parameter named `completions`: TRL's form, called once per group of samples as
             fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=..., **columns,
             **params) -> one value per completion, as TRL's GRPOTrainer calls it.
             A completion is the text, or [{"role": "assistant", "content": text}] when its prompt
             is chat messages (TRL's conversational datasets); `prompts` are the raw prompts;
             `completion_ids` each completion's sampled token ids (a list of ints, no prompt, the
             EOS token included when the sample ended on it); `trainer_state` a
             relayrl.rewards.state.TrainerState (global_step, max_steps, epoch, ...); each dataset
             column (`meta["fields"]`; `answer` for built-in tasks) is a keyword list, one item per
             completion. TRL's `log_extra`, `log_metric` and `environments` are not passed (a
             function that requires one is refused at load). A function without **kwargs gets only
             the keywords it names. Without ids (a caller that has none) `completion_ids` is left out.
    verl     parameters named `solution_str` and `ground_truth`: verl's custom reward function,
             fn(data_source=..., solution_str=completion, ground_truth=..., extra_info=..., **params),
             with `reward_model.ground_truth` (else a `ground_truth` column, else the answer), `data_source`
             (else the task's name)
             and `extra_info` of the row; it may return a number or a dict whose "score" is one.
    keyword  a parameter named `completion`: fn(completion=text, answer=..., prompt=..., info=...,
             example=..., **columns, **params) -> float, by name (the verifiers style): `answer` and
             `prompt` are the example's, `info` the row's `info` column (else its columns as a dict, else
             the example's meta), and each dataset column is filled by its name. A function without
             **kwargs gets only the keywords it names.

What counts as a value:
    int, float, fractions.Fraction, numpy's real scalars   float(v), if finite
    bool, numpy.bool_                                       1.0 / 0.0 (`return pred == gold` is common, and
                                                            numpy's comparisons give numpy.bool_)
    a 0-d numpy array or torch tensor (`x.mean()`)          its .item(), by the rules above
    NaN, +-inf, an int too large for a float (10**400)      a failure
    complex, str (even "1.0"), None, anything else          a failure
A batch function returns a list (or tuple, or array) with one value per completion: a wrong length or
something else is a failure of every sample of the call, a bad item a failure of its sample, and None
an item the function does not apply to (TRL's meaning: it adds 0 to the reward and is no failure).

A failure's message is one short line; it is what a RewardError quotes when every sample fails.

It imports the reward registry and relayrl.errors only; like all of rewards, it must never import the
trainer, the engine, sync or the controller (rewards may use relayrl.data and the ground floor only).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.errors import ConfigError
from relayrl.rewards.forms import BATCH, KEYWORD, KEYWORD_NAMES, SAMPLE, VERL, function_form
from relayrl.rewards.registry import RewardFn, get_reward_fn
from relayrl.rewards.state import TrainerState

__all__ = ["BATCH", "KEYWORD", "SAMPLE", "VERL", "LoadedFunction", "call_batch", "call_one", "function_form",
           "load_functions", "to_reward"]

MAX_MESSAGE = 300
# TRL hands a batch function every column but these (its own names for the model's input and output).
NOT_COLUMNS = frozenset({"prompt", "completion", "completion_ids", "prompts", "completions"})


@dataclass(frozen=True)
class LoadedFunction:
    """A configured reward function: `fn` with its params, its form, and the keywords it accepts
    (None: any, it has **kwargs)."""

    fn: RewardFn
    form: str
    params: dict[str, Any]
    accepts: frozenset[str] | None


def load_functions(specs: list[tuple]) -> list[LoadedFunction]:
    """The functions of `reward.functions` in order, their params bound; raises on the first bad entry.

    Each spec is (name, params), (name, params, batch) or (name, params, batch, args), batch being True,
    False or None (detect); args, when not None, make `name` a factory called once as name(**args)."""
    out = []
    for i, (name, params, *rest) in enumerate(specs):
        batch, args = (list(rest) + [None, None])[:2]
        fn = get_reward_fn(name) if args is None else _from_factory(name, args, i)
        sig = _signature(fn)
        try:
            form = function_form(sig, name, batch, params)
        except ConfigError as e:
            raise ConfigError(f"config error: reward.functions.{i}: {e}") from None
        _check_params(sig, form, name, params, i)
        accepts = None
        if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            accepts = frozenset(sig.parameters)
        out.append(LoadedFunction(fn=fn, form=form, params=dict(params), accepts=accepts))
    return out


def _from_factory(name: str, args: dict[str, Any], i: int) -> RewardFn:
    """factory(**args), once, at load: the reward function it returns."""
    factory = get_reward_fn(name)
    where = f"config error: reward.functions.{i}.args"
    try:
        fn = factory(**args)
    except Exception as e:  # a user factory may raise anything on bad arguments
        raise ConfigError(f"{where}: factory '{name}' raised {type(e).__name__}: {_first_line(e)}") from None
    if not callable(fn):
        raise ConfigError(f"{where}: factory '{name}' returned {_safe_repr(fn)} ({type(fn).__name__}), "
                          "not a reward function")
    return fn


def _signature(fn: RewardFn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some callables (builtins, C functions) have no signature
        return None


def _check_params(sig: inspect.Signature | None, form: str, name: str, params: dict[str, Any], i: int) -> None:
    """Fail at startup, naming the key, if the params do not fit the function's signature."""
    if sig is None:
        return
    try:
        taken = sorted(set(params) & set(KEYWORD_NAMES)) if form == KEYWORD else []
        if taken:
            raise TypeError(f"{', '.join(taken)} is filled from each sample, not set in params")
        if form == SAMPLE:
            sig.bind("", None, **params)
        else:  # called with keywords only; the columns are not known before the data are
            sig.bind_partial(**params)
    except TypeError as e:
        raise ConfigError(f"config error: reward.functions.{i}.params: {e} (function '{name}')") from None


def call_one(f: LoadedFunction, completion: str, example: Any) -> tuple[float | None, str | None]:
    """A per-sample call (forms sample, verl and keyword)."""
    if f.form == KEYWORD:
        return _call_keyword(f, completion, example)
    if f.form == VERL:
        fields = example.meta.get("fields") or {}
        rm = fields.get("reward_model")
        truth = (rm["ground_truth"] if isinstance(rm, dict) and "ground_truth" in rm
                 else fields.get("ground_truth", example.answer))
        kwargs = {"data_source": fields.get("data_source", example.meta.get("task")), "solution_str": completion,
                  "ground_truth": truth, "extra_info": fields.get("extra_info"), **f.params}
        value, error = _guarded(lambda: f.fn(**_accepted(f, kwargs)))
        if error is None and isinstance(value, dict) and "score" in value:
            value = value["score"]  # verl's reward functions may return {"score": ..., other diagnostics}
        return (None, error) if error is not None else to_reward(value)
    fn = functools.partial(f.fn, **f.params) if f.params else f.fn
    return call_reward(fn, completion, example)


def _call_keyword(f: LoadedFunction, completion: str, example: Any) -> tuple[float | None, str | None]:
    fields = example.meta.get("fields") or {}
    named = {"completion": completion, "answer": example.answer, "prompt": example.prompt, "example": example,
             "info": fields.get("info", dict(fields) if fields else dict(example.meta))}
    columns = {k: v for k, v in fields.items() if k not in NOT_COLUMNS}
    kwargs = {**columns, **f.params, **named}
    value, error = _guarded(lambda: f.fn(**_accepted(f, kwargs)))
    return (None, error) if error is not None else to_reward(value)


def call_batch(f: LoadedFunction, completions: list[str], examples: list[Any],
               completion_ids: Sequence[Sequence[int]] | None = None, state: TrainerState | None = None,
               ) -> tuple[list[tuple[float | None, str | None]] | None, str | None]:
    """One call of a batch function on a group of samples: a (value, error) per sample, or one error for all.
    `state` None: TrainerState() (TRL's state before any training)."""
    n = len(completions)
    columns: dict[str, list] = {}
    rows = [ex.meta["fields"] if "fields" in ex.meta else {"answer": ex.answer} for ex in examples]
    for key in dict.fromkeys(k for row in rows for k in row):
        if key not in NOT_COLUMNS:
            columns[key] = [row.get(key) for row in rows]
    kwargs = {**columns, **f.params,
              "prompts": [ex.prompt for ex in examples],
              "completions": [c if isinstance(ex.prompt, str) else [{"role": "assistant", "content": c}]
                              for c, ex in zip(completions, examples, strict=True)],
              "trainer_state": state if state is not None else TrainerState()}
    if completion_ids is not None:
        kwargs["completion_ids"] = [list(ids) for ids in completion_ids]  # a fresh list each call, as TRL's
    out, error = _guarded(lambda: f.fn(**_accepted(f, kwargs)))
    if error is not None:
        return None, error
    if hasattr(out, "tolist") and not isinstance(out, (str, bytes)):
        out = out.tolist()  # a numpy array or a torch tensor
    if not isinstance(out, Sequence) or isinstance(out, (str, bytes)):
        return None, f"returned {_safe_repr(out)} ({type(out).__name__}), expected a list of {n} numbers"
    if len(out) != n:
        return None, f"returned {len(out)} values for {n} completions, expected one per completion"
    items = []
    for j, v in enumerate(out):
        value, err = (0.0, None) if v is None else to_reward(v)  # None: does not apply to this sample (TRL)
        items.append((value, None if err is None else f"item {j}: {err}"))
    return items, None


def _accepted(f: LoadedFunction, kwargs: dict[str, Any]) -> dict[str, Any]:
    return kwargs if f.accepts is None else {k: v for k, v in kwargs.items() if k in f.accepts}


def _guarded(thunk) -> tuple[Any, str | None]:
    """(the call's result, None), or (None, message) when it raises: see call_reward."""
    try:
        return thunk(), None
    except SystemExit as e:
        return None, f"called sys.exit({_safe_repr(e.code)})"
    except MemoryError:
        return None, "MemoryError (over reward.memory_mb?)"
    except BaseException as e:  # user code may raise anything on odd output
        return None, f"{type(e).__name__}: {_first_line(e)}"


def call_reward(fn: RewardFn, completion: str, example: Any) -> tuple[float | None, str | None]:
    """(value, None) on success, (None, message) when the call raises or returns a non-value.

    BaseException is caught on purpose: a reward calling sys.exit() or raising KeyboardInterrupt
    fails its sample, not the process that scores it."""
    v, error = _guarded(lambda: fn(completion, example))
    return (None, error) if error is not None else to_reward(v)


def to_reward(v: Any) -> tuple[float | None, str | None]:
    """(float(v), None) for a finite real number (numpy's and torch's scalars included), else (None, why)."""
    v, error = _plain_scalar(v)
    if error is not None:
        return None, error
    if not isinstance(v, numbers.Real):
        return None, f"returned {_safe_repr(v)} ({type(v).__name__}), expected a finite real number"
    try:
        f = float(v)
    except OverflowError:
        return None, f"returned an {type(v).__name__} too large for a float ({_safe_repr(v)})"
    except BaseException as e:  # a user's Real subclass may fail to convert in any way
        return None, f"returned {type(v).__name__} that float() rejects: {type(e).__name__}: {_first_line(e)}"
    if not math.isfinite(f):
        return None, f"returned {f!r}, expected a finite real number"
    return f, None


def _plain_scalar(v: Any) -> tuple[Any, str | None]:
    """numpy.bool_ (not a numbers.Real), and a 0-d numpy array or torch tensor, as the Python number .item()
    gives; anything else unchanged. A value whose .item() raises is a failure of its sample."""
    if isinstance(v, (numbers.Real, str, bytes)) or v is None:
        return v, None
    try:
        zero_d = getattr(v, "ndim", None) == 0 and callable(getattr(v, "item", None))
    except BaseException:  # a user object's attribute may raise anything
        zero_d = False
    if not zero_d:
        return v, None
    try:
        return v.item(), None
    except BaseException as e:
        return None, f"returned {type(v).__name__} whose .item() raised {type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    try:
        text = str(e).strip()
    except BaseException:  # a user exception's __str__ may itself fail
        return "(unprintable message)"
    line = text.splitlines()[0] if text else "(no message)"
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE] + "..."


def _safe_repr(v: Any) -> str:
    try:
        text = repr(v)
    except BaseException:  # huge ints refuse repr (int max str digits); user objects may raise
        return f"<{type(v).__name__}>"
    text = text.replace("\n", " ")
    return text if len(text) <= 60 else text[:60] + "..."
