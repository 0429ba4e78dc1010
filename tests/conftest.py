import pytest
import torch

from relayrl.models import CausalLM, ModelConfig
from relayrl.single_controller.process_setup import configure_process

torch.set_num_threads(2)
configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up

# What kind of test each one is (registered in pyproject.toml; tests/README.md says what each means). Every test has
# exactly one, so `pytest -m <kind>` selects one part of a partition; `slow` comes on top of a kind (never of unit).
KINDS = ("unit", "equivalence", "e2e", "faults")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected test is checked, whatever the selection
def pytest_collection_modifyitems(config, items):
    wrong = []
    for item in items:
        kinds = [k for k in KINDS if item.get_closest_marker(k)]
        if len(kinds) != 1:
            wrong.append(f"{item.nodeid}: {' and '.join(kinds) or 'no kind'}")
        elif kinds == ["unit"] and item.get_closest_marker("slow"):
            wrong.append(f"{item.nodeid}: unit and slow")
    if wrong:
        shown = "\n  ".join(wrong[:20]) + (f"\n  ... and {len(wrong) - 20} more" if len(wrong) > 20 else "")
        raise pytest.UsageError(f"{len(wrong)} test(s) need exactly one of the markers {', '.join(KINDS)} "
                                f"(`pytestmark = pytest.mark.unit` in the module, or @pytest.mark.<kind> on the test; "
                                f"see tests/README.md):\n  {shown}")


def tiny_config(**kw) -> ModelConfig:
    base = dict(
        model_type="qwen2", vocab_size=61, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, eos_token_id=2, pad_token_id=0,
        bos_token_id=1, tie_word_embeddings=True, qkv_bias=True,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    m = CausalLM(tiny_config())
    # a larger init than 0.02 gives peaked, varied distributions: a stricter test of sampling
    m.reset_parameters(std=0.3, seed=0)
    return m.eval()
