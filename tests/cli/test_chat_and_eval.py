"""Chat templates outside training and `relayrl eval` with the user's reward and a run's settings, on tiny models:

    relayrl generate --chat / --no-chat / --system     the ids the engine is fed, compared with hand-templated ones;
                                                       generation_config.json's end-of-sequence ids stop sampling
    relayrl eval --run RUN                             a file dataset, a keyword-style reward, chat_template always
                                                       with a system prompt: the printed reward is the mean of the
                                                       reward applied by hand to the completions of the hand-templated
                                                       prompts; --config FILE, key=value overrides and an earlier
                                                       relayrl's config.yaml (use_chat_template) give the same
    bad input                                          one line, exit 2
"""

import json
import shutil

import pytest
import yaml

from relayrl.cli.main import main
from relayrl.models.tokenizer import CHAT_TEMPLATE_CHARS

pytestmark = pytest.mark.e2e

ALPHABET = "0123456789+=abefirsy "  # the sums, and the system prompt "be brief"
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, init_std=0.3)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", ALPHABET, TinyModelConfig(**SHAPE))


def engine_samples(model_dir, prompts, max_tokens, **params):
    """Greedy samples of the engine fed `prompts` (token ids) directly."""
    from relayrl.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(str(model_dir))
    try:
        outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=i, **params)
                                         for i in range(len(prompts))])
    finally:
        engine.close()
    return [o.samples[0] for o in outs]


def shown(s) -> str:
    return f"{s.finish_reason}, {len(s.token_ids)} tokens, logprob {sum(s.logprobs):.3f}]"


def test_generate_chat_feeds_the_engine_the_templated_prompt(tiny, tmp_path, capsys):
    from relayrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    templated = ids("system: be brief\nuser: 1+2=\nassistant: ")
    raw = [tok.bos_token_id] + ids("1+2=")
    want_chat, want_raw = engine_samples(tiny, [templated, raw], 6)
    assert want_chat.token_ids != want_raw.token_ids  # the two prompts are told apart by what follows

    code, out, err = run_cli(capsys, "generate", "--model", str(tiny), "--chat", "--system", "be brief", "1+2=",
                             "--max-tokens", "6")
    assert code == 0 and out == want_chat.text + "\n" and err == f"[prompt 0, sample 0: {shown(want_chat)}\n"
    for flag in (["--no-chat"], []):  # the tiny tokenizer's template is for conversations: auto sends raw text
        code, out, err = run_cli(capsys, "generate", "--model", str(tiny), *flag, "1+2=", "--max-tokens", "6")
        assert code == 0 and out == want_raw.text + "\n" and err == f"[prompt 0, sample 0: {shown(want_raw)}\n"

    # generation_config.json's end-of-sequence ids end a sample (an instruct model's end-of-turn token)
    toks = want_chat.token_ids
    assert len(toks) >= 3
    turn_end = toks[1]
    copy = shutil.copytree(tiny, tmp_path / "with_gen")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, turn_end]}))
    code, out, err = run_cli(capsys, "generate", "--model", str(copy), "--chat", "--system", "be brief", "1+2=",
                             "--max-tokens", "6")
    stopped = toks.index(turn_end) + 1
    assert code == 0 and err.startswith(f"[prompt 0, sample 0: stop, {stopped} tokens, ")
    assert want_chat.text.startswith(out.rstrip("\n"))


def test_generate_bad_chat_flags_are_one_line(tiny, tmp_path, capsys):
    bare = shutil.copytree(tiny, tmp_path / "bare")
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    cases = {
        (str(bare), "--chat"): f"--chat: the tokenizer of {bare} has no chat template; drop --chat (the prompt is then "
                               "sent as raw text) or add a chat_template to its tokenizer_config.json",
        (str(tiny), "--no-chat", "--system", "x"): "--system needs the chat template, but --no-chat sends raw text; "
                                                   "drop --system",
        (str(tiny), "--system", "x"): f"--system needs the chat template, but the chat template of {tiny} is for "
                                      "conversations only (relayrl's tiny tokenizers); drop --system, or give --chat",
    }
    for (model, *flags), want in cases.items():
        code, out, err = run_cli(capsys, "generate", "--model", model, *flags, "1+2=")
        assert (code, out, err) == (2, "", f"relayrl: error: {want}\n")
    # a character the tiny tokenizer lacks (in neither ALPHABET nor its chat template's) is refused, not dropped
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny), "1+2=", "What 1+2=")
    lost = ", ".join(repr(c) for c in dict.fromkeys("What ") if c not in ALPHABET + CHAT_TEMPLATE_CHARS)
    assert lost == "'W', 'h'"
    assert (code, out) == (2, "")
    assert err == (f"relayrl: error: command-line example 1: the prompt has characters the tokenizer of {tiny} cannot "
                   f"represent ({lost}), which the model would never see; rephrase the prompt, or use a model whose "
                   "tokenizer has them\n")


# ---------------------------------------------------------------------------- relayrl eval with the user's reward
KEYWORD_REWARD = '''
def overlap(completion, answer):  # the keyword form: filled by name
    return len(set(completion) & set(answer)) / len(set(answer))
'''


def overlap(completion, answer):
    return len(set(completion) & set(answer)) / len(set(answer))


@pytest.fixture(scope="module")
def chat_run(tiny, tmp_path_factory):
    """A 1-step run on a file dataset of sums, string prompts through the chat template with a system prompt,
    rewarded by a keyword-style function from a file."""
    from relayrl.jobs.train import train

    from helpers import cfg_for

    tmp = tmp_path_factory.mktemp("chat_run")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(7) for b in range(6)]
    (tmp / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "kw_reward.py").write_text(KEYWORD_REWARD)
    cfg = cfg_for(tmp, "run", model={"path": str(tiny)},
                  data={"task": "file", "path": str(tmp / "sums.jsonl"), "n_eval": 8, "chat_template": "always",
                        "system_prompt": "be brief"},
                  reward={"functions": [{"name": f"{tmp / 'kw_reward.py'}:overlap"}], "workers": 0},
                  run={"steps": 1, "save_every": 0})
    train(cfg, show_progress=False)
    return tmp / "run"


def figures(out: str) -> dict[str, float]:
    """The printed held-out line's figures and the key=value line's."""
    held, kv = out.strip().splitlines()
    return {"held": held, **{k: float(v) for k, v in (x.split("=") for x in kv.split())}}


def test_eval_run_scores_with_the_runs_reward_and_chat_template(chat_run, capsys):
    from relayrl.data import DataConfig, build_datasets
    from relayrl.models.tokenizer import load_tokenizer

    code, out, err = run_cli(capsys, "eval", "--run", str(chat_run))
    assert code == 0 and err == ""
    got = figures(out)
    # by hand: the run's held-out rows, templated as "system: ...\nuser: ...\nassistant: ", greedy, scored by overlap
    cfg = yaml.safe_load((chat_run / "config.yaml").read_text())
    _, held_out = build_datasets(DataConfig.from_dict(cfg["data"]))
    tok = load_tokenizer(chat_run / "final_model")
    prompts = [tok(f"system: be brief\nuser: {ex.prompt}\nassistant: ", add_special_tokens=False)["input_ids"]
               for ex in held_out]
    samples = engine_samples(chat_run / "final_model", prompts, cfg["eval"]["max_tokens"])
    rewards = [overlap(s.text, ex.answer) for s, ex in zip(samples, held_out, strict=True)]
    exact = [s.text.strip().split("\n")[0] == ex.answer for s, ex in zip(samples, held_out, strict=True)]
    assert len(held_out) == 8 and 0 < sum(rewards) < 8  # a reward with spread: the figure tells completions apart
    # the share the task calls correct is exact match here (a file dataset), named so beside the user's reward
    assert got["eval/reward"] == float(f"{sum(rewards) / 8:.4g}") and got["eval/exact_match"] == sum(exact) / 8
    length = sum(len(s.token_ids) for s in samples) / 8
    assert got["eval/n"] == 8 and got["eval/response_length"] == float(f"{length:.4g}")
    reward_fn = f"{chat_run.parent / 'kw_reward.py'}:overlap"
    assert got["held"] == (f"held-out: 8 prompts  reward {sum(rewards) / 8:.4f} (mean of {reward_fn})  exact match "
                           f"{sum(exact) / 8:.4f}  response length {length:.2f}")
    # the run's own last evaluation of the same model: the same figures
    last = json.loads((chat_run / "eval.jsonl").read_text().splitlines()[-1])
    assert last["eval/reward"] == pytest.approx(sum(rewards) / 8, abs=1e-12)


def test_eval_config_file_overrides_and_an_earlier_runs_config_agree(chat_run, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "eval", "--run", str(chat_run))
    want = figures(out)
    model = shutil.copytree(chat_run / "final_model", tmp_path / "bare")
    cfg = yaml.safe_load((chat_run / "config.yaml").read_text())
    reward_fn = cfg["reward"]["functions"][0]["name"]
    overrides = ["data.task=file", f"data.path={cfg['data']['path']}", "data.n_eval=8", "data.chat_template=always",
                 "data.system_prompt=be brief", f"reward.functions=[{{name: '{reward_fn}'}}]", "reward.workers=0",
                 f"eval.max_tokens={cfg['eval']['max_tokens']}"]
    # an earlier relayrl's run directory: use_chat_template: true where chat_template is now
    old = tmp_path / "old_run"
    old.mkdir()
    shutil.copytree(chat_run / "final_model", old / "final_model")
    old_cfg = json.loads(json.dumps(cfg))
    del old_cfg["data"]["chat_template"]
    old_cfg["data"]["use_chat_template"] = True
    (old / "config.yaml").write_text(yaml.safe_dump(old_cfg))
    for argv in (["--model", str(model), "--config", str(chat_run / "config.yaml")],
                 ["--model", str(model), *overrides],
                 ["--run", str(old)]):
        code, out, err = run_cli(capsys, "eval", *argv)
        assert code == 0 and err == "" and figures(out) == want, argv
    # the override changes what is evaluated: raw text instead of the template (the system prompt then refused)
    code, out, err = run_cli(capsys, "eval", "--run", str(chat_run), "data.chat_template=never",
                             "data.system_prompt=null")
    assert code == 0 and figures(out)["eval/n"] == 8 and figures(out) != want


def test_eval_bad_input_is_one_line(chat_run, tiny, tmp_path, capsys):
    bare = shutil.copytree(tiny, tmp_path / "bare")
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((bare / "tokenizer_config.json").read_text())
    tc.pop("chat_template")
    (bare / "tokenizer_config.json").write_text(json.dumps(tc))
    cases = [
        (["--model", str(bare), "--task-params", "{}", "--n", "2", "data.chat_template=always"],
         "data.chat_template is always but the tokenizer has no chat template; set data.chat_template=auto (or "
         "never) or add a chat_template to the tokenizer"),
        (["--run", str(chat_run), "data.use_chat_template=true"],
         f"{chat_run / 'config.yaml'}: config error: data: Value error, 'use_chat_template' was replaced: set "
         "data.chat_template: always (was true) or never (was false); auto, the default, renders string prompts "
         "through the model's chat template where it has one"),
        (["--config", str(chat_run / "config.yaml")], "--config gives the settings, not the model; add --model "
                                                       "MODEL_DIR"),
    ]
    for argv, want in cases:
        code, out, err = run_cli(capsys, "eval", *argv)
        assert (code, out, err) == (2, "", f"relayrl: error: {want}\n"), argv
    # sft (as train): the old key refused before any work
    code, out, err = run_cli(capsys, "sft", "data.use_chat_template=true", f"sft.out_dir={tmp_path / 's'}")
    assert code == 2 and err.count("\n") == 1 and "set data.chat_template: always (was true)" in err
