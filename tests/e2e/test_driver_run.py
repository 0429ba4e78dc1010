"""The driver end to end: learning, metrics, resume equality, dynamic sampling, KL, bf16 engine."""


import pytest

from relayrl.controller import driver as driver_mod
from relayrl.errors import RewardError
from relayrl.jobs.train import train
from relayrl.observe import read_metrics

from helpers import cfg_for

REQUIRED = [
    "reward/mean", "reward/std", "reward/accuracy", "response_length/mean", "response_length/max",
    "clip_frac", "entropy", "grad_norm", "lr", "mismatch/logp_abs_mean", "mismatch/logp_abs_max",
    "groups/no_signal_frac", "time/sync", "time/rollout", "time/reward", "time/old_logp", "time/ref_logp",
    "time/update", "time/step", "throughput/gen_tokens_per_s",
]


def _training_lines(run_dir):
    drop = ("time/", "throughput/")
    return [{k: v for k, v in m.items() if not k.startswith(drop)} for m in read_metrics(run_dir)]


@pytest.mark.e2e
def test_metrics_complete_and_fp32_mismatch_tiny(tmp_path):
    res = train(cfg_for(tmp_path, "a"), show_progress=False)
    lines = [m for m in read_metrics(res["run_dir"]) if "reward/mean" in m]
    assert len(lines) == 4
    for m in lines:
        missing = [k for k in REQUIRED if k not in m]
        assert not missing, missing
        assert m["mismatch/logp_abs_max"] < 1e-5  # same fp32 weights on both sides
    assert (tmp_path / "a" / "final_model" / "config.json").is_file()


@pytest.mark.e2e
def test_resume_reproduces_uninterrupted_run(tmp_path, monkeypatch):
    straight = train(cfg_for(tmp_path, "straight"), show_progress=False)

    calls = {"n": 0}
    real = driver_mod.Driver.train_step

    def dies_on_third(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed after the step-2 checkpoint
        return real(self)

    monkeypatch.setattr(driver_mod.Driver, "train_step", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        train(cfg_for(tmp_path, "resumed"), show_progress=False)
    monkeypatch.setattr(driver_mod.Driver, "train_step", real)
    train(cfg_for(tmp_path, "resumed"), resume=True, show_progress=False)
    assert _training_lines(straight["run_dir"]) == _training_lines(tmp_path / "resumed")


@pytest.mark.e2e
def test_grpo_raises_a_learnable_reward(tmp_path):
    cfg = cfg_for(
        tmp_path, "learn",
        reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
        rollout={"prompts_per_step": 8, "group_size": 8, "max_tokens": 8},
        trainer={"lr": 3e-3, "micro_batch_size": 64, "mini_batches": 1},
        run={"steps": 12, "save_every": 0},
    )
    train(cfg, show_progress=False)
    r = [m["reward/mean"] for m in read_metrics(tmp_path / "learn") if "reward/mean" in m]
    assert sum(r[-3:]) / 3 > sum(r[:3]) / 3 + 0.15, r


@pytest.mark.e2e
def test_kl_dynamic_sampling_and_bf16_engine(tmp_path):
    cfg = cfg_for(
        tmp_path, "kl",
        algo={"kl_coef": 0.1, "filter_groups": True, "max_resample_rounds": 1, "mis_low": 0.5, "mis_high": 2.0},
        rollout={"engine_dtype": "bfloat16"},
        trainer={"mini_batches": 1},  # KL is measured before the only optimiser step of a batch
        reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
        run={"steps": 2, "save_every": 0},
    )
    train(cfg, show_progress=False)
    lines = [m for m in read_metrics(tmp_path / "kl") if "reward/mean" in m]
    assert all(m["time/ref_logp"] > 0 and "kl" in m for m in lines)
    assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert all(m["mismatch/logp_abs_max"] > 1e-4 for m in lines)  # bf16 engine vs fp32 trainer


@pytest.mark.e2e
def test_all_rewards_failing_stops_the_run(tmp_path):
    cfg = cfg_for(tmp_path, "fail", reward={"functions": [{"name": "tests.fixtures.rewards:always_raises"}]},
                  run={"steps": 1, "save_every": 0})
    with pytest.raises(RewardError, match="every sample failed"):
        train(cfg, show_progress=False)


@pytest.mark.unit
def test_a_prompt_row_sets_its_own_generation_budget(tmp_path):
    from relayrl.data import Example
    from relayrl.errors import DataError
    from relayrl.rollout.source import sampling_params

    cfg = cfg_for(tmp_path, "b", rollout={"max_tokens": 12})
    from_file = Example(prompt="p", answer="a", meta={"row": 0, "fields": {"max_tokens": 5}})  # a dataset column
    from_task = Example(prompt="p", answer="a", meta={"max_tokens": 7})
    too_long = Example(prompt="p", answer="a", meta={"max_tokens": 99})
    assert [sampling_params(cfg.rollout, 0, 0, 0, 0, ex).max_tokens
            for ex in (from_file, from_task, too_long, None)] == [5, 7, 12, 12]
    with pytest.raises(DataError, match="max_tokens must be a whole number"):
        sampling_params(cfg.rollout, 0, 0, 0, 0,
                        Example(prompt="p", answer="a", meta={"fields": {"max_tokens": "long"}}))


@pytest.mark.unit
def test_evaluation_seeds_each_prompt_apart():
    from relayrl.data import DataConfig, Example
    from relayrl.engine.outputs import CompletionSample, RequestOutput
    from relayrl.rewards.result import ScoreResult
    from relayrl.rollout.evaluate import evaluate

    class Tokenizer:
        bos_token_id = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    class Engine:
        tokenizer = Tokenizer()

        def generate(self, prompts, params):
            self.params = params
            return [RequestOutput(i, [1], [CompletionSample([1], [0.0], "x", finish_reason="stop")], 0)
                    for i in range(len(prompts))]

    class Scorer:
        def score(self, texts, examples, completion_ids=None, state=None):
            return ScoreResult(rewards=[0.0] * len(texts), per_function={}, failures=0, correct=[False] * len(texts))

    engine = Engine()
    exs = [Example(prompt=f"{i}+1=", answer="") for i in range(3)]
    evaluate(engine, exs, DataConfig(chat_template="never"), Scorer(), 4, temperature=1.0, seed=10)
    # one shared seed would draw the same uniforms for every prompt at temperature 1
    assert [p.seed for p in engine.params] == [10, 11, 12]


@pytest.mark.e2e
def test_the_sync_after_an_evaluation_is_skipped_and_changes_nothing(tmp_path, monkeypatch):
    """An evaluation after every step (and before step 1) syncs the weights; the next step's sync finds the engine
    holding them and is skipped (sync/skipped 1, the engine's weights version unchanged). Forcing those syncs to
    happen gives the same run, figure for figure."""
    versions = []
    real_sync = driver_mod.Driver.sync_weights

    def recorded(self):
        out = real_sync(self)
        versions.append(self.engine.weights_version)
        return out

    monkeypatch.setattr(driver_mod.Driver, "sync_weights", recorded)
    skipped = train(cfg_for(tmp_path, "skipped", eval={"max_tokens": 12, "every": 1}), show_progress=False)
    lines = [m for m in read_metrics(skipped["run_dir"]) if "reward/mean" in m]
    # an evaluation after every step: each step trains on the evaluation's sync before it
    assert [m["sync/skipped"] for m in lines] == [1.0] * len(lines)
    assert versions == [v for v in range(1, len(lines) + 2) for _ in (0, 1)][:len(versions)]

    def never_skips(self):
        self._holds = None
        return recorded(self)

    monkeypatch.setattr(driver_mod.Driver, "sync_weights", never_skips)
    synced = train(cfg_for(tmp_path, "synced", eval={"max_tokens": 12, "every": 1}), show_progress=False)
    drop = ("sync/skipped",)
    assert ([{k: v for k, v in m.items() if k not in drop} for m in _training_lines(skipped["run_dir"])]
            == [{k: v for k, v in m.items() if k not in drop} for m in _training_lines(synced["run_dir"])])


@pytest.mark.e2e
def test_a_trainer_in_this_process_syncs_an_engine_in_processes_of_its_own(tmp_path):
    """parallel.backend none with placement disaggregated: the trainer in the driver's process, the engine's rank in
    a process of its own (local), every piece sent between processes and verified by the canary."""
    res = train(cfg_for(tmp_path, "d", parallel={"placement": "disaggregated"}, run={"steps": 2, "save_every": 0}),
                show_progress=False)
    lines = [m for m in read_metrics(res["run_dir"]) if "reward/mean" in m]
    assert len(lines) == 2
    for m in lines:
        assert m["sync/bytes_between_processes"] > 0 and m["sync/bytes_copied_in_place"] == 0
        assert m["sync/canary_gap"] < 1e-5 and m["mismatch/logp_abs_max"] < 1e-5  # fp32 on both sides
