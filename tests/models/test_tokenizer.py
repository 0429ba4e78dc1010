"""The char tokenizer round-trips exactly through AutoTokenizer under every model family."""

import json

import pytest

from relayrl.errors import ModelDirError
from relayrl.models.tokenizer import build_char_tokenizer, load_tokenizer

pytestmark = pytest.mark.unit

CHARS = "0123456789+-*= \nabc"
TEXT = "12 + 7=19\n  3*4 =12\n\nabc  cba\n"


def _write_model_config(d, model_type):
    # Only what AutoConfig needs to pick the family; the tokenizer loader keys off model_type.
    cfg = {
        "model_type": model_type,
        "vocab_size": 64,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_round_trip_through_auto_tokenizer(tmp_path, model_type):
    built = build_char_tokenizer(tmp_path, CHARS, model_type)
    _write_model_config(tmp_path, model_type)
    tok = load_tokenizer(tmp_path)
    ids = tok.encode(TEXT, add_special_tokens=True)
    assert ids == built.encode(TEXT, add_special_tokens=True)
    assert len(ids) == len(TEXT)  # one token per character, no BOS/EOS added
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    # decoding one token at a time (as streaming generation does) gives back the characters
    assert "".join(tok.decode([i]) for i in ids) == TEXT


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_special_ids(tmp_path, model_type):
    build_char_tokenizer(tmp_path, CHARS, model_type)
    _write_model_config(tmp_path, model_type)
    tok = load_tokenizer(tmp_path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert tok.encode("0")[0] == 4  # characters follow the specials, in the order given
    assert tok.decode([1, 4, 5, 2], skip_special_tokens=True) == "01"


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_non_ascii_round_trip(tmp_path, model_type):
    # a non-ASCII character becomes one token per UTF-8 byte, and still decodes exactly
    build_char_tokenizer(tmp_path, "0é ", model_type)
    _write_model_config(tmp_path, model_type)
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("é 0é")
    assert tok.unk_token_id not in ids and tok.decode(ids) == "é 0é"


def test_unknown_char_is_unk(tmp_path):
    tok = build_char_tokenizer(tmp_path, "01", "llama")
    assert tok.encode("0%1") == [4, 3, 5]


def test_vocab_is_small_and_deduplicated(tmp_path):
    tok = build_char_tokenizer(tmp_path, "0011", "llama")
    # 4 specials + '0', '1' + the chat template's own characters
    assert len(tok) == len(set(tok.get_vocab().values()))
    assert len(tok) < 30


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_chat_template_renders(tmp_path, model_type):
    build_char_tokenizer(tmp_path, CHARS, model_type)
    _write_model_config(tmp_path, model_type)
    tok = load_tokenizer(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "system: be brief\nuser: 1+2=\nassistant: "
    # the template's own characters are in the vocab even though CHARS lacks most letters
    ids = tok.encode("user: 1+2=\nassistant: ")
    assert tok.unk_token_id not in ids


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ModelDirError, match="not found"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelDirError, match="no tokenizer files") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path)


def test_tool_tags_are_single_tokens_only_when_asked(tmp_path):
    plain = build_char_tokenizer(tmp_path / "plain", CHARS)
    tools = build_char_tokenizer(tmp_path / "tools", CHARS, tool_tokens=True)
    # the characters keep their ids; the four tags follow them, one token each
    assert tools.encode("12 + 7") == plain.encode("12 + 7")
    ids = tools.encode("<tool_call>1</tool_call>")
    assert len(ids) == 3 and ids[0] >= len(plain) and tools.decode(ids) == "<tool_call>1</tool_call>"
    assert len(plain.encode("<tool_call>")) > 1  # without them a tag is just characters
