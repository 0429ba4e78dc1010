"""Rollout throughput of a fleet of engine replicas against one engine (issue 35, deliverable 6).

    OMP_NUM_THREADS=1 python benchmarks/bench_fleet.py                     1 vs 2 replicas (and 4: --replicas 1 2 4)
    OMP_NUM_THREADS=1 python benchmarks/bench_fleet.py --fault             and a replica of 2 killed mid-rollout

The same workload, in one run, on fleets of N replicas (relayrl.roles.fleet: each replica an LLMEngine in a rollout
worker process of its own, one torch thread each, behind the router): --prompts distinct random prompts, --n seeded
samples each, every sample --max-tokens long (ignore_eos: the work is the same whatever is sampled), each replica
running at most --max-num-seqs sequences at once (a replica's capacity: what more replicas add). The figure is
generated tokens per second of the fleet's generate() call, the best of --repeats after a warm-up call; the ratio
against 1 replica is printed (the issue's target: 2 one-thread replicas >= 1.7x one, on 2 cores). The samples of
every fleet are checked equal to the 1-replica fleet's (the router does not change what is sampled).

Beside each measured ratio, the planner's prediction (relayrl.planner.rollout.fleet_speedup): the rounds of
--max-num-seqs sequences (or fewer, if the KV cache holds fewer: relayrl.planner.kv.engine_kv) each replica runs
its share of the workload in, with replicas beyond the cores sharing them; and the tokens/s it implies from the
1-replica measurement.

--fault: 2 replicas run the workload; part way through (--fault-at of the no-fault call's time) replica 1 is killed
(SIGKILL). The call still returns every output, equal to the no-fault call's (replica 1's requests run again on replica
0, resumed from the tokens it had reported), and the time from the kill to the call's completion is reported beside the
rest of the no-fault call at that point (what the loss cost), with the lost replica's restart: the seconds until its new
process has built its engine (it would join at the next weight sync).

On a machine shared with other work the ratio shows the cores left to the run: report the load average beside it.
The machine's own scaling is printed first (--no-probe skips it): the rate of one process multiplying the model's
widths' matrices in a loop, against two such processes at once: what two one-thread processes get out of this
machine this minute, whatever they run (a host's other tenants, shared caches, the boost clock of two busy cores).
The replicas' own CPU time is printed too (tokens per CPU-second of the replica processes, summed): the fleet's
overhead, which the machine's load does not move; the wall-clock ratio is what an idle 2-core machine is judged by.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.engine import SamplingParams
from relayrl.models import load_config
from relayrl.models.config import ModelShape, TinyModelConfig
from relayrl.models.tiny import build_tiny_model
from relayrl.models.tokenizer import load_tokenizer
from relayrl.planner.kv import engine_kv
from relayrl.planner.rollout import fleet_speedup
from relayrl.roles.fleet import RolloutFleet
from relayrl.single_controller.liveness import GroupOptions

ALPHABET = "0123456789+-*= abcdefghijklmnopqrstuvwxyz"


def workload(prompts: int, n: int, max_tokens: int, prompt_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    ids = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(prompts)]
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed * 1000 + i)
              for i in range(prompts)]
    return ids, params


def _matmul_loop(secs: float, hidden: int, out) -> None:
    import torch

    torch.set_num_threads(1)
    ws = [torch.randn(hidden, 3 * hidden) for _ in range(8)]
    x, n, t0 = torch.randn(32, hidden), 0, time.perf_counter()
    while time.perf_counter() - t0 < secs:
        for w in ws:
            x @ w
        n += 1
    out.put(n / (time.perf_counter() - t0))


def machine_scaling(hidden: int, secs: float = 4.0) -> float:
    """Two one-thread processes' summed rate of a decode-shaped matmul loop over one process's (see the docstring)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rates = []
    for k in (1, 2):
        q = ctx.Queue()
        procs = [ctx.Process(target=_matmul_loop, args=(secs, hidden, q)) for _ in range(k)]
        for p in procs:
            p.start()
        rates.append(sum(q.get() for _ in procs))
        for p in procs:
            p.join()
    return rates[1] / rates[0]


def cpu_seconds(engine) -> float:
    """This process's CPU time (run in a rollout worker, on its engine: RolloutRole._engine)."""
    return time.process_time()


def measure(model_dir: Path, replicas: int, args, ids, params) -> tuple[float, float, list]:
    engine_kwargs = dict(block_size=16, kv_cache_bytes=args.kv_mb << 20, max_num_seqs=args.max_num_seqs, seed=0)
    fleet = RolloutFleet.own_processes(replicas, model_dir, engine_kwargs, GroupOptions(threads=1),
                                       load_tokenizer(model_dir), block_size=16)
    try:
        fleet.generate(ids[:replicas], params[:replicas])  # warm-up: every replica runs once
        best, cpu, outs = float("inf"), 0.0, []
        for _ in range(args.repeats):
            c0 = [role._engine(cpu_seconds) for role in fleet.replicas]
            t0 = time.perf_counter()
            outs = fleet.generate(ids, params)
            wall = time.perf_counter() - t0
            used = sum(role._engine(cpu_seconds) - c for role, c in zip(fleet.replicas, c0, strict=True))
            if wall < best:
                best, cpu = wall, used
        tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
        return tokens / best, tokens / cpu, [[s.token_ids for s in o.samples] for o in outs]
    finally:
        fleet.close()


def fault(model_dir: Path, args, ids, params) -> None:
    """Replica 1 of 2 killed part way through the workload: the time from its death to the call's completion."""
    import signal
    import threading

    engine_kwargs = dict(block_size=16, kv_cache_bytes=args.kv_mb << 20, max_num_seqs=args.max_num_seqs, seed=0)
    fleet = RolloutFleet.own_processes(2, model_dir, engine_kwargs, GroupOptions(threads=1),
                                       load_tokenizer(model_dir), block_size=16, max_restarts=args.fault_restarts)
    fleet.notice = lambda line: print(f"  fleet: {line}", flush=True)
    try:
        fleet.generate(ids[:2], params[:2])
        t0 = time.perf_counter()
        want = fleet.generate(ids, params)
        clean = time.perf_counter() - t0
        kill_at = args.fault_at * clean
        killed: list[float] = []

        def kill() -> None:
            os.kill(fleet.replicas[1].group._pids[0], signal.SIGKILL)
            killed.append(time.perf_counter())

        timer = threading.Timer(kill_at, kill)
        t0 = time.perf_counter()
        timer.start()
        got = fleet.generate(ids, params)
        end = time.perf_counter()
        timer.join()
        same = [[s.token_ids for s in o.samples] for o in got] == [[s.token_ids for s in o.samples] for o in want]
        after, rest = end - killed[0], clean - kill_at
        print(f"fault: replica 1 of 2 killed {kill_at:.2f} s into a {clean:.2f} s call; the call ended {after:.2f} s "
              f"after the kill (the rest of the no-fault call: {rest:.2f} s; x{after / rest:.2f}), {fleet.rerouted} "
              f"requests moved to replica 0, resumed from {fleet.reprefilled} tokens replica 1 had generated "
              f"(re-prefilled), every output equal to the no-fault call's: {same}", flush=True)
        t1 = time.perf_counter()
        if args.fault_restarts == 0:
            return
        while fleet.slots[1].state == "starting" and time.perf_counter() - t1 < 300:
            fleet.maintain()
            time.sleep(0.1)
        print(f"fault: the restarted replica 1 was built {time.perf_counter() - killed[0]:.1f} s after the kill "
              f"(state {fleet.slots[1].state}: it joins at the next weight sync)", flush=True)
        if not same:
            sys.exit("the fleet lost or changed a sample when a replica died")
    finally:
        fleet.close()


def planned_capacity(model_dir: Path, args) -> int:
    """The sequences of the workload's length one replica runs at once, as the planner counts them: its KV cache's
    (--kv-mb) blocks, at most --max-num-seqs."""
    kv = engine_kv(ModelShape.of(load_config(model_dir)), tp=1, dtype="float32", block_size=16,
                   kv_cache_bytes=args.kv_mb << 20, max_num_seqs=args.max_num_seqs,
                   seq_len=args.prompt_len + args.max_tokens)
    return kv.max_concurrent_seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=512, help="the model's width (4 layers)")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="sequences a replica runs at once (its capacity)")
    ap.add_argument("--kv-mb", type=int, default=64, help="each replica's KV cache")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fault", action="store_true", help="also kill a replica of 2 mid-rollout (see above)")
    ap.add_argument("--no-probe", action="store_true", help="skip the machine's own two-process scaling")
    ap.add_argument("--fault-at", type=float, default=0.3, help="when, as a share of the no-fault call")
    ap.add_argument("--fault-restarts", type=int, default=2, help="restarts of the lost replica (0: none; on 2 "
                    "cores its engine's build shares them with the replica left)")
    args = ap.parse_args()
    if 1 not in args.replicas:
        args.replicas = [1, *args.replicas]
    cfg = TinyModelConfig(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(build_tiny_model(Path(tmp) / "m", ALPHABET, cfg))
        vocab = load_tokenizer(model_dir).vocab_size
        ids, params = workload(args.prompts, args.n, args.max_tokens, args.prompt_len, vocab, seed=1)
        print(f"workload: {args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens, model width "
              f"{args.hidden} x 4 layers, {args.max_num_seqs} sequences at once per replica; load average before: "
              f"{os.getloadavg()[0]:.2f}")
        if not args.no_probe:
            scaling = machine_scaling(args.hidden)
            print(f"machine: two one-thread matmul loops (width {args.hidden}) run at x{scaling:.2f} one loop's rate",
                  flush=True)
        per_replica, cores = planned_capacity(model_dir, args), len(os.sched_getaffinity(0))
        print(f"planner: a replica runs {per_replica} sequences at once; {cores} cores, a one-thread replica each")
        figures, ref = {}, None
        for n in args.replicas:
            tps, per_cpu, samples = measure(model_dir, n, args, ids, params)
            ref = samples if ref is None else ref
            same = samples == ref
            figures[n] = tps, per_cpu
            planned = fleet_speedup(n, 1, cores, args.prompts * args.n, per_replica)
            print(f"replicas {n}: {tps:8.1f} tokens/s  x{tps / figures[1][0]:.2f} of 1 replica (planner: "
                  f"x{planned:.2f}, {planned * figures[1][0]:.1f} tokens/s); {per_cpu:8.1f} tokens per replica "
                  f"CPU-second x{per_cpu / figures[1][1]:.2f} (samples equal to 1 replica's: {same}; load average "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
            if not same:
                sys.exit("the fleet sampled differently from one replica")
        if args.fault:
            fault(model_dir, args, ids, params)


if __name__ == "__main__":
    main()
