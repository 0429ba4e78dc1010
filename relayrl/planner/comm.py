"""Communication per optimizer step, per rank, collective by collective, with a time from the link it
crosses.

Ring algorithms; B = the bytes of the full tensor, n = the group's size; what one rank sends:

    all-reduce        2 (n-1)/n B          all-gather / reduce-scatter    (n-1)/n B
    all-to-all        (n-1)/n B            p2p                             B

    DDP        all-reduce of the trained grads, once per step (accumulation without sync)
    ZeRO-1/2   reduce-scatter of grads + all-gather of updated params over the shard group, once per step
    FSDP       all-gather of params in forward and again in backward + reduce-scatter of grads, per
               micro-batch (FSDP2 reshards after forward and reduces every backward); HSDP adds an
               all-reduce of the grad shards over dp_replicate (every micro-batch under FSDP, once per step
               under ZeRO-1/2)
    TP         per layer per micro-batch: 2 all-reduces of e s b h in forward, 2 in backward (one per
               attention and MLP block); SP replaces each by an all-gather + a reduce-scatter: the same
               bytes; full recompute re-runs the forward's 2
    PP         per micro-batch a stage boundary carries e s b h forward and its gradient back
    CP ring    per layer per micro-batch: K, V chunks passed cp-1 times in forward, K, V and dK, dV in
               backward (3x the forward, 4x with full recompute); Ulysses: all-to-all of q, k, v and out,
               forward and backward (a third forward's with full recompute)
    EP         (MoE, ep > 1) per layer per micro-batch: dispatch and combine all-to-alls of the k routed copies,
               forward and backward, (ep-1)/ep x e s b k h each, over the ep ranks at stride tp; the experts' ZeRO /
               FSDP traffic runs over the n / ep ranks holding the same experts (stride tp x ep), the rest over n

Which link: ranks are laid out tp fastest, then cp, dp_shard, dp_replicate, pp, on nodes of
gpus_per_node consecutive ranks. A group of size n at rank stride st stays inside a node when
st x n <= gpus_per_node; otherwise it crosses nodes and runs at inter_bw. Time = bytes / bandwidth
(the bandwidths are per-GPU bus bandwidths, as nccl-tests reports busbw).

It imports the planner's modules and relayrl.models.config only.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.models.config import ModelShape
from relayrl.planner.layout import Layout
from relayrl.planner.workload import Workload


@dataclass(frozen=True)
class Network:
    gpus_per_node: int
    intra_bw: float = 450.0  # GB/s per GPU, NVLink (H100 SXM: 900 GB/s both ways)
    inter_bw: float = 50.0  # GB/s per GPU, one 400 Gb/s NIC per GPU

    def describe(self) -> str:
        return (f"{self.gpus_per_node} GPUs per node; {self.intra_bw:g} GB/s per GPU inside a node, "
                f"{self.inter_bw:g} GB/s per GPU across nodes (bus bandwidth; time = bytes / bandwidth)")


@dataclass
class Collective:
    name: str
    group: str  # which layout dims
    size: int
    bytes: int  # per rank per step
    crosses_nodes: bool
    seconds: float
    overlapped: bool  # data-parallel traffic overlaps compute; TP / CP / PP sit on the critical path
    explanation: str


def _coll(name, layout, dims, nbytes, net, overlapped, why) -> Collective:
    size = 1
    for d in dims:
        size *= getattr(layout, d)
    shown = [d for d in dims if getattr(layout, d) > 1] or list(dims[:1])
    return _coll_at(name, " x ".join(shown), size, layout.stride(dims[0]), nbytes, net, overlapped, why)


def _coll_at(name, group, size, stride, nbytes, net, overlapped, why) -> Collective:
    """A group of `size` ranks `stride` apart (inside a node when stride x size <= gpus_per_node)."""
    cross = stride * size > net.gpus_per_node
    bw = net.inter_bw if cross else net.intra_bw
    return Collective(name, group, size, int(nbytes), cross, nbytes / (bw * 1e9), overlapped, why)


def _expert_collectives(shape: ModelShape, layout: Layout, w: Workload, net: Network, expert_elems: tuple[int, int],
                        n_layers: int) -> list[Collective]:
    """EP: the routed tokens' all-to-all, and the experts' own ZeRO / FSDP traffic over the n / ep ranks that hold
    the same experts (stride tp x ep inside the shard group)."""
    sb = w.state_bytes()
    m, ep, n = w.micro_batches(layout.pp), layout.ep, layout.shard_group
    ne, stride = n // ep, layout.tp * ep
    e, b, s, h, k = w.act_bytes, w.micro_batch, w.seq / layout.cp, shape.hidden_size, shape.num_experts_per_tok
    passes = 6 if w.recompute == "full" else 4
    per = (ep - 1) / ep * e * s * b * k * h
    out = [_coll_at("ep all-to-all", "ep", ep, layout.tp, n_layers * m * passes * per, net, False,
                    f"dispatch + combine, forward and backward ({passes} per layer per micro-batch) x {n_layers} "
                    f"layers x {m}: (ep-1)/ep x e s b k h = {per:,.0f} B")]
    if ne == 1:
        return out
    g_bytes, p_bytes = expert_elems[1] * sb.grad, expert_elems[0] * sb.param
    if layout.dp_mode == "fsdp":
        out += [_coll_at("fsdp expert param all-gather", "expert shard", ne, stride, 2 * m * (ne - 1) / ne * p_bytes,
                         net, True, f"the rank's experts, forward and backward: 2 m (n/ep-1)/(n/ep) x {p_bytes:,} B"),
                _coll_at("fsdp expert grad reduce-scatter", "expert shard", ne, stride, m * (ne - 1) / ne * g_bytes,
                         net, True, f"every backward: m (n/ep-1)/(n/ep) x {g_bytes:,} B")]
    else:
        out += [_coll_at("zero expert grad reduce-scatter", "expert shard", ne, stride, (ne - 1) / ne * g_bytes, net,
                         True, f"(n/ep-1)/(n/ep) x {g_bytes:,} B, once per step"),
                _coll_at("zero expert param all-gather", "expert shard", ne, stride,
                         (ne - 1) / ne * expert_elems[1] * sb.param, net, True,
                         "(n/ep-1)/(n/ep) x the updated experts, once per step")]
    return out


def pp_sends(layout: Layout) -> int:
    """Stage boundaries the busiest pp rank sends each micro-batch across (activations forward; as many gradients
    back): 1 with one stage per rank; 2 under a loop placement (r -> r + 1 and r + p -> r + p + 1); under a V one
    of rank p - 1's two stages feeds the other on the same rank and rank 0's second stage is the last, so 2 only
    from pp = 3 (ranks 1 .. p - 2)."""
    if layout.stages_per_rank == 1:
        return 1
    v_style = layout.rank_stages(0)[1] == 2 * layout.pp - 1
    return 2 if not v_style or layout.pp > 2 else 1


def step_collectives(shape: ModelShape, layout: Layout, w: Workload, net: Network,
                     stage_elems: tuple[int, int], n_layers: int,
                     expert_elems: tuple[int, int] = (0, 0)) -> list[Collective]:
    """stage_elems: (all, trained) TP-local parameter elements of one pipeline stage; expert_elems: the part of
    them that are experts sharded over n / ep ranks (ep > 1), which the shard-group collectives leave out."""
    sb = w.state_bytes()
    allp, trained = stage_elems[0] - expert_elems[0], stage_elems[1] - expert_elems[1]
    m = w.micro_batches(layout.pp)
    e, b, t = w.act_bytes, w.micro_batch, layout.tp
    s = w.seq / layout.cp
    h = shape.hidden_size
    out: list[Collective] = []
    g_bytes, p_bytes = trained * sb.grad, allp * sb.param
    if layout.dp_mode == "ddp" and layout.dp_replicate * layout.cp > 1:
        n = layout.dp_replicate * layout.cp
        out.append(_coll("ddp grad all-reduce", layout, ("cp", "dp_replicate"), 2 * (n - 1) / n * g_bytes, net, True,
                         f"2(n-1)/n x {g_bytes:,} B of trained grads, once per step"))
    n = layout.shard_group
    if layout.dp_mode in ("zero1", "zero2") and n > 1:
        out.append(_coll("zero grad reduce-scatter", layout, ("cp", "dp_shard"), (n - 1) / n * g_bytes, net, True,
                         f"(n-1)/n x {g_bytes:,} B, once per step"))
        out.append(_coll("zero param all-gather", layout, ("cp", "dp_shard"), (n - 1) / n * trained * sb.param, net,
                         True, "(n-1)/n x the updated params, once per step"))
    if layout.dp_mode == "fsdp" and n > 1:
        out.append(_coll("fsdp param all-gather", layout, ("cp", "dp_shard"), 2 * m * (n - 1) / n * p_bytes, net, True,
                         f"forward and backward, {m} micro-batch(es): 2 m (n-1)/n x {p_bytes:,} B"))
        out.append(_coll("fsdp grad reduce-scatter", layout, ("cp", "dp_shard"), m * (n - 1) / n * g_bytes, net, True,
                         f"every backward: m (n-1)/n x {g_bytes:,} B"))
    if layout.dp_mode in ("zero1", "zero2", "fsdp") and layout.dp_replicate > 1:
        r = layout.dp_replicate
        times = m if layout.dp_mode == "fsdp" else 1
        shard = g_bytes / n + (expert_elems[1] * sb.grad / (n // layout.ep) if layout.ep > 1 else 0)
        out.append(_coll("replica grad all-reduce", layout, ("dp_replicate",), times * 2 * (r - 1) / r * shard,
                         net, True, f"HSDP: the grad shards all-reduced over {r} replicas"))
    if t > 1:
        per = e * s * b * h
        k = 6 if w.recompute == "full" else 4
        out.append(_coll("tp all-reduce" + (" (sp: all-gather + reduce-scatter)" if layout.sp else ""), layout, ("tp",),
                         n_layers * m * k * 2 * (t - 1) / t * per, net, False,
                         f"{k} per layer per micro-batch x {n_layers} layers x {m}: 2(t-1)/t x e s b h = {per:,.0f} B"))
    if layout.pp > 1:
        per = e * s * b * h / (t if layout.sp else 1)
        hops = pp_sends(layout)
        out.append(_coll("pp p2p", layout, ("pp",), 2 * hops * m * per, net, False,
                         f"activations forward and gradients back: 2 x {hops} stage boundaries x m x {per:,.0f} B"))
    if layout.cp > 1:
        c = layout.cp
        kv = shape.num_key_value_heads * shape.head_dim
        q = shape.num_attention_heads * shape.head_dim
        fwd_passes = 2 if w.recompute == "full" else 1
        if layout.cp_mode == "ring":
            per = (c - 1) * 2 * e * s * b * kv / t
            total = n_layers * m * (3 + fwd_passes - 1) * per
            why = f"per layer: K, V chunks (c-1) x 2 e (s/c) b kv / t = {per:,.0f} B, x3 with backward"
        else:
            per = (c - 1) / c * e * s * b * (2 * q + 2 * kv) / t
            total = n_layers * m * (1 + fwd_passes) * per
            why = f"per layer: q, k, v, out all-to-all (c-1)/c x e (s/c) b (2q + 2kv) / t = {per:,.0f} B, fwd + bwd"
        out.append(_coll(f"cp {layout.cp_mode}", layout, ("cp",), total, net, False, why))
    if layout.ep > 1:
        out += _expert_collectives(shape, layout, w, net, expert_elems, n_layers)
    return out
