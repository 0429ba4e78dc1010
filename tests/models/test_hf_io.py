"""relayrl's decoder against transformers' own model, for each family, both directions."""

import pytest
import torch
import transformers

from relayrl.errors import ModelDirError
from relayrl.models import load_pretrained, save_pretrained

from helpers import parity_inputs

COMMON = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2,
)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_theta=50000.0),
    "llama3_scaled_bias_tied": lambda: transformers.LlamaConfig(
        **COMMON, attention_bias=True, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3_head_dim": lambda: transformers.Qwen3Config(**COMMON, head_dim=24),
}


def _hf_model(cfg):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    # random biases and norm weights, so a wrong bias or norm cannot hide behind zeros and ones
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.equivalence
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_to_relayrl_and_back(family, tmp_path):
    hf = _hf_model(FAMILIES[family]())
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    ids, mask = parity_inputs()
    with torch.no_grad():
        # no padding: compare every position
        ref = hf(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), ref, atol=1e-4, rtol=0)
        # with padding: compare real positions (both use position ids = count of real tokens before)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ref_m = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got_m = ours(ids, attention_mask=mask)
        real = mask.bool()
        torch.testing.assert_close(got_m[real], ref_m[real], atol=1e-4, rtol=0)

    save_pretrained(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ref, atol=1e-4, rtol=0)


@pytest.mark.unit
def test_sharded_save_loads_in_both(tmp_path):
    hf = _hf_model(FAMILIES["llama"]())
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "sharded", max_shard_bytes=40_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    again = load_pretrained(tmp_path / "sharded")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    ids, _ = parity_inputs()
    with torch.no_grad():
        torch.testing.assert_close(again(ids), ours(ids), atol=0, rtol=0)
        torch.testing.assert_close(back(input_ids=ids).logits, ours(ids), atol=1e-4, rtol=0)


@pytest.mark.unit
def test_bf16_load(tmp_path):
    hf = _hf_model(FAMILIES["qwen2"]())
    hf.save_pretrained(tmp_path / "hf")
    m = load_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    ids, _ = parity_inputs()
    with torch.no_grad():
        diff = (m(ids).float() - hf(input_ids=ids).logits).abs().max()
    assert 0 < diff < 0.1  # bf16 differs from fp32, but only by rounding


@pytest.mark.unit
def test_bad_model_dirs(tmp_path):
    with pytest.raises(ModelDirError, match="not found"):
        load_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirError, match="no config.json"):
        load_pretrained(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="malformed"):
        load_pretrained(bad)
    hf = _hf_model(FAMILIES["llama"]())
    hf.save_pretrained(tmp_path / "noweights")
    (tmp_path / "noweights" / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match="no \\*.safetensors"):
        load_pretrained(tmp_path / "noweights")
