"""This module defines the limits one sandboxed run is held to.

`Limits` is a frozen dataclass of plain numbers, so it can be a default argument, a dict key and a
config value. Each limit says where it is enforced:

    wall_s        the host: the whole sandbox (every process in its pid namespace) is killed past it
    cpu_s         RLIMIT_CPU of every process: SIGXCPU at cpu_s seconds, SIGKILL one second later
    memory_mb     the whole run's memory, where a memory cgroup can be made (relayrl.sandbox.cgroup):
                  every process's pages, memfd, shared memory and tmpfs files, and the kernel memory
                  they cost; past it the kernel kills a process of the run (RunResult.memory_exceeded).
                  And RLIMIT_AS of every process (address space; Python raises MemoryError)
    processes     RLIMIT_NPROC (threads count too), counted inside the run's own user namespace, so
                  concurrent runs never share (or exhaust) one budget
    file_size_mb  RLIMIT_FSIZE: no file written grows past it
    open_files    RLIMIT_NOFILE
    output_bytes  the host: at most this many bytes of stdout and of stderr are kept; past it the run
                  is killed and marked output_truncated
    disk_mb       the size of each writable tmpfs (/sandbox, /tmp, /dev/shm); everything else is
                  read-only
    files         the most files and directories (inodes, its root included) on each writable tmpfs,
                  where the host is root (relayrl.sandbox.stage); past it creating one fails with
                  ENOSPC. Elsewhere only the run's memory cgroup bounds what its inodes cost

The rlimits bind each process. Where no memory cgroup can be made (no writable cgroup v1 memory
hierarchy, no cgroup v2 with the memory controller delegated), the seccomp filter denies memfd_create
and SysV shared memory, whose pages are no address space, and what a whole run may hold is bounded by
processes x memory_mb (32 GB with the defaults) plus its tmpfs, so a caller that expects no forking
should lower `processes` (the code reward uses 8).

It imports the standard library and relayrl.errors only, and must never import another relayrl layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from relayrl.errors import ConfigError


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use (see the module docstring for where each is enforced)."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    processes: int = 64
    file_size_mb: int = 16
    open_files: int = 64
    output_bytes: int = 65536
    disk_mb: int = 64
    files: int = 4096

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # bool is an int subclass: Limits(processes=True) is a mistake, not "1"
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"sandbox limit {f.name} must be a number (got {value!r})")
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"sandbox limit {f.name} must be a positive finite number (got {value!r})")
            if f.name != "wall_s" and not float(value).is_integer():
                raise ConfigError(f"sandbox limit {f.name} must be a whole number (got {value!r})")

    def memory_bytes(self) -> int:
        """memory_mb in bytes: the cap of the run's memory cgroup."""
        return int(self.memory_mb) * 1024 * 1024

    def rlimits(self) -> dict[str, int]:
        """The resource limits the launcher sets inside the sandbox, by RLIMIT_* name, in bytes where
        the kernel counts bytes."""
        mib = 1024 * 1024
        return {
            "CPU": int(self.cpu_s),
            "AS": int(self.memory_mb) * mib,
            "NPROC": int(self.processes),
            "FSIZE": int(self.file_size_mb) * mib,
            "NOFILE": int(self.open_files),
        }
