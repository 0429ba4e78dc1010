"""Activation memory from the published per-layer formula, adapted to the models relayrl trains.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", GPT: GeLU
MLP of 4h, LayerNorm, dropout, attention scores materialised), bytes per layer at 16-bit:

    no parallelism           s b h (34 + 5 a s / h)
    TP t                     s b h (10 + 24 / t + 5 a s / (h t))
    TP t + SP                s b h (34 / t + 5 a s / (h t))
    selective recompute      the 5 a s / h term is dropped (scores recomputed in backward)
    full recompute           2 s b h (the layer input only)

(34 = attention 11: QKV input 2, Q and K 4, V 2, o_proj input 2, dropout mask 1; MLP 19: input 2,
GeLU input 8, GeLU output 8, dropout mask 1; two LayerNorm inputs 4. 5as/h: softmax output 2,
dropout mask 1, dropout output 2 per score.) `korthikanti_layer_bytes` is that formula, exactly.

Our adaptation for Llama / Qwen (RMSNorm, SwiGLU of I, GQA with kv heads, RoPE, no dropout) is what
relayrl's model saves for backward, measured with torch.autograd.graph.saved_tensors_hooks (tests/
test_plan_activations.py, fp32, one process, TP 2, TP 2 + SP): e bytes per element (2 for bf16, 4 for fp32),
q = a*hd, kv = kv_heads*hd, per layer:

    two RMSNorm inputs                           2 e s b h            / t with SP
    two RMSNorm outputs: normalised x (the weight  2 e s b h + 2 x 4 s b   / t with SP
      multiply keeps it) and the fp32 rsqrt
    QKV input and MLP input                      2 e s b h            NOT / t with relayrl's SP (below)
    Q, K, V after RoPE (attention's inputs)      e s b (q + 2 kv) / t
    attention output (o_proj's input)            e s b q / t
    SwiGLU: gate, up, silu(gate), their product  4 e s b I / t
    scores: sdpa (flash / memory-efficient)      4 a s b / t (fp32 logsumexp; no s x s kept)
            eager                                e a s^2 b / t (softmax output; no dropout)
    sdpa's attention mask                        e b s^2 (the boolean mask made additive in the query's dtype,
                                                 torch's convert_boolean_attn_mask, in every layer; padded
                                                 rows: full rows run the causal kernel and keep none, so the
                                                 plan is an upper bound for them)

LoRA (relayrl.models.lora, frozen base, fp32 adapters, no LoRA dropout): autograd keeps what a trained
tensor's gradient needs, so the frozen norms keep only their rsqrt (not the normalised x), a frozen linear's
input is kept only when its adapter is trained (q/k/v's and gate/up's when one of them is targeted; down_proj's,
the SwiGLU product, only when it is), and each target adds x A^T [s, b, r] (kept by lora_B's matmul; x itself
is the linear's input already counted, no copy). The first layer keeps less still (its input needs no gradient).

Sequence parallel: relayrl's SP (relayrl.parallel.tensor_parallel: PrepareModuleInput turns the sequence-
sharded residual into a replicated one before the colwise q/k/v and gate/up) all-gathers the norm's output and
the linears keep that gathered input, so "QKV input and MLP input" stay 2 e s b h. Megatron-LM's SP keeps the
sharded input and all-gathers again in backward, so the paper's 34 / t divides them too:
`layer_terms(..., sp_gathered_inputs=False)` gives that published variant, for comparison only.

At e = 2, q = kv = h with the paper's GeLU MLP of 4h (input 2, GeLU in 8, out 8) in place of SwiGLU the
terms the paper counts are s b h (32 + 2 a s / h) against its 34 + 5as/h: the differences are the two dropout
masks and the scores' dropout mask and output; the paper leaves out the norms' outputs and the mask.
SwiGLU of I keeps 4 tensors of I (8 s b I at e = 2).
With CP c each rank keeps s/c of every token term, and its scores cover (s/c) x s. Outside the layers:
the attention mask relayrl's model builds
([b, 1, s, s] bool, once), the final norm's input, its normalised output and rsqrt and the lm_head's input
(LoRA: the rsqrt only), and the fp32 log-softmax over the vocabulary at the s - 1 positions that predict a
token (b (s - 1) V / t x 4 B) that the logprob loss keeps for backward. The entropy the trainer reports is
computed without a graph unless algo.entropy_coef != 0 (relayrl.trainer.logprobs), so it keeps nothing;
the loss's per-token [b, s] scalars (ratios, masks, advantages: tens of bytes per token) are not counted.

MoE (relayrl.planner.moe): the router's softmax and top-k weights, the routed copies, each copy's SwiGLU of
moe_intermediate / t and the experts' outputs take the SwiGLU's place (balanced routing assumed); with ep > 1
the dispatch's send and receive buffers are transient.

Pipeline: a pp rank keeps the activations of the micro-batches in flight on each stage it holds (`in_flight`:
counted from a micro-batch's forward to its last backward pass on that stage, the weight-gradient one in the
zero-bubble schedules), at the rank's peak; the activation terms are each stage's layers x its count, summed.

It imports the planner's modules and relayrl.models.config only.
"""

from __future__ import annotations

from relayrl.models.config import ModelShape, MoEShape
from relayrl.planner.layout import Layout
from relayrl.planner.moe import moe_mlp_terms
from relayrl.planner.workload import Workload


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """The paper's per-layer activation bytes (16-bit, GPT shape) — the reference our adaptation cites."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    scores = 0 if recompute == "selective" else 5 * a * s / (h * t)
    linear = 34 / t if sp else 10 + 24 / t
    return s * b * h * (linear + scores)


def in_flight(layout: Layout, m: int, pp_rank: int) -> tuple[int, ...]:
    """Micro-batches whose activations pp rank r keeps at its peak, per stage it holds (layout.rank_stages(r)
    order), over m micro-batches on p ranks; k = m // max(1, m // p), the micro-batches of one of torch's rounds:

        gpipe              (m,)                              every forward before any backward
        1f1b               (min(m, p - r),)                  p - r warm-up forwards (Narayanan et al. 2021)
        interleaved_1f1b   the first F = min(2m, k + 2 (p - 1 - r) + 1) forwards, dealt to the two stages in
                           blocks of k (torch's warm-up: (v - 1) k + 2 (p - 1 - r), then one more before the
                           first backward): rank 0 of p = 4, m = 8 holds (7, 4)
        interleaved_zb     (k, min(m, p))                    every rank alike (ZB1P keeps 1F1B's memory)
        zbv                (min(m, 2p - 1 - r), min(m, r + 1))   together 2p: 1F1B's p micro-batches of a full
                                                             stage (Qi et al. 2023: ZB-V's peak equals 1F1B's)
        dualpipev          (min(m, 2p - r), min(m, r + 1))    together 2p + 1 chunks (DeepSeek-V3: PP + 1)

    They are the peaks of torch's own action orders, counted in tests/planner/test_plan_pipeline.py."""
    p, r, name = layout.pp, pp_rank, layout.pp_schedule
    if p == 1:
        return (1,)
    if name == "gpipe":
        return (m,)
    if name == "1f1b":
        return (min(m, p - r),)
    k = m // max(1, m // p)
    if name == "interleaved_1f1b":
        f = min(2 * m, k + 2 * (p - 1 - r) + 1)
        first = sum(1 for i in range(f) if (i // k) % 2 == 0)
        return first, f - first
    if name == "interleaved_zb":
        return k, min(m, p)
    if name == "zbv":
        return min(m, 2 * p - 1 - r), min(m, r + 1)
    return min(m, 2 * p - r), min(m, r + 1)  # dualpipev


def layer_terms(shape: ModelShape, layout: Layout, w: Workload,
                sp_gathered_inputs: bool = True) -> list[tuple[str, float, str]]:
    """Per-layer, per-micro-batch activation bytes of one rank (no recompute), as (name, bytes, why).
    sp_gathered_inputs=False: Megatron-LM's SP (the linears' inputs / t too), not what relayrl does."""
    e, b, t = w.act_bytes, w.micro_batch, layout.tp
    s = w.seq / layout.cp  # tokens this rank keeps
    h, a, inter = shape.hidden_size, shape.num_attention_heads, shape.intermediate_size
    q, kv = a * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    seq_split = t if layout.sp else 1
    sp_note = " / t (SP)" if layout.sp else ""
    if not layout.sp:
        inputs_note = " (replicated over TP)"
    elif sp_gathered_inputs:
        inputs_note = " (SP: the all-gathered input, not / t)"
    else:
        inputs_note = " / t (Megatron SP)"
    in_split = seq_split if not sp_gathered_inputs else 1
    lora = set(w.lora_targets) if w.lora_rank else None
    if lora is None:
        norm_out = ("norm outputs", (2 * e * s * b * h + 2 * 4 * s * b) / seq_split,
                    "2 RMSNorm normalised outputs and fp32 rsqrt: 2 (e s b h + 4 s b)" + sp_note)
        n_in, in_why, swiglu = 2, "inputs of q/k/v and gate/up: 2 e s b h", 4
    else:  # frozen base: a linear keeps its input only for a trained adapter, a norm only its rsqrt
        norm_out = ("norm outputs", 2 * 4 * s * b / seq_split, "LoRA: the frozen norms keep only the fp32 rsqrt: "
                    "2 x 4 s b" + sp_note)
        n_in = bool(lora & {"q_proj", "k_proj", "v_proj"}) + bool(lora & {"gate_proj", "up_proj"})
        in_why = f"inputs of the targeted q/k/v and gate/up ({n_in} of 2): {n_in} e s b h"
        swiglu = 4 if "down_proj" in lora else 3
    out = [("norm inputs", 2 * e * s * b * h / seq_split, "2 RMSNorm inputs: 2 e s b h" + sp_note), norm_out,
           ("qkv + mlp inputs", n_in * e * s * b * h / in_split, in_why + inputs_note),
           ("q, k, v", e * s * b * (q + 2 * kv) / t, f"after RoPE: e s b (q + 2 kv) / t, q={q}, kv={kv} (GQA)"),
           ("attention output", e * s * b * q / t, "o_proj input (sdpa's output): e s b q / t"),
           ("swiglu", swiglu * e * s * b * inter / t, f"gate, up, silu(gate){', product' if swiglu == 4 else ''}: "
            f"{swiglu} e s b I / t, I={inter}" + ("" if swiglu == 4 else " (down_proj frozen: its input not kept)"))]
    if isinstance(shape, MoEShape):  # the router and the routed experts in the dense SwiGLU's place
        out = [x for x in out if x[0] != "swiglu"] + moe_mlp_terms(shape, s, b, t, e)
    if lora is not None:
        out.append(("lora x A^T", len(lora) * e * s * b * w.lora_rank,
                    f"each of the {len(lora)} targets keeps x A^T for lora_B's gradient: {len(lora)} e s b r, r="
                    f"{w.lora_rank} (not / t: colwise A is replicated, rowwise x A^T is a partial sum of full size)"))
    if w.attention == "eager":
        out.append(("attention scores", e * a * s * w.seq * b / t, "softmax output e a (s/cp) s b / t"))
    else:
        out.append(("attention scores", 4 * a * s * b / t, "sdpa keeps only the fp32 logsumexp: 4 a s b / t"))
        out.append(("sdpa mask", e * b * s * w.seq, "sdpa's additive copy of the boolean mask in the query's dtype: "
                    "e b (s/cp) s"))
    return out


def activation_terms(shape: ModelShape, layout: Layout, w: Workload, stage: int) -> list[tuple[str, int, str]]:
    """The activations pp rank `stage` keeps at its peak: each held stage's layers x its micro-batches in flight."""
    from relayrl.planner.memory import stage_layers

    m = w.micro_batches(layout.pp)
    stages = layout.rank_stages(stage)
    flies = in_flight(layout, m, stage)
    per_stage = [(len(stage_layers(shape.num_hidden_layers, layout.num_stages, st)), f)
                 for st, f in zip(stages, flies, strict=True)]
    e, b, t, s = w.act_bytes, w.micro_batch, layout.tp, w.seq / layout.cp
    h = shape.hidden_size
    seq_split = t if layout.sp else 1
    mult = sum(n * f for n, f in per_stage)
    fly = sum(flies)  # forwards in flight: each built its own attention mask
    if len(stages) == 1:
        where = f"x {per_stage[0][0]} layers x {flies[0]} micro-batch(es) in flight"
    else:
        where = "x (" + " + ".join(f"{n} layers x {f}" for n, f in per_stage) + ") on stages " + \
                ", ".join(map(str, stages)) + " (layers x micro-batches in flight)"
    out: list[tuple[str, int, str]] = []
    if w.recompute == "full":
        out.append(("layer inputs (full recompute)", int(e * s * b * h / seq_split * mult),
                    f"only each layer's input is kept: e s b h{' / t' if layout.sp else ''} {where}"))
    else:
        for name, per, why in layer_terms(shape, layout, w):
            if name == "attention scores" and w.recompute == "selective":
                continue  # recomputed in backward: the point of selective recompute
            out.append((name, int(per * mult), f"{why} {where}"))
    last = layout.num_stages - 1
    out.append(("attention mask", int(b * s * w.seq * fly), "[b, 1, s, s] bool built once per forward"))
    if last in stages:
        fly = flies[stages.index(last)]  # the head's terms: the last stage's micro-batches only
        v = shape.vocab_size
        out += [("log-softmax", int(4 * b * (w.seq - 1) / layout.cp * v / t * fly),
                 f"fp32 b (s - 1) V / t kept by the logprob loss (the last position predicts nothing), V={v}"),
                ("final norm input", int(e * s * b * h / seq_split * fly), "e s b h")]
        if w.lora_rank:  # frozen final norm and lm_head: only the rsqrt is kept
            out.append(("final norm rsqrt", int(4 * s * b / seq_split * fly), "LoRA: the frozen norm keeps 4 s b"))
        else:
            out.append(("final norm output + lm_head input", int(((e * s * b * h + 4 * s * b) / seq_split
                                                                  + e * s * b * h) * fly),
                        "the normalised x and fp32 rsqrt (e s b h + 4 s b), and the lm_head's input x w (e s b h)"))
    return out


def transient_terms(shape: ModelShape, layout: Layout, w: Workload, stage: int) -> list[tuple[str, int, str]]:
    """Buffers that live for part of a step. Summed: a conservative peak (they do not all coexist)."""
    from relayrl.planner.memory import stage_summary

    e, b, t, s = w.act_bytes, w.micro_batch, layout.tp, w.seq / layout.cp
    h = shape.hidden_size
    out: list[tuple[str, int, str]] = []
    _, big, root, _ = stage_summary(shape, layout, w, stage)
    sb = w.state_bytes()
    pb = max(sb.param, w.frozen_bytes) if w.lora_rank else sb.param
    n = layout.shard_group
    if layout.dp_mode == "fsdp" and n > 1:
        out.append(("fsdp gathered layers", 2 * big[0] * pb,
                    f"two decoder layers unsharded at once (the current and the prefetched): 2 x {big[0]:,} x {pb} B"))
        out.append(("fsdp gathered root", root[0] * pb,
                    f"embedding / norm / lm_head: the root group stays gathered for forward and backward, "
                    f"{root[0]:,} x {pb} B"))
        out.append(("fsdp grad reduce-scatter input", big[1] * sb.grad,
                    f"one layer's unsharded gradients before the reduce-scatter: {big[1]:,} x {sb.grad} B"))
    elif layout.dp_mode == "zero2" and n > 1:
        out.append(("zero2 grad bucket", big[1] * sb.grad, "one layer's full gradients before the reduce-scatter"))
    if layout.sp:
        out.append(("sp all-gather gradient", int(e * w.seq / layout.cp * b * h),
                    "backward: the gradient of a TP region's all-gathered input before its reduce-scatter: e s b h"))
    if layout.ep > 1:
        k = shape.num_experts_per_tok
        out.append(("ep all-to-all buffers", int(2 * e * s * b * k * h),
                    f"the dispatch's send and receive buffers of the {k} routed copies: 2 e s b k h"))
    if layout.cp > 1:
        kv = shape.num_key_value_heads * shape.head_dim
        if layout.cp_mode == "ring":
            out.append(("cp ring kv buffers", int(2 * 2 * e * s * b * kv / t),
                        "the K, V chunk being used and the one arriving: 2 x 2 e (s/cp) b kv / t"))
        else:
            q = shape.num_attention_heads * shape.head_dim
            out.append(("cp all-to-all buffers", int(e * s * b * (2 * q + 2 * kv) / t),
                        "Ulysses: q, k, v, out re-split by heads: e (s/cp) b (2q + 2kv) / t"))
    if w.recompute == "full":
        one = sum(per for _, per, _ in layer_terms(shape, layout, w))
        out.append(("recomputed layer", int(one), "one layer's activations, rebuilt during its backward"))
    if layout.num_stages - 1 in layout.rank_stages(stage):
        v = shape.vocab_size
        out.append(("logits temporaries", int(b * s * v / t * (e + 4)),
                    "logits at the compute dtype and their fp32 copy while log_softmax runs: b s V / t (e + 4)"))
    return out
