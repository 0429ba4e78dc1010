"""Run report: PNGs from a synthetic metrics file, skipping what was not logged; summary."""

import json

import pytest

from relayrl.errors import UserError
from relayrl.observe.report import make_report, summarize

pytestmark = pytest.mark.unit

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _full_run(steps=6):
    records = []
    for step in range(1, steps + 1):
        records.append(
            {
                "step": step,
                "reward/mean": 0.1 * step,
                "reward/accuracy": 0.08 * step,
                "mismatch/logp_abs_mean": 1e-5 * step,
                "mismatch/logp_abs_max": 1e-3 * step,
                "response_length/mean": 40.0 + step,
                "response_length/max": 90.0 + step,
                "time/rollout": 2.0,
                "time/update": 1.0,
                "time/sync": 0.5,
                "time/step": 4.0,
            }
        )
        if step % 3 == 0:
            records.append({"step": step, "eval/accuracy": 0.3 + 0.05 * step})
    return records


def _assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)


def test_report_writes_all_pngs(tmp_path):
    _write_metrics(tmp_path, _full_run())
    paths = make_report(tmp_path)
    names = ["reward.png", "mismatch.png", "time_share.png", "lengths.png"]
    assert [p.name for p in paths] == names
    for path in paths:
        assert path.parent == tmp_path / "report"
        _assert_png(path)


def test_report_skips_what_was_not_logged(tmp_path):
    # One step, no mismatch or lengths, a zero mismatch would forbid a log axis anyway.
    _write_metrics(tmp_path, [{"step": 1, "reward/mean": 0.2, "time/rollout": 1.0}])
    paths = make_report(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "time_share.png"]
    for path in paths:
        _assert_png(path)


def test_report_mismatch_with_zero_uses_linear_axis(tmp_path):
    _write_metrics(tmp_path, [{"step": s, "mismatch/logp_abs_max": 0.0} for s in (1, 2)])
    assert [p.name for p in make_report(tmp_path)] == ["mismatch.png"]


@pytest.mark.parametrize("content", [None, "", "\n\n"])
def test_missing_or_empty_metrics_is_user_error(tmp_path, content):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(UserError, match="no metrics in RUN_DIR"):
        make_report(tmp_path)
    with pytest.raises(UserError, match="no metrics in RUN_DIR"):
        summarize(tmp_path)


def test_summarize_first_and_last(tmp_path):
    _write_metrics(tmp_path, _full_run(steps=6))
    summary = summarize(tmp_path)
    assert summary["first_step"] == 1 and summary["last_step"] == 6
    assert summary["total_time_s"] == pytest.approx(24.0)
    reward = summary["metrics"]["reward/mean"]
    assert reward["first"] == pytest.approx(0.1) and reward["last"] == pytest.approx(0.6)
    assert summary["metrics"]["eval/accuracy"]["first_step"] == 3
    assert "accuracy" not in summary["metrics"]  # not logged under that name here


def test_time_share_counts_a_stage_once():
    from relayrl.observe.report import time_stages

    keys = {"time/sync", "time/sync_transfer", "time/sync_verify", "time/rollout", "time/step", "reward/mean"}
    assert time_stages(keys) == ["time/rollout", "time/sync"]


def test_time_env_is_part_of_the_rollout_not_a_stage():
    from relayrl.observe.report import time_stages

    # environment seconds are summed over episodes that overlap the rollout: not a share of the step
    assert time_stages({"time/rollout", "time/env", "time/update", "time/step"}) == ["time/rollout", "time/update"]


def test_async_waits_are_not_stages():
    from relayrl.observe.report import time_stages

    # the trainer's wait is its time/rollout again; the engine's wait runs beside the step
    keys = {"time/rollout", "time/wait_rollout", "time/wait_train", "time/update", "time/step"}
    assert time_stages(keys) == ["time/rollout", "time/update"]


def test_report_plots_episodes_when_the_run_had_an_environment(tmp_path):
    records = [{"step": s, "reward/mean": 0.1 * s, "reward/accuracy": 0.1 * s, "turns/mean": 2.0 - 0.1 * s}
               for s in range(1, 5)] + [{"step": 4, "eval/accuracy": 0.4}]
    _write_metrics(tmp_path, records)
    paths = make_report(tmp_path)
    assert [p.name for p in paths] == ["reward.png", "episodes.png"]
    _assert_png(paths[-1])


def test_report_plots_the_critic_when_the_run_had_one(tmp_path):
    from relayrl.observe.report import make_report

    records = [{"step": s, "reward/mean": 0.1 * s, "critic/value_loss": 1.0 / s, "critic/explained_variance": 0.2 * s}
               for s in range(1, 5)]
    _write_metrics(tmp_path, records)
    names = {p.name for p in make_report(tmp_path)}
    assert "critic.png" in names
    _write_metrics(tmp_path / "grpo", [{"step": 1, "reward/mean": 0.1}])
    assert "critic.png" not in {p.name for p in make_report(tmp_path / "grpo")}


def test_a_user_reward_runs_report_shows_its_scorer_and_exact_match_not_accuracy(tmp_path):
    """Beside a user's reward exact match is logged as exact_match (relayrl.rewards.naming): the summary and the
    reward plot take it, and the held-out eval/reward, with no accuracy at all."""
    records = [{"step": 0, "eval/reward": 0.2, "eval/exact_match": 0.0, "eval/n": 4.0},
               {"step": 1, "eval/reward": 0.4, "eval/exact_match": 0.25, "eval/n": 4.0}]
    _write_metrics(tmp_path / "evals", records)  # evaluations only: the held-out dots are the whole plot
    (path,) = make_report(tmp_path / "evals")
    assert path.name == "reward.png"
    _assert_png(path)
    _write_metrics(tmp_path / "run", [records[0], {"step": 1, "reward/mean": 0.3, "reward/exact_match": 0.125},
                                      records[1]])
    metrics = summarize(tmp_path / "run")["metrics"]
    assert metrics["eval/reward"]["first"] == 0.2 and metrics["eval/reward"]["last"] == 0.4
    assert metrics["eval/exact_match"]["last"] == 0.25 and metrics["reward/exact_match"]["last"] == 0.125
    assert not any("accuracy" in k for k in metrics)
