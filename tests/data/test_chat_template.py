"""data.chat_template (auto | always | never): what text and ids a prompt becomes under each mode, against
transformers' own apply_chat_template and hand-written strings, for relayrl's tiny tokenizer (its template is for
conversations: auto keeps string prompts raw) and for an instruct-style tokenizer with a ChatML template."""

import string

import pytest

from relayrl.config import apply_overrides
from relayrl.controller.config import RunConfig
from relayrl.data import DataConfig, Example, format_prompt
from relayrl.data.chat import CONVERSATIONS_ONLY, string_template, uses_chat_template
from relayrl.errors import ConfigError, DataError
from relayrl.models.tokenizer import CHAT_TEMPLATE, build_char_tokenizer
from relayrl.rollout.prompts import encode_prompt

pytestmark = pytest.mark.unit

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tiny"), "0123456789+=abeirfsy")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """An instruct model's tokenizer: ChatML template, its turn markers as special tokens, a BOS of its own."""
    tok = build_char_tokenizer(tmp_path_factory.mktemp("chatml"), string.printable)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def by_hand(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_tiny_tokenizer_template_is_marked_and_renders_as_without_the_mark(tiny):
    assert CHAT_TEMPLATE.startswith(CONVERSATIONS_ONLY)  # relayrl.models spells the mark data reads
    msgs = [{"role": "system", "content": "be"}, {"role": "user", "content": "1+2="}]
    marked = by_hand(tiny, msgs)
    tiny.chat_template = CHAT_TEMPLATE.replace(CONVERSATIONS_ONLY, "")
    try:
        assert by_hand(tiny, msgs) == marked == "system: be\nuser: 1+2=\nassistant: "
        assert string_template(tiny)  # without the mark auto would render strings through it
    finally:
        tiny.chat_template = CHAT_TEMPLATE
    assert not string_template(tiny)


def test_string_prompt_under_each_mode(tiny, chatml):
    user = [{"role": "user", "content": "1+2="}]
    # the tiny tokenizer: auto keeps the built-in tasks' completion-style prompts raw; always templates them
    assert format_prompt(tiny, "1+2=", "auto") == format_prompt(tiny, "1+2=", "never") == "1+2="
    assert format_prompt(tiny, "1+2=", "always") == by_hand(tiny, user) == "user: 1+2=\nassistant: "
    # an instruct tokenizer: auto and always template, never does not
    want = "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert format_prompt(chatml, "1+2=", "auto") == format_prompt(chatml, "1+2=", "always") == by_hand(chatml, user)
    assert by_hand(chatml, user) == want
    assert format_prompt(chatml, "1+2=", "never") == "1+2="
    # a system prompt: first, under auto and always alike
    sys_user = [{"role": "system", "content": "be brief"}, *user]
    assert format_prompt(chatml, "1+2=", "auto", system="be brief") == by_hand(chatml, sys_user)
    assert format_prompt(tiny, "1+2=", "always", system="be") == "system: be\nuser: 1+2=\nassistant: "
    assert [uses_chat_template(t, "x", m) for t in (tiny, chatml) for m in ("auto", "always", "never")] == \
        [False, True, False, True, True, False]


def test_message_prompts_always_use_the_template(tiny, chatml):
    msgs = [{"role": "user", "content": "1+2="}]
    for tok in (tiny, chatml):
        assert {format_prompt(tok, msgs, m) for m in ("auto", "always", "never")} == {by_hand(tok, msgs)}


def test_ids_and_bos(tiny, chatml):
    """A raw string gets the tokenizer's BOS; a templated prompt is the template's ids alone (it decides the BOS)."""
    ex = Example("1+2=", "3")
    ids = lambda tok, text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert encode_prompt(tiny, ex, DataConfig()) == [tiny.bos_token_id] + ids(tiny, "1+2=")
    assert encode_prompt(tiny, ex, DataConfig(chat_template="always")) == ids(tiny, "user: 1+2=\nassistant: ")
    templ = encode_prompt(chatml, ex, DataConfig())
    assert templ == ids(chatml, "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n")
    assert templ[0] == chatml.convert_tokens_to_ids("<|im_start|>") and chatml.bos_token_id not in templ
    assert encode_prompt(chatml, ex, DataConfig(chat_template="never")) == [chatml.bos_token_id] + ids(chatml, "1+2=")


def test_bad_input_is_one_line(tiny, chatml, tmp_path):
    bare = build_char_tokenizer(tmp_path, "0123456789+=")
    bare.chat_template = None
    with pytest.raises(DataError) as e:
        format_prompt(bare, "1+2=", "always")
    assert str(e.value) == ("data.chat_template is always but the tokenizer has no chat template; set "
                            "data.chat_template=auto (or never) or add a chat_template to the tokenizer")
    assert format_prompt(bare, "1+2=", "auto") == "1+2="  # auto: no template, the raw text
    with pytest.raises(DataError, match=r"^data.system_prompt is set but string prompts are not rendered through a "
                                        r"chat template \(the tokenizer's chat template is for conversations only"):
        format_prompt(tiny, "1+2=", "auto", system="be")
    # the old key: refused in one line naming the new one; a system prompt with never: refused
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(apply_overrides({}, ["data.use_chat_template=true"]))
    assert "\n" not in str(e.value) and str(e.value).endswith(
        "'use_chat_template' was replaced: set data.chat_template: always (was true) or never (was false); auto, the "
        "default, renders string prompts through the model's chat template where it has one")
    with pytest.raises(ConfigError, match="data: Value error, system_prompt needs a chat template"):
        RunConfig.from_dict({"data": {"chat_template": "never", "system_prompt": "be"}})
    with pytest.raises(ConfigError, match=r"data.chat_template: Input should be 'auto', 'always' or 'never'"):
        RunConfig.from_dict({"data": {"chat_template": True}})
