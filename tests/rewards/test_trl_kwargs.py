"""TRL's reward functions that read `completion_ids` and `trainer_state`, configured as a TRL user writes them
(`{name: trl.rewards:get_soft_overlong_punishment, args: {...}}`), give what TRL's own function gives called by hand
on the same ids, in this process, in the reward pool's processes and in reward worker processes
(parallel.reward_workers); the trainer state a function reads is the one the caller gave, and `TrainerState.at`
reads a step's epoch off the prompt sampler."""

from __future__ import annotations

import math

import pytest

from relayrl.data import Example, PromptSampler
from relayrl.rewards import RewardConfig, TrainerState, build_scorer

SOFT = {"name": "trl.rewards:get_soft_overlong_punishment", "args": {"max_completion_len": 64, "soft_punish_cache": 16}}
REPEAT = {"name": "trl.rewards:get_repetition_penalty_reward", "args": {"ngram_size": 3}}

STATE_MODULE = '''
def schedule(completions, trainer_state, **kwargs):
    s = trainer_state
    return [s.global_step + 100 * s.max_steps + 1000 * s.epoch + 10000 * s.num_train_epochs] * len(completions)

def lengths(completion_ids):
    return [len(ids) for ids in completion_ids]

def tamper(completions, trainer_state, **kwargs):
    trainer_state.global_step = 99
    return [0.0] * len(completions)
'''


@pytest.fixture
def trl_rewards():
    return pytest.importorskip("trl.rewards")


@pytest.fixture
def state_module(tmp_path, monkeypatch):
    (tmp_path / "state_rewards.py").write_text(STATE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))


def two_groups():
    """Two prompts' groups of three samples; lengths on each side of the soft punishment's band (48, 64]."""
    a, b = Example(prompt="p", answer="1"), Example(prompt="q", answer="2")
    ids = [[5] * 10, [7, 8] * 25, [3] * 60, [1, 2, 3] * 3 + [9] * 40, [4, 6] * 32, [6] * 80]
    return [str(len(i)) for i in ids], [a] * 3 + [b] * 3, ids


def scorer(functions, workers):
    return build_scorer(RewardConfig.from_dict({"functions": functions, "workers": workers}))


@pytest.mark.unit
@pytest.mark.parametrize("workers", [0, 1])
def test_trl_overlong_and_repetition_rewards_through_the_config_equal_trl_by_hand(trl_rewards, workers):
    texts, examples, ids = two_groups()
    with scorer([SOFT, REPEAT], workers) as s:
        r = s.score(texts, examples, completion_ids=ids)
        forms = s.runner.forms[:2]
    soft = trl_rewards.get_soft_overlong_punishment(max_completion_len=64, soft_punish_cache=16)
    repeat = trl_rewards.get_repetition_penalty_reward(ngram_size=3)
    # GRPOTrainer calls each function on the whole batch; relayrl on each prompt's group: per-sample values agree
    want_soft, want_repeat = soft(completion_ids=ids), repeat(completion_ids=ids)
    assert forms == ["batch", "batch"] and r.failures == 0
    assert want_soft == [0.0, -0.125, -0.75, -0.0625, -1.0, -1.0]  # (48 - len) / 16 in the band, -1 past 64
    assert r.per_function[SOFT["name"]] == want_soft
    assert r.per_function[REPEAT["name"]] == want_repeat and len(set(want_repeat)) >= 4
    assert r.rewards == [a + b for a, b in zip(want_soft, want_repeat, strict=True)]


@pytest.mark.unit
def test_trl_cosine_scaled_reward_reads_the_text_a_column_and_the_ids(trl_rewards):
    """Conversational prompts, the `solution` column and completion_ids in one call, as GRPOTrainer passes them."""
    cfg = {"name": "trl.rewards:get_cosine_scaled_reward", "args": {"max_len": 40}}
    chat = [{"role": "user", "content": "1/3 as a fraction?"}]
    ex = Example(prompt=chat, answer="1/3", meta={"fields": {"solution": r"\frac{1}{3}"}})
    texts = [r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{3}}", r"\boxed{\frac{2}{6}}"]
    ids = [[1] * 10, [1] * 10, [1] * 30, [1] * 50]
    with scorer([cfg], 0) as s:
        got = s.score(texts, [ex] * 4, completion_ids=ids).per_function[cfg["name"]]
    want = trl_rewards.get_cosine_scaled_reward(max_len=40)(
        completions=[[{"role": "assistant", "content": t}] for t in texts], solution=[r"\frac{1}{3}"] * 4,
        completion_ids=ids)
    assert got == want
    # correct and short scores most, wrong least at its shortest; past max_len the long bound (0.5)
    assert want[0] == pytest.approx(0.5 + 0.25 * (1 + math.cos(0.25 * math.pi))) and want[3] == 0.5
    assert want[1] == pytest.approx(-0.5 - 0.25 * (1 + math.cos(0.25 * math.pi)))


@pytest.mark.unit
@pytest.mark.parametrize("workers", [0, 1])
def test_the_trainer_state_and_ids_the_caller_gives_reach_the_function(state_module, workers):
    texts, examples, ids = two_groups()
    fns = [{"name": "state_rewards:schedule"}, {"name": "state_rewards:lengths"}]
    with scorer(fns, workers) as s:
        r = s.score(texts, examples, completion_ids=ids,
                    state=TrainerState(global_step=7, max_steps=9, epoch=0.25, num_train_epochs=2))
        assert r.per_function["state_rewards:schedule"] == [7 + 900 + 250 + 20000] * 6
        assert r.per_function["state_rewards:lengths"] == [10, 50, 60, 49, 64, 80]
        # no state: TRL's before any training (every field 0)
        assert s.score(texts, examples, completion_ids=ids).per_function["state_rewards:schedule"] == [0.0] * 6
        with pytest.raises(ValueError, match="6 completions but 5 completion_ids"):
            s.score(texts, examples, completion_ids=ids[:5])


@pytest.mark.unit
def test_a_function_cannot_change_the_state_the_other_calls_see(state_module):
    texts, examples, ids = two_groups()
    state = TrainerState(global_step=3, max_steps=5)
    with scorer([{"name": "state_rewards:tamper"}, {"name": "state_rewards:schedule"}], 0) as s:
        r = s.score(texts, examples, completion_ids=ids, state=state, check=False)
    assert r.failures_per_function["state_rewards:tamper"] == 6
    assert "FrozenInstanceError" in r.first_errors["state_rewards:tamper"]
    assert state.global_step == 3 and r.per_function["state_rewards:schedule"] == [503.0] * 6


@pytest.mark.unit
def test_trainer_state_at_a_step_reads_the_prompt_sampler():
    sampler = PromptSampler([Example(prompt=str(i), answer="") for i in range(10)], seed=0)
    states = []
    for step in range(4):  # batches of 4 over 10 prompts: drawn before steps 0..3 are 0, 4, 8, 12 prompts
        states.append(TrainerState.at(step, 5, sampler.state_dict(), 4))
        sampler.next_batch(4)
    assert [s.epoch for s in states] == [0.0, 0.4, 0.8, 1.2]
    assert [s.global_step for s in states] == [0, 1, 2, 3]
    assert {(s.max_steps, s.num_train_epochs) for s in states} == {(5, 2)}  # ceil(5 * 4 / 10)
    assert TrainerState.at(2, 5) == TrainerState(global_step=2, max_steps=5)  # no sampler: no epochs


@pytest.mark.equivalence
def test_reward_worker_processes_pass_the_ids_and_the_state(trl_rewards, state_module):
    """parallel.reward_workers 2: each worker process scores its share of the samples (one group each here)."""
    from relayrl.roles.rule_scorer import RuleScorer
    from relayrl.single_controller.liveness import GroupOptions

    texts, examples, ids = two_groups()
    # each worker runs the functions in its own process (reward.workers 0): the split is what is tested here
    cfg = RewardConfig.from_dict({"functions": [SOFT, {"name": "state_rewards:schedule"}], "workers": 0})
    rules = RuleScorer(cfg, workers=2, options=GroupOptions(backend="local"))
    try:
        r = rules.score(texts, examples, completion_ids=ids, state=TrainerState(global_step=4, max_steps=6))
    finally:
        rules.close()
    assert r.per_function[SOFT["name"]] == trl_rewards.get_soft_overlong_punishment(64, 16)(completion_ids=ids)
    assert r.per_function["state_rewards:schedule"] == [604.0] * 6
