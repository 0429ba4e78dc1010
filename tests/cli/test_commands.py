"""Bad input: one line naming the problem, exit code 2, no traceback, nothing written lost."""

import json

import pytest

from relayrl.cli.main import main

TINY = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=1",
        "data.n_train=32", "data.n_eval=8", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_tokens=4", "eval.max_tokens=4", "run.loggers=[]"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def cfg_file(tmp_path):
    def write(text):
        p = tmp_path / "cfg.yaml"
        p.write_text(text)
        return str(p)
    return write


CASES = {
    "malformed yaml": ("run: {steps: [1,\n", [], "malformed YAML"),
    "unknown key": ("trainer:\n  lrr: 0.1\n", [], "unknown key 'trainer.lrr'"),
    "wrong type": ("trainer:\n  lr: fast\n", [], "trainer.lr"),
    "group size 1": ("{}", ["rollout.group_size=1"], "rollout.group_size"),
    "negative lr": ("trainer:\n  lr: -0.001\n", [], "trainer.lr"),
    "missing model dir": ("model:\n  path: /nonexistent/model\n", [], "model directory not found: /nonexistent/model"),
    "reward not importable": ("reward:\n  functions: [{name: 'nosuchmod:fn'}]\n", [], "nosuchmod:fn"),
    "agent not importable": ("data: {task: calculator, chat_template: always}\n", ["rollout.agent=nosuchmod:run"],
                             "cannot load agent 'nosuchmod:run'"),
    "agent and env": ("env: {name: calculator}\n", ["rollout.agent=env:calculator"], "set one of them"),
    "agent's unknown environment": ("{}", ["rollout.agent=env:nosuchenv"], "nosuchenv"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_one_line_exit_2(case, cfg_file, tmp_path, capsys):
    text, extra, needle = CASES[case]
    code, err = run_cli(capsys, "train", cfg_file(text), f"run.out_dir={tmp_path / 'run'}", *TINY, *extra)
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert needle in err, err


@pytest.mark.e2e
def test_dataset_errors(tmp_path, cfg_file, capsys):
    no_prompt = tmp_path / "d.jsonl"
    no_prompt.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    model = tmp_path / "m"
    code, err = run_cli(capsys, "sft", f"sft.out_dir={tmp_path / 's'}", "sft.steps=1", *TINY[:3], "data.n_eval=1")
    assert code == 0
    model = tmp_path / "s" / "model"
    for path, needle in ((no_prompt, "prompt"), (empty, "empty")):
        code, err = run_cli(capsys, "train", cfg_file("{}"), f"model.path={model}", "data.task=file",
                            f"data.path={path}", "data.n_eval=1", f"run.out_dir={tmp_path / 'r'}")
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.e2e
def test_existing_run_is_not_overwritten(tmp_path, cfg_file, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    code, err = run_cli(capsys, "train", cfg_file("{}"), f"run.out_dir={out}", *TINY)
    assert code == 2 and "--resume" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.e2e
def test_debug_shows_traceback(cfg_file, capsys):
    from relayrl.errors import ConfigError

    with pytest.raises(ConfigError):
        main(["--debug", "train", cfg_file("trainer:\n  lrr: 1\n")])


@pytest.mark.e2e
def test_train_report_generate_eval_roundtrip(tmp_path, cfg_file, capsys):
    out = tmp_path / "run"
    code, _ = run_cli(capsys, "train", cfg_file("{}"), f"run.out_dir={out}", "run.steps=2", *TINY)
    assert code == 0
    code, _ = run_cli(capsys, "train", "run.steps=3", "--resume", str(out))
    assert code == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 2, 3, 3]  # eval@0, train 1, train 2, eval@2, then resumed: train 3, eval@3
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (out / "report" / "reward.png").stat().st_size > 1000
    # the bottleneck section: printed after the plots' paths, and written beside them
    section = (out / "report" / "bottleneck.md").read_text()
    assert section.startswith("## Bottleneck") and "Share of the step:" in section and "### Findings" in section
    assert printed.endswith(section)
    code = main(["generate", "--model", str(out / "final_model"), "12+3=", "--max-tokens", "3"])
    printed = capsys.readouterr()  # the completion alone on stdout; how it ended on stderr
    assert code == 0 and printed.err.startswith("[prompt 0, sample 0: ") and not printed.out.startswith("12+3=")
    code = main(["eval", "--model", str(out / "final_model"), "--task", "arith", "--n", "4", "--max-tokens", "3"])
    assert code == 0 and "eval/accuracy=" in capsys.readouterr().out


@pytest.mark.unit
def test_shipped_configs_validate():
    from pathlib import Path

    from relayrl.config import load_yaml
    from relayrl.controller.config import load_run_config
    from relayrl.jobs.sft import SFTJobConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    assert load_run_config(root / "grpo_arith.yaml").rollout.group_size == 8
    assert SFTJobConfig.from_dict(load_yaml(root / "sft_arith.yaml")).sft.steps == 300
    agent = load_run_config(root / "agent_calculator.yaml")
    assert agent.env.name == "calculator" and agent.data.chat_template == "always"
    sft = SFTJobConfig.from_dict(load_yaml(root / "sft_agent_calculator.yaml"))
    assert sft.env.params == {"direct_share": 0.75} and sft.data.task == "calculator"


@pytest.mark.e2e
def test_eval_in_an_environment(tmp_path, capsys):
    from relayrl.data import get_task
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    shape = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    model = build_tiny_model(tmp_path / "m", get_task("calculator").alphabet, shape, tool_tokens=True)
    argv = ["eval", "--model", str(model), "--task", "calculator", "--task-params", '{"digits": [2, 2]}',
            "--env", "calculator", "--n", "4", "--max-tokens", "8"]
    assert main(argv) == 0
    held, figures = capsys.readouterr().out.strip().splitlines()
    out = dict(kv.split("=") for kv in figures.split())
    assert held.startswith("held-out: 4 prompts  reward ") and "success rate" in held
    assert out["eval/n"] == "4" and float(out["eval/turns"]) >= 1.0 and "eval/tool_calls" in out
    code, err = run_cli(capsys, *argv[:6], '{"digits": [2, 2]', *argv[7:])
    assert code == 2 and err == ("relayrl: error: --task-params is not JSON: Expecting ',' delimiter "
                                 "(e.g. '{\"digits\": [2, 2, 2]}')")


@pytest.mark.e2e
def test_sync_plan_command(capsys):
    assert main(["sync-plan", "--preset", "tiny-gqa", "--trainer-tp", "2", "--engine-tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "qkv_proj" in out
    code, err = run_cli(capsys, "sync-plan", "--preset", "tiny-gqa", "--model", "/x")
    assert code == 2 and "exactly one of" in err


@pytest.mark.e2e
def test_a_bad_sync_stops_the_run_in_one_line_and_keeps_the_checkpoint(tmp_path, cfg_file, capsys, monkeypatch):
    """The second sync (the start of step 2: step 1 trains on the first evaluation's) corrupts one weight in the
    engine: the canary stops the run with the piece named; the step-1 checkpoint and metrics stay, and the run
    resumes from them."""
    import relayrl.roles.sync_steps as ws

    real, calls = ws.sync_step, {"n": 0}

    def corrupting(spec, **kw):
        out = real(spec, **kw)
        calls["n"] += 1
        if calls["n"] == 2:
            kw["params"]["layers.0.mlp.down_proj.weight"][:, :4] *= -3.0
        return out

    monkeypatch.setattr(ws, "sync_step", corrupting)
    out = tmp_path / "run"
    args = ["train", cfg_file("{}"), f"run.out_dir={out}", *TINY, "run.steps=3", "run.save_every=1",
            "model.tiny.init_std=0.5"]
    code, err = run_cli(capsys, *args)
    assert code == 2
    (line,) = [x for x in err.splitlines() if not x.startswith("grpo:")]  # the progress bar aside: one line
    assert line.startswith("relayrl: error: weight sync verification failed after sync before step 2")
    assert "first parameter whose checksum differs: engine rank 0 layers.0.mlp.down_proj.weight" in line
    assert (out / "checkpoints" / "step_00000001").is_dir()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    monkeypatch.setattr(ws, "sync_step", real)
    code, err = run_cli(capsys, "train", "--resume", str(out))
    assert code == 0, err


# ---------------------------------------------------------------------------- relayrl eval of a run
ARITH_RANGE = {"digits": 1, "ops": "+-", "num_operands": 3}  # not arith's defaults, as the demo's


@pytest.fixture(scope="module")
def arith_run(tmp_path_factory):
    """A 2-step run on a non-default arith range, rewarded by a user function with spread (so eval/reward and the
    response lengths say which completions were drawn): its directory and its last evaluation line."""
    from relayrl.jobs.train import train

    from helpers import cfg_for

    tmp = tmp_path_factory.mktemp("eval_run")
    cfg = cfg_for(tmp, "run", data={"task_params": ARITH_RANGE}, run={"steps": 2, "save_every": 0},
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]})
    train(cfg, show_progress=False)
    run = tmp / "run"
    last = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2
    return run, {k: v for k, v in last.items() if k != "step"}


def printed(res: dict) -> str:
    return "  ".join(f"{k}={v:.4g}" for k, v in res.items())


@pytest.mark.e2e
def test_eval_of_a_run_is_its_last_evaluation(arith_run, capsys):
    """`relayrl eval --run RUN` evaluates the final model with the run's task parameters, reward, eval settings and
    engine: the figures of the run's own last evaluation, exactly (same greedy decoding, same examples)."""
    from relayrl.data import build_datasets
    from relayrl.jobs.eval import run_eval
    from relayrl.jobs.eval_config import Flags, eval_job

    run, last = arith_run
    job, notice = eval_job(None, str(run))
    assert notice is None and job.model_dir == str(run / "final_model")
    assert job.data.task_params == ARITH_RANGE and job.data.n_eval == 16 and job.max_tokens == 4
    assert run_eval(job) == last
    # the run's problems, not the task's defaults
    _, defaults = build_datasets(eval_job(None, str(run), Flags(task_params={}))[0].data)
    assert [ex.prompt for ex in build_datasets(job.data)[1]] != [ex.prompt for ex in defaults]
    for argv in (["--run", str(run)], ["--model", str(run)]):  # a run directory given as --model: the same
        assert main(["eval", *argv]) == 0
        out = capsys.readouterr()
        assert out.out.strip().splitlines()[-1] == printed(last) and out.err == ""
    # flags override the run's settings
    assert main(["eval", "--run", str(run), "--n", "4", "--max-tokens", "2"]) == 0
    figures = dict(kv.split("=") for kv in capsys.readouterr().out.strip().splitlines()[-1].split())
    assert figures["eval/n"] == "4" and float(figures["eval/response_length"]) <= 2


@pytest.mark.e2e
def test_eval_of_a_runs_model_directory_says_it_uses_the_run(arith_run, tmp_path, capsys):
    """--model RUN/final_model: the run's settings, and one line on stderr saying so. A bare copy of the model on a
    built-in task without --task-params: the task's defaults, and one line saying they may not be the run's."""
    import shutil

    run, last = arith_run
    assert main(["eval", "--model", str(run / "final_model")]) == 0
    out = capsys.readouterr()
    assert out.out.strip().splitlines()[-1] == printed(last)
    assert out.err == (f"relayrl: {run / 'final_model'} is the model of run {run}: evaluating with that run's "
                       f"settings ({run / 'config.yaml'}); flags given override them\n")
    bare = shutil.copytree(run / "final_model", tmp_path / "bare")
    assert main(["eval", "--model", str(bare), "--task", "arith", "--n", "4", "--max-tokens", "3"]) == 0
    out = capsys.readouterr()
    assert "eval/accuracy=" in out.out
    assert out.err == (f"relayrl: note: {bare} has no run config beside it, so task 'arith' uses its default "
                       "parameters, which may differ from the training run's; give --task-params, or --run RUN_DIR\n")
    argv = ["eval", "--model", str(bare), "--task-params", json.dumps(ARITH_RANGE), "--n", "4", "--max-tokens", "3"]
    assert main(argv) == 0 and capsys.readouterr().err == ""  # the parameters given: nothing to say
    code, err = run_cli(capsys, "eval", "--run", str(bare))
    assert code == 2 and err == f"relayrl: error: {bare} is not a run directory (no config.yaml); give --run the " \
                                "run's out_dir"
    code, err = run_cli(capsys, "eval")
    assert code == 2 and err == "relayrl: error: relayrl eval needs --model MODEL_DIR or --run RUN_DIR"


@pytest.mark.e2e
def test_eval_of_an_sft_run_is_its_last_evaluation(tmp_path, capsys):
    """An SFT run directory: its model/ with its settings (rule rewards only, as its own evaluation)."""
    out = tmp_path / "s"
    code, _ = run_cli(capsys, "sft", f"sft.out_dir={out}", "sft.steps=1", "sft.batch_size=8", *TINY[:3],
                      "data.n_eval=4", "data.task_params={digits: 1}", "eval.max_tokens=3", "sft.tensorboard=false")
    assert code == 0
    last = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert main(["eval", "--run", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == printed({k: v for k, v in last.items() if k != "step"})
