"""This module runs one untrusted program under bubblewrap and returns its output and how it ended.

The life of one run, on the host:

    a memory cgroup capped at Limits.memory_mb, where one can be made (relayrl.sandbox.cgroup)
    memfds (code, files, stdin, seccomp filter) ──> Popen(bwrap ...) as SANDBOX_UID, in a new session
       (as root: Popen(stage ... bwrap ...), which mounts tmpfs bounded in files, then drops and runs bwrap)
    read --info-fd: the host pid of the sandbox's pid-1 ──> pidfd_open (a handle no pid reuse can fool)
       ──> pid-1 into the memory cgroup (every process of the run starts from it)
    write --block-fd: the program starts
    poll stdout / stderr / bwrap's exit, keeping at most Limits.output_bytes of each stream
       past the wall clock or the output cap ──> SIGKILL pid-1
    SIGKILL pid-1 in every case, and wait on its pidfd: the kernel kills every process of a pid
    namespace when its pid-1 dies and reports pid-1's exit only once they are all gone, so when `run`
    returns nothing the program started (background, double-forked, setsid) is left running.
    read the cgroup's peak and OOM kills, remove it

Without a memory cgroup, the seccomp filter denies memfd_create and SysV shared memory (the memory
RLIMIT_AS does not see); /dev/shm and /tmp are size-bounded tmpfs either way.

It imports the standard library and relayrl.errors only, and must never import another relayrl layer.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from relayrl.sandbox import bwrap, seccomp
from relayrl.sandbox.availability import SandboxUnavailable, sandbox_available
from relayrl.sandbox.cgroup import MemoryCgroup
from relayrl.sandbox.limits import Limits
from relayrl.sandbox.result import RunResult

DEFAULT_LIMITS = Limits()
_SETUP_TIMEOUT_S = 10.0  # bwrap's own start (namespaces, mounts), not counted against wall_s
_REAP_TIMEOUT_S = 10.0  # a pid namespace whose pid-1 was SIGKILLed empties in milliseconds
_CHUNK = 65536


def run(code: str, *, files: dict[str, str | bytes] | None = None, limits: Limits = DEFAULT_LIMITS,
        stdin: str = "") -> RunResult:
    """Run the Python program `code` in the sandbox, with each `files[name]` written to its working
    directory (/sandbox/name) first and `stdin` as its standard input."""
    reason = sandbox_available()
    if reason is not None:
        raise SandboxUnavailable(reason)
    if not isinstance(limits, Limits):
        raise TypeError(f"limits must be a relayrl.sandbox.Limits, not {type(limits).__name__}")
    encoded = {bwrap.check_file_name(name): _file_bytes(name, data) for name, data in (files or {}).items()}
    if sum(map(len, encoded.values())) > limits.disk_mb * 1024 * 1024:
        raise ValueError(f"the sandbox files hold more than its {limits.disk_mb} MB working directory")
    inodes = 1 + len(encoded) + len({"/".join(name.split("/")[:i]) for name in encoded
                                     for i in range(1, name.count("/") + 1)})  # its root, files, directories
    if inodes > limits.files:
        raise ValueError(f"the sandbox files need {inodes} inodes, more than its limit of {limits.files} files")
    interpreter = bwrap.find_interpreter()
    bwrap_path = bwrap.find_bwrap()
    assert interpreter is not None and bwrap_path is not None  # sandbox_available checked both

    cgroup = MemoryCgroup.create(limits.memory_bytes())
    with _descriptors() as fds, _removed(cgroup):
        seccomp_fd = fds.memfd("seccomp", seccomp.program(deny_unbounded_memory=cgroup is None))
        code_fd = fds.memfd("code", code.encode())
        file_fds = {name: fds.memfd("file", data) for name, data in encoded.items()}
        stdin_fd = fds.memfd("stdin", stdin.encode())
        info_r, info_w = fds.pipe()
        block_r, block_w = fds.pipe()
        staging = bwrap.staging_dir(interpreter)
        argv = bwrap.command(bwrap_path, interpreter, limits, files=file_fds, code_fd=code_fd,
                             info_fd=info_w, block_fd=block_r, seccomp_fd=seccomp_fd, staging=staging)
        if staging is not None:  # the stage mounts the bounded tmpfs as root, then drops to SANDBOX_UID
            argv, drop = bwrap.staged(argv, limits, staging), {}
        else:
            drop = {"user": bwrap.SANDBOX_UID, "group": bwrap.SANDBOX_UID, "extra_groups": []} \
                if bwrap.drops_privileges() else {}
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(code_fd, *file_fds.values(), info_w, block_r, seccomp_fd), env={}, cwd="/",
                                start_new_session=True, **drop)
        fds.close(info_w, block_r, code_fd, stdin_fd, seccomp_fd, *file_fds.values())  # the child holds its copies
        return _supervise(proc, info_r, block_w, limits, start, fds, cgroup)


def _file_bytes(name: str, data: str | bytes) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    raise TypeError(f"sandbox file {name!r} must be str or bytes, not {type(data).__name__}")


def _supervise(proc: subprocess.Popen, info_r: int, block_w: int, limits: Limits, start: float,
               fds: _Descriptors, cgroup: MemoryCgroup | None) -> RunResult:
    pid1 = None
    try:
        pid, pid1 = _open_pid1(info_r, proc)
        if cgroup is not None:
            cgroup.add(pid)  # before the program starts: it and all it starts are counted
        os.write(block_w, b"1")  # the program starts now: the wall clock starts with it
        fds.close(block_w)
        deadline = time.monotonic() + limits.wall_s
        out, err, timed_out, truncated = _collect(proc, pid1, limits, deadline)
    finally:
        _kill(proc, pid1)
    returncode = proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    exit_code = None if (timed_out or truncated) else (returncode if returncode >= 0 else 128 - returncode)
    return RunResult(stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
                     exit_code=exit_code, timed_out=timed_out, output_truncated=truncated,
                     wall_s=time.monotonic() - start,
                     memory_peak_bytes=cgroup.peak_bytes() if cgroup is not None else None,
                     memory_exceeded=cgroup is not None and cgroup.oom_kills() > 0)


def _open_pid1(info_r: int, proc: subprocess.Popen) -> tuple[int, int]:
    """The host pid and a pidfd of the sandbox's pid-1, from the JSON bwrap writes to --info-fd once it
    has cloned it."""
    text, deadline = b"", time.monotonic() + _SETUP_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(info_r, 4096) if ready else b""
        text += chunk
        with suppress(ValueError, ProcessLookupError):  # not all of it yet; or its setup failed and it is gone
            pid = int(json.loads(text)["child-pid"])
            return pid, os.pidfd_open(pid)
        if ready and not chunk:
            break
    proc.kill()
    err = proc.communicate()[1].decode("utf-8", "replace").strip()
    raise RuntimeError(f"bubblewrap did not start the sandbox: {err or 'no message'}")


def _collect(proc: subprocess.Popen, pid1: int, limits: Limits, deadline: float):
    """Read stdout and stderr, at most output_bytes of each, until the program has ended and both
    pipes are closed, the wall clock runs out, or a stream passes the cap.
    Returns (stdout, stderr, timed_out, truncated)."""
    assert proc.stdout is not None and proc.stderr is not None
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    poller = select.poll()
    for fd in streams:
        poller.register(fd, select.POLLIN)
    proc_fd = os.pidfd_open(proc.pid)  # readable once bwrap exits, which it does when the program does
    poller.register(proc_fd, select.POLLIN)
    open_streams, ended = set(streams), False
    try:
        while open_streams or not ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # past the wall clock; or, once ended, leftovers that somehow still hold the pipes
                return bytes(streams[proc.stdout.fileno()]), bytes(streams[proc.stderr.fileno()]), not ended, False
            for fd, _ in poller.poll(max(1, int(remaining * 1000))):
                if fd == proc_fd:
                    poller.unregister(proc_fd)
                    # The program is gone. Processes it left behind may hold the pipes open: they die
                    # with pid-1, after which the pipes end once what is buffered in them is read.
                    ended = True
                    _signal(pid1)
                    deadline = time.monotonic() + _REAP_TIMEOUT_S
                    continue
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    poller.unregister(fd)
                    open_streams.discard(fd)
                    continue
                buf = streams[fd]
                room = limits.output_bytes - len(buf)
                buf += chunk[:room]
                if len(chunk) > room:
                    return bytes(streams[proc.stdout.fileno()]), bytes(streams[proc.stderr.fileno()]), False, True
    finally:
        os.close(proc_fd)
    return bytes(streams[proc.stdout.fileno()]), bytes(streams[proc.stderr.fileno()]), False, False


def _signal(pidfd: int | None) -> None:
    if pidfd is not None:
        with suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)


def _kill(proc: subprocess.Popen, pid1: int | None) -> None:
    """SIGKILL the sandbox's pid-1 (so its whole pid namespace) and bwrap, and wait until pid-1 is
    gone, which the kernel reports only after every process of its namespace has been reaped."""
    _signal(pid1)
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if pid1 is not None:
        select.select([pid1], [], [], _REAP_TIMEOUT_S)
        os.close(pid1)


class _Descriptors:
    """The descriptors one run opens, closed however it ends."""

    def __init__(self) -> None:
        self._open: set[int] = set()

    def memfd(self, name: str, data: bytes) -> int:
        fd = os.memfd_create(f"relayrl-sandbox-{name}", os.MFD_CLOEXEC)
        self._open.add(fd)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def pipe(self) -> tuple[int, int]:
        r, w = os.pipe2(os.O_CLOEXEC)
        self._open.update((r, w))
        return r, w

    def close(self, *fds: int) -> None:
        for fd in fds:
            if fd in self._open:
                self._open.discard(fd)
                os.close(fd)

    def close_all(self) -> None:
        self.close(*list(self._open))


@contextmanager
def _removed(cgroup: MemoryCgroup | None) -> Iterator[None]:
    try:
        yield
    finally:
        if cgroup is not None:
            cgroup.remove()


@contextmanager
def _descriptors() -> Iterator[_Descriptors]:
    fds = _Descriptors()
    try:
        yield fds
    finally:
        fds.close_all()
