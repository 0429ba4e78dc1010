"""Input bounded before it is sized, and every malformed input one line (issue 36, problems 7-10).

Each case as a user or an attacker would bring it, through the command line where it is a file (a YAML config,
a dataset, a model directory: one line, exit 2, nothing of a run written) and through the agent loop where it
comes from an environment or the model (a reset of the wrong type, a 10 MB observation, a chat template that
raises, a tool call nested 3000 deep: that episode fails or the model reads an `error:` line, and the run goes on).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.data import Example
from relayrl.data.agent_tasks import PRINTABLE
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.envs.base import StepResult, make_env, register_env
from relayrl.envs.config import EnvConfig
from relayrl.errors import EnvError
from relayrl.models.config import TinyModelConfig
from relayrl.models.tiny import build_tiny_model
from relayrl.models.tokenizer import build_char_tokenizer
from relayrl.rollout.agent_loop import AgentLoop, episode_metrics
from tests.helpers import perturbed_model, small_config

pytestmark = pytest.mark.faults

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_arith.yaml")


def one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("relayrl: error: "), err
    return err.removeprefix("relayrl: error: ")


def nothing_written(out: Path) -> None:
    """A refused start trains nothing: no checkpoint, no metrics."""
    assert not any((out / name).exists() for name in ("checkpoints", "metrics.jsonl")), out


# ---- YAML configs -------------------------------------------------------------------------------------------------

def alias_bomb() -> str:
    """9 anchors of 9 aliases each: 700 bytes of text, 9**9 (387 million) strings once expanded."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "\n".join(lines + ["trainer: *a8", ""])


YAML_CASES = {
    "duplicate key": ("run:\n  steps: 2\ntrainer:\n  lr: 0.1\ntrainer:\n  lr: 0.2\n",
                      "at line 5, column 1: duplicate key 'trainer' (first at line 3): write each key once "
                      "(merge the two blocks)"),
    "alias bomb": (alias_bomb(), "at line 6, column 5: the document expands to more than 100000 nodes (aliases of "
                                 "aliases: an alias bomb?); write the values out or use fewer aliases"),
    "nested 50k deep": ("run: " + "[" * 50_000 + "]" * 50_000 + "\n", "at line 1, column 105: nested deeper than "
                                                                       "100 levels"),
    "5000-digit number": ("run:\n  steps: " + "7" * 5000 + "\n", "at line 2, column 10: an integer of 5000 digits "
                                                                 "is too long"),
}


@pytest.mark.parametrize("case", sorted(YAML_CASES))
def test_a_malformed_or_hostile_yaml_config_is_one_line(tmp_path, capsys, case):
    text, where = YAML_CASES[case]
    path = tmp_path / "c.yaml"
    path.write_text(text)
    t0 = time.monotonic()
    line = one_line(capsys, main(["train", str(path), f"run.out_dir={tmp_path / 'run'}"]))
    assert line == f"malformed YAML in {path} {where}"
    assert time.monotonic() - t0 < 10  # the bomb is refused while composed, never expanded
    nothing_written(tmp_path / "run")


def test_data_n_train_past_the_bound_is_one_line(tmp_path, capsys):
    line = one_line(capsys, main(["train", CONFIG, "data.n_train=10000000000", f"run.out_dir={tmp_path}"]))
    assert line.startswith("config error: data.n_train: Value error, at most 1,000,000 generated examples are held "
                           "in memory, got 10,000,000,000; "), line
    nothing_written(tmp_path)


# ---- dataset files --------------------------------------------------------------------------------------------------

def file_run(tmp_path, rows_text: str) -> tuple[Path, list[str]]:
    data = tmp_path / "d.jsonl"
    data.write_text(rows_text)
    return data, ["train", CONFIG, "data.task=file", f"data.path={data}", "data.n_eval=1",
                  f"run.out_dir={tmp_path / 'run'}"]


GOOD = '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'
DATA_CASES = {
    "a row nested 200k deep": ('{"prompt": "3+3=", "answer": ' + "[" * 200_000 + "]" * 200_000 + "}\n",
                               "malformed JSON in {p} at line 3: nested deeper than 100 levels (column 1)"),
    "a 5000-digit number": ('{"prompt": "3+3=", "answer": ' + "6" * 5000 + "}\n",
                            "malformed JSON in {p} at line 3: a number of 5000 digits is too long (column 30)"),
    "a null answer": ('{"prompt": "3+3=", "answer": null}\n',
                      "{p} line 3: answer field 'answer' is null; give the row its answer, or set data.answer_field: "
                      "null if the dataset has no answers (a null would become the text 'None')"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_a_malformed_dataset_row_is_one_line_naming_file_and_line(tmp_path, capsys, case):
    row, want = DATA_CASES[case]
    data, argv = file_run(tmp_path, GOOD + row)
    assert one_line(capsys, main(argv)) == want.format(p=data)
    nothing_written(tmp_path / "run")


def test_a_100_mb_prompt_line_is_one_line_not_an_abort_in_the_tokenizer(tmp_path, capsys):
    # 17 MiB stands for the 100 MB: past the 16 MiB a row may hold, so it is refused without being read whole
    data, argv = file_run(tmp_path, GOOD + '{"prompt": "' + "1+" * (17 * 2**19) + '1=", "answer": "3"}\n')
    t0 = time.monotonic()
    assert one_line(capsys, main(argv)) == (f"{data} line 3 is longer than 16 MiB, past what one row may hold; "
                                            "shorten the row (or split the text over several rows)")
    assert time.monotonic() - t0 < 20
    nothing_written(tmp_path / "run")


def test_a_prompt_longer_than_the_model_holds_is_refused_before_it_is_tokenized(tmp_path, capsys):
    # 40,000 characters of a character-level tokenizer (tokens of at most a dozen characters) with the tiny
    # model's 512 positions: refused by its length before the start-up check tokenizes every prompt
    data, argv = file_run(tmp_path, GOOD * 2 + '{"prompt": "' + "1+" * 20_000 + '1=", "answer": "3"}\n')
    line = one_line(capsys, main(argv))
    model = re.escape(str(tmp_path / "run" / "base_model"))
    assert re.fullmatch(rf"(train|eval) example \d+ \(row 4 of {re.escape(str(data))}, counting from 0\): the prompt "
                        rf"has 40,002 characters, far more than the 512 tokens {model} holds can take \(its tokens "
                        r"are at most 5 characters each\); shorten the prompt or drop it", line), line


# ---- model directories ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("m") / "base"
    build_tiny_model(out, "0123456789+=", TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=4, num_key_value_heads=2))
    return out


def broken_copy(model_dir: Path, tmp_path: Path, case: str) -> tuple[Path, str]:
    m = tmp_path / "m"
    shutil.copytree(model_dir, m)
    cfg = json.loads((m / "config.json").read_text())
    cfg_file = m / "config.json"
    if case == "num_attention_heads 0":
        cfg_file.write_text(json.dumps(dict(cfg, num_attention_heads=0)))
        return m, f"{cfg_file}: num_attention_heads must be at least 1, got 0"
    if case == "hidden_size '32'":
        cfg_file.write_text(json.dumps(dict(cfg, hidden_size="32")))
        return m, f"{cfg_file}: hidden_size must be an integer, got '32' (str)"
    if case == "a list":
        cfg_file.write_text(json.dumps([cfg]))
        return m, f"{cfg_file}: the top level must be a JSON object, got list"
    if case == "nested 100k deep":
        cfg_file.write_text("[" * 100_000 + "]" * 100_000)
        return m, f"malformed {cfg_file}: nested deeper than 100 levels: line 1 column 1 (char 0)"
    if case == "weight_map a list":
        (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
        return m, (f"malformed {m / 'model.safetensors.index.json'}: weight_map must be an object of tensor name -> "
                   "file name, got list; rewrite the index or remove it")
    assert case == "hidden_size 1e9"
    cfg_file.write_text(json.dumps(dict(cfg, hidden_size=10**9)))
    return m, (f"{m}: tensor 'model.embed_tokens.weight' has shape (29, 32), the model config implies "
               "(29, 1000000000); check that the weights belong to this config.json")


MODEL_CASES = ["num_attention_heads 0", "hidden_size '32'", "a list", "nested 100k deep", "weight_map a list",
               "hidden_size 1e9"]


@pytest.mark.parametrize("case", MODEL_CASES)
def test_a_malformed_model_directory_is_one_line(model_dir, tmp_path, capsys, case):
    m, want = broken_copy(model_dir, tmp_path, case)
    assert one_line(capsys, main(["generate", "--model", str(m), "1+1="])) == want
    # train and eval resolve model.path the same way, before any worker starts
    assert one_line(capsys, main(["train", CONFIG, f"model.path={m}", f"run.out_dir={tmp_path / 'run'}"])) == want
    nothing_written(tmp_path / "run")


def test_hidden_size_1e9_is_refused_before_anything_of_its_size_is_allocated(model_dir, tmp_path, monkeypatch):
    """load_pretrained (what every trainer rank calls) checks the shapes on the meta model: nothing is
    materialised (to_empty) for a config that does not describe its weights."""
    import torch

    from relayrl.errors import ModelDirError
    from relayrl.models import load_pretrained

    m, want = broken_copy(model_dir, tmp_path, "hidden_size 1e9")
    materialised = []
    to_empty = torch.nn.Module.to_empty
    monkeypatch.setattr(torch.nn.Module, "to_empty",
                        lambda self, **kw: materialised.append(type(self).__name__) or to_empty(self, **kw))
    with pytest.raises(ModelDirError) as e:
        load_pretrained(m)
    assert str(e.value) == want and materialised == []
    assert load_pretrained(model_dir).config.hidden_size == 32 and materialised == ["CausalLM"]


# ---- environments and tools -----------------------------------------------------------------------------------------

@register_env("test_bounds")
class BoundsEnv:
    """Misbehaves as its example's prompt says: 'reset_str' (reset returns a string), 'huge' (a 10 MB
    observation), 'boom' (an observation the chat template raises on); 'good' answers and ends."""

    tools: list = []

    def reset(self, example):
        self.mode = example.prompt
        return "hello" if self.mode == "reset_str" else [{"role": "user", "content": "go"}]

    def step(self, message):
        if self.mode == "huge":
            return StepResult([{"role": "user", "content": "x" * 10_000_000}], 0.0, False, {})
        if self.mode == "boom":
            return StepResult([{"role": "user", "content": "BOOM"}], 0.0, False, {})
        return StepResult(None, 1.0, True, {})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tok = build_char_tokenizer(tmp_path_factory.mktemp("tok"), PRINTABLE, tool_tokens=True)
    # the template refuses any message holding BOOM, as a real template refuses roles out of order
    tok.chat_template = ("{% for m in messages %}{% if 'BOOM' in m['content'] %}{{ raise_exception('no BOOM "
                         "here') }}{% endif %}{% endfor %}" + tok.chat_template)
    cfg = small_config(vocab_size=len(tok), max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    eng = LLMEngine.from_model(perturbed_model(cfg, seed=3).eval(), tok, kv_cache_bytes=32 << 20)
    yield eng
    eng.close()


def run_episodes(engine, prompts: list[str], **env) -> list:
    loop = AgentLoop(engine, EnvConfig(name="test_bounds", max_turns=3, max_total_tokens=200, **env))
    sp = SamplingParams(n=2, max_tokens=4, seed=0, ignore_eos=True)
    try:
        return loop.run([Example(p, "") for p in prompts], [sp] * len(prompts))
    finally:
        loop.close()


def test_a_reset_of_the_wrong_type_fails_its_episodes_counted_and_the_run_goes_on(engine):
    trajs = run_episodes(engine, ["reset_str", "good"])
    assert [(t.finish, t.error) for t in trajs[:2]] == [
        ("env_error", "reset() must return a non-empty list of messages, got a str")] * 2
    assert [(t.finish, t.reward) for t in trajs[2:]] == [("done", 1.0)] * 2
    assert episode_metrics(trajs)["env/errors"] == 0.5


def test_a_10_mb_observation_ends_its_episode_without_being_tokenized(engine):
    t0 = time.monotonic()
    trajs = run_episodes(engine, ["huge", "good"])
    assert time.monotonic() - t0 < 20  # tokenizing it took minutes (257 s in the issue)
    assert [t.finish for t in trajs] == ["max_total_tokens"] * 2 + ["done"] * 2
    assert all(len(t.prompt_ids) + len(t.response_ids) <= 200 for t in trajs)


def test_a_chat_template_that_raises_mid_run_fails_its_episode_and_everywhere_is_one_line(engine):
    trajs = run_episodes(engine, ["boom", "good"])
    assert [t.finish for t in trajs] == ["env_error"] * 2 + ["done"] * 2
    assert trajs[0].error == ("the chat template raised TemplateError: no BOOM here while rendering 3 message(s) "
                              "(roles: user, assistant, user)")
    with pytest.raises(EnvError) as e:  # every episode: the run stops in one line (the CLI's exit 2)
        run_episodes(engine, ["boom"])
    assert str(e.value) == ("environment 'test_bounds' failed on every episode of the step, e.g.: " + trajs[0].error)


@pytest.mark.parametrize("arguments, why", [
    ("[" * 3000 + "]" * 3000, "nested deeper than 100 levels at line 1 column 1"),
    ('{"expression": ' + "9" * 5000 + "}", "a number of 5000 digits is too long at line 1 column 52"),
])
def test_a_hostile_tool_call_is_answered_with_an_error_line(arguments, why):
    env = make_env(EnvConfig(name="calculator"))
    env.reset(Example("What is 2+2?", "4"))
    out = env.step({"role": "assistant", "content": f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}'
                                                    "</tool_call>"})
    assert out.observation == [{"role": "tool", "name": "error",
                                "content": f"error: malformed tool call: block 1: malformed JSON ({why})"}]
    assert (out.done, out.info["tool_errors"]) == (False, 1)
