"""Held-out accuracy against wall time for two systems trained side by side (benchmarks/bench_grpo_trl.py):
printed as a table, the figure at the slower system's total time, and plotted."""

from __future__ import annotations


def report_curves(curves: dict, args, n_eval: int, extra_steps: int) -> None:
    """The held-out curves against each system's own step time, and relayrl's figure at TRL's total time."""
    print(f"\nheld-out greedy accuracy (n={n_eval}) against each system's cumulative step time"
          + (f" (relayrl {extra_steps} steps past TRL's {args.steps}, up to TRL's time)" if extra_steps else ""))
    print("| system | RL steps | step time so far (s) | held-out acc |\n|---|---|---|---|")
    for name, pts in curves.items():
        for step, t, acc in pts:
            print(f"| {name} | {step} | {t:.0f} | {acc:.3f} |")
    t_trl, acc_trl = curves["trl"][-1][1], curves["trl"][-1][2]
    at = [p for p in curves["relayrl"] if p[1] <= t_trl]
    step, t, acc = at[-1]
    print(f"at TRL's {args.steps} steps ({t_trl:.0f} s): TRL {acc_trl:.3f}; relayrl {acc:.3f} after {step} steps "
          f"({t:.0f} s, its last evaluation within that time): {'equal or better' if acc >= acc_trl else 'WORSE'}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, pts in curves.items():
            ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=name)
        ax.set_xlabel("cumulative step time (s), evaluations excluded")
        ax.set_ylabel(f"held-out greedy accuracy (n={n_eval})")
        ax.set_title(f"GRPO, {args.workload}: relayrl vs TRL GRPOTrainer")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
