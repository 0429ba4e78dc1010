"""The plan as text: assumptions, the ranked training layouts that fit (then those that do not, by how
much), the largest rank's memory terms for the best layout, its collectives, the rollout engine's TP
degrees, and colocated or disaggregated. `--json` prints Plan.to_dict() instead.

It imports the planner's modules only.
"""

from __future__ import annotations

from relayrl.planner.search import GIB, Plan


def _g(b: float) -> str:
    return f"{b / GIB:8.2f}"


def render(plan: Plan, top: int = 15) -> str:
    lines = [f"relayrl plan: {plan.model} on {plan.gpus} GPUs of {plan.gpu_mem_bytes / GIB:g} GiB", "", "assumptions:"]
    lines += [f"  - {a}" for a in plan.assumptions]
    fit = [o for o in plan.train if o.fits]
    over = [o for o in plan.train if not o.fits]
    head = (f"  {'#':>3} {'layout':<44} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'trans':>8} "
            f"{'total':>8} {'step s':>8} {'MFU':>6}")
    lines += ["", f"training layouts that fit ({len(fit)}; GiB per GPU, the largest rank; highest MFU first):", head]
    for i, o in enumerate(fit[:top], 1):
        m = o.memory
        lines.append(f"  {i:>3} {o.layout:<44} {_g(m.params)} {_g(m.grads)} {_g(m.optim)} {_g(m.activations)} "
                     f"{_g(m.transient)} {_g(m.total)} {o.time.step_s:8.3f} {o.time.mfu:6.1%}")
    if len(fit) > top:
        lines.append(f"  ... {len(fit) - top} more (--top N, or --json for all)")
    lines += ["", f"layouts that do not fit ({len(over)}; closest first):"]
    for o in over[:top]:
        lines.append(f"      {o.layout:<44} total {_g(o.memory.total)} GiB: over by {_g(o.over_bytes)} GiB")
    if len(over) > top:
        lines.append(f"  ... {len(over) - top} more")
    best = fit[0] if fit else (over[0] if over else None)
    if best is not None:
        lines += ["", f"memory of {best.layout} (rank {best.memory.rank}), every term:"]
        for name, b, why in best.memory.terms:
            lines.append(f"  {name:<42} {_g(b)} GiB  {why}")
        lines.append(f"  {'total':<42} {_g(best.memory.total)} GiB")
        lines += ["", f"communication per step of {best.layout}, per rank:"]
        for c in best.collectives:
            link = "inter-node" if c.crosses_nodes else "intra-node"
            ov = "overlapped" if c.overlapped else "exposed"
            lines.append(f"  {c.name:<44} {c.bytes / 1e9:9.3f} GB over {c.group} ({c.size}, {link}) "
                         f"{c.seconds:8.4f} s {ov}  {c.explanation}")
        t = best.time
        lines.append(f"  compute {t.compute_s:.3f} s for {t.tokens:,} tokens ({t.hardware_flops:.3g} FLOPs), "
                     f"bubble {t.bubble:.1%}, step {t.step_s:.3f} s, MFU {t.mfu:.1%}")
    lines += ["", "rollout engine (per replica; KV at the planned --seq; fastest decode first):",
              f"  {'tp':>3} {'replicas':>8} {'weights GiB':>11} {'KV GiB':>8} {'seqs/replica':>12} {'seqs total':>10} "
              f"{'tokens/s':>10} {'batch s':>8} {'MFU':>6} {'bound':>7}"]
    for r in plan.rollout:
        speed = (f" {r.tokens_per_s:>10,.0f} {r.batch_s:8.2f} {r.mfu:6.1%} {r.bound:>7}" if r.fits
                 else "  (no sequence fits)")
        lines.append(f"  {r.tp:>3} {r.replicas:>8} {r.weight_bytes / GIB:11.2f} {r.kv_bytes / GIB:8.2f} "
                     f"{r.concurrent_per_replica:>12} {r.concurrent_total:>10}{speed}")
    if plan.fleet is not None:
        f, o = plan.fleet, plan.fleet.option
        speed = (f"{o.tokens_per_s:,.0f} tokens/s over all replicas ({o.tokens_per_s / f.replicas:,.0f} each), "
                 f"{o.concurrent_total} sequences at once" if o.fits else "no sequence fits a replica")
        lines += ["", f"rollout fleet: {f.replicas} replicas x engine tp {f.tp} = {f.processes} engine processes "
                  f"(GPUs); per replica {f.replica_bytes / GIB:.2f} GiB (per rank: weights {o.weight_bytes / GIB:.2f} "
                  f"+ KV {o.kv_bytes / GIB:.2f}), {o.concurrent_per_replica} sequences; {speed}"]
    lines += ["", f"placement: {plan.placement} — {plan.placement_reason}"]
    return "\n".join(lines)
