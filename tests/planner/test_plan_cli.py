"""`relayrl plan` from the command line: a preset, a real model directory, JSON, and one-line errors."""

from __future__ import annotations

import json

import pytest

from relayrl.cli.main import main
from relayrl.models import CausalLM, ModelConfig, save_pretrained

pytestmark = pytest.mark.e2e

TINY = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                   tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny model: load_config gives a ModelConfig (unhashable), not a ModelShape."""
    model = CausalLM(TINY)
    model.reset_parameters(std=0.02, seed=0)
    return save_pretrained(model, tmp_path_factory.mktemp("plan") / "m")


def test_cli_plans_a_model_directory(capsys, model_dir):
    assert main(["plan", "--model", str(model_dir), "--gpus", "2", "--gpu-mem", "1", "--seq", "64",
                 "--micro-batch", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == str(model_dir) and plan["train"][0]["fits"]
    # the directory's shape reached the planner: engine weights at tp 1 = the saved model's parameters in bf16
    # (embed 64x32, tied; per layer q 32x32, k, v 16x32, o 32x32, gate, up 48x32, down 32x48, 2 norms; final norm)
    n = 64 * 32 + 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 48 * 32 + 2 * 32) + 32
    assert n == sum(p.numel() for p in CausalLM(TINY).parameters())
    assert {r["tp"]: r["weight_bytes"] for r in plan["rollout"]}[1] == 2 * n


def _plan(capsys, *extra) -> dict:
    assert main(["plan", "--preset", "tiny-gqa", "--gpus", "2", "--gpu-mem", "1", "--seq", "64", "--micro-batch",
                 "1", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_lora_sync_counts_merges_base_copy(capsys):
    sep = _plan(capsys, "--lora-rank", "4")
    merge = _plan(capsys, "--lora-rank", "4", "--lora-sync", "merge")
    w_sep, w_merge = ({r["tp"]: r["weight_bytes"] for r in p["rollout"]} for p in (sep, merge))
    # tiny-gqa at tp 1, every projection targeted: merge keeps a bf16 copy of each layer's qkv (48 x 32), o (32 x 32),
    # gate_up (128 x 32) and down (32 x 64) weights, 2 layers
    assert w_merge[1] - w_sep[1] == 2 * 2 * (48 * 32 + 32 * 32 + 128 * 32 + 32 * 64)
    assert sep == _plan(capsys, "--lora-rank", "4", "--lora-sync", "separate")  # the default
    assert sep["placement"] == "colocated" and sep["engine_tp"] in (1, 2)
    assert any("sync.lora=merge" in a for a in merge["assumptions"])


def test_cli_json_ranks_fitting_layouts(capsys):
    assert main(["plan", "--preset", "qwen2.5-0.5b", "--gpus", "4", "--gpu-mem", "24", "--seq", "2048",
                 "--micro-batch", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    fits = [o for o in plan["train"] if o["fits"]]
    assert fits and all(o["memory"]["total"] <= plan["gpu_mem_bytes"] for o in fits)
    assert [o["time"]["mfu"] for o in fits] == sorted((o["time"]["mfu"] for o in fits), reverse=True)
    rest = plan["train"][len(fits):]
    assert all(not o["fits"] and o["over_bytes"] > 0 for o in rest)
    assert plan["placement"] in ("colocated", "disaggregated") and plan["rollout"][0]["fits"]


def test_cli_text_prints_every_assumption(capsys):
    assert main(["plan", "--preset", "tiny-gqa", "--gpus", "2", "--gpu-mem", "1", "--seq", "64",
                 "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "assumptions:" in out and "16 B per trained parameter" in out and "placement:" in out


@pytest.mark.parametrize("argv, msg", [
    (["--preset", "nope"], "unknown model preset"),
    (["--model", "/nonexistent/dir"], "model directory not found"),
    (["--preset", "tiny-gqa", "--gpus", "0"], "--gpus must be >= 1"),
    (["--preset", "tiny-gqa", "--lora-sync", "merge"], "--lora-sync needs --lora-rank"),
    (["--preset", "tiny-gqa", "--efficiency", "0"], "--efficiency must be in (0, 1]"),
    (["--preset", "tiny-gqa", "--replicas", "2", "--engine-tp", "2"],
     "= 4 engine ranks, one GPU each, but --gpus is 2"),
])
def test_cli_bad_input_is_one_line_exit_2(capsys, argv, msg):
    base = {"--gpus": "2", "--gpu-mem": "80", "--seq": "64", "--micro-batch": "1"}
    args = list(argv)
    for k, v in base.items():
        if k not in args:
            args += [k, v]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err


def test_cli_efficiency_scales_step_times(capsys):
    """--efficiency is the fraction of the peak the kernels reach: halving it doubles a compute-bound step."""
    half, full = _plan(capsys, "--efficiency", "0.5"), _plan(capsys, "--efficiency", "1")
    a, b = half["train"][0]["time"], {o["layout"]: o["time"] for o in full["train"]}[half["train"][0]["layout"]]
    assert a["compute_s"] == pytest.approx(2 * b["compute_s"])
    assert any("kernel efficiency 0.5" in x for x in half["assumptions"])


def test_cli_plans_a_fleet(capsys):
    """--replicas 2: two engines of one rank on the 2 GPUs, one replica's memory 0.9 x 1 GiB (its weights and the KV
    they leave), twice one engine's tokens per second (the rollout table's tp-1 row: 2 replicas of the 2 GPUs)."""
    plan = _plan(capsys, "--replicas", "2")
    f = plan["fleet"]
    assert (f["replicas"], f["tp"], f["processes"]) == (2, 1, 2)
    assert f["replica_bytes"] == int(0.9 * 2**30)
    tp1 = {r["tp"]: r for r in plan["rollout"]}[1]  # gpus // 1 = 2 replicas: the same fleet
    assert f["option"]["tokens_per_s"] == pytest.approx(tp1["tokens_per_s"]) and tp1["replicas"] == 2
    one = _plan(capsys, "--replicas", "1")["fleet"]["option"]
    assert f["option"]["tokens_per_s"] == pytest.approx(2 * one["tokens_per_s"])
    assert main(["plan", "--preset", "tiny-gqa", "--gpus", "2", "--gpu-mem", "1", "--seq", "64", "--micro-batch", "1",
                 "--replicas", "2"]) == 0
    assert "rollout fleet: 2 replicas x engine tp 1 = 2 engine processes (GPUs)" in capsys.readouterr().out
