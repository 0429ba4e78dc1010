"""What the endpoint's tests share: a character tokenizer with the tool tags, and a tiny model whose weights are
perturbed off their init (so a wrong load or a wrong reuse of ids cannot pass), 192 positions."""

import pytest

from relayrl.data.agent_tasks import PRINTABLE
from relayrl.models.tokenizer import build_char_tokenizer, load_tokenizer
from tests.helpers import perturbed_model, small_config

MAX_LEN = 192


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(d, PRINTABLE, tool_tokens=True)
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def model(tok):
    cfg = small_config(vocab_size=len(tok), max_position_embeddings=MAX_LEN, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    return perturbed_model(cfg, seed=3).eval()
