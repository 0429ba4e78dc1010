"""The reading's 70B figures (../shared/reading/distributed-rl-training.txt) recomputed by the planner:
which follow, under which assumptions, and which do not."""

from __future__ import annotations

import json

import pytest

from relayrl.cli.main import main
from relayrl.planner import texts


def _fig(what: str) -> texts.Figure:
    return next(f for f in texts.figures() if f.what == what)


# llama-3-70b by hand (h 8192, 64 heads of 128, 8 KV heads, I 28672, 80 layers, V 128256), one 4096-token
# sequence, bf16 (e = 2), sdpa, one rank; bytes per token of the sequence:
#   per layer: norm inputs 2e h 32768 + norm outputs 2 (e h + 4) 32776 + qkv/mlp inputs 2e h 32768
#              + q,k,v e (8192 + 2 x 1024) 20480 + o_proj input e 8192 16384 + SwiGLU 4e I 229376
#              + sdpa logsumexp 4 x 64 256 + sdpa's mask e s 8192 = 373000
#   outside:   mask 4096 (s bools per token) + final norm input e h 16384 + its normalised output and rsqrt
#              e h + 4 and the lm_head's input e h (32772) = 53252, and the fp32 log-softmax at the s - 1
#              predicting positions, 4 x 4095 x 128256 = 2,100,833,280 B in all
#   none: 4096 x (80 x 373000 + 53252) + 2100833280;  full recompute: 4096 x (80 x e h 16384 + 53252) + 2100833280
ACT_NONE, ACT_FULL = 124_543_593_472, 7_687_662_592
RATIO = ACT_FULL / ACT_NONE  # 0.0617
# rank-16 adapters on q, k, v, o, gate, up, down: 16 x (in + out) per target, 80 layers, 16 B each
LORA_PARAMS = 80 * 16 * ((8192 + 8192) * 2 + (8192 + 1024) * 2 + (8192 + 28672) * 3)  # 207,093,760


@pytest.mark.unit
def test_sixteen_bytes_per_parameter_table():
    assert texts.bytes_per_param(True) == 16 and texts.bytes_per_param(False) == 12
    assert _fig("training state, 70B at 16 B/param").computed == pytest.approx(1.12)  # 16 x 70e9 = 1.12e12 B
    assert _fig("table: weights / grads / master / m / v").computed == pytest.approx(140)  # 2 x 70e9
    assert _fig("total with activations").computed == pytest.approx(1.22)  # 1.12 TB + 0.1 TB
    assert _fig("activations").computed == pytest.approx(124.543593472)  # ACT_NONE / 1e9
    assert texts.one_sequence_activations() == ACT_NONE
    # the paper's GPT formula, no scores: 80 x 34 x 4096 x 8192 B + the fp32 log-softmax 4 x 4096 x 128256 B
    assert texts.korthikanti_70b() == 80 * 34 * 4096 * 8192 + 4 * 4096 * 128256 == 93_369_401_344
    assert "gives 93.4 GB" in _fig("activations").assumptions


@pytest.mark.unit
def test_zero_savings_limits_and_at_the_texts_n():
    assert texts.zero_saving(1, 8) == pytest.approx(16 / 5.5) and texts.zero_saving(2, 8) == pytest.approx(16 / 3.75)
    assert texts.zero_saving(1, 10**9) == pytest.approx(4, rel=1e-6)
    assert texts.zero_saving(2, 10**9) == pytest.approx(8, rel=1e-6)
    assert texts.zero_saving(3, 8) == 8
    # the planner's own per-rank state on llama-3-70b agrees (per-tensor chunks and step counters)
    for level, ratio in ((1, 16 / 5.5), (2, 16 / 3.75), (3, 8)):
        assert texts.planner_zero_saving(level, 8) == pytest.approx(ratio, rel=1e-4)


@pytest.mark.unit
def test_940_and_118_follow_from_12_bytes_not_16():
    assert _fig("no sharding").computed == pytest.approx(940)  # 12 x 70 + 100
    assert _fig("ZeRO-3").computed == pytest.approx(117.5)  # (840 + 100) / 8
    assert "gives 1220 GB" in _fig("no sharding").assumptions  # 16 x 70 + 100: what the table's 16 B gives
    assert "gives 152.5" in _fig("ZeRO-3").assumptions  # 1220 / 8
    assert all(_fig(w).verdict == "follows under assumptions" for w in ("no sharding", "ZeRO-3"))


@pytest.mark.unit
def test_checkpointing_and_lora_rows():
    assert texts.checkpoint_ratio() == pytest.approx(RATIO) and ACT_FULL / ACT_NONE == pytest.approx(RATIO)
    ck = _fig("ZeRO-3 + checkpointing")
    assert ck.computed == pytest.approx((840 + 100 * 0.06172668) / 32)  # 26.44 GB per GPU at N = 32
    assert ck.computed == pytest.approx(26.4429, abs=1e-4)
    assert "N >= 29" in ck.assumptions  # ceil(846.1 / 30)
    assert texts.lora_state_bytes() == 16 * LORA_PARAMS == 3_313_500_160
    lora = _fig("ZeRO-3 + checkpointing + LoRA")
    assert lora.verdict == "does not follow"
    assert lora.computed == pytest.approx((140 + 3.31350016 + 6.172668) / 8)  # 18.69 GB per GPU at N = 8
    assert lora.computed == pytest.approx(18.6858, abs=1e-4)


@pytest.mark.e2e
def test_cli_prints_the_texts(capsys):
    assert main(["plan", "--texts"]) == 0
    assert "~940 GB" in capsys.readouterr().out
    assert main(["plan", "--texts", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["verdict"] for r in rows} == {"follows", "follows under assumptions", "does not follow"}
