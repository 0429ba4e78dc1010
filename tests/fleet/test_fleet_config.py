"""rollout.replicas: what a fleet runs on today, and every other combination refused in one line naming what to set.
(The streaming modes on a fleet: tests/fleet/test_fleet_stream.py.)"""

from __future__ import annotations

import pytest

from relayrl.controller.config import RunConfig
from relayrl.errors import ConfigError

pytestmark = pytest.mark.unit

FLEET = {"backend": "local", "placement": "disaggregated", "rollout_worker": True}


def cfg(rollout: dict, parallel: dict, **more) -> RunConfig:
    return RunConfig.from_dict({"rollout": rollout, "parallel": parallel, **more})


def test_one_replica_is_the_default_and_today_s_engine():
    assert RunConfig().rollout.replicas == 1
    assert cfg({"replicas": 4}, FLEET).rollout.replicas == 4


@pytest.mark.parametrize("parallel, rollout, names", [
    ({}, {}, "parallel.backend=local, parallel.placement=disaggregated, parallel.rollout_worker=true"),
    ({**FLEET, "rollout_worker": False}, {}, "set parallel.rollout_worker=true (or"),
    ({**FLEET, "backend": "ray"}, {}, "set parallel.backend=local (or"),
])
def test_other_combinations_are_refused_in_one_line(parallel, rollout, names):
    with pytest.raises(ConfigError) as info:
        cfg({"replicas": 2, **rollout}, parallel)
    msg = str(info.value)
    assert "\n" not in msg and "rollout.replicas=2" in msg and names in msg and "rollout.replicas=1" in msg


def test_episodes_are_refused_with_replicas():
    with pytest.raises(ConfigError, match=r"rollout.replicas=2 routes single-turn requests only.*rollout.replicas=1"):
        cfg({"replicas": 2}, FLEET, env={"name": "tests.fixtures.envs:TwoTurns"},
            data={"task": "calculator", "chat_template": "always"})


def test_replicas_must_be_at_least_one():
    with pytest.raises(ConfigError, match="rollout.replicas"):
        cfg({"replicas": 0}, FLEET)
