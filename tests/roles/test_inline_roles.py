"""The rollout and rule-reward roles, inline: one class each, the same objects as the direct calls (no copies), the
same numbers, the engine's state mirrored by the handle, errors as the direct path gives them."""

from __future__ import annotations

import pytest
import torch

from relayrl.data import DataConfig, build_task
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.errors import RewardError, RunFault
from relayrl.models.tokenizer import load_tokenizer
from relayrl.rewards import RewardConfig, build_scorer
from relayrl.roles.rollout_worker import RolloutRole
from relayrl.roles.rule_scorer import RuleScorer
from relayrl.single_controller.dispatch import Dispatch, dispatch
from relayrl.single_controller.liveness import GroupOptions, WorkerLostError
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, init_std=0.3)
    return str(build_tiny_model(tmp_path_factory.mktemp("roles") / "m", "0123456789+=", cfg))


@pytest.mark.unit
def test_the_inline_rollout_role_is_the_engine_itself(model_dir):
    built = []

    def build():
        built.append(LLMEngine.from_pretrained(model_dir, num_blocks=32, seed=0))
        return built[0]

    tok = load_tokenizer(model_dir)
    role = RolloutRole.inline(build, tok)
    direct = LLMEngine.from_pretrained(model_dir, num_blocks=32, seed=0)
    try:
        assert role.local_engine() is built[0] and role.tokenizer is tok and role.pad_id == built[0].pad_id
        prompts, params = [[3, 4, 5], [6, 7]], SamplingParams(temperature=1.0, max_tokens=6, seed=1, n=2)
        got, want = role.generate(prompts, params), direct.generate(prompts, params)
        assert [[s.token_ids for s in o.samples] for o in got] == [[s.token_ids for s in o.samples] for o in want]
        rows = [[3, 4, 5, 6]]
        assert torch.equal(role.score(rows), direct.score(rows))
        version = role.weights_version
        role.sleep(2)
        assert role.asleep == built[0].asleep == 2
        role.begin_weight_update()  # the handle follows the engine's own state through the weight-update bracket
        assert role.asleep == built[0].asleep
        assert role.end_weight_update() == version + 1 == built[0].weights_version == role.weights_version
        assert role.asleep == built[0].asleep == 1  # the weights are back, the KV cache comes with wake()
        role.wake()
        assert role.asleep == 0 and role.stats() == built[0].stats()
    finally:
        role.close()
        direct.close()


@pytest.mark.unit
def test_the_inline_rule_scorer_scores_as_the_reward_scorer_does():
    task = build_task(DataConfig(task="arith"))
    examples = [ex for ex in task.generate(4, seed=0) for _ in range(3)]
    texts = [ex.answer if i % 2 else "nope" for i, ex in enumerate(examples)]
    cfg = RewardConfig.from_dict({"functions": [{"name": "task"}, {"name": "format", "weight": 0.5}]})
    rules, direct = RuleScorer(cfg), build_scorer(cfg)
    try:
        assert rules.group.backend_name == "inline" and rules.group.world_size == 1
        assert rules.score(texts, examples) == direct.score(texts, examples)
        assert rules.score([], []) == direct.score([], [])
    finally:
        rules.close()
        direct.close()


@pytest.mark.unit
def test_a_reward_function_failing_everywhere_stops_in_one_line_inline():
    rules = RuleScorer(RewardConfig.from_dict({"functions": [{"name": "tests.fixtures.rewards:always_raises"}]}))
    examples = build_task(DataConfig(task="arith")).generate(2, seed=0)
    try:
        with pytest.raises(RewardError, match="every sample failed") as e:
            rules.score(["a", "b"], examples)
        assert "\n" not in str(e.value)
    finally:
        rules.close()


class LosesARank(Worker):
    @dispatch(Dispatch.RANK_ZERO)
    def run(self):
        raise WorkerLostError("engine worker rank 1 (pid 7) died during 'run'")


@pytest.mark.parametrize("backend", [pytest.param("inline", marks=pytest.mark.unit),
                                     pytest.param("local", marks=pytest.mark.faults)])
def test_a_fault_below_a_worker_comes_back_as_that_fault(backend):
    """A group the worker drives lost a process: the run's fault (RunFault, exit status 3), not the worker's bug."""
    with WorkerGroup(ResourcePool([1]), LosesARank, options=GroupOptions(backend=backend)) as group:
        with pytest.raises(RunFault, match="engine worker rank 1 .* died"):
            group.call(LosesARank.run)
