"""The host allocator policy (relayrl.parallel.host_memory): with it, a freed large block is reused without page
faults; without it (release, or a glibc setting in the environment) glibc unmaps it and the next one faults in
again. Each case runs in a fresh interpreter (the policy is per process and cannot be undone), with the C
library's own malloc and free, so no torch import is paid."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from relayrl.errors import ConfigError
from relayrl.parallel import host_memory

from dist_harness import run_distributed

BLOCK = 64 << 20  # 64 MiB: above glibc's largest mmap threshold (32 MiB), so mmapped by default
PAGES = BLOCK // 4096

# malloc, touch every page, free; twice. The second round's minor faults are the ones a step pays again.
PROBE = f"""
import ctypes, json, resource
from relayrl.parallel import host_memory
basis = host_memory.apply()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc({BLOCK})
    libc.memset(p, 1, {BLOCK})
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"basis": basis, "faults": faults}}))
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the policy is glibc's mallopt")


def probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in host_memory.GLIBC_ENV and k not in (host_memory.ENV, "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


@pytest.mark.unit
@glibc
def test_keep_reuses_a_freed_block_without_faults_and_release_faults_it_in_again():
    kept = probe()
    assert kept["basis"] == host_memory.KEEP
    assert kept["faults"][0] >= PAGES * 0.9  # the first touch faults every page in, under either policy
    assert kept["faults"][1] < PAGES * 0.05  # the heap kept them: nothing to fault in again

    released = probe(RELAYRL_HOST_MEMORY="release")
    assert released["basis"].startswith("release")
    assert released["faults"][1] >= PAGES * 0.9  # unmapped on free, faulted in again


@pytest.mark.unit
@glibc
def test_a_glibc_setting_in_the_environment_is_left_to_the_user():
    out = probe(MALLOC_MMAP_THRESHOLD_="65536")
    assert out["basis"] == "left to MALLOC_MMAP_THRESHOLD_ in the environment"
    assert out["faults"][1] >= PAGES * 0.9  # glibc still maps the block and unmaps it: the user's setting holds
    assert probe(GLIBC_TUNABLES="glibc.malloc.hugetlb=1")["basis"] == "left to GLIBC_TUNABLES in the environment"


@pytest.mark.unit
def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "sometimes")
    with pytest.raises(ConfigError, match=r"RELAYRL_HOST_MEMORY='sometimes': expected one of keep, release"):
        host_memory.plan()
    monkeypatch.setenv(host_memory.ENV, " Release ")
    assert host_memory.mode() == "release"


@pytest.mark.e2e
def test_the_cli_reports_a_bad_value_in_one_line_before_the_command_runs(tmp_path):
    env = {**os.environ, host_memory.ENV: "sometimes"}
    out = subprocess.run([sys.executable, "-m", "relayrl.cli.main", "demo", "--out", str(tmp_path / "run")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "relayrl: error: RELAYRL_HOST_MEMORY='sometimes': expected one of keep, release"
    assert not (tmp_path / "run").exists()  # nothing written


def _rank_policy(rank, world_size):
    return host_memory.basis()


@pytest.mark.equivalence
def test_every_launched_rank_applies_the_policy_before_its_function_runs():
    assert run_distributed(_rank_policy, 2) == [host_memory.plan()] * 2
