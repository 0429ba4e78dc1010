"""Run traces: spans written per process, merged into one Chrome / Perfetto trace by
`relayrl report RUN --trace`; a real run on two local worker ranks puts the driver's stages and both
ranks' worker calls on one timeline, nested in their step."""

from __future__ import annotations

import json
import os

import pytest

from relayrl.cli.main import main
from relayrl.errors import UserError
from relayrl.jobs.train import train
from relayrl.observe import StageTimer, read_metrics
from relayrl.observe.trace import Tracer, merge_traces, open_tracer, trace_dir

from helpers import group_cfg


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class RecordingSink:
    """A tracer whose clock the test moves by hand."""

    def __init__(self) -> None:
        self.ns = 1_000
        self.spans: list[tuple[str, int, int]] = []

    def now_ns(self) -> int:
        return self.ns

    def record(self, name, start_ns, end_ns, args=None) -> None:
        self.spans.append((name, start_ns, end_ns))


@pytest.mark.unit
def test_stage_timer_records_each_entry_as_a_span_and_keeps_its_totals():
    clock, sink = FakeClock(), RecordingSink()
    timer = StageTimer(clock=clock, tracer=sink)
    with timer.stage("rollout"):
        clock.t += 2.0
        sink.ns += 2_000
    sink.ns += 500
    with timer.stage("rollout"):
        clock.t += 1.0
        sink.ns += 1_000
    assert timer.pop() == {"time/rollout": 3.0}
    assert sink.spans == [("rollout", 1_000, 3_000), ("rollout", 3_500, 4_500)]
    timer.tracer = None  # detached: totals only
    with timer.stage("update"):
        clock.t += 1.0
    assert timer.pop() == {"time/update": 1.0} and len(sink.spans) == 2


@pytest.mark.unit
def test_merge_writes_a_chrome_trace_in_microseconds_with_named_processes(tmp_path):
    d = trace_dir(tmp_path)
    drv, w1, w0 = Tracer(d, "driver"), Tracer(d, "actor", 1), Tracer(d, "actor", 0)
    base = 1_700_000_000_000_000_000
    drv.record("step", base, base + 10_000_000, {"step": 1})
    drv.record("update", base + 6_000_000, base + 9_000_000)
    w0.record("actor.update", base + 6_500_000, base + 8_500_500, {"rank": 0})
    w1.record("actor.update", base + 6_600_000, base + 8_400_000, {"rank": 1})
    for t in (drv, w0, w1):
        t.close()
    with open(w1.path, "a") as f:
        f.write('{"name": "cut short by a kill", "t0": 1')  # a half-written last line is skipped

    trace = json.loads(merge_traces(tmp_path).read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == ["actor rank 0", "actor rank 1", "driver"]
    assert names[1] == "driver"  # listed first
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(names[e["pid"]], e["name"], e["ts"], e["dur"]) for e in spans] == [
        ("driver", "step", 0.0, 10_000.0),
        ("driver", "update", 6_000.0, 3_000.0),
        ("actor rank 0", "actor.update", 6_500.0, 2_000.5),
        ("actor rank 1", "actor.update", 6_600.0, 1_800.0),
    ]
    assert spans[0]["args"] == {"step": 1} and spans[2]["args"] == {"rank": 0}
    assert trace["otherData"]["t0_unix_us"] == base / 1000
    threads = [e for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert len(threads) == 3 and all(e["ph"] == "M" for e in threads)


@pytest.mark.unit
def test_merge_refuses_a_damaged_middle_line_and_a_run_without_spans(tmp_path):
    with pytest.raises(UserError, match="no trace spans"):
        merge_traces(tmp_path)
    t = Tracer(trace_dir(tmp_path), "driver")
    t.record("a", 1, 2)
    t.close()
    with open(t.path, "a") as f:
        f.write("{broken\n")
        f.write(json.dumps({"name": "b", "t0": 3, "t1": 4}) + "\n")
    with pytest.raises(UserError, match="line 4 is not valid JSON"):
        merge_traces(tmp_path)


@pytest.mark.unit
def test_tracing_off_records_nothing(tmp_path):
    t = open_tracer(None, "driver")
    with t.span("x"):
        pass
    t.close()
    assert not trace_dir(tmp_path).exists()


def _within(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


@pytest.mark.e2e
def test_a_run_on_two_worker_ranks_traces_driver_and_workers_on_one_timeline(tmp_path, capsys):
    before = dict(os.environ)
    out = train(group_cfg(tmp_path, "run", backend="local", dp_shard=2), show_progress=False)
    assert dict(os.environ) == before  # the directory travels as an argument: nothing leaks to the next run
    run_dir = out["run_dir"]
    files = sorted(p.name.rsplit("-", 2)[0] for p in trace_dir(run_dir).glob("*.jsonl"))
    assert files == ["actor-0", "actor-1", "driver-0"]

    assert main(["report", run_dir, "--trace"]) == 0
    path = capsys.readouterr().out.strip()
    assert path == os.path.join(run_dir, "report", "trace.json")
    trace = json.loads(open(path).read())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == ["actor rank 0", "actor rank 1", "driver"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and isinstance(e["tid"], int) for e in spans)
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
    by = {who: [e for e in spans if names[e["pid"]] == who] for who in names.values()}

    steps = [e for e in by["driver"] if e["name"] == "step"]
    assert [s["args"]["step"] for s in steps] == [1, 2]
    stages = [e for e in by["driver"] if e["name"] not in ("step", "eval", "checkpoint")]
    # the stages the driver timed (its metrics' time/* keys, but a stage's parts: sync_transfer and
    # sync_verify are the weight sync's own figures, inside the sync stage) are the spans inside each step
    timed = {k.removeprefix("time/") for m in read_metrics(run_dir) if "time/step" in m for k, v in m.items()
             if k.startswith("time/") and k != "time/step" and v > 0}
    timed = {k for k in timed if not any(k.startswith(t + "_") for t in timed)}
    assert {"sync", "rollout", "reward", "ref_logp", "update"} <= {e["name"] for e in stages} == timed
    for stage in stages:
        assert sum(_within(stage, s) for s in steps) == 1, stage
    for step in steps:
        inside = [e for e in stages if _within(e, step)]
        assert abs(sum(e["dur"] for e in inside) - step["dur"]) <= 0.2 * step["dur"]  # the stages cover the step

    for rank in (0, 1):
        calls = by[f"actor rank {rank}"]
        assert {"construct TrainerProcess", "actor.update"} <= {e["name"] for e in calls}
        assert all(e["args"]["rank"] == rank for e in calls)
        updates = [e for e in calls if e["name"].endswith(".update")]
        assert len(updates) == len(steps)
        for step, upd in zip(steps, updates, strict=True):  # each rank's update inside its step and stage
            assert _within(upd, step)
            assert any(_within(upd, s) for s in stages if s["name"] == "update")


@pytest.mark.e2e
def test_report_trace_on_a_run_without_spans_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["report", str(tmp_path), "--trace"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("relayrl: error:") and "run.trace" in err and "\n" not in err
