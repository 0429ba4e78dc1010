"""Engine input checked at the API: sampling settings, weight shapes, prompts against the model's
maximum length, the KV budget, tensor-parallel degrees, and a failed generate leaving nothing queued."""

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.block_manager import BlockManager
from relayrl.engine.model import check_weights, logical_shapes
from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import check_tp
from relayrl.engine.scheduler import Scheduler
from relayrl.engine.sequence import Sequence
from relayrl.errors import (
    KVCacheError,
    ModelDirError,
    PromptError,
    SamplingParamsError,
    TensorParallelError,
    UserError,
    WeightShapeError,
)
from relayrl.models import CausalLM, save_pretrained

from conftest import tiny_config

MAX_LEN = 32  # the test model's max_position_embeddings
BS = 4


@pytest.fixture
def short_model():
    m = CausalLM(tiny_config(max_position_embeddings=MAX_LEN))
    m.reset_parameters(std=0.3, seed=0)
    return m.eval()


def engine(model, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", BS)
    return LLMEngine.from_model(model, **kw)


def tokens(outputs):
    return [[s.token_ids for s in o.samples] for o in outputs]


# ---- SamplingParams ---------------------------------------------------------------------------------
BAD_PARAMS = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0), ("temperature", 1e-9),
    ("temperature", "0.7"), ("top_p", 0.0), ("top_p", 2.0), ("top_p", math.nan), ("top_k", -1), ("top_k", 2.5),
    ("min_p", 1.0), ("min_p", -0.1), ("min_p", math.nan), ("n", 0), ("n", True), ("n", 1.5), ("max_tokens", 0),
    ("max_tokens", -1), ("max_tokens", math.inf), ("logprobs", -1), ("seed", 1.5), ("seed", "3"),
    ("truncate_prompt_tokens", 0), ("stop", [""]), ("stop", [1]), ("stop_token_ids", [-1]), ("ignore_eos", "yes"),
]


@pytest.mark.unit
@pytest.mark.parametrize("field,value", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_bad_sampling_value_names_field_and_value(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)  # exit 2; old ValueError catchers
    msg = str(e.value)
    assert msg.startswith(f"SamplingParams.{field} must be") and repr(value) in msg, msg


@pytest.mark.unit
def test_good_sampling_values_are_normalised():
    sp = SamplingParams(n=np.int64(3), temperature=0, top_p=1, seed=np.int32(-5), stop="##", max_tokens=np.int64(7))
    assert (sp.n, sp.seed, sp.max_tokens, sp.stop) == (3, -5, 7, ["##"])
    assert type(sp.n) is int and type(sp.temperature) is float and type(sp.top_p) is float
    assert SamplingParams(temperature=1e-6).temperature == 1e-6  # the smallest non-greedy temperature


@pytest.mark.unit
def test_a_field_changed_after_construction_is_caught_at_add(tiny_model):
    eng = engine(tiny_model)
    sp = SamplingParams(max_tokens=4)
    sp.temperature = math.nan
    with pytest.raises(SamplingParamsError, match="temperature"):
        eng.generate([[5, 6, 7]], sp)
    with pytest.raises(SamplingParamsError, match="logprobs must be at most the vocabulary size"):
        eng.generate([[5, 6, 7]], SamplingParams(logprobs=62))  # vocab 61: topk would fail inside the step
    assert not eng.has_unfinished()


@pytest.mark.unit
def test_top_p_that_rounds_to_zero_keeps_the_top_token():
    from relayrl.engine.sampler import sample

    logits = torch.tensor([[0.0, 3.0, 1.0]])
    tokens_, logps = sample(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1e-300]),
                            torch.tensor([0.0]), torch.tensor([0.5]))
    assert tokens_.tolist() == [1]
    torch.testing.assert_close(logps, logits.log_softmax(-1)[:, 1])


# ---- weight shapes ----------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("kw", [
    {},  # qwen2: q/k/v biases, tied embeddings
    {"model_type": "llama", "qkv_bias": True, "o_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
    {"model_type": "qwen3", "qkv_bias": False, "qk_norm": True, "head_dim": 16},  # head_dim * heads != hidden
])
def test_logical_shapes_are_those_of_the_model(kw):
    cfg = tiny_config(**kw)
    with torch.device("meta"):
        model = CausalLM(cfg)
    assert logical_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _bad_dir(tmp_path, model, edit):
    from relayrl.models.tokenizer import build_char_tokenizer

    build_char_tokenizer(tmp_path / "tok", "abc")
    save_pretrained(model, tmp_path / "m", tokenizer_dir=tmp_path / "tok")
    f = tmp_path / "m" / "model.safetensors"
    sd = load_file(f)
    edit(sd)
    save_file(sd, f)
    return tmp_path / "m"


@pytest.mark.unit
def test_wrong_shape_from_a_directory_is_refused_not_sliced(tiny_model, tmp_path):
    name = "model.layers.1.self_attn.q_proj.weight"

    def grow(sd):  # 4 more rows than 4 heads x 12 need: the old loaders sliced them off and generated
        sd[name] = torch.cat([sd[name], torch.zeros(4, 48)])
    path = _bad_dir(tmp_path, tiny_model, grow)
    with pytest.raises(ModelDirError) as e:
        LLMEngine.from_pretrained(path, num_blocks=16, block_size=BS)
    assert str(e.value) == (f"{path}: tensor '{name}' has shape (52, 48), the model config implies (48, 48); "
                            f"check that the weights belong to this config.json")


@pytest.mark.unit
@pytest.mark.parametrize("case", ["norm shape", "unknown", "missing", "twice", "integer"])
def test_load_weights_refuses_before_writing_any_rank(tiny_model, case):
    eng = engine(tiny_model)
    before = eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))
    sd = {k: torch.zeros_like(v) for k, v in tiny_model.state_dict().items()}  # would change every output
    items = list(sd.items())
    if case == "norm shape":  # (1,) would broadcast into (48,) in a plain copy_
        sd["model.norm.weight"] = torch.ones(1)
        items, want = list(sd.items()), "tensor 'model.norm.weight' has shape (1,), the model config implies (48,)"
    elif case == "unknown":
        items, want = items + [("model.layers.2.mlp.up_proj.weight", torch.zeros(96, 48))], \
            "tensor 'model.layers.2.mlp.up_proj.weight' (96, 48) is not part of the model the config describes"
    elif case == "missing":
        items, want = [kv for kv in items if kv[0] != "model.layers.0.mlp.down_proj.weight"], \
            "the weights lack tensor 'model.layers.0.mlp.down_proj.weight' (1 missing in all)"
    elif case == "twice":
        items, want = items + items[:1], f"tensor '{items[0][0]}' is given twice"
    else:
        sd["model.norm.weight"] = torch.ones(48, dtype=torch.int64)
        items, want = list(sd.items()), "tensor 'model.norm.weight' has dtype torch.int64"
    with pytest.raises(WeightShapeError) as e:
        eng.load_weights(items)
    assert str(e.value).startswith(want), str(e.value)
    assert eng.weights_version == 0
    assert tokens(eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))) == tokens(before)


@pytest.mark.unit
def test_derived_rope_buffers_in_a_checkpoint_are_skipped(tiny_model):
    items = list(tiny_model.state_dict().items()) + [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(6))]
    assert [n for n, _ in check_weights(tiny_model.config, items)] == list(tiny_model.state_dict())


# ---- prompts against the model's maximum length -----------------------------------------------------
@pytest.mark.unit
def test_prompt_leaving_no_room_is_refused_with_its_index(short_model):
    eng = engine(short_model)
    ok = list(range(3, 3 + MAX_LEN - 1))  # 31 tokens: room for exactly one
    with pytest.raises(PromptError) as e:
        eng.generate([[5, 6], ok + [9]], SamplingParams(max_tokens=4))
    assert str(e.value).startswith(
        "prompt 1 has 32 tokens, but the model's maximum length (max_position_embeddings) is 32 tokens, prompt and "
        "completion together: at most 31 prompt tokens leave room for a completion (max_tokens 4)"), str(e.value)
    assert not eng.has_unfinished()
    out = eng.generate([ok], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].samples[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


@pytest.mark.unit
def test_truncate_prompt_tokens_keeps_the_last_tokens(short_model):
    eng = engine(short_model)
    long = [3 + i % 50 for i in range(45)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=20)
    out = eng.generate([long], sp)[0]
    assert out.prompt_token_ids == long[-20:]
    direct = eng.generate([long[-20:]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.samples[0].token_ids == direct.samples[0].token_ids and len(direct.samples[0].token_ids) == 6
    with pytest.raises(PromptError, match=r"has 32 tokens \(after truncate_prompt_tokens=40\)"):
        eng.generate([long[:32]], SamplingParams(truncate_prompt_tokens=40))


@pytest.mark.unit
def test_empty_and_out_of_vocabulary_prompts_are_refused(tiny_model, tmp_path):
    from relayrl.models.tokenizer import build_char_tokenizer

    eng = engine(tiny_model, tokenizer=build_char_tokenizer(tmp_path, "abc"))
    cases = {
        "empty list": ([[5], []], "prompt 1 is empty: give at least one token"),
        "empty string": ([""], "prompt 0 is empty: give at least one token"),
        "token past vocab": ([[5, 61]], "prompt 0 holds token id 61, outside the vocabulary [0, 61)"),
        "negative token": ([[-1]], "prompt 0 holds token id -1"),
        "not tokens": ([[5.0]], "prompt 0 must be a string or a list of token ids"),
        "a bare string": ("abc", "generate takes a list of prompts"),
    }
    for prompts, want in cases.values():
        with pytest.raises(PromptError) as e:
            eng.generate(prompts, SamplingParams(max_tokens=2))
        assert str(e.value).startswith(want), str(e.value)
    with pytest.raises(PromptError, match="the prompt is empty"):
        eng.add_request([], SamplingParams())
    assert not eng.has_unfinished()


# ---- the scheduler reserves at most the model's maximum length --------------------------------------
@pytest.mark.unit
def test_reservation_is_capped_at_the_model_maximum_by_hand():
    def seq(i, prompt, max_tokens):
        from types import SimpleNamespace
        return Sequence(i, list(range(prompt)), SimpleNamespace(max_tokens=max_tokens), 4)

    # max_model_len 17: a sequence ends at 17 tokens, the last never fed back: KV for 16 = 4 blocks
    sched = Scheduler(BlockManager(4, 4), 4, 100, max_model_len=17)
    assert sched.max_kv_tokens(seq(0, 8, 10**9)) == 16
    sched.add(seq(0, 8, 10**9))
    assert sched.max_kv_tokens(seq(1, 8, 3)) == 10  # under the cap: prompt + max_tokens - 1
    # max_model_len 18: KV for 17 tokens = 5 blocks of 4 > 4
    sched = Scheduler(BlockManager(4, 4), 4, 100, max_model_len=18, kv_bytes_per_block=1000)
    with pytest.raises(KVCacheError) as e:
        sched.add(seq(7, 8, 10**9))
    assert str(e.value) == (
        "sequence 7 (prompt 8 tokens, max_tokens 1000000000) needs KV for 17 tokens (capped at the model's maximum "
        "length) = 5 blocks of 4 tokens = 5000 bytes, but the KV cache holds 4 blocks of 4 tokens = 4000 bytes; one "
        "sequence of the model's maximum length (18 tokens) needs 5 blocks of 4 tokens = 5000 bytes. To run it, "
        "raise kv_cache_bytes (rollout.kv_cache_bytes in a run config) to at least 5000, or lower max_tokens or the "
        "prompt's length")


@pytest.mark.unit
def test_max_tokens_past_the_limit_runs_to_the_limit(short_model):
    eng = engine(short_model, num_blocks=MAX_LEN // BS)  # the pool holds one sequence of the model's maximum
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=100_000, ignore_eos=True, seed=3)
    out = eng.generate([[5, 6, 7, 8, 9]], sp)[0]
    assert [len(s.token_ids) for s in out.samples] == [MAX_LEN - 5] * 2
    assert [s.finish_reason for s in out.samples] == ["length"] * 2


@pytest.mark.unit
def test_kv_budget_too_small_names_the_bytes_and_the_key(short_model):
    cfg = short_model.config
    per_block = cfg.num_hidden_layers * 2 * BS * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32: 1536 bytes
    with pytest.raises(KVCacheError) as e:
        LLMEngine(cfg, kv_cache_bytes=per_block - 1, block_size=BS)
    longest = per_block * 8  # 31 KV tokens = 8 blocks of 4
    assert str(e.value) == (
        f"the KV cache holds no block ({per_block} bytes each, num_blocks=0); one sequence of the model's maximum "
        f"length (32 tokens) needs {longest} bytes: set kv_cache_bytes (rollout.kv_cache_bytes in a run config) "
        f"to at least that")
    eng = LLMEngine.from_model(short_model, kv_cache_bytes=3 * per_block, block_size=BS)
    with pytest.raises(KVCacheError) as e:
        eng.generate([[5, 6], [5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=8))  # 6 + 8 - 1 = 13: 4 blocks
    assert str(e.value).startswith("prompt 1: sequence ") and f"at least {4 * per_block}," in str(e.value)
    assert f"maximum length (32 tokens) needs 8 blocks of 4 tokens = {longest} bytes" in str(e.value)
    assert not eng.has_unfinished()


# ---- tensor-parallel degree -------------------------------------------------------------------------
@pytest.mark.unit
def test_tp_that_does_not_divide_is_a_user_error():
    cases = [((4, 2, 3, 96), "tensor_parallel_size 3 does not divide the number of attention heads (4)"),
             ((12, 4, 6, 96), "tensor_parallel_size 6 and the number of KV heads (4) must divide one another"),
             ((4, 2, 2, 95), "tensor_parallel_size 2 does not divide intermediate_size (95)")]
    for args, want in cases:
        with pytest.raises(TensorParallelError, match=want.replace("(", r"\(").replace(")", r"\)")):
            check_tp(*args)
    with pytest.raises(TensorParallelError, match="attention heads"):  # before any worker process starts
        LLMEngine(tiny_config(), tensor_parallel_size=3, num_blocks=4)


# ---- a failed generate leaves nothing queued --------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [8, 9, 10], [20, 21, 22, 23, 24, 25]]
SAMPLED = SamplingParams(n=2, temperature=0.8, max_tokens=8, ignore_eos=True, seed=5)


@pytest.mark.unit
def test_failed_add_removes_the_requests_added_before_it(short_model):
    want = tokens(engine(short_model).generate(PROMPTS, SAMPLED))
    eng = engine(short_model, num_blocks=3)  # 12 KV slots: prompt 7 + 8 - 1 = 14 cannot fit
    with pytest.raises(KVCacheError, match="^prompt 2: "):
        eng.generate([PROMPTS[1], PROMPTS[1], PROMPTS[0]], SAMPLED)
    assert not eng.has_unfinished() and not eng.scheduler.waiting
    assert tokens(eng.generate(PROMPTS[1:2], SAMPLED)) == want[1:2]


@pytest.mark.unit
@pytest.mark.parametrize("fail_at", [1, 3])  # the first call is a prefill, the third a decode
def test_failed_step_aborts_the_call_and_the_engine_serves_the_next(short_model, monkeypatch, fail_at):
    want = tokens(engine(short_model).generate(PROMPTS, SAMPLED))
    eng = engine(short_model)
    other = eng.add_request(PROMPTS[2], SAMPLED)  # another caller's request, in flight
    real, calls = eng.ranks.group.call, []

    def failing(fn, *args):
        if fn is ModelRunner.run:
            calls.append(fn)
            if len(calls) == fail_at:
                raise RuntimeError("injected")
        return real(fn, *args)
    monkeypatch.setattr(eng.ranks.group, "call", failing)
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate(PROMPTS[:2], SAMPLED)
    # only the other caller's request is left; a prefill that failed left no cached block behind
    assert {s.request_id for s in list(eng.scheduler.waiting) + list(eng.scheduler.running)} == {other}
    assert eng.block_manager.num_free_blocks == eng.num_blocks and not eng.block_manager._cached
    rest = []
    while eng.has_unfinished():
        rest += eng.step()
    assert [o.request_id for o in rest] == [other] and tokens(rest) == want[2:]  # its samples went on unchanged
    again = eng.generate(PROMPTS[:2], SAMPLED)  # the same prompts: a poisoned prefix cache would show
    assert tokens(again) == want[:2] and not eng.has_unfinished()


# ---- the generate command: one line, exit 2 ---------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, init_std=0.3)
    return str(build_tiny_model(tmp_path_factory.mktemp("cli") / "m", "0123456789+=", cfg))


CLI_CASES = {
    "max tokens -1": (["--max-tokens", "-1", "1+2="], "SamplingParams.max_tokens must be an integer >= 1, got -1"),
    "n 0": (["--n", "0", "1+2="], "SamplingParams.n must be an integer >= 1, got 0"),
    "temperature -1": (["--temperature", "-1", "1+2="], "SamplingParams.temperature must be 0 (greedy) or a finite"),
    "temperature nan": (["--temperature", "nan", "1+2="], "SamplingParams.temperature must be 0 (greedy)"),
    "top p 2": (["--top-p", "2", "1+2="], "SamplingParams.top_p must be a number in (0, 1] (1 = off), got 2.0"),
    "empty prompt": (["1+2=", ""], "prompt 1 is empty: give some text to continue"),
    "prompt too long": (["1" * 600], "prompt 0 has 601 tokens, but the model's maximum length"),  # BOS + 600
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_generate_bad_input_is_one_line_and_exit_2(case, model_dir, capsys):
    from relayrl.cli.main import main

    argv, want = CLI_CASES[case]
    code = main(["generate", "--model", model_dir, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith(f"relayrl: error: {want}"), err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.e2e
def test_generate_wrong_shaped_weights_is_one_line_and_exit_2(model_dir, tmp_path, capsys):
    import shutil

    from relayrl.cli.main import main

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    sd = load_file(bad / "model.safetensors")
    sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 60)
    save_file(sd, bad / "model.safetensors")
    assert main(["generate", "--model", str(bad), "1+2="]) == 2
    assert capsys.readouterr().err == (f"relayrl: error: {bad}: tensor 'model.layers.0.mlp.down_proj.weight' has shape "
                                       f"(32, 60), the model config implies (32, 64); check that the weights belong "
                                       f"to this config.json\n")
    assert main(["generate", "--model", model_dir, "1+2=", "--max-tokens", "3"]) == 0  # the good directory runs
    assert capsys.readouterr().err.startswith("[prompt 0, sample 0: ")


@pytest.mark.e2e
def test_eval_bad_sampling_flag_is_one_line_and_exit_2(model_dir, capsys):
    from relayrl.cli.main import main

    assert main(["eval", "--model", model_dir, "--temperature", "inf", "--n", "2"]) == 2
    assert capsys.readouterr().err == "relayrl: error: SamplingParams.temperature must be 0 (greedy) or a finite " \
                                      "number >= 1e-06, got inf\n"
