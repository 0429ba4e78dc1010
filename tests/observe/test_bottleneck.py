"""The bottleneck section: each finding fires exactly at its threshold and not below, its advice names real
config keys, and the report writes and prints it."""

import json
import re
import typing

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter

from relayrl.controller.config import RunConfig
from relayrl.observe import bottleneck as bn
from relayrl.observe.report import bottleneck, make_report

pytestmark = pytest.mark.unit


def _names(records):
    return [f.name for f in bn.findings(records)]


def _one(**metrics):
    return [{"step": 1, **metrics}]


# (records at the threshold, records just below it, the finding)
CASES = {
    "rollout": (_one(**{"time/step": 5.0, "time/rollout": 4.0}),  # 4 / 5 = 80%
                _one(**{"time/step": 5.0, "time/rollout": 3.99})),
    "weight sync": (_one(**{"time/step": 20.0, "time/sync": 1.0}),  # 1 / 20 = 5%
                    _one(**{"time/step": 20.0, "time/sync": 0.99})),
    "communication": (_one(**{"time/step": 10.0, "time/update": 2.0, "time/update_comm": 1.0}),  # 1 / 10 = 10%
                      _one(**{"time/step": 10.0, "time/update": 2.0, "time/update_comm": 0.99})),
    "stragglers": (_one(**{"time/step": 1.0, "rollout/straggler_share": 0.25}),
                   _one(**{"time/step": 1.0, "rollout/straggler_share": 0.24})),
    "update MFU": (_one(**{"time/step": 1.0, "time/update": 0.5, "throughput/mfu_update": 0.3}),
                   _one(**{"time/step": 1.0, "time/update": 0.5, "throughput/mfu_update": 0.31})),
    "rollout MFU": (_one(**{"time/step": 1.0, "time/rollout": 0.5, "throughput/mfu_rollout": 0.3}),
                    _one(**{"time/step": 1.0, "time/rollout": 0.5, "throughput/mfu_rollout": 0.31})),
    "expert imbalance": (_one(**{"time/step": 1.0, "moe/load_max_over_mean": 3.0}),
                         _one(**{"time/step": 1.0, "moe/load_max_over_mean": 2.99})),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_finding_fires_at_its_threshold_and_not_below(name):
    at, below = CASES[name]
    assert name in _names(at)
    assert name not in _names(below)


def test_shares_and_nothing_else_for_a_balanced_step():
    rec = _one(**{"time/step": 10.0, "time/rollout": 5.0, "time/update": 4.0, "time/sync": 0.2,
                  "time/sync_transfer": 0.1, "time/wait_train": 9.0})
    assert bn.findings(rec) == []
    s = bn.shares(rec)
    assert s["time/rollout"] == 0.5 and s["time/update"] == 0.4 and s["time/sync_transfer"] == 0.01
    assert "time/wait_train" not in s  # an asynchronous run's wait is not a stage of the step
    assert "No bottleneck over its threshold." in bn.section(rec)


def test_a_slow_sync_is_the_sync_finding_only_and_comm_counts_profiled_steps_only():
    # a sync of 40% of the step, all of it transfer: "weight sync", not "communication" too
    slow_sync = _one(**{"time/step": 10.0, "time/sync": 4.0, "time/sync_transfer": 4.0, "time/update": 1.0,
                        "time/update_comm": 0.5})
    assert _names(slow_sync) == ["weight sync"]
    # profiled every other step: (1.5 + 0.5) / (10 + 10) = 10% of the steps that were profiled, not of all four
    rows = [{"step": s, "time/step": 10.0, "time/update": 3.0, **comm}
            for s, comm in ((2, {"time/update_comm": 1.5}), (3, {}), (4, {"time/update_comm": 0.5}), (5, {}))]
    assert bn.comm_share(rows) == pytest.approx(0.1)
    assert "communication" in _names([{"step": 1, "time/step": 10.0}, *rows])
    assert "10.0% of the step over 2 profiled step(s)" in bn.section([{"step": 1, "time/step": 10.0}, *rows])
    assert bn.comm_share(rows[1::2]) is None and "no step was profiled" in bn.section(rows[1::2])
    # time/update_comm is a part of time/update, not a stage of its own: the stages still add up
    assert bn.time_stages(bn.shares(rows)) == ["time/update"]


def test_the_first_step_is_left_out_from_three_steps_on():
    warm = {"step": 1, "time/step": 10.0, "time/rollout": 9.0}  # 90%: one-time costs
    later = [{"step": s, "time/step": 10.0, "time/rollout": 7.0} for s in (2, 3)]
    assert bn.shares(bn.training_steps([warm, *later]))["time/rollout"] == 0.7  # steps 2 and 3 only
    assert "rollout" not in _names([warm, *later])
    assert "rollout" in _names([warm, later[0]])  # two steps: both count, (9 + 7) / 20 = 80%
    assert "the first left out" in bn.section([warm, *later])


def test_mfu_is_time_weighted_over_the_steps():
    rows = [{"step": 1, "time/step": 1.0, "time/update": 1.0, "throughput/mfu_update": 0.2},
            {"step": 2, "time/step": 1.0, "time/update": 3.0, "throughput/mfu_update": 0.6}]
    # sum(flops) / (sum(seconds) x peak x ranks) = (0.2 x 1 + 0.6 x 3) / 4
    assert bn._mfu(rows, "update") == pytest.approx(0.5)


def _all_findings():
    rec = {"step": 1, "time/step": 10.0, "time/rollout": 8.0, "time/sync": 1.5, "time/sync_verify": 1.0,
           "time/sync_transfer": 0.5, "time/update_comm": 1.0, "rollout/straggler_share": 0.9,
           "throughput/mfu_update": 0.01, "throughput/mfu_rollout": 0.01, "moe/load_max_over_mean": 4.0,
           "time/update": 1.5}
    found = bn.findings([rec])
    assert [f.name for f in found] == ["rollout", "weight sync", "communication", "stragglers", "update MFU",
                                       "rollout MFU", "expert imbalance"]
    return found


def _field(model: type[BaseModel], path: list[str]):
    """The pydantic field at a dotted path of RunConfig (through optional sections); KeyError if none."""
    info = None
    for i, part in enumerate(path):
        if part not in model.model_fields:
            raise KeyError(".".join(path[: i + 1]))
        info = model.model_fields[part]
        if i < len(path) - 1:
            nested = [a for a in (info.annotation, *typing.get_args(info.annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)]
            if not nested:
                raise KeyError(".".join(path[: i + 2]))
            model = nested[0]
    return info


def test_every_config_key_in_the_advice_is_a_field_of_runconfig():
    keys = []
    for f in _all_findings():
        for line in f.advice:
            keys += [k for k in re.findall(r"`([^`]+)`", line) if re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+(=.*)?", k)]
    assert len(keys) >= 20
    for item in keys:
        key, _, value = item.partition("=")
        info = _field(RunConfig, key.split("."))  # raises on a key that does not exist
        if value:  # the suggested value is one the field accepts
            TypeAdapter(info.annotation).validate_python(yaml.safe_load(value))
    # the sync's own canary is named when it is most of the sync
    assert any("sync.canary_rows" in a for a in _all_findings()[1].advice)


def test_a_made_up_key_would_be_caught():
    with pytest.raises(KeyError):
        _field(RunConfig, ["rollout", "max_num_seq"])
    with pytest.raises(KeyError):
        _field(RunConfig, ["rollout", "max_tokens", "x"])


def test_report_writes_and_returns_the_section(tmp_path):
    rows = [{"step": 1, "time/step": 5.0, "time/rollout": 4.5, "time/update": 0.5, "rollout/straggler_share": 0.2,
             "throughput/mfu_update": 0.4, "throughput/peak_gflops_trainer": 50.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.name for p in make_report(tmp_path)] == ["time_share.png"]  # the plots; the section beside them
    text = (tmp_path / "report" / "bottleneck.md").read_text()
    assert text == bottleneck(tmp_path)
    assert "rollout 90.0%" in text and "update 10.0%" in text
    assert "MFU: update 40.0% (peak 50.0 GFLOP/s per rank)" in text and "MFU = flops / (seconds x peak x ranks)" in text
    assert "**rollout**" in text and "`rollout.max_num_seqs`" in text
    assert "Stragglers: 20.0%" in text and "**stragglers**" not in text
