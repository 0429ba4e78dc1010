"""The plan's rollout side: engine weights with LoRA (separate / merge) against the engine's own modules, and
the placement's search over engine TP degrees, on hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from relayrl.models.config import ModelConfig
from relayrl.planner.kv import engine_weight_bytes, engine_weight_terms
from relayrl.planner.memory import TrainMemory
from relayrl.planner.rollout import Engine, placement
from relayrl.sync.adapters import AdapterShape
from relayrl.sync.presets import preset

pytestmark = pytest.mark.unit

# tiny-gqa: V 32, h 32, I 64, 2 layers, 8 heads of 4 over 2 KV heads, qkv bias, tied embedding.
# Engine weights, bf16: tp 1: embed 1024 + norm 32 + 2 x (qkv 48x32 + bias 48 + o 32x32 + gate_up 128x32
# + down 32x64 + 2 norms 32) = 18688 elements; tp 2: 1024 + 32 + 2 x (24x32 + 24 + 32x16 + 64x32 + 32x32 + 64)
W1, W2 = 2 * 18688, 2 * 9936
# KV of one 64-token sequence, block 16: 63 KV tokens -> 4 blocks; 2 layers x K,V x kv heads x 4 x 2 B per token
SEQ1, SEQ2 = 4 * 16 * (2 * 2 * 2 * 4 * 2), 4 * 16 * (2 * 2 * 1 * 4 * 2)  # 4096, 2048


def _engine_held(shape, tp: int, lora: AdapterShape, mode: str) -> dict[str, int]:
    """Elements the engine's own model holds on rank 0: parameters (adapters apart) and merge's base copies."""
    from relayrl.engine.lora import enable_lora, lora_modules
    from relayrl.engine.model import EngineModel
    from relayrl.engine.parallel_state import TPInfo

    with torch.device("meta"):
        model = EngineModel(ModelConfig(model_type="qwen2", **shape.__dict__), TPInfo(0, tp))
        enable_lora(model, lora.rank, 2.0, lora.targets, mode)
    params = dict(model.named_parameters())
    return {"base": sum(p.numel() for n, p in params.items() if ".lora_" not in n),
            "adapters": sum(p.numel() for n, p in params.items() if ".lora_" in n),
            "merge copy": sum(m.lora_base.numel() for m in lora_modules(model) if hasattr(m, "lora_base"))}


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     ("q_proj", "v_proj", "down_proj"), ("up_proj",)])
@pytest.mark.parametrize("mode", ["separate", "merge"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_engine_weights_with_lora_are_the_engines(targets, mode, tp):
    shape, lora = preset("tiny-gqa"), AdapterShape(4, targets)
    held = _engine_held(shape, tp, lora, mode)
    planned = engine_weight_terms(shape, tp, "bfloat16", lora, mode)
    assert planned == {k: 2 * v for k, v in held.items()}
    assert (held["merge copy"] > 0) == (mode == "merge")


def test_engine_weights_by_hand():
    shape = preset("tiny-gqa")
    assert engine_weight_bytes(shape, 1, "bfloat16") == W1 and engine_weight_bytes(shape, 2, "bfloat16") == W2
    # rank 2 on q and down only, tp 1: qkv_proj.lora_A [2, 32] (q's A), lora_B [32, 2] (q's 32 rows);
    # down_proj.lora_A [2, 64], lora_B [32, 2]; per layer 64 + 64 + 128 + 64 = 320, 2 layers
    lora = AdapterShape(2, ("q_proj", "down_proj"))
    sep = engine_weight_terms(shape, 1, "bfloat16", lora, "separate")
    assert sep == {"base": W1, "adapters": 2 * 2 * 320, "merge copy": 0}
    # merge also clones the whole qkv_proj weight (48x32, its bias is not cloned) and down_proj (32x64)
    assert engine_weight_terms(shape, 1, "bfloat16", lora, "merge")["merge copy"] == 2 * 2 * (48 * 32 + 32 * 64)


def _mem(state: int, act: int = 0) -> TrainMemory:
    return TrainMemory(rank=0, params=state, grads=0, optim=0, activations=act, transient=0)


def test_placement_searches_engine_tp_degrees():
    shape, eng = preset("tiny-gqa"), Engine("bfloat16", seq=64)
    # 64 sequences: tp 1 needs 1e6 + W1 + 64 x 4096 = 1,299,520 B; tp 2 needs 1e6 + W2 + 64 x 2048 = 1,150,944 B
    p = placement(_mem(1_000_000), shape, 2, 2, 1_200_000, eng, 64, [])
    assert (p.where, p.engine_tp) == ("colocated", 2)
    assert "1 of 2 engine TP degrees fit" in p.reason
    # awake: (1.2e6 - 1e6 - W2) // 2048 = 87 sequences on the one tp-2 replica
    assert "holds 87 sequences" in p.reason
    # both fit: tp 1's two replicas hold 2 x 256 (max_num_seqs) against tp 2's 256
    p = placement(_mem(1_000_000), shape, 2, 2, 10_000_000, eng, 64, [])
    assert (p.where, p.engine_tp) == ("colocated", 1)
    # activations larger than the KV take its place in the max(): 1e6 + W2 + 160,000 > 1.15e6 fits neither
    p = placement(_mem(1_000_000, act=160_000), shape, 2, 2, 1_150_944, eng, 64, [])
    assert p.where == "disaggregated"
    assert placement(_mem(1_000_000), shape, 2, 2, 1_150_944, eng, 64, []).engine_tp == 2  # exactly at the limit


def test_placement_counts_the_merge_copy():
    shape = preset("tiny-gqa")
    lora = AdapterShape(2, ("q_proj", "down_proj"))
    extra = 2 * 2 * (48 * 32 + 32 * 64) // 2  # tp 2: half of qkv's rows (24 x 32) and of down's columns (32 x 32)
    sep = Engine("bfloat16", seq=64, lora=lora, lora_sync="separate")
    merge = Engine("bfloat16", seq=64, lora=lora, lora_sync="merge")
    assert merge.weights(shape, 2) - sep.weights(shape, 2) == extra
    mem = 1_000_000 + sep.weights(shape, 2) + 64 * SEQ2  # tp 2 fits exactly when separate
    assert placement(_mem(1_000_000), shape, 2, 2, mem, sep, 64, []).where == "colocated"
    assert placement(_mem(1_000_000), shape, 2, 2, mem, merge, 64, []).where == "disaggregated"


# qwen2.5-7b by hand: 28 layers of q 3584^2 + k, v 3584 x 512 + o 3584^2 + gate, up, down 3 x 3584 x 18944
# = 233,046,016 matmul weights (N_body 6,525,288,448); lm_head 152064 x 3584; 7,615,616,512 parameters in all
# (15,231,233,024 B in bf16 at engine TP 1); KV 2 x 28 x 4 x 128 x 2 B = 57,344 B per token
def test_decode_roofline_by_hand():
    from relayrl.planner.rollout import decode_time

    shape, eng = preset("qwen2.5-7b"), Engine("bfloat16", seq=2048)
    assert engine_weight_bytes(shape, 1, "bfloat16") == 15_231_233_024
    # one sequence at 1000 tokens of context: the weights and its KV read once, at half of 3350 GB/s
    step, bound = decode_time(shape, 1, 1, 1000, eng)
    assert bound == "memory" and step == pytest.approx((15_231_233_024 + 1000 * 57_344) / (3350e9 * 0.5))
    # 4096 sequences with no context yet: 2 N_body + 2 V h FLOPs each, at half of 989 TFLOP/s
    step, bound = decode_time(shape, 1, 4096, 0, eng)
    per_token = 2 * 6_525_288_448 + 2 * 152064 * 3584
    assert bound == "compute" and step == pytest.approx(4096 * per_token / (989e12 * 0.5))
    # TP 2 adds 2 all-reduces per layer of e x batch x h, 2 (t-1)/t of it per rank, at 450 GB/s
    step2, _ = decode_time(shape, 2, 4096, 0, eng)
    assert step2 == pytest.approx(step / 2 + 2 * 28 * 2 * 2 * 4096 * 3584 / 2 / 450e9)


def test_a_fleet_is_replicas_engines_of_tp_ranks_by_hand():
    """rollout.replicas N x rollout.tp T: N x T engine processes (a GPU each), one replica's memory T x (weights + KV
    per rank), the tokens per second of all N replicas; refused in one line when the ranks outnumber the GPUs."""
    from relayrl.errors import ConfigError
    from relayrl.planner.rollout import decode_time, fleet_option

    shape, eng = preset("tiny-gqa"), Engine("bfloat16", seq=64, max_num_seqs=8)
    # tp 1: a rank's KV budget 0.9 x 1e6 - W1 = 862,624 B = 842 blocks of 1024 B (16 tokens x 64 B), 4 per
    # 64-token sequence: 210 sequences, capped at max_num_seqs 8
    f = fleet_option(shape, 3, 1, 4, 4, 1_000_000, eng)
    assert (f.replicas, f.tp, f.processes) == (3, 1, 3)
    assert (f.option.weight_bytes, f.option.kv_bytes) == (W1, 900_000 - W1)
    assert f.replica_bytes == 900_000
    assert (f.option.concurrent_per_replica, f.option.concurrent_total) == (8, 24)
    step, _ = decode_time(shape, 1, 8, 32, eng)  # 8 sequences at a mean context of 64 / 2
    assert f.option.tokens_per_s == pytest.approx(3 * 8 / step)
    # tp 2: 2 replicas of 2 ranks, each rank W2 + its KV; one replica 2 x 900,000 B
    f = fleet_option(shape, 2, 2, 4, 4, 1_000_000, eng)
    assert (f.processes, f.option.weight_bytes, f.replica_bytes) == (4, W2, 1_800_000)
    step2, _ = decode_time(shape, 2, 8, 32, eng)
    assert f.option.tokens_per_s == pytest.approx(2 * 8 / step2)
    for args, msg in [((3, 2, 4, 4), "--replicas 3 x --engine-tp 2 = 6 engine ranks, one GPU each, but --gpus is 4"),
                      ((1, 3, 4, 4), "--engine-tp 3 does not divide"), ((1, 2, 4, 1), "more than the 1 GPUs of a node"),
                      ((0, 1, 4, 4), "--replicas must be >= 1")]:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(")) as info:
            fleet_option(shape, *args, 1_000_000, eng)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("replicas, tp, devices, sequences, per_replica, want", [
    (2, 1, 2, 128, 32, 2.0),  # 4 rounds of 32 on one replica, 2 on each of two
    (4, 1, 2, 128, 32, 2.0),  # 1 round each, but 4 replicas share 2 devices: 4 x 2 / 4
    (3, 1, 4, 40, 32, 2.0),  # one replica: 2 rounds (32 + 8); three: 14 each in 1 round, the third adds nothing
    (2, 1, 4, 16, 32, 1.0),  # one replica already runs all 16 at once
    (2, 2, 2, 128, 32, 1.0),  # 2 ranks a replica on 2 devices: the second replica shares them (2 x 1 / 2)
])
def test_fleet_speedup_by_hand(replicas, tp, devices, sequences, per_replica, want):
    from relayrl.planner.rollout import fleet_speedup

    assert fleet_speedup(replicas, tp, devices, sequences, per_replica) == want
