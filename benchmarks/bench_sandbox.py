"""The sandbox's overhead: median wall time of `print(1)` run by `relayrl.sandbox.run` against a bare
subprocess, in one process, the variants interleaved so that machine load hits them alike.

    python benchmarks/bench_sandbox.py [--repeats 40]

Rows:
    bare subprocess             subprocess.run([sys.executable, "-c", "print(1)"]) (the host's Python, with
                                its site-packages: the baseline the issue names)
    bare, sandbox interpreter   the interpreter and flags the sandbox uses (-E -s -S -u -B), no sandbox:
                                what is left of the difference is bubblewrap and the launcher
    sandbox                     relayrl.sandbox.run("print(1)")
    code test                   relayrl.rewards.code.run_tests on one test (a sandbox run plus the harness
                                importing the solution and judging its result)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relayrl.rewards.code import run_tests
from relayrl.sandbox import run, sandbox_available
from relayrl.sandbox.bwrap import find_interpreter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    reason = sandbox_available()
    if reason is not None:
        sys.exit(f"bench_sandbox: {reason}")
    interpreter = find_interpreter()
    assert interpreter is not None

    def bare() -> None:
        out = subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True)
        assert out.stdout == "1\n"

    def bare_same() -> None:
        out = subprocess.run([interpreter.executable, "-E", "-s", "-S", "-u", "-B", "-c", "print(1)"],
                             capture_output=True, text=True, env={})
        assert out.stdout == "1\n"

    def sandboxed() -> None:
        assert run("print(1)").stdout == "1\n"

    def code_test() -> None:
        assert run_tests("def f():\n    return 1\n", [{"call": "f()", "expected": 1}]).passed == 1

    variants = {"bare subprocess": bare, "bare, sandbox interpreter": bare_same, "sandbox": sandboxed,
                "code test (1 test)": code_test}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm the page cache and the probe
        fn()
    for _ in range(args.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)

    base = statistics.median(times["bare subprocess"])
    print(f"host python: {sys.executable} ({sys.version.split()[0]}); sandbox python: {interpreter.executable}")
    print(f"{args.repeats} interleaved rounds\n")
    print("| variant | median ms | p90 ms | ratio to bare subprocess |")
    print("|---|---|---|---|")
    for name, samples in times.items():
        med = statistics.median(samples)
        p90 = statistics.quantiles(samples, n=10)[-1]
        print(f"| {name} | {med:.1f} | {p90:.1f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
