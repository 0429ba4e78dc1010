"""The planner's six pipeline schedules (relayrl.planner.layout / compute.bubble / activations.in_flight / memory):

- the placement table equals relayrl.parallel.pipeline_stages' (the planner may not import it);
- bubbles and micro-batches in flight by hand, for every schedule;
- both against torch's own action orders (torch.distributed.pipelining's pipeline_order for the four multi-stage
  schedules), simulated at unit forward, input-gradient and weight-gradient times;
- the tensors a pp rank holds (two stages per rank, loop and V placement, tied and untied) equal what
  relayrl.models.stage.split_model cuts for relayrl.parallel.pipeline_stages.schedule_stages, parameter for
  parameter, and the AdamW state of those stages after one step equals the planned bytes;
- torch's rules on micro-batches and layers as one-line ConfigErrors, and the search keeping only what can run;
- the planned bubbles against benchmarks/RESULTS.md's measured idle shares (pp = 2).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.pipelining.schedules import _ComputationType as Op

from relayrl.errors import ConfigError
from relayrl.models import CausalLM
from relayrl.models.config import ModelShape
from relayrl.models.stage import split_model
from relayrl.parallel import pipeline_stages
from relayrl.planner import Layout, Workload, train_memory
from relayrl.planner.activations import activation_terms, in_flight
from relayrl.planner.comm import pp_sends
from relayrl.planner.compute import bubble
from relayrl.planner.layout import PP_SCHEDULES, SCHEDULE_STAGES
from relayrl.planner.memory import rank_layers, stage_tensors
from relayrl.planner.search import layouts, schedules
from tests.helpers import small_config

pytestmark = pytest.mark.unit

MULTI = ("interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
TORCH_NAMES = {"interleaved_1f1b": "Interleaved1F1B", "interleaved_zb": "InterleavedZeroBubble",
               "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
FP32 = Workload(seq=6, micro_batch=1, dtype="float32", mixed_precision=False)


def test_placement_is_the_trainers():
    from relayrl.parallel.config import PP_SCHEDULES as TRAINER_SCHEDULES

    assert SCHEDULE_STAGES == pipeline_stages.SCHEDULE_STAGES and set(PP_SCHEDULES) == set(TRAINER_SCHEDULES)
    for name in PP_SCHEDULES:
        for p in (2, 3, 4):
            lay = Layout(pp=p, pp_schedule=name)
            for r in range(p):
                assert (lay.rank_stages(r), lay.num_stages) == pipeline_stages.schedule_stages(name, r, p)
    assert Layout(pp=4, pp_schedule="zbv").rank_stages(0) == (0, 7)  # V: rank 0 holds the first and the last
    assert Layout(pp=4, pp_schedule="interleaved_zb").rank_stages(1) == (1, 5)


def test_bubble_by_hand():
    p, m = 4, 8
    got = {name: bubble(Layout(pp=p, pp_schedule=name), m) for name in PP_SCHEDULES}
    assert got == {"gpipe": 3 / 11, "1f1b": 3 / 11, "interleaved_1f1b": 3 / 19,  # (p-1)/(2m+p-1)
                   "interleaved_zb": 3 / 51, "zbv": 3 / 51,  # (p-1)/(6m+p-1)
                   "dualpipev": 3 / 27}  # (p-1)/(3m+p-1)
    assert bubble(Layout(pp=2, pp_schedule="dualpipev"), 4) == 1 / 13
    # outside the regime the schedule fills: the 1F1B figure
    assert bubble(Layout(pp=4, pp_schedule="zbv"), 4) == 3 / 7
    assert bubble(Layout(pp=4, pp_schedule="interleaved_1f1b"), 2) == 3 / 5
    assert bubble(Layout(pp=1, pp_schedule="zbv"), 8) == 0.0


def test_in_flight_by_hand():
    def fly(name, r, p=4, m=8):
        return in_flight(Layout(pp=p, pp_schedule=name), m, r)

    assert [fly("gpipe", r) for r in (0, 3)] == [(8,), (8,)]
    assert [fly("1f1b", r) for r in (0, 3)] == [(4,), (1,)]
    # torch's warm-up k + 2(p-1-r) forwards then one more, in blocks of k = 4 (stage r first)
    assert [fly("interleaved_1f1b", r) for r in range(4)] == [(7, 4), (5, 4), (4, 3), (4, 1)]
    assert fly("interleaved_1f1b", 0, m=4) == (4, 4)  # capped by the m micro-batches of each stage
    assert fly("interleaved_1f1b", 0, m=10) == (7, 5)  # k = 10 // 2 = 5
    assert [fly("interleaved_zb", r) for r in (0, 3)] == [(4, 4), (4, 4)]
    assert [fly("zbv", r) for r in range(4)] == [(7, 1), (6, 2), (5, 3), (4, 4)]  # 2p in all, as 1F1B's p x 2 chunks
    assert [fly("dualpipev", r) for r in range(4)] == [(8, 1), (7, 2), (6, 3), (5, 4)]  # 2p + 1
    assert fly("1f1b", 0, p=1) == (1,)


def _simulate(name: str, p: int, m: int) -> tuple[float, list[tuple[int, int]]]:
    """torch's action order for `name` at unit times (F = B_input = W = 1, a full backward 2): the mean idle share
    of the ranks over the step, and each rank's per-stage micro-batches in flight (F to its last backward) at its
    peak (counted in the rank's action order)."""
    # torch's private helper that builds a schedule over mock stages: skip, not fail, if a torch release drops it
    viz = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    ops = [[a for a in rank if a is not None] for rank in viz.get_schedule_ops(TORCH_NAMES[name], p, m, 2)]
    cost = {Op.FORWARD: 1, Op.FULL_BACKWARD: 2, Op.BACKWARD_INPUT: 1, Op.BACKWARD_WEIGHT: 1}
    last = 2 * p - 1
    done: dict[tuple[str, int, int], float] = {}
    clock, busy, pos = [0.0] * p, [0.0] * p, [0] * p
    while any(pos[r] < len(ops[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(ops[r]):
                a = ops[r][pos[r]]
                subs = a.sub_actions if a.computation_type == Op.OVERLAP_F_B else [a]
                subs = [x for x in subs if x.computation_type in cost]
                deps = []
                for x in subs:
                    c, s, mb = x.computation_type, x.stage_index, x.microbatch_index
                    if c == Op.FORWARD and s > 0:
                        deps.append(("F", s - 1, mb))
                    if c in (Op.FULL_BACKWARD, Op.BACKWARD_INPUT):
                        deps += [("F", s, mb)] + ([("B", s + 1, mb)] if s < last else [])
                    if c == Op.BACKWARD_WEIGHT:
                        deps.append(("B", s, mb))
                if any(d not in done for d in deps):
                    break
                t = sum(cost[x.computation_type] for x in subs)
                end = max([clock[r]] + [done[d] for d in deps]) + t
                clock[r], busy[r] = end, busy[r] + t
                for x in subs:
                    kind = "F" if x.computation_type == Op.FORWARD else "B"
                    if x.computation_type != Op.BACKWARD_WEIGHT:
                        done[(kind, x.stage_index, x.microbatch_index)] = end
                pos[r] += 1
                moved = True
        assert moved, f"{name} p={p} m={m}: the simulated order deadlocked"
    span = max(clock)
    peaks = []
    for r in range(p):
        stages = Layout(pp=p, pp_schedule=name).rank_stages(r)
        live, best = Counter(), (0, (0, 0))
        for a in ops[r]:
            for x in (a.sub_actions if a.computation_type == Op.OVERLAP_F_B else [a]):
                if x.computation_type == Op.FORWARD:
                    live[x.stage_index] += 1
                elif x.computation_type in (Op.FULL_BACKWARD, Op.BACKWARD_WEIGHT):
                    live[x.stage_index] -= 1
                if sum(live.values()) > best[0]:
                    best = (sum(live.values()), tuple(live[s] for s in stages))
        peaks.append(best[1])
    return sum(1 - b / span for b in busy) / p, peaks


CASES = [(name, p, m) for name in MULTI for p, m in ((2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 5), (4, 8), (4, 12))
         if Layout(pp=p, pp_schedule=name).schedule_error(m) is None]


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_bubble_and_in_flight_equal_torchs_schedule_orders(name, p, m):
    idle, peaks = _simulate(name, p, m)
    lay = Layout(pp=p, pp_schedule=name)
    filled = m >= (2 * p if name == "zbv" else p)
    if filled:
        assert bubble(lay, m) == pytest.approx(idle, abs=1e-12)
    else:  # torch's order cannot fill: the planner's 1F1B figure bounds it
        assert idle <= bubble(lay, m) == (p - 1) / (m + p - 1)
    assert [in_flight(lay, m, r) for r in range(p)] == peaks


def _real_holdings(cfg, name: str, p: int, r: int) -> Counter:
    model = CausalLM(cfg)
    stage_ids, num_stages = pipeline_stages.schedule_stages(name, r, p)
    held = Counter()
    for stage in split_model(model, stage_ids, num_stages):
        for n, prm in stage.named_parameters():
            held[(n, tuple(prm.shape))] += 1
    return held


@pytest.mark.parametrize("name", ["interleaved_1f1b", "zbv", "dualpipev"])
@pytest.mark.parametrize("tied", [True, False])
def test_rank_tensors_equal_split_model(name, tied):
    """5 layers over 4 stages (2, 1, 1, 1): rank 0 of a loop holds stages 0 and 2 (layers 0, 1, 3), of a V stages 0
    and 3 (layers 0, 1, 4, the embedding and the lm_head, its own copy when tied)."""
    cfg = small_config(num_hidden_layers=5, tie_word_embeddings=tied)
    shape, p = ModelShape.of(cfg), 2
    lay = Layout(pp=p, pp_schedule=name)
    for r in range(p):
        real = _real_holdings(cfg, name, p, r)
        planned = Counter((n, shp) for n, shp, _ in stage_tensors(shape, lay, FP32, r, 0))
        embed = ("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        if tied and planned[embed] > int(0 in lay.rank_stages(r)):  # the planner names the lm_head copy after
            planned[embed] -= 1                                     # the tensor it copies
            planned[("lm_head.weight", embed[1])] += 1
        assert +planned == real, f"{name} rank {r}"
    v0 = {n for n, _ in _real_holdings(cfg, name, p, 0)}
    expect = [0, 1, 4] if name != "interleaved_1f1b" else [0, 1, 3]
    assert rank_layers(5, lay, 0) == expect
    assert {int(n.split(".")[2]) for n in v0 if n.startswith("model.layers.")} == set(expect)


def test_v_rank_zero_state_bytes_equal_adamw_on_its_stages():
    """AdamW over rank 0's two V stages (tied: the embedding and the lm_head copy): params, grads and optimizer
    state bytes as planned, fp32, one process per pp rank."""
    cfg = small_config(num_hidden_layers=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    stages = split_model(CausalLM(cfg), (0, 3), 4)
    params = [prm for st in stages for prm in st.parameters()]
    sum(prm.sum() for prm in params).backward()
    opt = torch.optim.AdamW(params)
    opt.step()
    held = dict(params=sum(prm.numel() * 4 for prm in params), grads=sum(prm.grad.numel() * 4 for prm in params),
                optim=sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()))
    plan = train_memory(ModelShape.of(cfg), Layout(pp=2, pp_schedule="zbv"),
                        Workload(seq=6, micro_batch=1, dtype="float32", mixed_precision=False), rank=0)
    assert dict(params=plan.params, grads=plan.grads, optim=plan.optim) == held


def test_two_stage_activations_sum_both_stages():
    """zbv, p = 2, m = 8, 4 layers (one per stage): rank 0 keeps 3 micro-batches of stage 0 and 1 of stage 3 (the
    last: the head's terms once), rank 1 keeps 2 of stage 1 and 2 of stage 2."""
    shape = ModelShape.of(small_config(num_hidden_layers=4))
    w = Workload(seq=6, micro_batch=1, dtype="float32", mixed_precision=False, num_micro_batches=8)
    one = dict((n, v) for n, v, _ in activation_terms(shape, Layout(), w, 0))["swiglu"] / 4  # per layer, one mb
    lay = Layout(pp=2, pp_schedule="zbv")
    r0 = dict((n, v) for n, v, _ in activation_terms(shape, lay, w, 0))
    r1 = dict((n, v) for n, v, _ in activation_terms(shape, lay, w, 1))
    assert (r0["swiglu"], r1["swiglu"]) == (4 * one, 4 * one)
    assert "log-softmax" in r0 and "log-softmax" not in r1
    assert r0["log-softmax"] == dict((n, v) for n, v, _ in activation_terms(shape, Layout(), w, 0))["log-softmax"]
    assert pp_sends(lay) == 1 and pp_sends(Layout(pp=4, pp_schedule="zbv")) == 2
    assert pp_sends(Layout(pp=2, pp_schedule="interleaved_1f1b")) == 2 and pp_sends(Layout(pp=2)) == 1


def test_torchs_rules_refuse_in_one_line_and_the_search_keeps_what_runs():
    shape = ModelShape.of(small_config(num_hidden_layers=6))
    w4 = Workload(seq=6, micro_batch=1, dtype="float32", mixed_precision=False, num_micro_batches=4)
    cases = {("dualpipev", 3): "dualpipev needs micro-batches >= stages (2 x pp = 6), got 4",
             ("zbv", 4): "makes 8 stages (2 per rank), more than the model's 6 decoder layers",
             ("1f1b", 5): "1f1b needs micro-batches >= pp: 4 < 5"}
    for (name, p), msg in cases.items():
        with pytest.raises(ConfigError, match="layout .*" + msg.replace("(", r"\(").replace(")", r"\)")) as e:
            train_memory(shape, Layout(pp=p, pp_schedule=name), w4)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="multiple of its rounds max"):
        bubble(Layout(pp=4, pp_schedule="interleaved_zb"), 9)
    with pytest.raises(ConfigError, match="pp_schedule must be one of"):
        Layout(pp=2, pp_schedule="zb-h2")
    assert schedules(shape, 2, 4) == list(PP_SCHEDULES)
    assert schedules(shape, 4, 4) == ["gpipe", "1f1b"]  # 8 stages > 6 layers; dualpipev needs m >= 8
    assert schedules(shape, 3, 4) == ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]  # m < 6
    found = {(lay.pp, lay.pp_schedule) for lay in layouts(shape, 4, 4, seq=6, m=4)}
    assert found == {(1, "1f1b"), *((2, s) for s in PP_SCHEDULES), (4, "gpipe"), (4, "1f1b")}


# benchmarks/RESULTS.md 'Pipeline parallelism', pp = 2 (2 free-ish cores; pp = 4 time-sliced 4 ranks on 2 cores
# and measured no bubble): the measured idle share per (m, schedule)
MEASURED_PP2 = {4: {"gpipe": 0.347, "1f1b": 0.340, "interleaved_1f1b": 0.252, "interleaved_zb": 0.213, "zbv": 0.260,
                    "dualpipev": 0.159},
                8: {"gpipe": 0.192, "1f1b": 0.190, "interleaved_1f1b": 0.208, "interleaved_zb": 0.223, "zbv": 0.154,
                    "dualpipev": 0.144}}


def test_planned_bubbles_sit_under_the_measured_idle():
    """The plan counts no per-action cost; the CPU measurement does (gloo hops, torch's Python per action, the
    split backward walking the graph twice), so every measured idle share is above the plan, by 0.08 - 0.22."""
    for m, row in MEASURED_PP2.items():
        for name, measured in row.items():
            planned = bubble(Layout(pp=2, pp_schedule=name), m)
            assert 0.05 < measured - planned < 0.25, (m, name, planned, measured)
