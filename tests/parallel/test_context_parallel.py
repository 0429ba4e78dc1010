"""Context parallelism (Ulysses and zigzag ring attention) against one process: logits and gradients.

Two gloo ranks are launched once (cached) and compute every case; the comparisons happen here against the
plain model run in this process. Each case's loss is a token-mean NLL over response tokens divided by the
GLOBAL token count, so the cp ranks' gradients summed over the cp group equal the single-process gradient.

Activation memory: the bytes autograd saves for backward during the forward (parameters excluded, each
storage counted once), on one rank of cp = 2 against the same code on a cp = 1 group, and against the plain model.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from relayrl.errors import ConfigError
from relayrl.parallel.config import ParallelConfig
from relayrl.parallel.context_parallel import (
    apply_context_parallel,
    check_ulysses_heads,
    shard_sequence,
    shard_slots,
    shard_spans,
    unshard_sequence,
)
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import apply_activation_checkpointing, parallelize_model
from relayrl.parallel.ring_attention import _pairs

from dist_harness import run_distributed
from helpers import masked_nll, perturbed_model, small_config

CP = 2
REL = 1e-5  # max |a - b| <= REL * max |b|, fp32
# saved bytes at cp over cp=1, per rank, at most MEM_RATIO_BOUND / cp: Ulysses with cp above the KV heads keeps a
# copy of its KV head (cp / KV times the K, V of 1 / cp): 0.2625 at cp = 4 with 2 KV heads, 0.500 at cp = 2
MEM_RATIO_BOUND = 1.1

CONFIGS = {
    "gqa": dict(),  # 4 query heads, 2 KV heads
    "kv1": dict(num_key_value_heads=1),  # fewer KV heads than cp ranks: Ulysses replicates them
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, qk_norm=True, qkv_bias=True),
    "window": dict(model_type="mistral", sliding_window=5),
}

# name: (mode, layout (None: the mode's default), config, batch, activation checkpointing, loss on gathered logits)
CASES = {
    "ring_zigzag_padded": ("ring", None, "gqa", "padded", False, False),
    "ulysses_padded": ("ulysses", None, "gqa", "padded", False, False),
    "ulysses_zigzag_padded": ("ulysses", "zigzag", "gqa", "padded", False, False),
    "ring_contiguous_full": ("ring", "contiguous", "gqa", "full", False, False),
    "ulysses_full": ("ulysses", None, "gqa", "full", False, False),
    "ring_kv1": ("ring", None, "kv1", "padded", False, False),
    "ulysses_kv1": ("ulysses", None, "kv1", "padded", False, False),
    "ring_qwen3_ac_gathered": ("ring", None, "qwen3", "padded", True, True),
    "ring_window_packed": ("ring", None, "window", "packed", False, False),
    "ulysses_window_packed": ("ulysses", "zigzag", "window", "packed", False, False),
}


def batch(kind: str):
    """ids [4, 16], attention_mask, position_ids or None, segment_ids or None, loss mask on 'responses'."""
    g = torch.Generator().manual_seed(5)
    B, T = 4, 16
    ids = torch.randint(0, 64, (B, T), generator=g)
    pos = torch.arange(T)[None].expand(B, T)
    if kind == "full":
        return ids, torch.ones(B, T, dtype=torch.long), None, None, (pos >= 3).float()
    if kind == "padded":  # right padding, none, left padding, right padding past the first half
        attn = torch.ones(B, T, dtype=torch.long)
        attn[0, 11:] = 0
        attn[2, :6] = 0
        attn[3, 5:] = 0
        return ids, attn, None, None, ((pos >= 7) & attn.bool()).float()
    # packed: segments of lengths 5 + 7 + 4, 9 + 7, 16, 2 + 14; positions restart at each segment
    lengths = [[5, 7, 4], [9, 7], [16], [2, 14]]
    seg = torch.cat([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])[None] for row in lengths])
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    return ids, torch.ones(B, T, dtype=torch.long), positions, seg, (positions >= 2).float()


def build(config: str):
    torch.manual_seed(0)
    return perturbed_model(small_config(**CONFIGS[config]))


def next_token(ids, loss_mask):
    """Labels and their mask aligned with the logits: slot t predicts ids[t + 1] (the last slot nothing)."""
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    return labels, torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], 1)


nll = masked_nll


@functools.cache
def reference(config: str, kind: str):
    model = build(config)
    ids, attn, pos, seg, loss_mask = batch(kind)
    labels, mask = next_token(ids, loss_mask)
    logits = model(ids, attention_mask=attn, position_ids=pos, segment_ids=seg)
    nll(logits, labels, mask, mask.sum()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def saved_bytes(fn, params) -> tuple[int, object]:
    """Bytes autograd saves for backward while fn() runs, parameters excluded, each storage once."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


# ---------------------------------------------------------------- rank side
def _case(mode, layout, config, kind, ac, gathered, group):
    model = build(config)
    if ac:
        apply_activation_checkpointing(model)
    cp = apply_context_parallel(model, group, mode, layout)
    ids, attn, pos, seg, loss_mask = batch(kind)
    labels, mask = next_token(ids, loss_mask)
    logits = cp(ids, attention_mask=attn, position_ids=pos, segment_ids=seg)
    if gathered:  # the loss on the full logits, the same on every rank
        loss = nll(cp.gather(logits), labels, mask, mask.sum())
    else:
        loss = nll(logits, cp.shard(labels), cp.shard(mask), mask.sum())
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)
        grads[n] = p.grad
    return cp.gather(logits.detach()), grads


def _memory(group, single):
    """Saved bytes of one forward (no padding, 2 x 64 tokens): plain model, ring / ulysses on cp=1 and on `group`."""
    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    out = {}
    model = build("gqa")
    out["plain"] = saved_bytes(lambda: model(ids), list(model.parameters()))[0]
    for mode in ("ring", "ulysses"):
        for g in (single, group):
            cp = apply_context_parallel(model, g, mode)
            out[mode, cp.cp] = saved_bytes(lambda cp=cp: cp(ids), list(model.parameters()))[0]
            cp.remove()
    return out


def _errors(group):
    """Ulysses refusing heads that do not split over cp = 2; ring taking the same model."""
    model = build("gqa")
    model3 = perturbed_model(small_config(num_attention_heads=3, num_key_value_heads=3, head_dim=8))
    out = {}
    try:
        apply_context_parallel(model3, group, "ulysses")
    except ConfigError as e:
        out["heads3"] = str(e)
    ring = apply_context_parallel(model3, group, "ring")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    out["ring_heads3"] = ring.gather(ring(ids)).detach()
    ring.remove()
    out["ring_heads3_ref"] = model3(ids).detach()
    try:
        apply_context_parallel(model, group, "ring")(ids[:, :6])
    except ValueError as e:
        out["seq6"] = str(e)
    return out


def _rank(rank, world_size):
    singles = [dist.new_group([r]) for r in range(world_size)]
    group = dist.group.WORLD
    results = {name: _case(*spec, group) for name, spec in CASES.items()}
    results["memory"] = _memory(group, singles[rank])
    results["errors"] = _errors(group)
    results.update({name: _composed_case(*spec) for name, spec in COMPOSED.items() if spec[0] == world_size})
    return results


@functools.cache
def distributed():
    return run_distributed(_rank, CP, timeout=180.0)


# name: world size, ParallelDims degrees, cp mode, config, activation checkpointing; through parallelize_model,
# whose FSDP shards (and sums the gradients) over dp_shard x cp. The 4-rank ones are slow (one more launch).
COMPOSED = {
    "fsdp_cp2_ring_ac": (2, dict(cp=2), "ring", "qwen3", True),  # FSDP over the cp ranks alone
    "fsdp2_cp2_ring": (4, dict(dp_shard=2, cp=2), "ring", "gqa", False),
    "hsdp2_cp2_ring": (4, dict(dp_replicate=2, cp=2), "ring", "qwen3", False),  # HSDP (dp_replicate, dp_shard x cp)
    "tp2_cp2_ulysses": (4, dict(tp=2, cp=2), "ulysses", "gqa", False),  # 1 KV head per TP rank, replicated over cp
}


def _composed_case(world_size, degrees, mode, config, ac):
    dims = ParallelDims(world_size=world_size, **degrees)
    mesh = dims.build_mesh("cpu")
    model = parallelize_model(build(config), dims, mesh, gather_logits=True, activation_checkpointing=ac)
    cp = apply_context_parallel(model, dims.cp_mesh.get_group(), mode)
    ids, attn, _, _, loss_mask = batch("padded")
    labels, mask = next_token(ids, loss_mask)
    rows = ids.shape[0] // dims.dp
    mine = slice(dims.dp_rank * rows, (dims.dp_rank + 1) * rows)
    logits = cp(ids[mine], attention_mask=attn[mine])
    nll(logits, cp.shard(labels[mine]), cp.shard(mask[mine]), mask.sum()).backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return dims.dp_rank, cp.gather(logits.detach()), grads


# cp = 4 over 4 ranks (slow: one more launch): the ring's K, V and dK, dV pass through 3 other ranks
CASES4 = {
    "ring_cp4_padded": ("ring", None, "gqa", "padded", False, False),
    "ring_cp4_window_packed": ("ring", None, "window", "packed", False, False),
    "ulysses_cp4_kv_replicated": ("ulysses", None, "gqa", "padded", False, False),  # 2 KV heads, each on 2 ranks
    "ulysses_cp4_zigzag_qwen3": ("ulysses", "zigzag", "qwen3", "padded", False, False),
}


def _rank4(rank, world_size):
    singles = [dist.new_group([r]) for r in range(world_size)]
    results = {name: _case(*spec, dist.group.WORLD) for name, spec in CASES4.items()}
    results["memory"] = _memory(dist.group.WORLD, singles[rank])
    results.update({name: _composed_case(*spec) for name, spec in COMPOSED.items() if spec[0] == world_size})
    return results


@functools.cache
def composed():
    return run_distributed(_rank4, 4, timeout=180.0)


# ---------------------------------------------------------------- tests
def assert_close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= REL * b.abs().max().item(), f"{what}: max |diff| {err:.3g} vs max |ref| {b.abs().max():.3g}"


@pytest.mark.equivalence
@pytest.mark.parametrize("case", list(CASES) + [pytest.param(name, marks=pytest.mark.slow) for name in CASES4])
def test_equals_one_process(case):
    mode, layout, config, kind, ac, gathered = CASES.get(case) or CASES4[case]
    ref_logits, ref_grads = reference(config, kind)
    for rank, results in enumerate(distributed() if case in CASES else composed()):
        logits, grads = results[case]
        assert logits.shape == ref_logits.shape
        assert_close(logits, ref_logits, f"{case} rank {rank} logits")
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert_close(g, ref_grads[name], f"{case} rank {rank} grad {name}")


@pytest.mark.equivalence
@pytest.mark.parametrize("case", [pytest.param(name, marks=[pytest.mark.slow] if spec[0] == 4 else [])
                                  for name, spec in COMPOSED.items()])
def test_composes_with_fsdp_and_tp(case):
    ref_logits, ref_grads = reference(COMPOSED[case][3], "padded")
    for rank, results in enumerate(composed() if COMPOSED[case][0] == 4 else distributed()):
        dp_rank, logits, grads = results[case]
        rows = logits.shape[0]
        assert_close(logits, ref_logits[dp_rank * rows:(dp_rank + 1) * rows], f"{case} rank {rank} logits")
        for name, g in grads.items():
            assert_close(g, ref_grads[name], f"{case} rank {rank} grad {name}")


@pytest.mark.unit
def test_parallel_dims_cp():
    dims = ParallelDims(dp_shard=-1, cp=2, tp=2, world_size=8)
    assert dims.dp_shard == 2 and dims.dp == 2 and dims.cp_enabled
    with pytest.raises(ConfigError, match=r"dp_shard \(1\) x cp \(2\) x tp \(1\) = 2, but world_size is 4"):
        ParallelDims(cp=2, world_size=4)
    assert ParallelConfig.from_dict({"cp": 2}).world_size == 2  # runs take it (tests/e2e/test_context_parallel_run.py)
    assert ParallelConfig.from_dict({"cp": 1, "cp_mode": "ulysses"}).cp_mode == "ulysses"


@pytest.mark.equivalence
@pytest.mark.parametrize("cp", [CP, pytest.param(4, marks=pytest.mark.slow)])
def test_activation_memory_falls_to_one_over_cp(cp):
    for rank, results in enumerate(distributed() if cp == CP else composed()):
        mem = results["memory"]
        for mode in ("ring", "ulysses"):
            ratio = mem[mode, cp] / mem[mode, 1]
            print(f"rank {rank} {mode}: saved {mem[mode, cp]} B at cp={cp}, {mem[mode, 1]} B at cp=1 (ratio "
                  f"{ratio:.3f}), plain model {mem['plain']} B (cp={cp} / plain {mem[mode, cp] / mem['plain']:.3f})")
            assert 0.95 / cp <= ratio <= MEM_RATIO_BOUND / cp, (mode, rank, ratio)
        # the swapped attention at cp = 1 keeps what the plain model (SDPA's causal kernel) keeps: ring exactly;
        # Ulysses one more [B T, h] fp32 copy per layer (2 x 64 x 32 x 4 B x 2 layers), the o_proj input that
        # its all-to-all's output layout makes the linear copy and save
        assert mem["ring", 1] == mem["plain"], mem
        assert mem["ulysses", 1] == mem["plain"] + 2 * 64 * 32 * 4 * 2, mem


@pytest.mark.equivalence
def test_errors_heads_and_length():
    errors = distributed()[0]["errors"]
    assert "3 query heads (not divisible by 2)" in errors["heads3"] and "cp_mode='ring'" in errors["heads3"]
    assert_close(errors["ring_heads3"], errors["ring_heads3_ref"], "ring with 3 heads on cp=2")
    assert "pad the batch to a multiple of 4" in errors["seq6"]


@pytest.mark.unit
def test_ulysses_head_checks():
    check_ulysses_heads(8, 2, 4)  # KV 2 divides cp 4: replicated twice
    check_ulysses_heads(8, 8, 4)
    with pytest.raises(ConfigError, match="6 query heads"):
        check_ulysses_heads(6, 2, 4)
    with pytest.raises(ConfigError, match=r"key/value heads \(3 in"):
        check_ulysses_heads(12, 3, 2)


@pytest.mark.unit
def test_zigzag_by_hand():
    assert shard_spans(8, 2, 0) == [(0, 2), (6, 8)]
    assert shard_spans(8, 2, 1) == [(2, 4), (4, 6)]
    assert shard_slots(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert shard_slots(16, 4, 3, "contiguous").tolist() == [12, 13, 14, 15]
    x = torch.arange(2 * 16).view(2, 16)
    parts = [shard_sequence(x, 4, r) for r in range(4)]
    assert parts[0][1].tolist() == [16, 17, 30, 31]
    assert torch.equal(unshard_sequence(parts), x)
    assert torch.equal(unshard_sequence([shard_sequence(x, 4, r, "contiguous") for r in range(4)], "contiguous"), x)
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_spans(12, 4, 0)


@pytest.mark.unit
def test_zigzag_balances_causal_work():
    """Query x key elements of the blocks each rank computes over the ring's steps (causal skipping), T = 32,
    cp = 4. Zigzag: rank r's chunks r and 7 - r meet (r + 1) + (8 - r) = 9 key chunks of 4, 9 x 16 each;
    contiguous: rank r's one chunk of 8 meets r + 1 chunks, (r + 1) x 64."""
    def work(layout):
        spans = [shard_spans(32, 4, r, layout) for r in range(4)]
        return [sum((qs[1] - qs[0]) * (ks[1] - ks[0]) for s in range(4) for _, qs, _, ks in _pairs(spans[r], spans[s]))
                for r in range(4)]
    assert work("zigzag") == [144] * 4
    assert work("contiguous") == [64, 128, 192, 256]
