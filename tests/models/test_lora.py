"""LoRA in one process against peft on transformers' own model: logits and adapter gradients equal, only
adapters train, the config refuses bad targets."""

import math

import peft
import pytest
import torch
import transformers

from relayrl.errors import ConfigError
from relayrl.models import load_pretrained
from relayrl.models.lora import (
    LORA_TARGETS,
    LoRAConfig,
    LoRALinear,
    apply_lora,
    lora_modules,
    lora_state,
    merged_state,
    merged_weight,
    set_lora_enabled,
)

COMMON = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
)
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "llama": lambda: transformers.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
}
RANK, ALPHA = 4, 8.0


def hf_model(cfg):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


def randomize_adapters(model, seed=5):
    """Non-zero B (a fresh adapter has B = 0, which would hide a wrong B or scaling)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_state(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def peft_of(hf, targets=LORA_TARGETS):
    return peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                   target_modules=list(targets))).eval()


def copy_into_peft(ours, pm):
    """Our adapters into peft's modules: q_proj.lora_A -> base_model.model.<...>.q_proj.lora_A.default.weight."""
    sd = {}
    for name, m in lora_modules(ours).items():
        sd[f"base_model.model.{name}.lora_A.default.weight"] = m.lora_A.detach().clone()
        sd[f"base_model.model.{name}.lora_B.default.weight"] = m.lora_B.detach().clone()
    missing = set(sd) - set(pm.state_dict())
    assert not missing, sorted(missing)[:3]
    pm.load_state_dict(sd, strict=False)


def assert_adapter_grads_equal_peft(ours, pm, got, ref):
    """Backward one logprob column through both models; every adapter's gradient equals peft's."""
    (got.float().log_softmax(-1)[..., 5].sum()).backward()
    (ref.float().log_softmax(-1)[..., 5].sum()).backward()
    peft_params = dict(pm.named_parameters())
    for name, m in lora_modules(ours).items():
        for ab in ("A", "B"):
            ref_g = peft_params[f"base_model.model.{name}.lora_{ab}.default.weight"].grad
            torch.testing.assert_close(getattr(m, f"lora_{ab}").grad, ref_g, atol=1e-5, rtol=1e-4)


def inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (3, 12), generator=g)
    return ids


@pytest.mark.equivalence
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_adapter_grads_equal_peft(family, tmp_path):
    hf = hf_model(FAMILIES[family]())
    hf.save_pretrained(tmp_path / "hf")
    ours = apply_lora(load_pretrained(tmp_path / "hf"), RANK, ALPHA, 0.0, LORA_TARGETS, seed=0).eval()
    randomize_adapters(ours)
    pm = peft_of(hf)
    copy_into_peft(ours, pm)
    ids = inputs()

    got = ours(ids)
    ref = pm(input_ids=ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # the adapters change the output (B != 0): the test compares something LoRA computes
    with torch.no_grad(), pm.disable_adapter():
        assert (pm(input_ids=ids).logits - ref).abs().max() > 1e-3
    assert_adapter_grads_equal_peft(ours, pm, got, ref)
    # only adapters train, and the base weight gets no gradient
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state(ours))
    assert all(p.grad is None for n, p in ours.named_parameters() if not p.requires_grad)


@pytest.mark.equivalence
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dropout_in_training_equals_peft_under_the_same_seed(family, tmp_path):
    """trainer.lora.dropout > 0: each target drops its adapter's input (peft's dropout(x) A^T B^T, the base path
    undropped), in the modules' call order, so one seed gives peft's masks: logits and adapter grads equal."""
    hf = hf_model(FAMILIES[family]())
    hf.save_pretrained(tmp_path / "hf")
    ours = apply_lora(load_pretrained(tmp_path / "hf"), RANK, ALPHA, 0.3, LORA_TARGETS, seed=0).train()
    randomize_adapters(ours)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.3,
                                                 target_modules=list(LORA_TARGETS))).train()
    copy_into_peft(ours, pm)
    ids = inputs()
    torch.manual_seed(7)
    got = ours(ids)
    torch.manual_seed(7)
    ref = pm(input_ids=ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.manual_seed(8)  # another seed, other masks: the dropout is live
        assert (ours(ids) - got).abs().max() > 1e-2
        assert (ours.eval()(ids) - got).abs().max() > 1e-2  # and off in eval mode
    assert_adapter_grads_equal_peft(ours, pm, got, ref)


@pytest.mark.equivalence
def test_init_matches_peft_and_leaves_output_unchanged(tmp_path):
    hf = hf_model(FAMILIES["qwen2"]())
    hf.save_pretrained(tmp_path / "hf")
    base = load_pretrained(tmp_path / "hf").eval()
    ours = apply_lora(load_pretrained(tmp_path / "hf"), RANK, ALPHA, targets=["q_proj", "down_proj"], seed=3).eval()
    ids = inputs()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), base(ids), atol=0, rtol=0)  # B = 0
    mods = lora_modules(ours)
    assert sorted(mods) == sorted(f"model.layers.{i}.{p}" for i in range(2)
                                  for p in ("self_attn.q_proj", "mlp.down_proj"))
    m = mods["model.layers.0.self_attn.q_proj"]
    assert m.scaling == ALPHA / RANK and m.lora_A.shape == (RANK, 64) and m.lora_B.shape == (64, RANK)
    bound = 1 / math.sqrt(64)  # kaiming_uniform(a=sqrt(5)) on [r, in]: U(-1/sqrt(in), 1/sqrt(in)), peft's init
    assert m.lora_A.abs().max() <= bound and m.lora_A.abs().max() > 0.8 * bound
    assert not m.lora_B.any()
    # seeded: the same seed, the same adapters; a different seed, different ones
    again = apply_lora(load_pretrained(tmp_path / "hf"), RANK, ALPHA, targets=["q_proj", "down_proj"], seed=3)
    other = apply_lora(load_pretrained(tmp_path / "hf"), RANK, ALPHA, targets=["q_proj", "down_proj"], seed=4)
    for n, p in lora_state(ours).items():
        torch.testing.assert_close(p, lora_state(again)[n], atol=0, rtol=0)
    assert not torch.equal(lora_state(ours)["model.layers.0.self_attn.q_proj.lora_A"],
                           lora_state(other)["model.layers.0.self_attn.q_proj.lora_A"])
    # Hugging Face names kept; the base weight is the same Parameter the plain model had
    names = set(dict(ours.named_parameters()))
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.self_attn.q_proj.lora_A" in names
    assert isinstance(m, torch.nn.Linear) and isinstance(m, LoRALinear)


@pytest.mark.equivalence
def test_merged_weights_and_disabled_adapters(tmp_path):
    hf = hf_model(FAMILIES["llama"]())
    hf.save_pretrained(tmp_path / "hf")
    base = load_pretrained(tmp_path / "hf").eval()
    ours = apply_lora(load_pretrained(tmp_path / "hf"), RANK, ALPHA, seed=0).eval()
    randomize_adapters(ours)
    ids = inputs()
    m = lora_modules(ours)["model.layers.1.mlp.up_proj"]
    torch.testing.assert_close(merged_weight(m), m.weight + (ALPHA / RANK) * m.lora_B @ m.lora_A)
    plain = load_pretrained(tmp_path / "hf").eval()
    plain.load_state_dict(merged_state(ours))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), ours(ids), atol=1e-5, rtol=0)
        assert (plain(ids) - base(ids)).abs().max() > 1e-3  # the merge changed the model
        set_lora_enabled(ours, False)
        torch.testing.assert_close(ours(ids), base(ids), atol=0, rtol=0)


@pytest.mark.equivalence
def test_bf16_base_fp32_adapters(tmp_path):
    hf = hf_model(FAMILIES["qwen2"]())
    hf.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf").to(torch.bfloat16)
    apply_lora(model, RANK, ALPHA, seed=0)
    randomize_adapters(model)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {dtypes[n] for n in lora_state(model)} == {torch.float32}
    assert {d for n, d in dtypes.items() if n not in lora_state(model)} == {torch.bfloat16}
    out = model(inputs())
    out.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora_state(model).values())


@pytest.mark.unit
def test_bf16_base_saves_no_copy_of_the_input():
    """q, k and v adapters (fp32) over a bf16 base on one input x: what autograd keeps for backward is x itself
    (the same storage for all three), the parameters, and each target's x A^T [tokens, r]; never another
    full-size copy of x (an fp32 cast per target would keep 3 x 2 = 6 times x's bytes). The numbers are the
    fp32 cast-then-linear's: the same output, and the adapters' gradients in fp32."""
    torch.manual_seed(0)
    n_tok, d = 256, 64
    lins = [LoRALinear.from_linear(torch.nn.Linear(d, d, dtype=torch.bfloat16).requires_grad_(False), rank=RANK,
                                   alpha=ALPHA, adapter_dtype=torch.float32) for _ in range(3)]
    for m in lins:
        m.reset_lora_parameters()
        torch.nn.init.normal_(m.lora_B, std=0.1)
    x = torch.randn(n_tok, d, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ys = [m(x) for m in lins]

    def storage(t):
        return t.untyped_storage().data_ptr()

    held = {storage(t) for t in [x, *(p for m in lins for p in m.parameters())]}
    extra = [t for t in saved if storage(t) not in held]
    assert any(storage(t) == storage(x) for t in saved)  # x itself is what the adapters keep
    assert [tuple(t.shape) for t in extra] == [(n_tok, RANK)] * 3, [tuple(t.shape) for t in extra]
    assert sum(t.numel() * t.element_size() for t in extra) == 3 * 4 * n_tok * RANK  # fp32 x A^T per target

    sum(y.float().square().sum() for y in ys).backward()
    x_grad = x.grad.clone()
    x.grad = None
    refs = []
    for m in lins:
        a, b = (t.detach().clone().requires_grad_() for t in (m.lora_A, m.lora_B))
        h = torch.nn.functional.linear(x.float(), a)
        refs.append((a, b, torch.nn.functional.linear(x, m.weight, m.bias)
                     + (torch.nn.functional.linear(h, b) * m.scaling).to(torch.bfloat16)))
    sum(r.float().square().sum() for _, _, r in refs).backward()
    # x's gradient sums six bf16 terms (base and adapter of each target), autograd's order differs: bf16 rounding
    torch.testing.assert_close(x_grad.float(), x.grad.float(), atol=2 ** -7 * float(x.grad.abs().max()), rtol=0)
    for m, y, (a, b, want) in zip(lins, ys, refs, strict=True):
        torch.testing.assert_close(y, want, atol=0, rtol=0)
        assert m.lora_A.grad.dtype == m.lora_B.grad.dtype == torch.float32
        torch.testing.assert_close(m.lora_A.grad, a.grad, atol=1e-6 * float(a.grad.abs().max()), rtol=0)
        torch.testing.assert_close(m.lora_B.grad, b.grad, atol=0, rtol=0)


@pytest.mark.unit
def test_config_validation():
    assert LoRAConfig().target_modules == list(LORA_TARGETS)
    with pytest.raises(ConfigError, match=r"target_modules.*qkv_proj.*valid: q_proj"):
        LoRAConfig.from_dict({"target_modules": ["q_proj", "qkv_proj"]})
    with pytest.raises(ConfigError, match="rank"):
        LoRAConfig.from_dict({"rank": 0})
    with pytest.raises(ConfigError, match="base_dtype"):
        LoRAConfig.from_dict({"base_dtype": "float16"})


@pytest.mark.unit
def test_lora_refused_where_it_does_not_apply():
    from relayrl.jobs.sft import SFTJobConfig
    from relayrl.trainer.config import CriticConfig, TrainerConfig

    assert TrainerConfig.from_dict({"lora": {"rank": 2}}).lora.rank == 2
    assert TrainerConfig().lora is None  # off by default
    with pytest.raises(ConfigError, match="trainer.lora: SFT trains the full model"):
        SFTJobConfig.from_dict({"trainer": {"lora": {}}})
    with pytest.raises(ConfigError, match="lora: the critic trains in full"):
        CriticConfig.from_dict({"lora": {}})


@pytest.mark.unit
def test_lora_dropout_refused_under_tensor_parallel():
    """Each TP rank would draw its own mask on a colwise linear's replicated input: refused in one line."""
    from relayrl.controller.config import RunConfig

    def run(dropout, tp):
        return RunConfig.from_dict({"trainer": {"lora": {"dropout": dropout}},
                                    "parallel": {"backend": "local", "tp": tp}})

    with pytest.raises(ConfigError, match=r"trainer.lora.dropout=0.1 with parallel.tp=2: .*set trainer.lora.dropout=0"):
        run(0.1, 2)
    assert run(0.0, 2).parallel.tp == 2 and run(0.1, 1).trainer.lora.dropout == 0.1
