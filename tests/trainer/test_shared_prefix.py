"""Shared-prefix training (trainer.shared_prefix, on by default with trainer.padding_free): the samples of a
prompt compute its tokens once and their responses attend to them. Logprobs, entropies and gradients equal the
padded and the padding-free forward; the update, the reference pass and a whole run equal the unshared ones;
under tensor parallelism (vocab-parallel logprobs) it equals one process; and the tokens computed fall from
G (P + R) to P + G R per prompt."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from relayrl.algorithms import AlgoConfig
from relayrl.errors import ConfigError
from relayrl.jobs.train import train
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.logprobs import computed_tokens, prompt_lens, token_logprobs
from relayrl.trainer.reference import Reference

from dist_harness import run_distributed
from helpers import assert_same_metrics, cfg_for, perturbed_model, small_config, step_metrics


def _grouped(seed: int = 0, prompts: int = 3, G: int = 4) -> TrainBatch:
    """G samples of each of `prompts` prompts (1-6 tokens), rows of a prompt not adjacent (interleaved), one
    empty response, and a multi-turn row whose observation tokens (mask 0) sit between its own."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, 60, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
          for _ in range(prompts)]
    rows_p, rows_r = [], []
    for _ in range(G):
        for p in ps:
            rows_p.append(p)
            rows_r.append(torch.randint(3, 60, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist())
    rows_r[1] = []  # a sample that ended at once: no response token
    masks = [[1] * len(r) for r in rows_r]
    rows_r[2] = rows_r[2] + [7, 8, 9]
    masks[2] = masks[2][:1] + [0] * (len(masks[2]) - 1) + [1, 1, 1]  # an observation after the first token
    ids, attn, resp = build_rows(rows_p, rows_r, masks=masks)
    return TrainBatch(ids, attn, resp, advantages=torch.randn(len(rows_p), generator=g))


def _forward_and_grads(model, batch, **kw):
    model.zero_grad()
    logp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True, **kw)
    ((logp * batch.response_mask).sum() + 0.3 * (ent * batch.response_mask).sum()).backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.equivalence
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3},
                                {"model_type": "qwen2", "qkv_bias": True, "tie_word_embeddings": True}],
                         ids=["llama-gqa", "sliding-window", "qwen2-tied"])
def test_logprobs_entropy_and_gradients_equal_the_padded_forward(kw):
    model = perturbed_model(small_config(**kw), seed=1)
    b = _grouped()
    real = b.attention_mask.bool().clone()
    real[:, 0] = False  # token 0 has no logprob
    plens = prompt_lens(b.response_mask, b.attention_mask)
    want = _forward_and_grads(model, b)
    for got in (_forward_and_grads(model, b, padding_free=True, prefix_lens=plens),
                _forward_and_grads(model, b, padding_free=True)):
        torch.testing.assert_close(got[0][real], want[0][real], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(got[1][real], want[1][real], atol=2e-6, rtol=1e-5)
        assert float(got[0][~real].abs().max()) == 0.0
        for n, grad in want[2].items():
            torch.testing.assert_close(got[2][n], grad, atol=1e-5 * float(grad.abs().max()), rtol=0, msg=n)


@pytest.mark.unit
def test_prompt_lengths_and_tokens_computed_by_hand():
    # prompt [5, 6, 7] x 3 samples (2, 4 and 0 response tokens), prompt [8, 9] x 1 (1 token), and [5, 6] whose
    # response starts with 7: a prompt of its own (2 tokens), not the first one's
    ids, attn, resp = build_rows([[5, 6, 7], [8, 9], [5, 6, 7], [5, 6], [5, 6, 7]],
                                 [[10, 11], [12], [13, 14, 15, 16], [7, 17], []])
    plens = prompt_lens(resp, attn)
    assert plens == [3, 2, 3, 2, 3]
    assert computed_tokens(ids, attn, None) == 5 + 3 + 7 + 4 + 3
    assert computed_tokens(ids, attn, plens) == (3 + 2 + 4 + 0) + (2 + 1) + (2 + 2)  # P + G R per prompt


@pytest.mark.equivalence
def test_the_update_equals_the_unshared_one(tiny_model):
    """Two shuffled mini-batches, two PPO epochs (ratios move off 1, clipping engages), micro-batches of 5:
    the same weights and statistics as the padding-free update, and as the padded one."""
    algo = AlgoConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)
    b = _grouped(seed=2)
    base = Actor(copy.deepcopy(tiny_model), TrainerConfig(), algo, total_steps=1).compute_logprobs(b)
    g = torch.Generator().manual_seed(5)
    b = b.replace(old_logp=base, rollout_logp=base + 0.05 * torch.randn(base.shape, generator=g) * b.response_mask,
                  ref_logp=base - 0.1 * b.response_mask)
    runs = {}
    for name, kw in {"padded": dict(padding_free=False), "packed": dict(shared_prefix=False),
                     "shared": {}}.items():  # the default: padding-free, prefixes shared
        m = copy.deepcopy(tiny_model)
        cfg = TrainerConfig(lr=1e-3, adam_eps=1e-3, micro_batch_size=5, mini_batches=2, ppo_epochs=2, **kw)
        actor = Actor(m, cfg, algo, total_steps=1)
        old = actor.compute_logprobs(b)
        stats = actor.update(b)
        runs[name] = (old, stats, {n: p.detach().clone() for n, p in m.named_parameters()})
    for other in ("padded", "packed"):
        old, stats, weights = runs[other]
        torch.testing.assert_close(runs["shared"][0], old, atol=2e-6, rtol=1e-5)
        for k in ("loss", "grad_norm", "clip_frac", "entropy", "kl", "ratio_max"):
            assert runs["shared"][1][k] == pytest.approx(stats[k], rel=1e-5, abs=1e-7), (other, k)
        for n, w in weights.items():
            moved = float((w - tiny_model.state_dict()[n]).abs().max())
            assert moved > 1e-5, n
            torch.testing.assert_close(runs["shared"][2][n], w, atol=1e-6 + 1e-4 * moved, rtol=0, msg=(other, n))


def _embedded_tokens(model) -> list[int]:
    """The real tokens of every forward the model runs (a pre-hook on its call)."""
    seen: list[int] = []
    def count(m, a, kw):  # a packed row holds real tokens only
        seen.append(int(a[0].numel()) if kw.get("layout") is not None else int(kw["attention_mask"].sum()))

    model.register_forward_pre_hook(count, with_kwargs=True)
    return seen


@pytest.mark.unit
def test_micro_batches_hold_whole_prompts_whatever_the_row_order(tiny_model):
    """Rows of the 3 prompts interleaved, micro-batches of 4 = G: the recompute, the update and the reference
    pass each regroup the rows, so every micro-batch is one prompt's samples and its prompt is computed once."""
    b = _grouped(seed=3)
    want = computed_tokens(b.input_ids, b.attention_mask, prompt_lens(b.response_mask, b.attention_mask))
    assert want < int(b.attention_mask.sum())
    m = copy.deepcopy(tiny_model)
    seen = _embedded_tokens(m)
    actor = Actor(m, TrainerConfig(micro_batch_size=4), AlgoConfig(), total_steps=1)
    actor.compute_logprobs(b)
    assert sum(seen) == want and len(seen) == 3
    seen.clear()
    actor.update(b)
    assert sum(seen) == want and len(seen) == 3
    seen.clear()
    Reference(m, temperature=1.0, micro_batch_size=4, padding_free=True, shared_prefix=True).compute_ref_logprobs(b)
    assert sum(seen) == want and len(seen) == 3


@pytest.mark.equivalence
def test_reference_logprobs_equal_the_unshared_ones(tiny_model):
    b = _grouped(seed=4)
    want = Reference(tiny_model, temperature=1.0, micro_batch_size=5).compute_ref_logprobs(b)
    got = Reference(tiny_model, temperature=1.0, micro_batch_size=5, padding_free=True,
                    shared_prefix=True).compute_ref_logprobs(b)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert float(want.abs().sum()) > 0 and float((want * (1 - b.response_mask)).abs().max()) == 0.0


@pytest.mark.unit
def test_shared_prefix_needs_the_packed_layout():
    assert TrainerConfig().shares_prefix and not TrainerConfig(padding_free=False).shares_prefix
    assert not TrainerConfig(shared_prefix=False).shares_prefix
    with pytest.raises(ValueError, match="padding_free=true"):
        TrainerConfig(shared_prefix=True, padding_free=False)
    with pytest.raises(ValueError, match="padding_free"):
        token_logprobs(perturbed_model(small_config()), torch.ones(1, 3, dtype=torch.long),
                       torch.ones(1, 3, dtype=torch.long), prefix_lens=[1])


@pytest.mark.e2e
def test_a_run_with_shared_prefixes_equals_one_without(tmp_path):
    """Two mini-batches (the old-logprob recompute) and a KL term (the reference pass): every pass shares. The
    same samples and updates, and fewer tokens computed: 4 prompts x 4 samples, so each step saves 3 copies of
    each of its prompts (every arith prompt is longer than 4 tokens)."""
    sections = dict(algo={"kl_coef": 0.05}, run={"steps": 2, "save_every": 0},
                    reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]})
    shared = train(cfg_for(tmp_path, "shared", **sections), show_progress=False)  # the default
    packed = train(cfg_for(tmp_path, "packed", trainer={"shared_prefix": False}, **sections), show_progress=False)
    a, b = step_metrics(shared["run_dir"]), step_metrics(packed["run_dir"])
    assert_same_metrics(a, b)
    for x, y in zip(a, b, strict=True):
        assert x["kl"] == pytest.approx(y["kl"], rel=1e-4, abs=1e-7)
        assert y["batch/trained_tokens"] == y["batch/real_tokens"] == x["batch/real_tokens"]
        assert x["batch/trained_tokens"] <= x["batch/real_tokens"] - 4 * 3 * 4
        assert x["flops/update"] / y["flops/update"] < 1.0


@pytest.mark.unit
def test_a_bad_setting_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="shared_prefix"):
        cfg_for(tmp_path, "bad", trainer={"shared_prefix": True, "padding_free": False})


def _tp_rank(rank, world, batch):
    """TP 2: vocab-sharded logits, logprobs computed shard-wise; the prefix's re-read last slot included."""
    dims = ParallelDims(world_size=world, tp=2)
    model = parallelize_model(perturbed_model(small_config(model_type="qwen2", qkv_bias=True), seed=1), dims,
                              dims.build_mesh("cpu"))
    plens = prompt_lens(batch.response_mask, batch.attention_mask)
    logp, ent, _ = _forward_and_grads(model, batch, padding_free=True, prefix_lens=plens,
                                      tp_group=dims.tp_mesh.get_group())
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters()}
    return logp, ent, grads


@pytest.mark.equivalence
def test_tensor_parallel_shared_prefix_equals_one_process():
    b = _grouped(seed=6)
    want = _forward_and_grads(perturbed_model(small_config(model_type="qwen2", qkv_bias=True), seed=1), b)
    real = b.attention_mask.bool().clone()
    real[:, 0] = False
    for logp, ent, grads in run_distributed(_tp_rank, 2, b):
        torch.testing.assert_close(logp[real], want[0][real], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(ent[real], want[1][real], atol=2e-6, rtol=1e-5)
        for n, grad in want[2].items():
            torch.testing.assert_close(grads[n], grad, atol=1e-5 * float(grad.abs().max()), rtol=0, msg=n)


@pytest.mark.equivalence
def test_filler_rounds_the_packed_row_to_the_linear_bucket_and_changes_nothing(monkeypatch):
    """Where the linears run on oneDNN the packed row ends in filler tokens up to its row bucket, so no linear pads
    (and copies) its operands: the model sees bucket(N) tokens, and logprobs, entropies and every gradient equal
    the row without filler."""
    from relayrl.models import linear as lin
    from relayrl.trainer import logprobs as lp

    if not lin._ONEDNN:
        pytest.skip("torch without oneDNN")
    monkeypatch.setattr(lin, "_choice", dict.fromkeys(lin.PRODUCTS, True))
    model = perturbed_model(small_config(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=128), seed=3)
    b = _grouped(seed=5, prompts=8, G=6)
    plens = prompt_lens(b.response_mask, b.attention_mask)
    n = computed_tokens(b.input_ids, b.attention_mask, plens)
    assert lin.bucket(n) > n > 64, n  # a row the linears would pad
    seen = []
    model.model.layers[0].mlp.up_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[-2]))
    got = _forward_and_grads(model, b, padding_free=True, prefix_lens=plens)
    monkeypatch.setattr(lp, "_filler_tokens", lambda *a: 0)
    want = _forward_and_grads(model, b, padding_free=True, prefix_lens=plens)
    assert seen == [lin.bucket(n), n]
    for g, w in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-5 * float(grad.abs().max()), rtol=0, msg=name)
    # no filler where the linears are torch's: a narrow model, or every product on torch's kernel (Intel's rule)
    monkeypatch.undo()
    monkeypatch.setattr(lin, "_choice", dict.fromkeys(lin.PRODUCTS, True))
    assert lp._filler_tokens(model, n, "cpu", None, None) == lin.bucket(n) - n
    assert lp._filler_tokens(perturbed_model(small_config()), n, "cpu", None, None) == 0
    monkeypatch.setattr(lin, "_choice", dict.fromkeys(lin.PRODUCTS, False))
    assert lp._filler_tokens(model, n, "cpu", None, None) == 0
