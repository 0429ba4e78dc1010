"""PPO with a critic end to end: the critic's metrics, its warm-up, a killed run resumed equal to the
uninterrupted one (the critic's checkpoint included), the same run in worker groups as in one process; and
ReMax and REINFORCE++ through the driver."""

import pytest

from relayrl.controller import driver as driver_mod
from relayrl.jobs.train import train
from relayrl.observe import read_metrics

from helpers import assert_same_metrics, cfg_for, group_cfg, step_metrics

PPO = {"advantage": "gae", "gamma": 1.0, "lam": 0.95, "value_clip": 0.2}
SEVENS = {"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]}
CRITIC_KEYS = ("critic/value_loss", "critic/clip_frac", "critic/grad_norm", "critic/explained_variance",
               "critic/values_mean", "critic/returns_mean", "time/values", "time/critic_update")


def _lines(run_dir):
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/"))} for m in read_metrics(run_dir)]


@pytest.mark.e2e
def test_ppo_with_a_critic_logs_its_figures_and_warms_up_first(tmp_path):
    res = train(cfg_for(tmp_path, "ppo", algo=PPO, reward=SEVENS, critic={"lr": 1e-3, "warmup_updates": 1},
                        run={"steps": 3, "save_every": 0}), show_progress=False)
    steps = step_metrics(res["run_dir"])
    assert len(steps) == 3
    for m in steps:
        assert all(k in m for k in CRITIC_KEYS), [k for k in CRITIC_KEYS if k not in m]
        assert m["critic/value_loss"] > 0
    # step 1 is the critic's alone: the actor takes no update (no policy loss figures), later steps both
    assert "clip_frac" not in steps[0] and "clip_frac" in steps[1] and "clip_frac" in steps[2]
    # the critic learns: its zero-initialised values move towards the returns
    assert steps[0]["critic/values_mean"] == 0.0 and steps[2]["critic/values_mean"] != 0.0


@pytest.mark.e2e
def test_killed_ppo_run_resumes_equal_to_the_uninterrupted_one(tmp_path, monkeypatch):
    cfg = dict(algo=PPO, reward=SEVENS, critic={"lr": 1e-3}, run={"steps": 4, "save_every": 2})
    straight = train(cfg_for(tmp_path, "straight", **cfg), show_progress=False)
    calls = {"n": 0}
    real = driver_mod.Driver.train_step

    def dies_on_third(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(driver_mod.Driver, "train_step", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        train(cfg_for(tmp_path, "resumed", **cfg), show_progress=False)
    assert (tmp_path / "resumed" / "critic" / "checkpoints").is_dir()
    monkeypatch.setattr(driver_mod.Driver, "train_step", real)
    train(cfg_for(tmp_path, "resumed", **cfg), resume=True, show_progress=False)
    assert _lines(straight["run_dir"]) == _lines(tmp_path / "resumed")


@pytest.mark.e2e
@pytest.mark.slow  # 22 s on 2 cores: `make bench`; worker groups against one process stay in CI for GRPO
def test_ppo_in_worker_groups_matches_one_process(tmp_path):
    def cfg(name, **parallel):
        c = group_cfg(tmp_path, name, **parallel).to_dict()
        c["algo"].update(PPO)
        c["critic"] = {"lr": 1e-3}
        from relayrl.controller.config import RunConfig

        return RunConfig.from_dict(c)

    ref = train(cfg("single"), show_progress=False)
    fsdp = train(cfg("fsdp2", backend="local", dp_shard=2), show_progress=False)  # critic in the actor's processes
    tp = train(cfg("tp2", backend="local", tp=2, placement="disaggregated"), show_progress=False)  # its own pool
    want = step_metrics(ref["run_dir"])
    for got in (step_metrics(fsdp["run_dir"]), step_metrics(tp["run_dir"])):
        assert_same_metrics(got, want)
        for g, w in zip(got, want, strict=True):
            for k in ("critic/value_loss", "critic/explained_variance", "critic/grad_norm"):
                assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), k


@pytest.mark.e2e
@pytest.mark.parametrize("advantage", ["remax", "reinforce_pp", "reinforce_pp_baseline"])
def test_remax_and_reinforce_pp_train_through_the_driver(tmp_path, advantage):
    token_level = advantage != "remax"  # the KL goes in the token rewards only where there are token rewards
    res = train(cfg_for(tmp_path, advantage, algo={"advantage": advantage, "kl_coef": 0.05,
                                                   "kl_in_reward": token_level},
                        reward=SEVENS, run={"steps": 2, "save_every": 0}), show_progress=False)
    steps = step_metrics(res["run_dir"])
    assert len(steps) == 2 and all(m["grad_norm"] > 0 for m in steps)
    # in the reward, the KL is no loss term; in the loss (ReMax) it is one, after the first update moved the policy
    assert all((m["loss/kl"] == 0.0) == token_level for m in steps[1:])
    if advantage == "remax":  # the greedy sample's share of sevens, in [0, 1]
        assert all(0.0 <= m["remax/baseline_mean"] <= 1.0 and "time/baseline" in m for m in steps)


@pytest.mark.e2e
def test_ppo_saved_in_one_process_resumes_on_fsdp(tmp_path):
    """The critic's checkpoint, like the actor's, loads into another layout."""
    cfg = dict(algo=PPO, reward=SEVENS, critic={"lr": 1e-3}, run={"steps": 3, "save_every": 2})
    straight = train(cfg_for(tmp_path, "straight", **cfg), show_progress=False)
    first = cfg_for(tmp_path, "moved", **{**cfg, "run": {"steps": 2, "save_every": 2}})
    train(first, show_progress=False)
    moved = cfg_for(tmp_path, "moved", **cfg, parallel={"backend": "local", "dp_shard": 2})
    train(moved, resume=True, show_progress=False)
    want, got = step_metrics(straight["run_dir"])[-1], step_metrics(tmp_path / "moved")[-1]
    assert got["step"] == 3
    assert_same_metrics([got], [want])  # the same samples, from the same actor, and the update to rounding
    for k in ("critic/value_loss", "critic/values_mean", "critic/explained_variance"):
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k  # the critic resumed, not restarted


@pytest.mark.unit
def test_a_critic_section_without_gae_is_refused_and_gae_gets_a_default_critic(tmp_path):
    from relayrl.controller.config import RunConfig
    from relayrl.errors import ConfigError

    with pytest.raises(ConfigError, match="critic: a value model is trained only for algo.advantage=gae"):
        RunConfig.from_dict({"critic": {"lr": 1e-3}})
    cfg = RunConfig.from_dict({"algo": {"advantage": "gae"}})
    assert cfg.critic is not None and cfg.critic.path is None and cfg.critic.warmup_updates == 0
    with pytest.raises(ConfigError, match="kl_in_reward puts the KL in token rewards"):  # grpo would lose its KL
        RunConfig.from_dict({"algo": {"kl_coef": 0.1, "kl_in_reward": True}})
    with pytest.raises(ConfigError, match="critic.padding_free"):
        RunConfig.from_dict({"algo": {"advantage": "gae"}, "critic": {"padding_free": True}})


@pytest.mark.e2e
def test_the_critic_keeps_one_checkpoint_more_than_the_actor(tmp_path):
    """A failure while the actor writes step N must still find the critic of step N - 1 beside it."""
    train(cfg_for(tmp_path, "k", algo=PPO, reward=SEVENS, run={"steps": 3, "save_every": 1, "keep_last": 1}),
          show_progress=False)
    names = lambda d: sorted(p.name for p in d.iterdir() if p.name.startswith("step_"))  # noqa: E731
    actor, critic = names(tmp_path / "k" / "checkpoints"), names(tmp_path / "k" / "critic" / "checkpoints")
    assert actor == ["step_00000003"] and critic == ["step_00000002", "step_00000003"]
