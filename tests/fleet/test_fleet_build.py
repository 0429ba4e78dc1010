"""The build turns rollout.* into a fleet: its router takes rollout.router's knobs (two replica processes of a tiny
model)."""

from __future__ import annotations

import pytest

from relayrl.controller.config import RunConfig

pytestmark = pytest.mark.e2e

FLEET = {"backend": "local", "placement": "disaggregated", "rollout_worker": True, "device": "cpu"}


@pytest.mark.slow  # ~4 s (two replica processes): `make bench`; CI: the knobs' validation (test_fleet_config.py)
def test_the_build_passes_the_knobs_to_the_fleet_s_router(tmp_path):
    """build_engine starts a fleet whose router weighs prefixes and load as rollout.router says (two replica
    processes of a tiny model)."""
    from relayrl.jobs.build import build_engine
    from relayrl.models import load_config
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model
    from relayrl.single_controller.liveness import GroupOptions

    model_dir = build_tiny_model(tmp_path / "m", "0123456789+=", TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                                                 num_hidden_layers=1))
    c = RunConfig.from_dict({"parallel": FLEET, "rollout": {
        "replicas": 2, "kv_cache_bytes": 1 << 20, "router": {"cache_threshold": 0.25, "balance_abs": 7,
                                                             "balance_rel": 3.0}}})
    fleet = build_engine(c, model_dir, load_config(model_dir), None, GroupOptions(threads=1))
    try:
        r = fleet.router
        assert (r.replicas, r.cache_threshold, r.balance_abs, r.balance_rel) == (2, 0.25, 7, 3.0)
        # the bound as set: 7 tokens of slack beyond the least loaded, or 3x it
        r.counters[0].outstanding, r.counters[1].outstanding = 30, 10
        assert not r.over_bound(0, 1)  # 30 - 10 > 7, but 30 <= 3 x 10
        r.counters[0].outstanding = 31
        assert r.over_bound(0, 1)
    finally:
        fleet.close()
