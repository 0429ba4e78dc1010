"""Training in an environment end to end: episode rewards, turns and tool metrics reach the update and the
logs; the trainer's logprobs match the engine's on multi-turn rows; SFT on an environment's traces teaches
its tool-call format; a rollout worker runs the agent loop beside its engine; a failing environment stops
the run in one line."""

import pytest

from relayrl.errors import EnvError
from relayrl.jobs.sft import SFTJobConfig, run_sft
from relayrl.jobs.train import train
from relayrl.observe import read_metrics

from helpers import env_cfg

pytestmark = pytest.mark.e2e

def steps(run_dir):
    return [m for m in read_metrics(run_dir) if "reward/mean" in m]


def test_episode_rewards_and_turns_reach_the_logs(tmp_path):
    res = train(env_cfg(tmp_path, "a", {"name": "tests.fixtures.envs:TwoTurns", "params": {"reward": 0.5},
                                        "max_total_tokens": 200}), show_progress=False)
    lines = steps(res["run_dir"])
    assert len(lines) == 2
    for m in lines:
        # every episode takes exactly two turns and earns the environment's 0.5
        assert m["turns/mean"] == 2.0 and m["reward/mean"] == 0.5 and m["reward/accuracy"] == 0.0
        assert m["env/truncated"] == 0.0 and m["env/errors"] == 0.0 and m["tools/calls"] == 0.0
        # all rewards equal: no advantage, no update signal
        assert m["groups/no_signal_frac"] == 1.0
        # trainer and engine agree on every generated token of both turns (fp32), the observation between
        # them excluded by the loss mask
        assert m["mismatch/logp_abs_max"] < 1e-4


def test_calculator_run_counts_tool_use_and_matches_the_engine(tmp_path):
    res = train(env_cfg(tmp_path, "b", {"name": "calculator", "max_total_tokens": 160}), show_progress=False)
    for m in steps(res["run_dir"]):
        assert {"tools/calls", "tools/errors", "tools/timeouts", "turns/mean", "time/env"} <= set(m)
        assert 1.0 <= m["turns/mean"] <= 4.0
        assert m["tools/timeouts"] == 0.0  # the calculator answers at once: no call can be reported as timed out
        assert all(float(m[k]).is_integer() for k in ("tools/calls", "tools/errors"))  # counts summed over episodes
        assert m["mismatch/logp_abs_max"] < 1e-4
    evals = [m for m in read_metrics(res["run_dir"]) if "eval/accuracy" in m]
    assert len(evals) == 2 and {"eval/turns", "eval/tool_calls"} <= set(evals[0])


# Ray's (~13 s) in `make bench`: the same worker code on local processes in CI, Ray's groups in tests/single_controller
@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_rollout_worker_runs_the_agent_loop(tmp_path, backend):
    cfg = env_cfg(tmp_path, "c", {"name": "tests.fixtures.envs:TwoTurns", "max_total_tokens": 200},
                  parallel={"backend": backend, "rollout_worker": True, "placement": "disaggregated"})
    if backend == "ray":
        ray = pytest.importorskip("ray")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        res = train(cfg, show_progress=False)
    finally:
        if backend == "ray":
            ray.shutdown()
    for m in steps(res["run_dir"]):
        assert m["turns/mean"] == 2.0 and m["reward/mean"] == 0.5
        assert m["mismatch/logp_abs_max"] < 1e-4


def test_an_environment_that_fails_every_episode_stops_in_one_line(tmp_path):
    with pytest.raises(EnvError, match="failed on every episode.*KeyError"):
        train(env_cfg(tmp_path, "d", {"name": "tests.fixtures.envs:Broken"}), show_progress=False)


def test_sft_on_the_environments_traces_teaches_its_tool_calls(tmp_path):
    cfg = SFTJobConfig.from_dict({
        "model": {"tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}},
        "data": {"task": "calculator", "task_params": {"digits": [2, 2, 2]}, "n_train": 128, "n_eval": 16,
                 "chat_template": "always"},
        "env": {"name": "calculator", "max_total_tokens": 224},
        "trainer": {"lr": 3e-3, "warmup_steps": 10, "micro_batch_size": 32},
        "eval": {"max_tokens": 96},
        "sft": {"steps": 120, "batch_size": 32, "out_dir": str(tmp_path / "sft"), "tensorboard": False}})
    res = run_sft(cfg, show_progress=False)
    assert res["eval_first"]["eval/tool_calls"] == 0.0
    # after the SFT every held-out episode opens with a well-formed call the calculator runs
    assert res["eval_last"]["eval/tool_calls"] == 1.0 and res["eval_last"]["eval/turns"] == 2.0


def test_an_episode_budget_past_the_models_length_is_one_line(tmp_path):
    from relayrl.errors import ConfigError

    with pytest.raises(ConfigError, match="env.max_total_tokens=600 exceeds the model's maximum length"):
        train(env_cfg(tmp_path, "e", {"name": "calculator", "max_total_tokens": 600}), show_progress=False)
