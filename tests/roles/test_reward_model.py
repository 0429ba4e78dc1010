"""Reward models as a scorer role: scores equal transformers' AutoModelForSequenceClassification on the same
texts (padded batches, truncation, chat-message prompts), the weighted sum with rule functions by hand, the
worker group equal to the driver's process, a GRPO run logging the model's reward, and bad input in one line."""

import pytest
import torch
import transformers

from relayrl.data.arith import ArithTask
from relayrl.data.tasks import Example
from relayrl.errors import ConfigError, DataError, ModelDirError
from relayrl.jobs.build import build_scorer_for
from relayrl.jobs.train import train
from relayrl.models import save_pretrained
from relayrl.models.score import ScoreModel, save_score_model
from relayrl.models.tokenizer import build_char_tokenizer
from relayrl.observe import read_metrics
from relayrl.rewards import task_reward
from relayrl.roles.reward_model import ModelEntry, ModelScorer, RewardModel, render

from helpers import cfg_for, perturbed_model, small_config

CHARS = "0123456789+-=*abcdefghijklmnopqrstuvwxyz ?"
MAX_LEN = 48


def _score_dir(path, num_labels=1, chat_template=True):
    """A tiny llama classifier (std-0.2 weights, a random head) with a char tokenizer."""
    tok = build_char_tokenizer(path.parent / f".tok_{path.name}", CHARS)
    cfg = small_config(vocab_size=len(tok), max_position_embeddings=MAX_LEN)
    model = ScoreModel(cfg, num_labels)
    model.reset_parameters(std=0.2, seed=3)
    save_score_model(model, path)
    build_char_tokenizer(path, CHARS)
    if not chat_template:
        import json

        p = path / "tokenizer_config.json"
        tc = json.loads(p.read_text())
        tc.pop("chat_template")
        p.write_text(json.dumps(tc))
        (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return _score_dir(tmp_path_factory.mktemp("rm") / "rm")


def _hf(path, tok):
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    hf.config.pad_token_id = tok.pad_token_id
    return hf


def _hf_scores(hf, rows, pad_id):
    """transformers' own forward: one row at a time (no padding), and all rows right-padded in one batch."""
    with torch.no_grad():
        alone = [hf(input_ids=torch.tensor([r])).logits[0, 0].item() for r in rows]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        batched = hf(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()
    return alone, batched


def _score_once(cfg, completions, examples):
    """The run's scorer, built, used once and closed (its reward pool stops)."""
    scorer = build_scorer_for(cfg)
    try:
        return scorer.score(completions, examples)
    finally:
        scorer.close()


@pytest.mark.equivalence
def test_scores_equal_transformers_on_padded_batches_and_truncation(rm_dir):
    entry = ModelEntry(name="model", key="k", path=str(rm_dir), weight=1.0, batch_size=2)
    scorer, rm = ModelScorer([entry]), RewardModel(entry)  # the scorer's worker group (inline); rm: its tokenizer
    prompts = ["1+2=", "12*3-4=", "what is 7?", "a", "9-8="]
    completions = ["3", "32", " seven", "bcdefghijklmnopqrstuvwxyz0123456789" * 2, ""]
    examples = [Example(p, "") for p in prompts]
    got = scorer.score(completions, examples)["model"]
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    # a char tokenizer without special tokens: one id per character; the long one keeps its last MAX_LEN
    rows = [rm.tokenizer(t[-MAX_LEN:], add_special_tokens=False)["input_ids"] for t in texts]
    assert len(texts[3]) > MAX_LEN and len({len(r) for r in rows}) == 5  # truncation, and padding in every batch
    alone, batched = _hf_scores(_hf(rm_dir, rm.tokenizer), rows, rm.tokenizer.pad_token_id)
    assert got == pytest.approx(alone, abs=1e-5)
    assert got == pytest.approx(batched, abs=1e-5)
    assert max(got) - min(got) > 1e-2  # the scores differ: a constant could not pass


@pytest.mark.equivalence
def test_chat_prompts_render_the_conversation_and_match_transformers(rm_dir):
    entry = ModelEntry(name="model", key="k", path=str(rm_dir), weight=1.0)
    scorer, tok = ModelScorer([entry]), RewardModel(entry).tokenizer
    examples = [Example([{"role": "user", "content": "1+2="}], ""),
                Example([{"role": "system", "content": "be exact"}, {"role": "user", "content": "9*9="}], "")]
    completions = ["3", "81"]
    # the tiny template by hand: "role: content\n", the assistant's turn ending with EOS
    texts = ["user: 1+2=\nassistant: 3<eos>\n", "system: be exact\nuser: 9*9=\nassistant: 81<eos>\n"]
    rows = [render(tok, ex.prompt, c) for ex, c in zip(examples, completions, strict=True)]
    assert [tok.decode(r) for r in rows] == texts and max(len(r) for r in rows) <= MAX_LEN  # not truncated
    got = scorer.score(completions, examples)["model"]
    alone, batched = _hf_scores(_hf(rm_dir, tok), rows, tok.pad_token_id)
    assert got == pytest.approx(alone, abs=1e-5)
    assert got == pytest.approx(batched, abs=1e-5)


def _arith_batch():
    task = ArithTask()
    exs = task.generate(3, seed=0)
    completions = [exs[0].answer, "x", exs[1].answer + "7", exs[2].answer]
    return completions, [exs[0], exs[0], exs[1], exs[2]]


@pytest.mark.unit
def test_weighted_sum_with_rule_functions_by_hand(tmp_path, rm_dir):
    fns = [{"name": "task", "weight": 0.5}, {"name": "model", "path": str(rm_dir), "weight": 2.0},
           {"name": "model", "path": str(rm_dir), "weight": -1.0, "params": {"batch_size": 1}}]
    cfg = cfg_for(tmp_path, "w", reward={"functions": fns, "workers": 0})
    completions, examples = _arith_batch()
    res = _score_once(cfg, completions, examples)
    assert list(res.per_function) == ["task", "model", "model#2"]
    task = [task_reward(c, ex) for c, ex in zip(completions, examples, strict=True)]
    assert res.per_function["task"] == task and task == [1.0, 0.0, 0.0, 1.0]
    alone = ModelScorer([ModelEntry(name="m", key="k", path=str(rm_dir), weight=1.0)]).score(completions, examples)
    assert res.per_function["model"] == pytest.approx(alone["m"], abs=1e-6)
    # batch size changes nothing but the matmuls' blocking: equal to ~8 fp32 ulps (a value of 2.07 was seen 5 off)
    assert res.per_function["model#2"] == pytest.approx(alone["m"], rel=1e-6, abs=1e-6)
    m, m2 = res.per_function["model"], res.per_function["model#2"]
    assert res.rewards == [0.0 + 0.5 * t + 2.0 * a - 1.0 * b for t, a, b in zip(task, m, m2, strict=True)]
    assert res.correct == [True, False, False, True] and res.failures == 0
    assert res.metrics()["reward/model/mean"] == pytest.approx(sum(m) / 4)


@pytest.mark.unit
def test_only_models_keep_accuracy_from_the_task(tmp_path, rm_dir):
    cfg = cfg_for(tmp_path, "o", reward={"functions": [{"name": "model", "path": str(rm_dir), "weight": 3.0}],
                                         "workers": 0})
    completions, examples = _arith_batch()
    res = _score_once(cfg, completions, examples)
    assert list(res.per_function) == ["model"]
    assert res.rewards == [0.0 + 3.0 * v for v in res.per_function["model"]]
    assert res.correct == [True, False, False, True]  # the task's score, as with rule functions


@pytest.mark.equivalence
def test_worker_group_equals_driver_process(tmp_path, rm_dir):
    fns = [{"name": "task"}, {"name": "model", "path": str(rm_dir), "weight": 0.25}]
    completions, examples = _arith_batch()
    results = []
    for backend in ("none", "local"):
        cfg = cfg_for(tmp_path, backend, reward={"functions": fns, "workers": 0}, parallel={"backend": backend})
        scorer = build_scorer_for(cfg)
        try:
            kind = scorer.models.group.backend_name  # one role class; where it runs is the group's backend
            results.append((kind, scorer.score(completions, examples)))
        finally:
            scorer.close()
    (k0, a), (k1, b) = results
    assert (k0, k1) == ("inline", "local")
    assert b.per_function["model"] == pytest.approx(a.per_function["model"], abs=1e-6)
    assert b.rewards == pytest.approx(a.rewards, abs=1e-6) and b.correct == a.correct


@pytest.mark.e2e
def test_grpo_run_logs_the_reward_model(tmp_path, rm_dir):
    cfg = cfg_for(tmp_path, "grpo", run={"steps": 2, "save_every": 0},
                  reward={"functions": [{"name": "model", "path": str(rm_dir)}], "workers": 0})
    train(cfg, show_progress=False)
    lines = [m for m in read_metrics(tmp_path / "grpo") if "reward/mean" in m and "reward/std" in m]
    assert len(lines) == 2
    for m in lines:
        assert m["reward/mean"] == pytest.approx(m["reward/model/mean"], abs=1e-6)  # the model is the reward
        assert m["reward/std"] > 0  # different completions, different scores: the groups carry signal
        assert m["reward/failures"] == 0


def _one_line(exc_info, *parts):
    msg = str(exc_info.value)
    assert "\n" not in msg
    for p in parts:
        assert p in msg, msg


@pytest.mark.unit
def test_bad_input_is_one_line(tmp_path, rm_dir):
    def scorer_for(fn):
        return build_scorer_for(cfg_for(tmp_path, "bad", reward={"functions": [fn], "workers": 0}))

    with pytest.raises(ModelDirError) as e:
        scorer_for({"name": "model", "path": str(tmp_path / "nowhere")})
    _one_line(e, "reward.functions.0.path", "nowhere")
    causal = tmp_path / "causal"
    save_pretrained(perturbed_model(small_config()), causal)
    build_char_tokenizer(causal, CHARS)
    with pytest.raises(ModelDirError) as e:
        scorer_for({"name": "model", "path": str(causal)})
    _one_line(e, "reward.functions.0.path", "score.weight")
    two = _score_dir(tmp_path / "two", num_labels=2)
    with pytest.raises(ModelDirError) as e:
        scorer_for({"name": "model", "path": str(two)})
    _one_line(e, "reward.functions.0.path", "num_labels", "2 labels")
    for fn, key in [({"name": "model"}, "needs path"), ({"name": "task", "path": str(rm_dir)}, "only for"),
                    ({"name": "model", "path": str(rm_dir), "params": {"batch_size": 0}}, "batch_size"),
                    ({"name": "model", "path": str(rm_dir), "params": {"temperature": 1}}, "params.temperature")]:
        with pytest.raises(ConfigError) as e:
            scorer_for(fn)
        _one_line(e, "reward.functions.0", key)
    plain = _score_dir(tmp_path / "plain", chat_template=False)
    scorer = ModelScorer([ModelEntry(name="model", key="k", path=str(plain), weight=1.0)])
    with pytest.raises(DataError) as e:
        scorer.score(["3"], [Example([{"role": "user", "content": "1+2="}], "3")])
    _one_line(e, "chat template")
