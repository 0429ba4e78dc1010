"""The preflight check counts a fleet's engines: rollout.replicas engines of rollout.tp ranks, each rank its share of
the weights in the engine's dtype plus rollout.kv_cache_bytes, against the machine's memory; refused in one line
before any process starts. Figures by hand for a tiny model."""

from __future__ import annotations

import pytest

from relayrl.controller.config import RunConfig
from relayrl.errors import ConfigError
from relayrl.jobs.preflight import check_fits_machine, check_fits_model
from relayrl.models import ModelConfig

pytestmark = pytest.mark.unit

FLEET = {"backend": "local", "placement": "disaggregated", "rollout_worker": True}
TINY = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                   tie_word_embeddings=True)
# engine elements per rank. tp 1: embedding 64 x 32 (tied) + final norm 32 + 2 layers x (q 32x32, k and v 16x32,
# o 32x32, gate, up and down 3 x 48x32, 2 norms 32) = 17,568. tp 2: the embedding and norms whole, per layer qkv
# 32 rows (2 Q heads, 1 KV head, 8 wide) x 32, o 32 x 16, gate_up 48 x 32, down 32 x 24 = 9,888
N1, N2 = 2048 + 32 + 2 * (1024 + 1024 + 1024 + 4608 + 64), 2048 + 32 + 2 * (1024 + 512 + 1536 + 768 + 64)


def cfg(**rollout) -> RunConfig:
    return RunConfig.from_dict({"rollout": rollout, "parallel": FLEET})


@pytest.mark.parametrize("rollout, need", [
    ({"replicas": 3, "kv_cache_bytes": 1000}, 3 * (4 * N1 + 1000)),
    ({"replicas": 2, "tp": 2, "kv_cache_bytes": 1000}, 2 * 2 * (4 * N2 + 1000)),
    ({"replicas": 4, "engine_dtype": "bfloat16"}, 4 * 2 * N1),  # no kv_cache_bytes: a share of what is free
])
def test_a_fleet_must_fit_the_machine(rollout, need):
    c = cfg(**rollout)
    check_fits_machine(c, TINY, (need, "its memory"))  # exactly what the engines hold: fits
    with pytest.raises(ConfigError) as info:
        check_fits_machine(c, TINY, (need - 1, "its memory"))
    msg = str(info.value)
    assert "\n" not in msg and f"rollout.replicas={rollout['replicas']} engines of rollout.tp={rollout.get('tp', 1)}" \
        in msg and "lower rollout.replicas or rollout.kv_cache_bytes" in msg


def test_the_run_s_preflight_measures_this_machine():
    """check_fits_model (what `relayrl train` runs) asks the machine: no machine holds 2 x 2**50 B of KV cache; one
    engine with 1 KiB of it fits anywhere."""
    on_cpu = {"parallel": {**FLEET, "device": "cpu"}}
    check_fits_model(RunConfig.from_dict({"rollout": {"replicas": 1, "kv_cache_bytes": 1024}, **on_cpu}), TINY)
    with pytest.raises(ConfigError, match=r"engines of rollout.tp=1 ranks need 2097152.00 GiB .* more than this "
                                          r"machine's \d+\.\d\d GiB \(its physical memory\)"):
        check_fits_model(RunConfig.from_dict({"rollout": {"replicas": 2, "kv_cache_bytes": 2**50}, **on_cpu}), TINY)


def test_on_cuda_the_engines_share_every_gpu_s_memory(monkeypatch):
    """Wherever the replicas are placed, they are on this machine's GPUs: their memory summed (two of 80 and 40 GiB,
    as torch reports them)."""
    from types import SimpleNamespace

    import torch

    from relayrl.jobs.preflight import machine_memory

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=[80, 40][i] << 30))
    assert machine_memory("cuda") == (120 << 30, "its 2 GPUs' memory")
    assert machine_memory("cpu")[1] == "its physical memory" and machine_memory("cpu")[0] > 0
