"""rollout.replicas: what a fleet runs on today (a rollout worker per replica on local processes or Ray; colocated on
the trainer's local ranks), and every other combination refused in one line naming what to set. (The streaming modes
on a fleet: tests/fleet/test_fleet_stream.py.)"""

from __future__ import annotations

import pytest

from relayrl.controller.config import RunConfig
from relayrl.errors import ConfigError
from relayrl.roles.group_policy import group_options

pytestmark = pytest.mark.unit

FLEET = {"backend": "local", "placement": "disaggregated", "rollout_worker": True}


def cfg(rollout: dict, parallel: dict, **more) -> RunConfig:
    return RunConfig.from_dict({"rollout": rollout, "parallel": parallel, **more})


def test_one_replica_is_the_default_and_today_s_engine():
    assert RunConfig().rollout.replicas == 1
    assert cfg({"replicas": 4}, FLEET).rollout.replicas == 4


@pytest.mark.parametrize("parallel, rollout, names", [
    ({"placement": "disaggregated"}, {}, "set parallel.backend=local (or ray), parallel.rollout_worker=true (or"),
    ({**FLEET, "rollout_worker": False}, {}, "set parallel.rollout_worker=true (or"),
])
def test_other_combinations_are_refused_in_one_line(parallel, rollout, names):
    with pytest.raises(ConfigError) as info:
        cfg({"replicas": 2, **rollout}, parallel)
    msg = str(info.value)
    assert "\n" not in msg and "rollout.replicas=2" in msg and names in msg and "rollout.replicas=1" in msg


def test_on_ray_each_replica_s_worker_group_runs_on_ray():
    """parallel.backend ray: the fleet is accepted, and the worker-group options build_engine starts every replica's
    rollout worker with (relayrl.roles.group_policy.group_options) name the Ray backend (tests/fleet/test_fleet_ray.py
    runs it: slow)."""
    c = cfg({"replicas": 2}, {**FLEET, "backend": "ray"})
    assert c.rollout.replicas == 2 and group_options(c.parallel).backend == "ray"
    assert group_options(cfg({"replicas": 2}, FLEET).parallel).backend == "local"


def test_episodes_run_on_replicas_in_lockstep_only():
    """env: and rollout.agent episodes run on a fleet (each replica's worker its own agent loop); streaming is still
    refused for a fleet, episodes or not."""
    calc = {"task": "calculator", "chat_template": "always"}
    assert cfg({"replicas": 2}, FLEET, env={"name": "calculator"}, data=calc).episodes
    assert cfg({"replicas": 2, "agent": "env:calculator"}, FLEET, data=calc).rollout.replicas == 2
    with pytest.raises(ConfigError, match="rollout.replicas=2 .* set rollout.mode=sync"):
        cfg({"replicas": 2, "agent": "env:calculator", "mode": "one_step_off"}, FLEET, data=calc)


def test_replicas_must_be_at_least_one():
    with pytest.raises(ConfigError, match="rollout.replicas"):
        cfg({"replicas": 0}, FLEET)


COLOCATED = {"backend": "local", "placement": "colocated"}


def test_colocated_replicas_fit_in_the_trainer_s_ranks():
    """replica k's rollout.tp ranks in trainer ranks k*tp..: replicas x tp of them at most (the rest host none)."""
    assert cfg({"replicas": 2}, {**COLOCATED, "dp_shard": 2}).rollout.replicas == 2
    assert cfg({"replicas": 2, "tp": 2}, {**COLOCATED, "dp_shard": 2, "tp": 2}).rollout.replicas == 2
    assert cfg({"replicas": 2}, {**COLOCATED, "dp_shard": 4}).rollout.replicas == 2  # ranks 2, 3 host no engine
    assert cfg({"replicas": 2}, {**COLOCATED, "backend": "ray", "dp_shard": 2}).rollout.replicas == 2  # Ray actors


@pytest.mark.parametrize("parallel, rollout, names", [
    ({}, {}, "rollout.replicas=2 colocated puts replica k's rollout.tp=1 rank(s) in trainer ranks k*1.., 2 in all: "
             "set parallel.backend=local (or ray) with at least 2 trainer ranks; or give each replica a rollout "
             "worker"),
    ({**COLOCATED, "dp_shard": 2}, {"tp": 2}, "4 in all, but the trainer has 2: raise the trainer's degrees to 4 "
                                              "ranks or lower rollout.replicas; or"),
    ({**COLOCATED, "dp_shard": 2}, {"mode": "one_step_off"}, "2 in all: set rollout.mode=sync; or"),
])
def test_colocated_replicas_refused_in_one_line(parallel, rollout, names):
    with pytest.raises(ConfigError) as info:
        cfg({"replicas": 2, **rollout}, parallel)
    msg = str(info.value)
    assert "\n" not in msg and names in msg and msg.endswith(
        "parallel.placement=disaggregated parallel.rollout_worker=true (or rollout.replicas=1)")


def test_router_knobs_default_to_the_router_s_and_are_validated_in_one_line():
    from relayrl.rollout import router

    knobs = RunConfig().rollout.router
    assert (knobs.cache_threshold, knobs.balance_abs, knobs.balance_rel) == (
        router.CACHE_THRESHOLD, router.BALANCE_ABS, router.BALANCE_REL)
    got = cfg({"replicas": 2, "router": {"cache_threshold": 0.3, "balance_abs": 0, "balance_rel": 2}}, FLEET)
    assert got.rollout.router.to_dict() == {"cache_threshold": 0.3, "balance_abs": 0, "balance_rel": 2.0}
    for key, bad in [("cache_threshold", 1.5), ("cache_threshold", -0.1), ("balance_abs", -1), ("balance_rel", 0.5),
                     ("balance_abs", "lots"), ("affinity", 1)]:
        with pytest.raises(ConfigError) as info:
            cfg({"replicas": 2, "router": {key: bad}}, FLEET)
        assert "\n" not in str(info.value) and f"rollout.router.{key}" in str(info.value)

