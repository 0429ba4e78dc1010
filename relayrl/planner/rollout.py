"""The rollout side of the plan: the engine's TP degrees, and colocated or disaggregated.

Rollout: engine TP degrees t (dividing the heads, with KV heads dividing or divided by t, and the
intermediate size; inside a node). Each replica's rank holds the engine's weights (with LoRA: the adapters,
and under sync.lora = merge a second copy of the targeted base weights: relayrl.planner.kv.engine_weight_terms)
and a KV cache of what is left of gpu_mem x gpu_util; a degree is useful when it holds at least one sequence of
--seq tokens. Its speed is a roofline of the decode step (decode_time: weights and KV read from HBM against the
FLOPs, plus the TP all-reduces); ranked by decode tokens per second over all replicas.

Colocated (one set of GPUs, the engine asleep while the trainer steps: relayrl's sleep(level=1) frees the KV
cache, the weights stay) when some engine TP degree t fits beside the best-fitting training layout's rank:

    trainer params + grads + optimizer + engine weights(t) + max(trainer activations + transient,
                                                                  KV(t) for rollout_seqs sequences) <= gpu_mem

Of the degrees that fit, the plan picks the one whose replicas hold the most sequences at once while the
engine is awake (per replica min(max_num_seqs, (gpu_mem - trainer state - weights(t)) // KV per sequence),
x gpus / t; the smaller t on a tie). None fits: disaggregated (trainer and engine on separate GPUs), and the
engine's degree is the rollout table's first.

A fleet (rollout.replicas engines of rollout.tp ranks behind a router, relayrl.roles.fleet; `relayrl plan --replicas
N --engine-tp T`) is that option at a given TP degree and number of replicas, N x T ranks on GPUs of their own
(fleet_option), with one replica's memory and the tokens per second of them all; fleet_speedup is the plan's
speedup of N replicas over one for a batch of sequences (benchmarks/bench_fleet.py prints it beside the measured).

It imports the planner's modules, relayrl.errors, relayrl.models (config, flops) and relayrl.sync.adapters only.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape, MoEShape
from relayrl.models.flops import generate_flops
from relayrl.planner.kv import engine_kv, engine_weight_bytes
from relayrl.planner.memory import TrainMemory
from relayrl.planner.moe import mlp_widths, router_params
from relayrl.planner.workload import DTYPE_BYTES
from relayrl.sync.adapters import AdapterShape

GIB = 2**30


@dataclass
class RolloutOption:
    tp: int
    replicas: int
    weight_bytes: int
    kv_bytes: int
    concurrent_per_replica: int
    concurrent_total: int
    fits: bool
    decode_step_s: float = 0.0  # one decode step of the replica's concurrent batch (decode_time)
    tokens_per_s: float = 0.0  # over all replicas
    batch_s: float = 0.0  # the concurrent batch generating --seq tokens each, from empty
    mfu: float = 0.0
    bound: str = ""  # "memory" or "compute": which side of the roofline the decode step is on


@dataclass
class Engine:
    """What the rollout side needs besides the shape: dtype, KV settings, LoRA and its sync mode."""

    dtype: str
    seq: int
    gpu_util: float = 0.9
    max_num_seqs: int = 256
    block_size: int = 16
    lora: AdapterShape | None = None
    lora_sync: str = "separate"
    peak_tflops: float = 989.0  # per GPU, the engine's dtype
    hbm_gbs: float = 3350.0  # GB/s per GPU (H100 SXM HBM3)
    intra_bw: float = 450.0  # GB/s per GPU inside a node: the engine's TP all-reduces
    efficiency: float = 0.5  # the fraction of both roofs the kernels reach

    def weights(self, shape: ModelShape, tp: int) -> int:
        return engine_weight_bytes(shape, tp, self.dtype, self.lora, self.lora_sync)

    def seq_bytes(self, shape: ModelShape, tp: int) -> int:
        """KV bytes of one --seq sequence at engine TP t (its blocks, the engine's rule)."""
        kv = engine_kv(shape, tp=tp, dtype=self.dtype, block_size=self.block_size, kv_cache_bytes=0,
                       seq_len=self.seq)
        return kv.blocks_per_seq * kv.bytes_per_block


def engine_tp_ok(shape: ModelShape, tp: int) -> bool:
    kv = shape.num_key_value_heads
    return (shape.num_attention_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
            and all(x % tp == 0 for x in mlp_widths(shape)))


def engine_tps(shape: ModelShape, gpus: int, gpus_per_node: int) -> list[int]:
    return [t for t in range(1, gpus + 1) if gpus % t == 0 and t <= gpus_per_node and engine_tp_ok(shape, t)]


def decode_time(shape: ModelShape, tp: int, batch: int, context: float, eng: Engine) -> tuple[float, str]:
    """Seconds of one decode step of `batch` sequences holding `context` KV tokens each, on engine TP tp, and
    which roof binds. A roofline, per rank:

        memory    (weights per rank + batch x context x KV bytes per token per rank) / (hbm x efficiency)
        compute   batch x (2 N_body / t + 2 V h / t + 4 L H d x context / t) / (peak x efficiency)
        step      max(memory, compute) + 2 L TP all-reduces of e x batch x h: 2 (t-1)/t of it each / intra_bw

    N_body: the active decoder weights (an MoE model's k experts; every expert is read, as a large batch touches
    them all). Launch latency and the all-reduces' latency are not counted: a lower bound on the step."""
    e = DTYPE_BYTES[eng.dtype]
    kv = engine_kv(shape, tp=tp, dtype=eng.dtype, block_size=eng.block_size, kv_cache_bytes=0)
    read = eng.weights(shape, tp) + batch * context * kv.bytes_per_token
    memory = read / (eng.hbm_gbs * 1e9 * eng.efficiency)
    flops = batch * decode_flops_per_token(shape, context) / tp
    compute = flops / (eng.peak_tflops * 1e12 * eng.efficiency)
    allreduce = 2 * shape.num_hidden_layers * 2 * (tp - 1) / tp * e * batch * shape.hidden_size / (eng.intra_bw * 1e9)
    return max(memory, compute) + allreduce, "memory" if memory >= compute else "compute"


def decode_flops_per_token(shape: ModelShape, context: float) -> float:
    """2 N_body + 2 V h + 4 L H d x context: one decode token (relayrl.models.flops.generate_flops' count)."""
    active = shape.active_shape() if isinstance(shape, MoEShape) else shape
    return float(generate_flops(active, 1, int(context), 1) + 2 * router_params(shape))


def rollout_option(shape: ModelShape, tp: int, replicas: int, gpu_mem: int, eng: Engine) -> RolloutOption:
    """`replicas` engines of TP tp, each rank on a GPU of its own: a rank's KV cache, how many --seq sequences a
    replica holds, and their decode speed over all replicas (the concurrent batch decoding from an empty cache to
    --seq tokens: --seq steps at a mean context of --seq / 2)."""
    weights = eng.weights(shape, tp)
    budget = max(0, int(gpu_mem * eng.gpu_util) - weights)
    kv = engine_kv(shape, tp=tp, dtype=eng.dtype, block_size=eng.block_size, kv_cache_bytes=budget,
                   max_num_seqs=eng.max_num_seqs, seq_len=eng.seq)
    conc = kv.max_concurrent_seqs or 0
    opt = RolloutOption(tp, replicas, weights, budget, conc, conc * replicas, conc >= 1)
    if conc:
        step, opt.bound = decode_time(shape, tp, conc, eng.seq / 2, eng)
        opt.decode_step_s, opt.batch_s = step, step * eng.seq
        opt.tokens_per_s = opt.concurrent_total / step
        opt.mfu = (opt.tokens_per_s * decode_flops_per_token(shape, eng.seq / 2)
                   / (replicas * tp * eng.peak_tflops * 1e12))
    return opt


def rollout_options(shape: ModelShape, gpus: int, gpus_per_node: int, gpu_mem: int, eng: Engine) -> list[RolloutOption]:
    """Every engine TP degree t, as gpus // t replicas (rollout_option)."""
    out = [rollout_option(shape, tp, gpus // tp, gpu_mem, eng) for tp in engine_tps(shape, gpus, gpus_per_node)]
    out.sort(key=lambda o: (not o.fits, -o.tokens_per_s, o.tp))
    return out


@dataclass
class FleetOption:
    """A rollout fleet (rollout.replicas engines of rollout.tp ranks, relayrl.roles.fleet) as the plan sees it."""

    replicas: int
    tp: int
    processes: int  # engine ranks: replicas x tp, each a process on a GPU of its own
    replica_bytes: int  # one replica's memory: tp x (weights + KV per rank)
    option: RolloutOption  # per replica and over all replicas (tokens_per_s: the fleet's)


def fleet_option(shape: ModelShape, replicas: int, tp: int, gpus: int, gpus_per_node: int, gpu_mem: int,
                 eng: Engine) -> FleetOption:
    """`replicas` engines of TP tp on `gpus` GPUs: refused in one line when the engine's TP degree does not suit the
    model or a node, or when the fleet's ranks outnumber the GPUs (a replica's ranks each need a GPU of their own:
    replicas that share a GPU are no faster than one)."""
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    if not engine_tp_ok(shape, tp):
        raise ConfigError(f"--engine-tp {tp} does not divide this model's attention heads, KV heads and MLP width; "
                          "pick a divisor of them")
    if tp > gpus_per_node:
        raise ConfigError(f"--engine-tp {tp} spans more than the {gpus_per_node} GPUs of a node; lower it")
    if replicas * tp > gpus:
        raise ConfigError(f"--replicas {replicas} x --engine-tp {tp} = {replicas * tp} engine ranks, one GPU each, "
                          f"but --gpus is {gpus}: lower --replicas or --engine-tp")
    opt = rollout_option(shape, tp, replicas, gpu_mem, eng)
    return FleetOption(replicas, tp, replicas * tp, tp * (opt.weight_bytes + opt.kv_bytes), opt)


def fleet_speedup(replicas: int, tp: int, devices: int, sequences: int, per_replica: int) -> float:
    """The plan's rollout speedup of `replicas` engines of TP tp over one engine, on `devices` devices, for a batch
    of `sequences` sequences (of equal length) that one engine runs at most `per_replica` at once:

        share(r)  = ceil(sequences / r)              a replica's sequences (the router spreads them by load)
        waves(r)  = ceil(share(r) / per_replica)     the rounds it runs them in, one after another
        a round takes about the same time at any batch up to per_replica (a decode step reads the weights once
        for the whole batch: decode_time's memory roof), so a replica's time is waves(r) rounds; replicas beyond
        devices // tp share their devices, r / (devices // tp) times slower
        speedup(r) = waves(1) / waves(r) x min(1, (devices // tp) / r)"""
    if min(replicas, tp, devices, sequences, per_replica) < 1:
        raise ValueError("replicas, tp, devices, sequences and per_replica must be >= 1")
    slots = max(devices // tp, 1)

    def waves(r: int) -> int:
        share = -(-sequences // r)
        return -(-share // per_replica)

    return waves(1) / waves(replicas) * min(1.0, slots / replicas)


@dataclass
class Placement:
    where: str  # "colocated" | "disaggregated" | "none"
    engine_tp: int | None
    reason: str


def placement(m: TrainMemory | None, shape: ModelShape, gpus: int, gpus_per_node: int, gpu_mem: int, eng: Engine,
              rollout_seqs: int, rollout: list[RolloutOption]) -> Placement:
    """Colocated or disaggregated, and the engine's TP degree (module docstring). m: the best training
    layout's largest rank."""
    if m is None:
        return Placement("none", None, "no training layout fits these GPUs")
    tried = []
    for tp in engine_tps(shape, gpus, gpus_per_node):
        weights, per_seq = eng.weights(shape, tp), eng.seq_bytes(shape, tp)
        kv_need = rollout_seqs * per_seq
        need = m.state + weights + max(m.activations + m.transient, kv_need)
        awake = min(eng.max_num_seqs, max(0, gpu_mem - m.state - weights) // per_seq) * (gpus // tp)
        tried.append((need <= gpu_mem, awake, -tp, tp, weights, kv_need, need))
    if not tried:
        return Placement("disaggregated", None, "no engine TP degree divides this model's heads on these GPUs")
    fits = [x for x in tried if x[0]]
    _, awake, _, tp, weights, kv_need, need = max(fits) if fits else min(tried, key=lambda x: x[6])
    rule = (f"trainer state {m.state / GIB:.1f} + engine weights (tp {tp}) {weights / GIB:.1f} + "
            f"max(trainer activations+transient {(m.activations + m.transient) / GIB:.1f}, KV for {rollout_seqs} "
            f"x {eng.seq}-token sequences {kv_need / GIB:.1f}) = {need / GIB:.1f} GiB")
    if fits:
        return Placement("colocated", tp, f"{rule} <= {gpu_mem / GIB:.0f} GiB: trainer and engine share the GPUs "
                         f"(engine sleeps), engine tp {tp} ({len(fits)} of {len(tried)} engine TP degrees fit; "
                         f"this one holds {awake} sequences at once over the {gpus} GPUs)")
    best = rollout[0].tp if rollout else tp
    return Placement("disaggregated", best, f"{rule} > {gpu_mem / GIB:.0f} GiB (the smallest need of the "
                     f"{len(tried)} engine TP degrees): put the engine on GPUs of its own, engine tp {best} "
                     "(the rollout table's first)")
