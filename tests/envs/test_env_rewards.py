"""An environment's step reward is a finite real number, or the episode fails (issue 36): NaN, inf, None or a
string from step() reached the loss (NaN: `loss nan, grad_norm nan`) or ended the run with a traceback. Such a
step now ends its episode as an environment error (finish env_error, counted in env/errors) keeping the reward
of the episode's earlier steps, as a step that raises does; numpy's and torch's scalars are numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from relayrl.data import Example
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.envs.base import StepResult, as_step_result, register_env
from relayrl.envs.config import EnvConfig
from relayrl.errors import EnvError
from relayrl.models.tokenizer import build_char_tokenizer, load_tokenizer
from relayrl.rollout.agent_loop import AgentLoop, episode_metrics
from tests.helpers import perturbed_model, small_config

pytestmark = pytest.mark.unit

BAD = {"nan": (math.nan, "returned nan, expected a finite real number"),
       "inf": (-math.inf, "returned -inf, expected a finite real number"),
       "none": (None, "returned None (NoneType), expected a finite real number"),
       "high": ("high", "returned 'high' (str), expected a finite real number"),
       "list": ([1.0], "returned [1.0] (list), expected a finite real number"),
       "big": (10**400, "returned an int too large for a float")}
GOOD = {"np_true": (np.bool_(True), 1.0), "np_f32": (np.float32(0.25), 0.25), "np_i64": (np.int64(2), 2.0),
        "0d": (np.array(0.5), 0.5), "torch": (torch.tensor(-1.5), -1.5), "torch_bool": (torch.tensor(False), 0.0),
        "true": (True, 1.0)}


@pytest.mark.parametrize("key", list(BAD))
def test_a_non_number_reward_is_one_line_naming_the_environment(key):
    value, says = BAD[key]
    with pytest.raises(EnvError) as e:
        as_step_result((None, value, True, {}), "mine")
    assert str(e.value).startswith(f"environment 'mine': the reward step() {says}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", list(GOOD))
def test_numpy_and_torch_scalars_are_numbers(key):
    value, want = GOOD[key]
    out = as_step_result(([{"role": "user", "content": "x"}], value, False, None), "mine")
    assert out.reward == want and type(out.reward) is float and out.info == {}


@register_env("test_reward_of_prompt")
class RewardOfPrompt:
    """Two steps: the first rewards 0.5; the second returns the reward named by the example's prompt."""

    tools: list = []

    def reset(self, example: Example):
        self.key, self.turn = example.prompt, 0
        return [{"role": "user", "content": example.prompt}]

    def step(self, message):
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "again"}], 0.5, False, {})
        table = {k: v for k, (v, _) in BAD.items()} | {k: v for k, (v, _) in GOOD.items()}
        return None, table[self.key], True, {}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(d, "abcdefghijklmnopqrstuvwxyz_0123456789 ")
    tok = load_tokenizer(d)
    cfg = small_config(vocab_size=len(tok), max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    eng = LLMEngine.from_model(perturbed_model(cfg, seed=3).eval(), tok, kv_cache_bytes=32 << 20)
    yield eng
    eng.close()


def test_a_bad_reward_fails_its_episode_and_the_others_go_on(engine):
    keys = list(BAD) + list(GOOD)
    loop = AgentLoop(engine, EnvConfig(name="test_reward_of_prompt", max_turns=3, max_total_tokens=400))
    sp = SamplingParams(n=1, max_tokens=3, seed=0, ignore_eos=True)
    try:
        trajs = loop.run([Example(k, "") for k in keys], [sp] * len(keys))
    finally:
        loop.close()
    by_key = dict(zip(keys, trajs, strict=True))
    for k, (_, says) in BAD.items():
        t = by_key[k]
        assert (t.finish, t.reward, t.turns) == ("env_error", 0.5, 2), k  # the first step's reward is kept
        assert t.error.startswith(f"environment 'test_reward_of_prompt': the reward step() {says}"), t.error
    for k, (_, want) in GOOD.items():
        assert (by_key[k].finish, by_key[k].reward, by_key[k].error) == ("done", 0.5 + want, None), k
    m = episode_metrics(trajs)
    assert m["env/errors"] == len(BAD) / len(keys)
    assert math.isfinite(m["reward/mean"])
    assert m["reward/mean"] == pytest.approx((0.5 * len(keys) + sum(w for _, w in GOOD.values())) / len(keys))


def test_every_episode_with_a_nan_reward_is_one_line(engine):
    loop = AgentLoop(engine, EnvConfig(name="test_reward_of_prompt", max_turns=3, max_total_tokens=400))
    try:
        with pytest.raises(EnvError) as e:
            loop.run([Example("nan", "")], [SamplingParams(n=2, max_tokens=3, seed=0, ignore_eos=True)])
    finally:
        loop.close()
    assert str(e.value) == ("environment 'test_reward_of_prompt' failed on every episode of the step, e.g.: "
                            "environment 'test_reward_of_prompt': the reward step() returned nan, expected a finite "
                            "real number")
