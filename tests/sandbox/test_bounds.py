"""The sandbox's bounds hold (issue 36, problem 1): memory in total per run (memfd, shared memory and
the pages of every process counted together), inodes on its tmpfs, and the seccomp filter's EPERM for
io_uring, keyrings and the other calls a test harness never needs. Each test is the attack from the
issue, run in the real sandbox, with what it reached measured on the host.
"""

from __future__ import annotations

import errno
import os
import re
import struct
from pathlib import Path

import pytest

from relayrl.sandbox import Limits, run, sandbox_available, seccomp
from relayrl.sandbox import runner as sandbox_runner
from relayrl.sandbox.cgroup import MemoryCgroup, writable_parent

UNAVAILABLE = sandbox_available()
needs_sandbox = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"sandbox unavailable: {UNAVAILABLE}")
needs_cgroup = pytest.mark.skipif(writable_parent() is None, reason="no writable memory cgroup here")
MB = 1024 * 1024

# The probe: one process fills 16 MB memfd files (RLIMIT_FSIZE caps each at file_size_mb) and
# says after each how much it holds; with memory_mb=128 it held 960 MB of host memory before the fix.
MEMFD_PROBE = """
import os
held = 0
fds = []
try:
    for _ in range(60):
        fd = os.memfd_create("hoard")
        for _ in range(16):
            os.write(fd, b"x" * (1 << 20))
        fds.append(fd)
        held += 16
        print("held", held, flush=True)
except OSError as e:
    print("refused", errno_name(e), flush=True)
""".replace("errno_name(e)", "__import__('errno').errorcode[e.errno]")


@needs_sandbox
@needs_cgroup
@pytest.mark.faults
def test_memfd_cannot_hold_more_than_memory_mb_in_total():
    r = run(MEMFD_PROBE, limits=Limits(memory_mb=128, wall_s=20, cpu_s=20))
    held = [int(m) for m in re.findall(r"^held (\d+)$", r.stdout, re.M)]
    assert r.memory_exceeded and r.exit_code == 128 + 9, (r.stdout[-200:], r.stderr[-200:])  # the OOM kill
    assert r.describe() == "memory limit exceeded"
    assert held and max(held) < 128  # the probe never held memory_mb in memfd pages (960 before)
    assert 100 * MB < r.memory_peak_bytes <= 128 * MB  # the host's own count of what the run reached


@needs_sandbox
@needs_cgroup
@pytest.mark.faults
def test_memory_is_bounded_across_processes_not_per_process():
    # 4 processes of 70 MB each: each within its RLIMIT_AS of 128 MB, 280 MB together
    code = ("import os, time\n"
            "pids = []\n"
            "for _ in range(4):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        hoard = bytearray(70 * 2**20)\n"
            "        hoard[::4096] = b'x' * len(hoard[::4096])\n"
            "        print('child holds 70', flush=True)\n"
            "        time.sleep(3)\n"
            "        os._exit(0)\n"
            "    pids.append(pid)\n"
            "codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]\n"
            "print('children', sorted(codes))\n")
    r = run(code, limits=Limits(memory_mb=128, processes=8, wall_s=20, cpu_s=20))
    assert r.exit_code == 0, r.stderr
    assert r.memory_exceeded and 0 < r.memory_peak_bytes <= 128 * MB
    codes = eval(r.stdout.splitlines()[-1].removeprefix("children "))
    assert -9 in codes and 0 < r.stdout.count("child holds 70") < 4  # some were killed, not all fit


@needs_sandbox
@pytest.mark.faults
def test_without_a_cgroup_memfd_and_sysv_shm_are_denied(monkeypatch):
    monkeypatch.setattr(MemoryCgroup, "create", classmethod(lambda cls, limit: None))
    code = (MEMFD_PROBE
            + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            + "print('shmget', libc.shmget(0, 1 << 20, 0o1600), __import__('errno').errorcode[ctypes.get_errno()])\n")
    r = run(code, limits=Limits(memory_mb=128, wall_s=10))
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["refused EPERM", "shmget -1 EPERM"]
    assert r.memory_peak_bytes is None and not r.memory_exceeded


@needs_sandbox
@pytest.mark.faults
def test_denied_system_calls_fail_with_eperm_inside():
    arch = seccomp.machine()
    names = ["io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key", "bpf",
             "userfaultfd", "perf_event_open", "ptrace", "mount", "fsopen", "unshare", "setns", "memfd_secret",
             "kexec_load", "init_module", "process_vm_readv", "pidfd_getfd"]
    column = list(seccomp.AUDIT_ARCH).index(arch)
    numbers = {name: seccomp.DENIED[name][column] for name in names}
    if arch == "x86_64":
        numbers["getpid in the x32 ABI"] = 0x40000000 | 39
    code = ("import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.syscall.restype = ctypes.c_long\n"
            f"for name, nr in {numbers!r}.items():\n"
            "    ctypes.set_errno(0)\n"
            "    buf = ctypes.create_string_buffer(256)\n"
            "    print(name, libc.syscall(nr, 1, buf, 0, 0, 0, 0), ctypes.get_errno())\n"
            "print('getpid', os.getpid(), 'memfd', os.memfd_create('ok') > 2)\n")
    r = run(code, limits=Limits(wall_s=10))
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:-1] == [f"{name} -1 {errno.EPERM}" for name in numbers]
    # ordinary calls still work; memfd_create is allowed where the memory cgroup counts its pages
    assert lines[-1] == f"getpid 2 memfd {writable_parent() is not None}"


# --- the filter itself, evaluated as the kernel would --------------------------------------------------

def _evaluate(program: bytes, arch: int, nr: int) -> int:
    """Run a classic BPF seccomp program (the four instructions seccomp.program emits) on one call."""
    insns = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    data, acc, pc = {0: nr, 4: arch}, 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = data[k]
        elif code == 0x15:
            pc += jt if acc == k else jf
        elif code == 0x35:
            pc += jt if acc >= k else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
        pc += 1


@pytest.mark.unit
@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_filter_denies_listed_calls_and_allows_the_rest(arch):
    audit = seccomp.AUDIT_ARCH[arch]
    eperm, allow = 0x00050000 | errno.EPERM, 0x7FFF0000
    strict = seccomp.program(deny_unbounded_memory=True, arch=arch)
    lenient = seccomp.program(deny_unbounded_memory=False, arch=arch)
    # hand-picked numbers from the kernel's tables: (x86_64, aarch64)
    io_uring_setup, keyctl, memfd_create, read, getpid, clone = 425, (250, 219), (319, 279), (0, 63), (39, 172), \
        (56, 220)
    pick = 0 if arch == "x86_64" else 1
    for program in (strict, lenient):
        assert _evaluate(program, audit, io_uring_setup) == eperm
        assert _evaluate(program, audit, keyctl[pick]) == eperm
        assert _evaluate(program, audit, read[pick]) == allow
        assert _evaluate(program, audit, getpid[pick]) == allow
        assert _evaluate(program, audit, clone[pick]) == allow
        assert _evaluate(program, 0x40000003, getpid[pick]) == eperm  # i386 (int 0x80): another ABI
    assert _evaluate(strict, audit, memfd_create[pick]) == eperm
    assert _evaluate(lenient, audit, memfd_create[pick]) == allow
    if arch == "x86_64":
        assert _evaluate(strict, audit, 0x40000000 | 39) == eperm  # x32


@pytest.mark.unit
def test_filter_numbers_match_the_kernel_headers():
    headers = {0: Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"), 1: Path("/usr/include/asm-generic/unistd.h")}
    if not all(p.exists() for p in headers.values()):
        pytest.skip("kernel headers not installed")
    checked = 0
    for column, path in headers.items():
        defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", path.read_text())}
        for name, numbers in {**seccomp.DENIED, **seccomp.UNBOUNDED_MEMORY}.items():
            if name in defined:  # headers older than the kernel may lack the newest calls
                assert numbers[column] == defined[name], (path.name, name)
                checked += 1
            else:
                assert name in ("open_tree_attr", "create_module", "get_kernel_syms", "query_module",
                                "iopl", "ioperm", "modify_ldt", "uselib", "_sysctl", "ustat", "sysfs") \
                    or numbers[column] is None, (path.name, name)
    assert checked > 100


@pytest.mark.unit
def test_unknown_architecture_is_refused():
    with pytest.raises(seccomp.UnsupportedArch, match="x86_64 and aarch64, not riscv64"):
        seccomp.program(deny_unbounded_memory=True, arch="riscv64")


assert sandbox_runner.MemoryCgroup is MemoryCgroup  # the tests above patch the class the runner uses


# --- inodes on its tmpfs -------------------------------------------------------------------------------

@needs_sandbox
@pytest.mark.faults
def test_tmpfs_holds_at_most_limits_files_and_keeps_what_was_written():
    from relayrl.sandbox.bwrap import find_interpreter, staging_dir

    if staging_dir(find_interpreter()) is None:
        pytest.skip("not root: the tmpfs are bwrap's, bounded in inodes by the memory cgroup only")
    code = ("import os\n"
            "for d in ('/sandbox', '/tmp', '/dev/shm'):\n"
            "    n = 0\n"
            "    try:\n"
            "        while n < 100000:\n"
            "            with open(f'{d}/f{n}', 'w') as f:\n"
            "                f.write(str(n))\n"
            "            n += 1\n"
            "        print(d, n, 'NO LIMIT')\n"
            "    except OSError as e:\n"
            "        print(d, n, __import__('errno').errorcode[e.errno])\n"
            "print(open('/sandbox/pkg/helper.py').read(), open('/sandbox/f95').read(), open('/tmp/f98').read())\n")
    r = run(code, files={"pkg/helper.py": "x = 1", "data.txt": "abc"}, limits=Limits(files=100, wall_s=10))
    assert r.exit_code == 0, r.stderr
    # 100 inodes: the root, and in /sandbox also pkg/, pkg/helper.py and data.txt (489 000 files before)
    assert r.stdout.splitlines() == ["/sandbox 96 ENOSPC", "/tmp 99 ENOSPC", "/dev/shm 99 ENOSPC", "x = 1 95 98"]


@needs_sandbox
@pytest.mark.unit
def test_files_that_need_more_inodes_than_the_limit_are_refused_before_the_run():
    files = {"a/b/c.py": "", "a/d.py": "", "e.py": ""}  # root + a/ + a/b/ + 3 files = 6 inodes
    with pytest.raises(ValueError, match="need 6 inodes, more than its limit of 5 files"):
        run("print(1)", files=files, limits=Limits(files=5))


# --- finding the memory cgroup --------------------------------------------------------------------------

@pytest.mark.unit
def test_own_memory_cgroup_is_found_from_proc_self_for_v1_and_v2():
    from relayrl.sandbox.cgroup import _cgroup_mounts, _join, _own_cgroups

    cgroups = _own_cgroups("9:name=systemd:/\n4:memory:/process_api/507b\n2:cpu,cpuacct:/x\n0::/user.slice/a\n")
    assert cgroups == {"name=systemd": "/", "memory": "/process_api/507b", "cpu": "/x", "cpuacct": "/x",
                       "": "/user.slice/a"}
    mounts = _cgroup_mounts(
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "36 31 0:33 /docker/c1 /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        "41 31 0:38 /user.slice /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n")
    assert mounts == {"memory": ("/sys/fs/cgroup/memory", "/"), "": ("/sys/fs/cgroup/unified", "/user.slice")}
    assert _join(*mounts["memory"], cgroups["memory"]) == "/sys/fs/cgroup/memory/process_api/507b"
    assert _join(*mounts[""], cgroups[""]) == "/sys/fs/cgroup/unified/a"  # the mount's root is /user.slice
    assert _join("/sys/fs/cgroup", "/", "/") == "/sys/fs/cgroup"
    assert _join("/sys/fs/cgroup", "/other.slice", "/user.slice/a") is None  # not under what is mounted


@needs_sandbox
@needs_cgroup
@pytest.mark.faults
def test_each_run_gets_its_own_cgroup_removed_after_it_and_stale_ones_are_cleared():
    directory, _ = writable_parent()
    stale = Path(directory) / "relayrl-sandbox-999999999-0"  # pid_max is at most 4194304: no such process
    stale.mkdir()
    r = run("print(1)", limits=Limits(wall_s=5))
    assert r.stdout == "1\n" and r.exit_code == 0, r.stderr
    assert 0 < r.memory_peak_bytes < 64 * MB and not r.memory_exceeded  # an interpreter's few MB
    assert not stale.exists()
    ours = f"relayrl-sandbox-{os.getpid()}-"  # other test processes may share the parent cgroup
    assert [p.name for p in Path(directory).iterdir() if p.name.startswith(ours)] == []
