"""The CPU kernel choice (relayrl.parallel.cpu_kernels) is made outside the models and handed to them: the decider
follows the CPU's rule, the measurement or the variable (hand-computed cases); a process decides once; the models
read neither the environment nor the CPU (their source, and a process that never configured them); and every
kind of relayrl process that runs models (the tests' own, a worker group's worker, a launched rank) runs the
choice its process decided."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relayrl.models import linear as lin
from relayrl.models import pointwise as pw
from relayrl.parallel import cpu_kernels as ck
from relayrl.single_controller.process_setup import configure_process
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import Worker
from relayrl.single_controller.worker_group import WorkerGroup

from dist_harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]  # the repository
ON, OFF = dict.fromkeys(ck.PRODUCTS, True), dict.fromkeys(ck.PRODUCTS, False)
MIXED = {"fwd": True, "dx": False, "dw": False}  # the fake measurement below: fwd 1.3 >= WIN, dx 1.2, dw 0.6 below


@pytest.fixture
def cpu(monkeypatch):
    """Pose as a CPU: cpu(vendor, capability); the measurement is fake (fwd 1.3, dx 1.2, dw 0.6) and counted."""
    calls = []

    def measured():
        calls.append(1)
        return {"fwd": 1.3, "dx": 1.2, "dw": 0.6}

    def pose(vendor: str, capability: str) -> list:
        monkeypatch.setattr(ck, "ONEDNN", True)
        monkeypatch.setattr(ck, "cpu_vendor", lambda: vendor)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(ck, "measure_kernels", measured)
        calls.clear()
        return calls

    return pose


@pytest.mark.unit
@pytest.mark.parametrize("mode, vendor, capability, want, measured, basis", [
    # auto: the rule where the CPU is known, without measuring
    ("auto", "GenuineIntel", "AVX512", OFF, 0, "the rule for GenuineIntel with AVX512"),
    ("auto", "AuthenticAMD", "AVX512", ON, 0, "the rule for AuthenticAMD with AVX512"),
    (None, "AuthenticAMD", "AVX512", ON, 0, "the rule for AuthenticAMD with AVX512"),  # unset is auto
    (" Auto ", "GenuineIntel", "AVX2", OFF, 0, "the rule for GenuineIntel with AVX2"),  # case and spaces
    ("auto", "AuthenticAMD", "AVX2", OFF, 0, "the rule for AuthenticAMD with AVX2"),  # Zen 3: MKL's AVX2 path
    # auto on a CPU the rule does not know (an unknown vendor): measured, WIN decides each
    ("auto", "", "DEFAULT", MIXED, 1, "measured: torch s / oneDNN s fwd 1.30, dx 1.20, dw 0.60"),
    # measure: whatever the CPU; torch / onednn: fixed
    ("measure", "GenuineIntel", "AVX512", MIXED, 1, "measured: torch s / oneDNN s fwd 1.30, dx 1.20, dw 0.60"),
    ("torch", "AuthenticAMD", "AVX512", OFF, 0, "RELAYRL_CPU_LINEAR=torch"),
    ("onednn", "GenuineIntel", "AVX512", ON, 0, "RELAYRL_CPU_LINEAR=onednn"),
])
@pytest.mark.unit
def test_the_linear_choice_is_the_rule_measured_or_named(cpu, mode, vendor, capability, want, measured, basis):
    calls = cpu(vendor, capability)
    env = {} if mode is None else {ck.KERNEL_ENV: mode}
    choice, why, ratios = ck.decide_linear(env)
    assert (choice, why, len(calls)) == (want, basis, measured)
    assert ratios == ({"fwd": 1.3, "dx": 1.2, "dw": 0.6} if measured else {})


@pytest.mark.unit
def test_without_onednn_every_product_is_torchs(cpu, monkeypatch):
    calls = cpu("AuthenticAMD", "AVX512")
    monkeypatch.setattr(ck, "ONEDNN", False)
    for mode in ("auto", "measure", "onednn"):
        assert ck.decide_linear({ck.KERNEL_ENV: mode})[:2] == (OFF, "no oneDNN")
    assert calls == []


@pytest.mark.unit
def test_bad_values_are_refused_in_one_line_naming_the_variable(cpu):
    cpu("AuthenticAMD", "AVX512")
    with pytest.raises(ValueError, match=r"^RELAYRL_CPU_LINEAR='mkl': expected auto, measure, torch or onednn$"):
        ck.decide({ck.KERNEL_ENV: "MKL"})
    with pytest.raises(ValueError, match=r"^RELAYRL_COMPILE='always': expected auto or off$"):
        ck.decide({ck.COMPILE_ENV: "always"})


@pytest.mark.unit
def test_compile_is_on_unless_the_variable_says_off():
    assert ck.decide_compile({}) and ck.decide_compile({ck.COMPILE_ENV: "auto"})
    assert not ck.decide_compile({ck.COMPILE_ENV: " OFF "})


@pytest.mark.unit
def test_a_process_decides_once(cpu, monkeypatch):
    """configure() decides on its first call (from the environment) and answers the same after, whatever the
    environment says later; kernel_choice() and choice_basis() report that one decision."""
    calls = cpu("AuthenticAMD", "AVX2")
    monkeypatch.setattr(ck, "_decided", None)
    monkeypatch.setenv(ck.KERNEL_ENV, "measure")
    monkeypatch.setenv(ck.COMPILE_ENV, "off")
    first = ck.configure()
    assert (first.linear, first.compile, len(calls)) == (MIXED, False, 1)
    monkeypatch.setenv(ck.KERNEL_ENV, "onednn")
    monkeypatch.setenv(ck.COMPILE_ENV, "bogus")
    assert ck.configure() is first and len(calls) == 1
    assert ck.kernel_choice() == MIXED
    assert ck.choice_basis() == "measured: torch s / oneDNN s fwd 1.30, dx 1.20, dw 0.60"


@pytest.mark.unit
def test_configure_process_hands_the_decision_to_the_models(monkeypatch):
    monkeypatch.setattr(lin, "_choice", dict(OFF))
    monkeypatch.setattr(pw, "_compile", True)
    monkeypatch.setattr(ck, "_decided", ck.CPUKernels(linear=dict(MIXED), compile=False, basis="posed"))
    assert configure_process().basis == "posed"
    assert lin.kernels() == MIXED and not pw.enabled()
    with pytest.raises(ValueError, match="a kernel choice names each of fwd, dx, dw"):
        lin.use_kernels({"fwd": True})


@pytest.mark.unit
def test_cpu_vendor_reads_cpuinfo():
    """On Linux the vendor is /proc/cpuinfo's vendor_id (the rule's key); elsewhere "" (the rule then measures)."""
    try:
        with open("/proc/cpuinfo") as f:
            want = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        want = ""
    assert ck.cpu_vendor() == want


@pytest.mark.unit
@pytest.mark.skipif(not ck.ONEDNN, reason="torch without oneDNN")
def test_measure_kernels_times_both_kernels():
    """The measurement's ratios are torch seconds over oneDNN seconds of real calls: positive and finite."""
    ratios = ck.measure_kernels(m=128, n=128, k=64, calls=1)
    assert set(ratios) == set(ck.PRODUCTS) and all(0 < r < float("inf") for r in ratios.values())
    assert lin.PRODUCTS == ck.PRODUCTS


def _reads_of_the_environment_or_cpu(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in ("environ", "getenv", "environb", "putenv"):
            found.append(f"{path.name}:{node.lineno} {name}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "/proc/" in node.value:
            found.append(f"{path.name}:{node.lineno} {node.value!r}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{path.name}:{node.lineno} imports {m}" for m in modules if m.split(".")[:2] ==
                      ["relayrl", "parallel"]]
    return found


@pytest.mark.unit
def test_the_models_read_neither_the_environment_nor_the_cpu():
    """DESIGN's principle 2: no environment reads inside model code. The kernel choice is handed to the models;
    no module of relayrl/models reads os.environ, getenv or /proc (the CPU), or reaches for the decider."""
    models = sorted((ROOT / "relayrl" / "models").glob("*.py"))
    assert {"linear.py", "pointwise.py"} <= {p.name for p in models}
    assert [hit for p in models for hit in _reads_of_the_environment_or_cpu(p)] == []
    # the check finds what it looks for
    assert len(_reads_of_the_environment_or_cpu(ROOT / "relayrl" / "parallel" / "cpu_kernels.py")) >= 2


@pytest.mark.equivalence
def test_models_never_configured_ignore_the_variables():
    """A process that never configured its models (no conftest here: a fresh interpreter) runs them on torch's
    kernels and compiled pointwise pieces, its defaults, whatever the variables say: bad values raise nothing."""
    code = ("import json, torch; from relayrl.models import linear as lin, pointwise as pw; "
            "x, w = torch.randn(600, 512), torch.randn(512, 512); y = lin.linear(x, w); "
            "pw.rms_norm(torch.randn(4, 8), torch.ones(8), 1e-6); "
            "print(json.dumps([lin.kernels(), pw.enabled(), lin.applies(x, w), "
            "bool(torch.equal(y, torch.nn.functional.linear(x, w)))]))")
    env = {**os.environ, ck.KERNEL_ENV: "bogus", ck.COMPILE_ENV: "bogus"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [OFF, True, lin._ONEDNN, True]


class KernelsWorker(Worker):
    def report(self) -> dict:
        return {"linear": lin.kernels(), "compile": pw.enabled(), "basis": ck.choice_basis()}


def _rank_kernels(rank: int, world_size: int) -> dict:
    return KernelsWorker().report()


@pytest.mark.equivalence
def test_workers_and_launched_ranks_run_the_choice_their_process_decided():
    """A worker group's worker (as every role's, and the engine's tensor-parallel ranks) and a rank of
    parallel.launch (through the tests' harness) hand their models the choice this process made: same
    environment, same rule."""
    here = {"linear": lin.kernels(), "compile": pw.enabled(), "basis": ck.choice_basis()}
    assert here["linear"] == ck.kernel_choice()
    if here["basis"].startswith("measured"):
        pytest.skip("this environment measures the kernels: each process may measure differently")
    with WorkerGroup(ResourcePool([1], name="kernels"), KernelsWorker) as group:
        assert group.execute_all(KernelsWorker.report) == [here]
    assert run_distributed(_rank_kernels, 1) == [here]
