"""This module builds the seccomp filter of the sandbox: a classic BPF program that bubblewrap installs
(--add-seccomp-fd) on its pid 1 before it starts, so that it holds every process of the run.

A denied system call fails with EPERM: the program sees an ordinary OSError, nothing is killed.
Denied are the calls a test harness never needs and the kernel surfaces that an escape or a denial
of service would go through:

    io_uring_*                        an asynchronous path around the rest of the filter
    add_key, request_key, keyctl      kernel keyrings (shared state outside the namespaces)
    bpf, perf_event_open, userfaultfd kernel attack surface, timing side channels, fault stalls
    ptrace, process_vm_*, kcmp, pidfd_getfd   reading or steering another process
    mount and the new mount API, pivot_root, chroot, unshare, setns   leaving the namespaces
    module, kexec, reboot, swap, clock, quota, acct, syslog ... calls   host administration
    memfd_secret                      memory no cgroup or rlimit sees the way it sees the rest
    memfd_create, shmget/shmat/shmctl/shmdt   only where the run has no memory cgroup
                                      (deny_unbounded_memory): their pages are no process's
                                      address space, so RLIMIT_AS does not bound them

System calls of another ABI (i386 through int 0x80 on x86_64; x32) are denied as a whole, since the
numbers below are those of the native ABI only. The program is built with `struct` (no libseccomp),
for x86_64 and aarch64; `program()` raises UnsupportedArch elsewhere.

It imports the standard library only, and must never import another relayrl layer.
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000  # x86_64's x32 ABI: the same arch value, numbers with this bit set

# name: (x86_64 number, aarch64 number); None where the architecture has no such call.
# Checked against the kernel headers by tests/sandbox/test_seccomp.py where they are installed.
DENIED: dict[str, tuple[int | None, int | None]] = {
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442), "open_tree_attr": (467, 467),
    "unshare": (272, 97), "setns": (308, 268),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265), "fanotify_init": (300, 262),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "create_module": (174, None), "get_kernel_syms": (177, None), "query_module": (178, None),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89), "syslog": (103, 116),
    "quotactl": (179, 60), "quotactl_fd": (443, 443), "nfsservctl": (180, 42), "lookup_dcookie": (212, 18),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266), "adjtimex": (159, 171),
    "sethostname": (170, 161), "setdomainname": (171, 162), "vhangup": (153, 58),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None), "uselib": (134, None),
    "_sysctl": (156, None), "ustat": (136, None), "sysfs": (139, None),
    "memfd_secret": (447, 447),
}
# Denied only where no memory cgroup counts their pages against the run.
UNBOUNDED_MEMORY: dict[str, tuple[int | None, int | None]] = {
    "memfd_create": (319, 279),
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197),
}

# classic BPF (linux/filter.h, linux/seccomp.h)
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # struct seccomp_data


class UnsupportedArch(RuntimeError):
    """The filter's system call numbers are known for x86_64 and aarch64 only."""


def machine() -> str:
    return platform.machine()


def denied_numbers(arch: str, *, deny_unbounded_memory: bool) -> list[int]:
    """The native system call numbers the filter denies on `arch`, in ascending order."""
    if arch not in AUDIT_ARCH:
        raise UnsupportedArch(f"the sandbox's seccomp filter knows x86_64 and aarch64, not {arch}")
    column = list(AUDIT_ARCH).index(arch)
    table = {**DENIED, **(UNBOUNDED_MEMORY if deny_unbounded_memory else {})}
    return sorted({numbers[column] for numbers in table.values() if numbers[column] is not None})


def program(*, deny_unbounded_memory: bool, arch: str | None = None) -> bytes:
    """The filter as bubblewrap reads it: struct sock_filter entries in native byte order."""
    arch = arch or machine()
    numbers = denied_numbers(arch, deny_unbounded_memory=deny_unbounded_memory)
    deny = _RET_ERRNO | errno.EPERM
    insns = [(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
             (_JEQ_K, 1, 0, AUDIT_ARCH[arch]),  # the native ABI: go on; any other: denied
             (_RET_K, 0, 0, deny),
             (_LD_W_ABS, 0, 0, _NR_OFFSET)]
    if arch == "x86_64":
        insns += [(_JGE_K, 0, 1, _X32_BIT), (_RET_K, 0, 0, deny)]
    for nr in numbers:
        insns += [(_JEQ_K, 0, 1, nr), (_RET_K, 0, 0, deny)]
    insns.append((_RET_K, 0, 0, _RET_ALLOW))
    return b"".join(struct.pack("=HBBI", *insn) for insn in insns)
