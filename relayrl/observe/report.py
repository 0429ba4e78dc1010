"""This module makes the plots and a short summary of a run, read back from run_dir/metrics.jsonl.

    metrics.jsonl ──> reward.png      reward/mean and training accuracy per step, held-out reward and accuracy
                                      dots (exact match where the run logged it under that name: beside the
                                      user's own reward, exact match is not called accuracy)
                      mismatch.png    |logp_trainer - logp_engine| mean and max per step, and
                                      the weight sync's canary gap
                      time_share.png  each stage's share of the timed step (stacked)
                      lengths.png     response length mean and max per step
                      episodes.png    (runs in an environment) success per step, held-out success
                                      dots, and turns per episode
                      bottleneck.md   stage shares, MFU, stragglers, and each threshold crossed with the
                                      config keys to change (relayrl.observe.bottleneck)

Any metric a run did not log is simply left out; a plot with nothing to show is not written.
Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so making a report never opens a
window, needs no display, and does not change the process-wide pyplot backend.

It imports matplotlib, the metrics reader, the bottleneck checks and relayrl.errors only; it must never import
another relayrl layer: observe is a leaf, which the controller and the CLI import.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from relayrl.errors import UserError
from relayrl.observe.bottleneck import STEP_TIME, section, time_stages
from relayrl.observe.metrics import metrics_path, read_metrics

REPORT_DIR = "report"

REWARD_MEAN = "reward/mean"
# Training correctness: the first of these that the run logged (relayrl.rewards.naming: exact match is logged as
# reward/exact_match where the user's own reward scores the run)
ACCURACY_KEYS = ("reward/accuracy", "accuracy", "reward/exact_match")
EVAL_ACCURACY = "eval/accuracy"
EVAL_EXACT_MATCH = "eval/exact_match"
EVAL_REWARD = "eval/reward"  # the user's scorer on the held-out set
MISMATCH_MEAN = "mismatch/logp_abs_mean"
MISMATCH_MAX = "mismatch/logp_abs_max"
CANARY_GAP = "sync/canary_gap"  # the weight sync's check: mean |Δ logp| on fixed rows after each sync
LENGTH_MEAN = "response_length/mean"
LENGTH_MAX = "response_length/max"
BOTTLENECK = "bottleneck.md"
TURNS = "turns/mean"
VALUE_LOSS = "critic/value_loss"  # PPO with a critic
EXPLAINED_VARIANCE = "critic/explained_variance"

SUMMARY_KEYS = (
    REWARD_MEAN,
    VALUE_LOSS,
    EXPLAINED_VARIANCE,
    *ACCURACY_KEYS,
    EVAL_REWARD,
    EVAL_ACCURACY,
    EVAL_EXACT_MATCH,
    MISMATCH_MEAN,
    MISMATCH_MAX,
    LENGTH_MEAN,
    STEP_TIME,
)

Series = tuple[list[int], list[float]]


def _load(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    records = [r for r in read_metrics(run_dir) if "step" in r]
    if not records:
        raise UserError(
            f"no metrics in RUN_DIR: {metrics_path(run_dir)} is missing or empty; "
            "pass the directory of a run that has logged at least one step"
        )
    return records


def _series(records: list[dict[str, Any]], key: str) -> Series:
    # Records are filtered per key because train and eval metrics may be logged as separate lines.
    steps = [int(r["step"]) for r in records if key in r]
    values = [float(r[key]) for r in records if key in r]
    return steps, values


def _first_key(records: list[dict[str, Any]], keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if any(k in r for r in records)), None)


def _new_axes(title: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    ax = fig.add_subplot()
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    return fig, ax


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    return path


def _plot_reward(records: list[dict[str, Any]], out: Path) -> Path | None:
    acc_key = _first_key(records, ACCURACY_KEYS)
    keys = [k for k in (REWARD_MEAN, acc_key) if k is not None and _series(records, k)[0]]
    evals = [(k, _series(records, k)) for k in (EVAL_REWARD, EVAL_ACCURACY, EVAL_EXACT_MATCH)]
    evals = [(k, s) for k, s in evals if s[0]]
    if not keys and not evals:
        return None
    exact = acc_key == "reward/exact_match" or any(k == EVAL_EXACT_MATCH for k, _ in evals)
    fig, ax = _new_axes("reward and exact match" if exact else "reward and accuracy")
    for key in keys:
        ax.plot(*_series(records, key), label=key)
    for key, (steps, values) in evals:
        ax.plot(steps, values, "o", label=key)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, out / "reward.png")


def _plot_mismatch(records: list[dict[str, Any]], out: Path) -> Path | None:
    present = [(k, _series(records, k)) for k in (MISMATCH_MEAN, MISMATCH_MAX, CANARY_GAP)]
    present = [(k, s) for k, s in present if s[0]]
    if not present:
        return None
    fig, ax = _new_axes("trainer vs engine logprob mismatch (rollout tokens; the sync's canary)")
    for key, (steps, values) in present:
        ax.plot(steps, values, label=key)
    finite = [v for _, (_, vs) in present for v in vs if math.isfinite(v)]
    # Mismatch spans orders of magnitude (1e-6 in fp32, 1e-2 in bf16); a log axis shows both, but
    # cannot show zero (an exact match), so it is used only when every value is positive.
    if finite and min(finite) > 0:
        ax.set_yscale("log")
    ax.set_ylabel("|Δ logp|")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, out / "mismatch.png")


def _plot_time_share(records: list[dict[str, Any]], out: Path) -> Path | None:
    stages = time_stages({k for r in records for k in r})
    rows = [r for r in records if any(s in r for s in stages)]
    if not rows:
        return None
    steps = [int(r["step"]) for r in rows]
    seconds = {s: [float(r.get(s, 0.0)) for r in rows] for s in stages}
    if any(STEP_TIME in r for r in rows):
        # Whatever the step spent outside the named stages (logging, Python overhead) is shown as
        # "other" so the shares add up to the real step time, not just to the timed parts.
        timed = [sum(seconds[s][i] for s in stages) for i in range(len(rows))]
        seconds["other"] = [
            max(float(r.get(STEP_TIME, t)) - t, 0.0) for r, t in zip(rows, timed, strict=True)
        ]
    names = list(seconds)
    labels = [n.removeprefix("time/") for n in names]
    totals = [sum(seconds[n][i] for n in names) or 1.0 for i in range(len(rows))]
    shares = {n: [v / t for v, t in zip(seconds[n], totals, strict=True)] for n in names}

    fig, ax = _new_axes("share of step time per stage")
    if len(rows) >= 2:
        ax.stackplot(steps, [shares[n] for n in names], labels=labels)
    else:
        # One step cannot be drawn as an area; a single stacked bar says the same thing.
        bottom = 0.0
        for n, label in zip(names, labels, strict=True):
            ax.bar([str(steps[0])], [shares[n][0]], bottom=bottom, label=label)
            bottom += shares[n][0]
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, out / "time_share.png")


def _plot_lengths(records: list[dict[str, Any]], out: Path) -> Path | None:
    present = [(k, _series(records, k)) for k in (LENGTH_MEAN, LENGTH_MAX)]
    present = [(k, s) for k, s in present if s[0]]
    if not present:
        return None
    fig, ax = _new_axes("response length (tokens)")
    for key, (steps, values) in present:
        ax.plot(steps, values, label=key)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, out / "lengths.png")


def _plot_episodes(records: list[dict[str, Any]], out: Path) -> Path | None:
    turn_steps, turns = _series(records, TURNS)
    if not turn_steps:
        return None
    fig, ax = _new_axes("episodes: success and turns")
    acc_key = _first_key(records, ACCURACY_KEYS)
    if acc_key is not None:
        ax.plot(*_series(records, acc_key), label="success (training episodes)")
    eval_steps, eval_values = _series(records, EVAL_ACCURACY)
    if eval_steps:
        ax.plot(eval_steps, eval_values, "o-", label="success (held-out, greedy)")
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_ylabel("success")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(turn_steps, turns, color="gray", alpha=0.6, label=TURNS)
    right.set_ylabel("turns per episode")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right")
    return _save(fig, out / "episodes.png")


def _plot_critic(records: list[dict[str, Any]], out: Path) -> Path | None:
    loss_steps, losses = _series(records, VALUE_LOSS)
    if not loss_steps:
        return None
    fig, ax = _new_axes("critic: value loss and explained variance")
    ax.plot(loss_steps, losses, label=VALUE_LOSS)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("value loss")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(*_series(records, EXPLAINED_VARIANCE), color="tab:orange", alpha=0.8, label=EXPLAINED_VARIANCE)
    right.axhline(0.0, color="gray", lw=0.5)
    right.set_ylabel("explained variance (1: perfect, 0: the mean)")
    lines, more = ax.get_legend_handles_labels(), right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right")
    return _save(fig, out / "critic.png")


def make_report(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Writes the PNGs the run's metrics allow under run_dir/report/ and returns their paths; writes the
    bottleneck section beside them, always, as report/bottleneck.md (`bottleneck()` returns its text)."""
    records = _load(run_dir)
    out = Path(run_dir) / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    plots = (_plot_reward, _plot_mismatch, _plot_time_share, _plot_lengths, _plot_episodes, _plot_critic)
    (out / BOTTLENECK).write_text(section(records))
    return [p for plot in plots if (p := plot(records, out)) is not None]


def bottleneck(run_dir: str | os.PathLike[str]) -> str:
    """The bottleneck section of the run's report (Markdown; relayrl.observe.bottleneck)."""
    return section(_load(run_dir))


def summarize(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """First and last value of each key metric the run logged, for the CLI to print.

    {"first_step": 1, "last_step": 50, "records": 55, "total_time_s": 812.4 (when time/step was
    logged), "metrics": {"reward/mean": {"first": 0.1, "last": 0.6, "first_step": 1,
    "last_step": 50}, ...}}
    """
    records = _load(run_dir)
    steps = [int(r["step"]) for r in records]
    summary: dict[str, Any] = {
        "first_step": min(steps),
        "last_step": max(steps),
        "records": len(records),
    }
    step_steps, step_times = _series(records, STEP_TIME)
    if step_steps:
        summary["total_time_s"] = sum(step_times)
    metrics: dict[str, dict[str, float | int]] = {}
    for key in SUMMARY_KEYS:
        key_steps, values = _series(records, key)
        if key_steps:
            metrics[key] = {
                "first": values[0],
                "last": values[-1],
                "first_step": key_steps[0],
                "last_step": key_steps[-1],
            }
    summary["metrics"] = metrics
    return summary
