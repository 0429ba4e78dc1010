"""This module puts one sandboxed run in a memory cgroup of its own, where the kernel offers a writable
one, so that Limits.memory_mb bounds everything the run holds together: every process's pages, the
pages of memfd_create files, tmpfs files and SysV/POSIX shared memory, and the kernel memory (inodes,
dentries, page tables) they cost. RLIMIT_AS alone bounds each process's address space only, and
memfd or tmpfs pages are not address space.

    cgroup = MemoryCgroup.create(limit_bytes)      # None where no writable memory cgroup exists
    cgroup.add(pid)                                 # before the process starts the program
    ... run ...
    cgroup.peak_bytes(), cgroup.oom_kills()         # what the run reached; whether the kernel killed in it
    cgroup.remove()

Where it lives: a new child of the cgroup this process is in, in the memory hierarchy:
    cgroup v1   <memory mount>/<own path>/relayrl-sandbox-<pid>-<n>, memory.limit_in_bytes (and
                memory.memsw.limit_in_bytes where swap is accounted, so nothing is swapped past it)
    cgroup v2   <cgroup2 mount>/<own path>/relayrl-sandbox-<pid>-<n>, memory.max and memory.swap.max=0,
                only where the own cgroup already delegates the memory controller to its children
                (cgroup.subtree_control lists memory): it never enables controllers or moves this process
At the limit the kernel's OOM killer kills a process of the run (SIGKILL), never one outside it.

It imports the standard library only, and must never import another relayrl layer.
"""

from __future__ import annotations

import itertools
import os
import time
from contextlib import suppress
from dataclasses import dataclass

_counter = itertools.count()
_PREFIX = "relayrl-sandbox-"
_RMDIR_TRIES = 50  # a cgroup whose last process just died may refuse rmdir (EBUSY) for a moment


@dataclass
class MemoryCgroup:
    """A memory cgroup created for one run, removed by `remove`."""

    path: str
    version: int  # 1 or 2

    @classmethod
    def create(cls, limit_bytes: int) -> MemoryCgroup | None:
        """A new memory cgroup capped at `limit_bytes`, or None where this process may not make one."""
        parent = writable_parent()
        if parent is None:
            return None
        directory, version = parent
        _remove_stale(directory)
        path = os.path.join(directory, f"{_PREFIX}{os.getpid()}-{next(_counter)}")
        try:
            os.mkdir(path)
        except OSError:
            return None
        cgroup = cls(path, version)
        try:
            cgroup._set_limit(int(limit_bytes))
        except OSError:
            cgroup.remove()
            return None
        return cgroup

    def _set_limit(self, limit: int) -> None:
        if self.version == 1:
            _write(self.path, "memory.limit_in_bytes", limit)
            if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                _write(self.path, "memory.memsw.limit_in_bytes", limit)  # memory + swap: no swapping past it
        else:
            _write(self.path, "memory.max", limit)
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                _write(self.path, "memory.swap.max", 0)

    def add(self, pid: int) -> None:
        """Move process `pid` in; the processes it starts afterwards are in it too."""
        _write(self.path, "cgroup.procs", pid)

    def peak_bytes(self) -> int | None:
        """The most memory the run held at once (v2 needs Linux 5.19 for memory.peak; else None)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        with suppress(OSError, ValueError):
            return int(_read(self.path, name))
        return None

    def oom_kills(self) -> int:
        """How many processes of the run the kernel killed at the memory limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with suppress(OSError, ValueError):
            for line in _read(self.path, name).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Remove the (empty) cgroup; pages still charged to it (a tmpfs not yet freed) go to its parent."""
        for _ in range(_RMDIR_TRIES):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


def _remove_stale(directory: str) -> None:
    """Remove the cgroups of runs whose host process is gone (killed before it could remove them)."""
    with suppress(OSError):
        for name in os.listdir(directory):
            pid = name[len(_PREFIX):].partition("-")[0] if name.startswith(_PREFIX) else ""
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with suppress(OSError):
                    os.rmdir(os.path.join(directory, name))  # fails, harmlessly, while processes remain


def writable_parent() -> tuple[str, int] | None:
    """(directory, version) of this process's own memory cgroup if a child can be made in it, else None."""
    try:
        return _writable_parent()
    except OSError:
        return None


def _writable_parent() -> tuple[str, int] | None:
    own = _own_cgroups(_read("/proc/self", "cgroup"))
    mounts = _cgroup_mounts(_read("/proc/self", "mountinfo"))
    if "memory" in own and "memory" in mounts:  # v1: a memory hierarchy of its own
        directory = _join(*mounts["memory"], own["memory"])
        if directory and os.access(directory, os.W_OK):
            return directory, 1
    if "" in own and "" in mounts:  # v2: the unified hierarchy
        directory = _join(*mounts[""], own[""])
        if directory and os.access(directory, os.W_OK):
            with suppress(OSError):
                if "memory" in _read(directory, "cgroup.subtree_control").split():
                    return directory, 2
    return None


def _own_cgroups(text: str) -> dict[str, str]:
    """From /proc/self/cgroup: the cgroup path per v1 controller ("memory"), and "" for the v2 hierarchy."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = path
    return found


def _cgroup_mounts(text: str) -> dict[str, tuple[str, str]]:
    """From /proc/self/mountinfo: (mount point, root inside the hierarchy) of the v1 memory hierarchy
    ("memory") and of the cgroup2 one ("")."""
    found: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < fields.index("-") + 4:
            continue
        sep = fields.index("-")
        root, mount_point = fields[3], fields[4].replace("\\040", " ")
        fstype, options = fields[sep + 1], fields[sep + 3]
        if fstype == "cgroup2":
            found.setdefault("", (mount_point, root))
        elif fstype == "cgroup" and "memory" in options.split(","):
            found.setdefault("memory", (mount_point, root))
    return found


def _join(mount_point: str, root: str, path: str) -> str | None:
    """The directory of cgroup `path` (as /proc/self/cgroup names it) under a hierarchy mounted at
    `mount_point` from `root`; None when the path lies outside what is mounted."""
    root = root.rstrip("/")
    if root and not (path == root or path.startswith(root + "/")):
        return None
    return os.path.join(mount_point, path[len(root):].lstrip("/")).rstrip("/") or mount_point


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as f:
        return f.read()


def _write(directory: str, name: str, value: int) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(str(value))
