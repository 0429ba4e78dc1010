"""This module builds tiny character-level tokenizers locally, and loads tokenizers from a model directory.

The char tokenizer is a byte-level BPE with no merges over the given characters:

    ids:  0 <pad>  1 <bos>  2 <eos>  3 <unk>  4.. one per character (one per UTF-8 byte for non-ASCII),
          then (with tool_tokens) the four tool-call tags (TOOL_TOKENS), each one token

Why byte-level and not a plain WordLevel over characters: with transformers 5, `AutoTokenizer` on
a directory whose config.json says `qwen2` (other families in other versions) ignores
`tokenizer_class` and rebuilds the tokenizer as `Qwen2Tokenizer`, keeping only tokenizer.json's
vocab and merges and imposing its own regex split + ByteLevel pre-tokenizer and ByteLevel decoder.
A WordLevel vocab of raw characters then loses spaces and newlines. If our tokenizer already *is*
ByteLevel with no merges, that rebuild produces the same pipeline: every byte maps to its own token
however the text was split, so ids and decoding are identical under every model family.

One difference remains: Qwen2Tokenizer's BPE has no unk token, so under qwen2 a character outside
the vocab is dropped instead of becoming <unk>. Build the vocab from every character the data use
(`task.alphabet`).

Encoding adds no BOS/EOS (no post-processor): prompt ids are exactly the characters, and the
caller decides whether to prepend `bos_token_id`.

It imports tokenizers, transformers and relayrl.errors only; it must never import another relayrl layer:
models hold no parallelism, and every layer above imports them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from relayrl.errors import ModelDirError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")

# Renders messages as plain lines: "system: ...\nuser: ...\nassistant: " (the last with
# add_generation_prompt). Plain text keeps it learnable by a tiny char model. Multi-turn pieces:
#   tools=[...]        one line first, "tools: calculator(expression)\n" (names and arguments only:
#                      a tiny model needs no prose, a real model's own template renders the full schema)
#   assistant turns    end with EOS, the token the model generates to end its turn, then the newline
#   tool results       "tool: <tool_response>...</tool_response>\n", as Hermes/Qwen templates wrap them
# (transformers renders with trim_blocks: a newline right after a block tag is dropped, hence {{ '\\n' }}.)
# It opens with a comment (it renders nothing) marking it for conversations only: the tiny models' built-in tasks
# are completion-style, so under data.chat_template=auto their string prompts stay raw text. The mark is
# relayrl.data.chat.CONVERSATIONS_ONLY, spelled out here because models never import data (a test checks both).
CHAT_TEMPLATE = (
    "{# relayrl: conversations only #}"
    "{% if tools %}tools: {% for t in tools %}{% set f = t.function if t.function is defined else t %}"
    "{{ f.name }}({{ f.parameters.properties | join(', ') }}){% if not loop.last %}, {% endif %}{% endfor %}{{ '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}assistant: {{ message['content'] }}{{ eos_token }}\n"
    "{% elif message['role'] == 'tool' %}tool: <tool_response>{{ message['content'] }}</tool_response>\n"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# The fixed text of CHAT_TEMPLATE (role names, ": ", newline) is always in the vocab, so a chat formatted
# prompt never produces <unk> for the template's own characters; with tool tokens, the tool lines' too.
CHAT_TEMPLATE_CHARS = "".join(dict.fromkeys("system: user: assistant: \n"))
TOOL_TEMPLATE_CHARS = "tool: tools: (, )"

# The Hermes/Qwen tool-call tags, one token each as in Qwen2.5's vocabulary (added after the characters,
# so every other id is unchanged; only for tasks with tools): a closed tool call is a stop token, and a
# tiny model learns a tag as one step instead of a dozen characters.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

def _byte_level() -> pre_tokenizers.ByteLevel:
    # No regex split and no prefix space: the text maps byte by byte, nothing is added.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _vocab_for(chars: str, tool_tokens: bool = False) -> dict[str, int]:
    """Specials, then one entry per byte symbol of `chars` (+ the template's), first-seen order.

    The ByteLevel pre-tokenizer itself maps each character to its byte symbols (one printable
    unicode character per UTF-8 byte), so the vocab agrees with it by construction.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    to_symbols = _byte_level()
    for ch in dict.fromkeys(chars + CHAT_TEMPLATE_CHARS + (TOOL_TEMPLATE_CHARS if tool_tokens else "")):
        for symbol in to_symbols.pre_tokenize_str(ch)[0][0]:
            vocab.setdefault(symbol, len(vocab))
    return vocab


def build_char_tokenizer(out_dir: str | Path, chars: str, model_type: str = "llama",
                         tool_tokens: bool = False) -> PreTrainedTokenizerFast:
    """Build a char-level tokenizer over `chars`, save it to `out_dir` in HF format, return it.
    `tool_tokens` adds the tool-call tags (TOOL_TOKENS) as single tokens after the characters.

    `model_type` names the family whose directory this goes into. The saved files are the same for
    every family, because the tokenizer round-trips under each family's loader (module docstring);
    the argument documents intent at call sites and is kept for families that may need more.
    """
    tok = char_tokenizer(chars, tool_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    _pin_tokenizer_config(out)
    return tok


def char_tokenizer(chars: str, tool_tokens: bool = False) -> PreTrainedTokenizerFast:
    """The char tokenizer over `chars` in memory (build_char_tokenizer saves it): e.g. to render prompts through
    CHAT_TEMPLATE before the characters are known, since the rendered text does not depend on the vocab."""
    vocab = _vocab_for(chars, tool_tokens)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False))
    backend.pre_tokenizer = _byte_level()
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    if tool_tokens:
        tok.add_tokens(list(TOOL_TOKENS))  # not special: decoding keeps them, as the tool-call parser needs
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _pin_tokenizer_config(out: Path) -> None:
    """Make tokenizer_config.json explicit: generic class, no cleanup spaces, template inline.

    The chat template is stored both inline and (by transformers 5) as chat_template.jinja, so
    transformers 4 readers find it too.
    """
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        clean_up_tokenization_spaces=False,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        add_bos_token=False,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
    )
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json")  # any one makes a tokenizer


def require_tokenizer_files(p: Path) -> None:
    """One-line ModelDirError when model directory `p` holds no tokenizer files."""
    if not any((p / f).is_file() for f in TOKENIZER_MARKERS):
        raise ModelDirError(
            f"{p} has no tokenizer files (tokenizer.json, tokenizer_config.json): copy them from the model's original "
            f"directory, or save them with AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained('{p}')"
        )


def load_tokenizer(path: str | Path):
    """Load the tokenizer of a model directory, never touching the network."""
    p = Path(path)
    if not p.is_dir():
        raise ModelDirError(f"tokenizer directory not found: {p} (pass a local model directory)")
    require_tokenizer_files(p)
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # json, tokenizers (Rust) and transformers each raise their own types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelDirError(f"cannot load the tokenizer in {p}: {first}") from None
