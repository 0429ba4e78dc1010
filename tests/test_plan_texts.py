"""The reading's 70B figures (../shared/reading/distributed-rl-training.txt) recomputed by the planner:
which follow, under which assumptions, and which do not."""

from __future__ import annotations

import json

import pytest

from relayrl.cli.main import main
from relayrl.planner import texts

PSI = 70e9


def _fig(what: str) -> texts.Figure:
    return next(f for f in texts.figures() if f.what == what)


def test_sixteen_bytes_per_parameter_table():
    assert texts.bytes_per_param(True) == 16 and texts.bytes_per_param(False) == 12
    assert _fig("training state, 70B at 16 B/param").computed == pytest.approx(1.12)
    assert _fig("table: weights / grads / master / m / v").computed == pytest.approx(140)
    assert _fig("total with activations").computed == pytest.approx(1.22)


def test_zero_savings_limits_and_at_the_texts_n():
    assert texts.zero_saving(1, 8) == pytest.approx(16 / 5.5) and texts.zero_saving(2, 8) == pytest.approx(16 / 3.75)
    assert texts.zero_saving(1, 10**9) == pytest.approx(4, rel=1e-6)
    assert texts.zero_saving(2, 10**9) == pytest.approx(8, rel=1e-6)
    assert texts.zero_saving(3, 8) == 8
    # the planner's own per-rank state on llama-3-70b agrees (per-tensor chunks and step counters)
    for level in (1, 2, 3):
        assert texts.planner_zero_saving(level, 8) == pytest.approx(texts.zero_saving(level, 8), rel=1e-4)


def test_940_and_118_follow_from_12_bytes_not_16():
    assert _fig("no sharding").computed == pytest.approx(940)  # 12 x 70 + 100
    assert _fig("ZeRO-3").computed == pytest.approx(117.5)  # (840 + 100) / 8
    assert (16 * PSI + 100e9) / 1e9 == pytest.approx(1220)  # what the table's 16 B would give
    assert all(_fig(w).verdict == "follows under assumptions" for w in ("no sharding", "ZeRO-3"))


def test_checkpointing_and_lora_rows():
    ck = _fig("ZeRO-3 + checkpointing")
    ratio = texts.checkpoint_ratio()
    assert 0 < ratio < 0.1
    assert ck.computed == pytest.approx((840e9 + 100e9 * ratio) / 32 / 1e9)
    assert 25 < ck.computed <= 30 and "N >= 29" in ck.assumptions
    lora = _fig("ZeRO-3 + checkpointing + LoRA")
    assert lora.verdict == "does not follow"
    assert lora.computed == pytest.approx((140e9 + texts.lora_state_bytes() + 100e9 * ratio) / 8 / 1e9)
    assert lora.computed > 15


def test_cli_prints_the_texts(capsys):
    assert main(["plan", "--texts"]) == 0
    assert "~940 GB" in capsys.readouterr().out
    assert main(["plan", "--texts", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["verdict"] for r in rows} == {"follows", "follows under assumptions", "does not follow"}
