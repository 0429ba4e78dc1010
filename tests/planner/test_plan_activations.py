"""The planner's per-layer activations against what relayrl's model saves for backward, counted with
torch.autograd.graph.saved_tensors_hooks: one process, TP 2 and TP 2 + SP on 2 gloo ranks (fp32, tiny model).

Counted: every distinct storage the last decoder layer's autograd nodes save that the layer before it did not
save too (RoPE's cos / sin are shared by the layers; the first layer, whose input needs no gradient under LoRA,
may save none) and that is not a parameter; a DTensor as its local shard."""

from __future__ import annotations

import pytest
import torch

from relayrl.models import CausalLM, ModelConfig
from relayrl.models.config import ModelShape
from relayrl.planner import Layout, Workload
from relayrl.planner.activations import layer_terms

from dist_harness import run_distributed

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
B, S = 2, 6  # S != head_dim, so [b, 1, s, s] and [b, 1, s, hd] differ
FP32 = Workload(seq=S, micro_batch=B, dtype="float32", mixed_precision=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    while type(t) not in (torch.Tensor, torch.nn.Parameter):  # DTensor, AsyncCollectiveTensor
        t = t._local_tensor if hasattr(t, "_local_tensor") else t.elem
    return t


def saved_bytes_of_last_layer(model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    current: list = [None]
    seen: dict[int, dict[int, int]] = {}
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))

    def pack(t):
        if current[0] is not None:
            st = _local(t).untyped_storage()
            if st.data_ptr() not in params:
                seen.setdefault(current[0], {})[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, attention_mask=attention_mask)
    before = seen.get(len(layers) - 2, {})
    return {"bytes": sum(n for p, n in seen[len(layers) - 1].items() if p not in before)}


def _measure_both(rank: int, world: int) -> dict:
    return {sp: _measure(rank, world, sp) for sp in (False, True)}


def _measure(rank: int, world: int, sp: bool) -> dict:
    from relayrl.parallel.dims import ParallelDims
    from relayrl.parallel.parallelize import parallelize_model

    model = CausalLM(CFG)
    model.reset_parameters(std=0.02, seed=0)
    if world > 1:
        dims = ParallelDims(world_size=world, tp=world)
        parallelize_model(model, dims, dims.build_mesh("cpu"), sequence_parallel=sp)
    ids = torch.randint(0, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    # padded rows, which the plan models (a full batch runs SDPA's causal kernel and keeps no mask: less)
    attn = torch.ones(B, S, dtype=torch.long)
    attn[1, -1] = 0
    return saved_bytes_of_last_layer(model, ids, attn)


def planned(layout: Layout, **kw) -> int:
    return int(sum(b for _, b, _ in layer_terms(ModelShape.of(CFG), layout, FP32, **kw)))


@pytest.mark.equivalence
def test_planned_layer_activations_are_what_one_process_saves():
    assert _measure(0, 1, False)["bytes"] == planned(Layout())


@pytest.fixture(scope="module")
def tp_runs() -> dict:
    runs = run_distributed(_measure_both, 2)  # one launch: TP 2, then TP 2 + SP on fresh models
    return {sp: [r[sp] for r in runs] for sp in (False, True)}


@pytest.mark.equivalence
def test_tensor_parallel_with_and_without_sp_saves_what_the_plan_says(tp_runs):
    """relayrl's SP all-gathers the norm's output before the colwise linears and they keep that gathered
    input: only the norms' inputs and outputs are / t, not the linears' inputs as in Megatron-LM's SP."""
    tp, sp = ([r["bytes"] for r in tp_runs[flag]] for flag in (False, True))
    assert tp[0] == tp[1] == planned(Layout(tp=2))
    assert sp[0] == sp[1] == planned(Layout(tp=2, sp=True))
    # by hand, fp32, s b = 12: SP halves the norms' inputs and outputs, 4 x 12 x 32 x 4 B + 2 x 12 x 4 B rsqrt
    assert tp[0] - sp[0] == (4 * 12 * 32 * 4 + 2 * 12 * 4) // 2 == 3120
    # Megatron's SP would also halve the q/k/v and gate/up inputs (2 x 12 x 32 x 4 B): not what relayrl keeps
    assert planned(Layout(tp=2, sp=True), sp_gathered_inputs=False) == sp[0] - 2 * 12 * 32 * 4 // 2


def _measure_lora(targets: tuple[str, ...], rank: int) -> int:
    from relayrl.models.lora import apply_lora

    model = CausalLM(CFG)
    model.reset_parameters(std=0.02, seed=0)
    apply_lora(model, rank, 2.0 * rank, targets=targets)
    ids = torch.randint(0, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    # padded rows, which the plan models (a full batch runs SDPA's causal kernel and keeps no mask: less)
    attn = torch.ones(B, S, dtype=torch.long)
    attn[1, -1] = 0
    return saved_bytes_of_last_layer(model, ids, attn)["bytes"]


@pytest.mark.equivalence
@pytest.mark.parametrize(("targets", "by_hand"), [
    # every projection: no normalised norm outputs (frozen norms), x A^T [12, 4] fp32 for each of 7 targets
    (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 23616 - 2 * 1536 + 7 * 192),
    # q and v: the MLP input and the SwiGLU product (down_proj's input) are no longer kept
    (("q_proj", "v_proj"), 23616 - 2 * 1536 - 1536 - 2304 + 2 * 192),
    (("down_proj",), 23616 - 2 * 1536 - 2 * 1536 + 192),
])
def test_lora_layer_activations_are_what_one_process_saves(targets, by_hand):
    """fp32, s b = 12, h 32, I 48, r 4; the full model's last layer keeps 23616 B (the test above)."""
    assert planned(Layout()) == 23616
    w = Workload(seq=S, micro_batch=B, dtype="float32", mixed_precision=False, lora_rank=4, lora_targets=targets)
    plan = int(sum(b for _, b, _ in layer_terms(ModelShape.of(CFG), Layout(), w)))
    assert _measure_lora(targets, 4) == plan == by_hand


def _outside_layers_saved(lora_rank: int = 0) -> int:
    """Bytes the GRPO loss's forward saves for backward outside the decoder layers (one process, fp32)."""
    from relayrl.algorithms import AlgoConfig
    from relayrl.models.lora import apply_lora
    from relayrl.trainer.actor import Actor
    from relayrl.trainer.batch import TrainBatch
    from relayrl.trainer.config import TrainerConfig

    model = CausalLM(CFG)
    model.reset_parameters(std=0.02, seed=0)
    if lora_rank:
        apply_lora(model, lora_rank, 2.0 * lora_rank, seed=0)
    ids = torch.randint(0, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    resp = torch.zeros(B, S)
    resp[:, 3:] = 1
    batch = TrainBatch(ids, torch.ones(B, S, dtype=torch.long), resp, advantages=torch.tensor([1.0, -1.0]))
    actor = Actor(model, TrainerConfig(micro_batch_size=B), AlgoConfig(), total_steps=1)
    batch = batch.replace(old_logp=actor.compute_logprobs(batch))
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    inside, seen = [False], {}
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))

    def pack(t):
        st = t.untyped_storage()
        if not inside[0] and st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        actor.loss(batch, torch.tensor(float(resp.sum())), float(B))
    return sum(seen.values())


@pytest.mark.unit
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_planned_outside_the_layers_is_what_the_loss_saves(lora_rank):
    """Outside the layers the plan counts the final norm's input (and, unless LoRA freezes them, its normalised
    output and rsqrt and the lm_head's input) and the fp32 log-softmax at the s - 1 predicting positions; the
    reported entropy keeps nothing (entropy_coef = 0). Not counted: the loss's per-token [b, s] scalars (bounded
    here by 16 fp32 values per token) and counted but not saved: the [b, 1, s, s] bool mask (72 B)."""
    from relayrl.planner.activations import activation_terms

    w = Workload(seq=S, micro_batch=B, dtype="float32", mixed_precision=False, lora_rank=lora_rank)
    outside = {n: b for n, b, _ in activation_terms(ModelShape.of(CFG), Layout(), w, 0)
               if n in ("attention mask", "log-softmax", "final norm input", "final norm output + lm_head input",
                        "final norm rsqrt")}
    # by hand, s b = 12, h 32, V 64: log-softmax 4 x 2 x 5 x 64, final norm input 4 x 12 x 32
    assert outside["log-softmax"] == 2560 and outside["final norm input"] == 1536
    if lora_rank:
        assert outside["final norm rsqrt"] == 4 * 12
    else:
        assert outside["final norm output + lm_head input"] == 2 * 1536 + 4 * 12
    planned = sum(outside.values()) - outside["attention mask"]
    measured = _outside_layers_saved(lora_rank)
    assert planned <= measured <= planned + 16 * 4 * B * S
