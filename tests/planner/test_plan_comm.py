"""relayrl.planner's communication, transient buffers and step time against hand-computed numbers from the
formulas in the module docstrings of relayrl/planner/comm.py, activations.py and compute.py. The DDP / TP
all-reduce and FSDP all-gather bytes are tests/planner/test_plan_memory.py's (test_collectives_bytes_and_links)."""

from __future__ import annotations

import pytest

from relayrl.models.config import ModelShape
from relayrl.planner import Layout, Workload
from relayrl.planner.activations import transient_terms
from relayrl.planner.comm import Network, step_collectives
from relayrl.planner.compute import bubble, step_time
from relayrl.planner.memory import stage_summary
from relayrl.sync.presets import preset

pytestmark = pytest.mark.unit

# qwen2.5-7b: h 3584, 28 layers, q = 28 x 128 = 3584, kv = 4 x 128 = 512
Q7 = preset("qwen2.5-7b")
W = Workload(seq=1024, micro_batch=1, num_micro_batches=2)  # bf16: e = P = G = 2, m = 2
NET8 = Network(gpus_per_node=8, intra_bw=400.0, inter_bw=25.0)
NET4 = Network(gpus_per_node=4, intra_bw=400.0, inter_bw=25.0)

# a hand-built shape with q/k/v biases, untied: h 16, I 24, 2 layers, 4 heads of 4 (q 16), 2 KV heads (kv 8), V 32
S = ModelShape(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=4, qkv_bias=True)
# one layer: in_ln 16, q 16x16 + 16, k 8x16 + 8, v 8x16 + 8, o 16x16, post_ln 16, gate/up 24x16, down 16x24
LAYER = 16 + (16 * 16 + 16) + 2 * (8 * 16 + 8) + 16 * 16 + 16 + 3 * 24 * 16  # 1984
ROOT = 32 * 16 + 16 + 32 * 16  # embed, norm, lm_head: 1040
# TP 2: q 8x16 + 8, k / v 4x16 + 4, o 16x8, gate/up 12x16, down 16x12; norms replicated; embed / lm_head 16 rows
LAYER_TP2 = 16 + (8 * 16 + 8) + 2 * (4 * 16 + 4) + 16 * 8 + 16 + 3 * 12 * 16  # 1008
ROOT_TP2 = 16 * 16 + 16 + 16 * 16  # 528
WS = Workload(seq=8, micro_batch=2, num_micro_batches=4)  # bf16, e = 2, b = 2, s = 8, m = 4


def _by_name(colls):
    return {c.name: c for c in colls}


def _check_link(c, net, crosses):
    assert c.crosses_nodes is crosses
    bw = net.inter_bw if crosses else net.intra_bw
    assert c.seconds == pytest.approx(c.bytes / (bw * 1e9))


# ---- comm.step_collectives ----

@pytest.mark.parametrize("mode", ["zero1", "zero2"])
def test_zero_reduce_scatter_and_all_gather_once_per_step(mode):
    elems = (1_000_000, 400_000)  # (all, trained): the all-gather sends the updated (trained) params only
    for m in (2, 8):  # once per step: the micro-batch count does not matter
        w = Workload(seq=1024, micro_batch=1, num_micro_batches=m)
        c = _by_name(step_collectives(Q7, Layout(dp_shard=4, dp_mode=mode), w, NET8, elems, 28))
        assert set(c) == {"zero grad reduce-scatter", "zero param all-gather"}
        assert c["zero grad reduce-scatter"].bytes == 3 / 4 * 400_000 * 2 == 600_000
        assert c["zero param all-gather"].bytes == 3 / 4 * 400_000 * 2 == 600_000
        for x in c.values():
            assert x.overlapped and x.size == 4
            _check_link(x, NET8, False)  # 4 ranks at stride 1 <= 8
    # tp 2: the shard group of 4 sits at stride 2, 2 x 4 = 8 ranks: one node of 8, two nodes of 4
    c8 = _by_name(step_collectives(Q7, Layout(dp_shard=4, tp=2, dp_mode=mode), W, NET8, elems, 28))
    c4 = _by_name(step_collectives(Q7, Layout(dp_shard=4, tp=2, dp_mode=mode), W, NET4, elems, 28))
    _check_link(c8["zero grad reduce-scatter"], NET8, False)
    _check_link(c4["zero grad reduce-scatter"], NET4, True)
    assert c4["zero param all-gather"].seconds == pytest.approx(600_000 / 25e9)


def test_hsdp_replica_grad_all_reduce():
    elems = (1_000_000, 1_000_000)
    lay = Layout(dp_replicate=2, dp_shard=4, dp_mode="fsdp")
    c8 = _by_name(step_collectives(Q7, lay, W, NET8, elems, 28))
    rep = c8["replica grad all-reduce"]
    # per micro-batch (m = 2): 2 (r-1)/r x the grad shard (1e6 x 2 B / 4)
    assert rep.bytes == 2 * 2 * (2 - 1) / 2 * (1_000_000 * 2 / 4) == 1_000_000
    assert rep.overlapped and rep.size == 2
    _check_link(rep, NET8, False)  # stride 4 x 2 = 8 <= 8
    _check_link(_by_name(step_collectives(Q7, lay, W, NET4, elems, 28))["replica grad all-reduce"], NET4, True)
    # the shard group's own traffic stays inside the node of 4
    _check_link(_by_name(step_collectives(Q7, lay, W, NET4, elems, 28))["fsdp grad reduce-scatter"], NET4, False)
    # ZeRO with replicas: once per step
    z = _by_name(step_collectives(Q7, Layout(dp_replicate=2, dp_shard=4, dp_mode="zero1"), W, NET8, elems, 28))
    assert z["replica grad all-reduce"].bytes == 2 * (2 - 1) / 2 * (1_000_000 * 2 / 4) == 500_000


def test_pp_p2p():
    elems = (1000, 1000)
    p = _by_name(step_collectives(Q7, Layout(pp=2, dp_mode="ddp"), W, NET8, elems, 14))["pp p2p"]
    assert p.bytes == 2 * 2 * 2 * 1024 * 1 * 3584  # 2 m x e s b h
    assert not p.overlapped
    _check_link(p, NET8, False)
    lay = Layout(pp=2, tp=4, sp=True, dp_mode="ddp")  # SP: the boundary carries the sequence shard, / t
    p8 = _by_name(step_collectives(Q7, lay, W, NET8, elems, 14))["pp p2p"]
    p4 = _by_name(step_collectives(Q7, lay, W, NET4, elems, 14))["pp p2p"]
    assert p8.bytes == p4.bytes == 2 * 2 * 2 * 1024 * 1 * 3584 / 4
    _check_link(p8, NET8, False)  # stride 4 x 2 = 8
    _check_link(p4, NET4, True)
    assert p4.seconds == pytest.approx(2 * 2 * 2 * 1024 * 3584 / 4 / 25e9)


def test_cp_ring_and_ulysses():
    elems = (1000, 1000)
    full = Workload(seq=1024, micro_batch=1, num_micro_batches=2, recompute="full")
    ring = Layout(cp=4, tp=2, dp_mode="ddp")  # s = 1024 / 4 = 256 per rank
    ring_fwd = (4 - 1) * 2 * 2 * 256 * 1 * 512 / 2  # (c-1) x 2 e (s/c) b kv / t per layer per micro-batch
    r = _by_name(step_collectives(Q7, ring, W, NET8, elems, 28))["cp ring"]
    assert r.bytes == 28 * 2 * 3 * ring_fwd == 132_120_576  # 3x the forward with backward
    assert not r.overlapped
    rf = _by_name(step_collectives(Q7, ring, full, NET8, elems, 28))["cp ring"]
    assert rf.bytes == 28 * 2 * 4 * ring_fwd  # the recomputed forward passes K, V again
    uly = Layout(cp=4, tp=2, dp_mode="ddp", cp_mode="ulysses")
    uly_fwd = (4 - 1) / 4 * 2 * 256 * 1 * (2 * 3584 + 2 * 512) / 2  # (c-1)/c e (s/c) b (2q + 2kv) / t
    u = _by_name(step_collectives(Q7, uly, W, NET8, elems, 28))["cp ulysses"]
    assert u.bytes == 28 * 2 * 2 * uly_fwd == 176_160_768  # forward and backward
    uf = _by_name(step_collectives(Q7, uly, full, NET8, elems, 28))["cp ulysses"]
    assert uf.bytes == 28 * 2 * 3 * uly_fwd
    # link: cp 4 at stride tp 2 spans 8 ranks
    _check_link(r, NET8, False)
    r4 = _by_name(step_collectives(Q7, ring, W, NET4, elems, 28))["cp ring"]
    _check_link(r4, NET4, True)
    assert r4.seconds == pytest.approx(28 * 2 * 3 * ring_fwd / 25e9)
    # cp 2 x tp 2 = 4 ranks fits a node of 4
    _check_link(_by_name(step_collectives(Q7, Layout(cp=2, tp=2, dp_mode="ddp"), W, NET4, elems, 28))["cp ring"],
                NET4, False)


def test_tp_full_recompute_reruns_the_forward_all_reduces():
    lay = Layout(tp=4, sp=True, dp_mode="ddp")  # SP: all-gather + reduce-scatter, the same bytes
    full = Workload(seq=1024, micro_batch=1, num_micro_batches=2, recompute="full")
    c = [x for x in step_collectives(Q7, lay, full, NET8, (1000, 1000), 28) if x.name.startswith("tp all-reduce")]
    assert c[0].bytes == 28 * 2 * 6 * 2 * 3 / 4 * 2 * 1024 * 1 * 3584


# ---- memory.stage_summary and activations.transient_terms ----

def test_stage_summary_counts_by_hand():
    assert stage_summary(S, Layout(dp_shard=2), WS, 0) == ((ROOT + 2 * LAYER,) * 2, (LAYER,) * 2, (ROOT,) * 2, (0, 0))
    assert stage_summary(S, Layout(tp=2), WS, 0)[1:3] == ((LAYER_TP2,) * 2, (ROOT_TP2,) * 2)
    # pp 2: stage 0 has the embedding, stage 1 the norm and lm_head
    assert stage_summary(S, Layout(pp=2), WS, 0)[0] == (32 * 16 + LAYER,) * 2
    assert stage_summary(S, Layout(pp=2), WS, 1)[2] == (16 + 32 * 16,) * 2


def _terms(layout, w=WS, stage=0):
    return {n: v for n, v, _ in transient_terms(S, layout, w, stage)}


def test_fsdp_gathered_layers_root_and_grad_input():
    t = _terms(Layout(dp_shard=2))
    assert t["fsdp gathered layers"] == 2 * 1984 * 2 == 2 * LAYER * 2
    assert t["fsdp gathered root"] == 1040 * 2
    assert t["fsdp grad reduce-scatter input"] == 1984 * 2
    assert t["logits temporaries"] == 2 * 8 * 32 * (2 + 4)  # b s V (e + 4)
    assert set(t) == {"fsdp gathered layers", "fsdp gathered root", "fsdp grad reduce-scatter input",
                      "logits temporaries"}
    assert _terms(Layout(dp_shard=2, dp_mode="zero2")) == {"zero2 grad bucket": 1984 * 2,
                                                           "logits temporaries": 2 * 8 * 32 * 6}
    # pp 2, stage 0: no logits; its root is the embedding alone
    t0 = _terms(Layout(dp_shard=2, pp=2))
    assert t0["fsdp gathered root"] == 32 * 16 * 2 and "logits temporaries" not in t0


def test_sp_gradient_and_tp_logits():
    t = _terms(Layout(dp_shard=2, tp=2, sp=True))
    assert t["fsdp gathered layers"] == 2 * 1008 * 2 and t["fsdp gathered root"] == 528 * 2
    assert t["sp all-gather gradient"] == 2 * 8 * 2 * 16  # e s b h
    assert t["logits temporaries"] == 2 * 8 * 32 / 2 * (2 + 4)  # b s V / t (e + 4)


def test_cp_buffers():
    ring = _terms(Layout(cp=2, dp_mode="ddp"))  # s / cp = 4
    assert ring["cp ring kv buffers"] == 2 * 2 * 2 * 4 * 2 * 8  # 2 x 2 e (s/cp) b kv / t
    assert ring["logits temporaries"] == 2 * 4 * 32 * 6
    uly = _terms(Layout(cp=2, tp=2, dp_mode="ddp", cp_mode="ulysses"))
    assert uly["cp all-to-all buffers"] == 2 * 4 * 2 * (2 * 16 + 2 * 8) / 2  # e (s/cp) b (2q + 2kv) / t


def test_recomputed_layer_under_full_recompute():
    full = Workload(seq=8, micro_batch=2, num_micro_batches=4, recompute="full")
    e, s, b, h, q, kv, inter, a = 2, 8, 2, 16, 16, 8, 24, 4
    one = (2 * e * s * b * h  # norm inputs
           + 2 * e * s * b * h + 2 * 4 * s * b  # norm outputs and fp32 rsqrt
           + 2 * e * s * b * h  # q/k/v and gate/up inputs
           + e * s * b * (q + 2 * kv) + e * s * b * q  # q, k, v after RoPE; attention output
           + 4 * e * s * b * inter  # SwiGLU
           + 4 * a * s * b + e * b * s * s)  # sdpa's logsumexp; sdpa's additive mask
    assert one == 8320
    assert _terms(Layout(), full)["recomputed layer"] == 8320
    assert "recomputed layer" not in _terms(Layout())


# ---- compute.step_time and bubble ----

# S: N = 2 x (q 16x16 + k, v 2 x 8x16 + o 16x16 + 3 x 24x16) + lm_head 32x16 (untied embedding: a lookup)
N = 2 * (16 * 16 + 2 * 8 * 16 + 16 * 16 + 3 * 24 * 16) + 32 * 16  # 4352
MODEL_FPT = 6 * N + 12 * 2 * 16 * 8  # 6N + 12 L q s = 29184
FULL_FPT = MODEL_FPT + 2 * N + 4 * 2 * 16 * 8  # 38912


def test_bubble():
    assert bubble(Layout(pp=2), 4) == 1 / 5 and bubble(Layout(pp=4), 4) == 3 / 7 and bubble(Layout(), 4) == 0


def test_step_time_compute_bound():
    lay = Layout(dp_shard=2, pp=2)  # world 4, dp 2; m = 4, bubble 1/5
    st = step_time(S, lay, WS, 1.0, exposed_s=1e-6, overlapped_s=1e-6, efficiency=0.5)
    assert st.tokens == 2 * 4 * 2 * 8 == 128
    assert st.model_flops == st.hardware_flops == 128 * 29184 == 128 * MODEL_FPT
    assert st.compute_s == pytest.approx(128 * 29184 / (4 * 1e12 * 0.5))
    assert st.bubble == 1 / 5
    step = 128 * 29184 / (4 * 1e12 * 0.5) / (1 - 1 / 5) + 1e-6  # 3.33472e-6 > the overlapped 1e-6
    assert st.step_s == pytest.approx(step) and st.step_s == pytest.approx(3.33472e-6)
    assert st.mfu == pytest.approx(128 * 29184 / (step * 4 * 1e12))
    # a tied embedding is counted once, as the lm_head: the same N
    tied = ModelShape(**{**S.__dict__, "tie_word_embeddings": True})
    assert step_time(tied, lay, WS, 1.0, 1e-6, 1e-6, 0.5).model_flops == 128 * MODEL_FPT


def test_step_time_overlapped_comm_dominates_full_recompute():
    full = Workload(seq=8, micro_batch=2, num_micro_batches=4, recompute="full")
    st = step_time(S, Layout(dp_shard=2, pp=2), full, 1.0, exposed_s=1e-6, overlapped_s=1e-3, efficiency=0.5)
    assert st.model_flops == 128 * 29184
    assert st.hardware_flops == 128 * 38912 == 128 * FULL_FPT  # + 2N + 4 L q s
    assert st.compute_s == pytest.approx(128 * 38912 / (4 * 1e12 * 0.5))
    assert st.step_s == 1e-3  # 2.490368e-6 / 0.8 + 1e-6 < 1e-3
    assert st.mfu == pytest.approx(128 * 29184 / (1e-3 * 4 * 1e12))
    sel = Workload(seq=8, micro_batch=2, num_micro_batches=4, recompute="selective")
    assert step_time(S, Layout(), sel, 1.0, 0, 0).hardware_flops == 4 * 2 * 8 * (MODEL_FPT + 4 * 2 * 16 * 8)
