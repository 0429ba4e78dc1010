"""`relayrl demo --agent react`: its recipe is the calculator demo's with the environment replaced by the ReAct agent of
examples/agents (resolved to its function, run through the endpoint), and what it cannot combine with is refused in
one line before anything is written."""

import pytest

from relayrl.controller.config import RunConfig
from relayrl.errors import UserError
from relayrl.jobs.demo import CALC_ENV, REACT_AGENT, recipe, run_demo
from relayrl.jobs.sft import SFTJobConfig


@pytest.mark.unit
def test_the_react_recipe_is_the_calculator_recipe_with_the_agent_instead_of_the_environment():
    pytest.importorskip("openai")
    from relayrl.serve.agents import check_signature, resolve_agent

    calc_sft, calc_rl, _ = recipe("calculator", "grpo")
    sft, rl, _ = recipe(None, "grpo", agent="react")
    assert SFTJobConfig.from_dict(sft) == SFTJobConfig.from_dict(calc_sft)  # the same warm-start
    cfg = RunConfig.from_dict({**rl, "model": {"path": "unused"}})
    calc = RunConfig.from_dict({**calc_rl, "model": {"path": "unused"}})
    assert cfg.env is None and cfg.episodes
    assert cfg.rollout.agent == f"{REACT_AGENT}:run" and REACT_AGENT.is_file()
    assert (cfg.rollout.agent_concurrency, cfg.rollout.agent_max_total_tokens) == (128, CALC_ENV["max_total_tokens"])
    assert cfg.rollout.prompts_per_step * cfg.rollout.group_size == 128  # a step's episodes all run at once
    same = {"agent": None, "agent_concurrency": calc.rollout.agent_concurrency, "agent_max_total_tokens": None}
    assert cfg.rollout.model_copy(update=same) == calc.rollout
    assert (cfg.run.steps, calc.run.steps) == (20, 60)
    assert cfg.model_copy(update={"rollout": calc.rollout, "env": calc.env, "run": calc.run}) == calc
    assert cfg.run.model_copy(update={"steps": 60}) == calc.run
    fn = resolve_agent(cfg.rollout.agent)
    assert (fn.__name__, fn.__code__.co_filename) == ("run", str(REACT_AGENT))
    assert check_signature(fn, "react") == ["example", "client", "model"]
    # seeded like every demo: data, model, SFT and run
    sft3, rl3, _ = recipe(None, "grpo", agent="react", seed=3)
    assert (sft3["data"]["seed"], sft3["model"]["tiny"]["seed"], rl3["run"]["seed"]) == (3, 3, 3)


@pytest.mark.unit
@pytest.mark.parametrize("kw, said", [
    ({"agent": "react", "lora": True}, "drop --env, --algo and --lora"),
    ({"agent": "react", "algo": "ppo"}, "drop --env, --algo and --lora"),
    ({"agent": "react", "env": "calculator"}, "drop --env, --algo and --lora"),
    ({"agent": "reflexion"}, "no recipe for agent 'reflexion'"),
])
def test_what_the_agent_demo_cannot_do_is_one_line_before_anything_is_written(tmp_path, kw, said):
    with pytest.raises(UserError, match=said) as e:
        run_demo(tmp_path, **kw)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "sft").exists()


@pytest.mark.unit
def test_the_cli_takes_agent_react_and_refuses_it_with_smollm2(capsys):
    from relayrl.cli.main import build_parser, main

    a = build_parser().parse_args(["demo", "--agent", "react", "--steps", "3"])
    assert (a.agent, a.steps, a.env) == ("react", 3, None)
    assert main(["demo", "--agent", "react", "--model", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--agent" in err
