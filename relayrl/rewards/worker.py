"""The reward worker process: loads the configured reward functions once, then runs the calls the pool
sends it (one sample, or one prompt's group for a batch function), one at a time in its main thread,
reporting each result as soon as it has it.

    main([_, FD, PARENT_PID, ...])      (started by relayrl.rewards.pool in a fresh interpreter, never by hand)

Protocol on the socket FD (a socketpair with the driver):

    driver -> worker   8-byte length + pickle of ("init", {...}) once, then ("run", [(id, fn, completion, example)]),
                       a batch function's call (id, fn, completions, examples, completion_ids, trainer state)
                       carrying one group's lists instead
    worker -> driver   records: header <IBI (id, kind, payload length) + payload, never pickled:
                         OK          8-byte float64 value
                         FAIL        utf-8 message (the call raised or returned a non-value)
                         BATCH       json [[value, null] | [null, message], ...]: a batch call's values
                         READY       json {"vm_mb": ..., "forms": ["sample" | "batch" | "verl" | "keyword", ...]}
                                     once the functions are loaded
                         INIT_ERROR  json {"kind": "config" | "reward", "message": ...}
                         RETIRE      utf-8 message: the call failed and this worker must be replaced (the
                                     reward forked: a copy of the worker may be running beside it)

The driver never unpickles what a worker sends: the worker runs user code, the driver only reads
numbers and strings, and treats a record out of turn, of an unknown kind or over reward.max_reply_mb
as the worker's failure (relayrl.rewards.pool).

Two processes make a worker: the keeper (the process the pool started: trusted code only) and the
worker proper, its child, which loads and runs the reward functions:

    keeper (PR_SET_CHILD_SUBREAPER) ── worker ── whatever a reward starts (setsid, double forks, ...)

The keeper is a subreaper, so every process the worker's subtree starts stays its descendant, even one
that leaves its process group and session (start_new_session=True) and whose parent exits. When the
worker ends (it exits, dies, or the pool asks with SIGTERM, which the keeper turns into SIGKILL of the
worker) the keeper SIGKILLs every descendant left, reaps them, and exits with the worker's own exit
status (its code, or the same signal), which is what the pool reports. The keeper dies with the driver
(PR_SET_PDEATHSIG=SIGTERM: the same clean-up), the worker with the keeper (PR_SET_PDEATHSIG=SIGKILL)
and on EOF on its socket. A reward that forks (os.fork, multiprocessing's fork) fails its call and its
worker is replaced: a copy of the worker that returned from the fork never answers. The worker ignores
SIGINT (Ctrl-C is the driver's to handle), writes no core files, and runs under
RLIMIT_AS = reward.memory_mb and, for each call, RLIMIT_CPU = the CPU it has used so far + cpu_s.
A worker that goes past its CPU limit dies of SIGXCPU; the pool charges that sample and replaces it.
Before the functions themselves it imports only the standard library, relayrl.errors, the reward
registry, relayrl.data (for `Example`; it brings pydantic) and relayrl.rewards.state: no torch. Like all
of rewards, it must never import the trainer, the engine, sync or the controller.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import signal
import socket
import struct
import sys
import time

HEADER = struct.Struct("<IBI")
VALUE = struct.Struct("<d")
OK, FAIL, READY, INIT_ERROR, BATCH, RETIRE = 0, 1, 2, 3, 4, 5
MAX_MESSAGE = 4000  # characters of a failure message sent (a message is one line for the user)
LENGTH = struct.Struct("<Q")
# What a worker needs beyond its own functions: the loaded modules and interpreter, with some room.
HEADROOM_MB = 64


def send_frame(sock: socket.socket, obj) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(LENGTH.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        b = sock.recv(min(n - got, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket):
    head = _recv_exact(sock, LENGTH.size)
    if head is None:
        return None
    body = _recv_exact(sock, LENGTH.unpack(head)[0])
    return None if body is None else pickle.loads(body)  # from the driver, which started us: trusted


def _record(tid: int, kind: int, payload: bytes) -> bytes:
    return HEADER.pack(tid, kind, len(payload)) + payload


def _prctl(option: int, arg: int | bytes) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0


PR_SET_PDEATHSIG, PR_SET_NAME, PR_SET_CHILD_SUBREAPER = 1, 15, 36


def _die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    _prctl(PR_SET_PDEATHSIG, sig)
    _prctl(PR_SET_NAME, b"rl-reward-pool")  # what ps / top show for this process
    # The parent may have died between starting us and the prctl: then we have a new parent already.
    if os.getppid() != parent_pid:
        os._exit(0)


def _children_map() -> dict[int, list[int]]:
    """ppid -> pids of every process visible in /proc."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])  # the name, in parentheses, may hold anything
        out.setdefault(ppid, []).append(int(name))
    return out


def _descendants(pid: int) -> list[int]:
    children, out, todo = _children_map(), [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _reap_now() -> bool:
    """Reap every child that has exited; False once this process has no child left at all."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _kill_descendants(deadline_s: float = 10.0) -> None:
    """SIGKILL every process below this one (a subreaper: orphans of the subtree come back to it), round
    after round, until none is left or the deadline passes (a process stuck in the kernel)."""
    end = time.monotonic() + deadline_s
    while _reap_now() and time.monotonic() < end:
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _keep(parent_pid: int, fd: int) -> None:
    """Fork the worker proper and return in it; in this process (the keeper) wait for it, kill what it
    left behind, and exit with its status. See the module doc."""
    subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    keeper = os.getpid()
    pid = os.fork()
    if pid == 0:
        _die_with_parent(keeper)
        return
    os.close(fd)  # only the worker holds the socket: its death is EOF for the pool
    status = None

    def on_term(*_) -> None:
        if status is None:  # not reaped yet: the pid is still the worker's
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    signal.signal(signal.SIGTERM, on_term)
    while status is None:
        try:
            got, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if got == pid:
            status = st
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if subreaper:  # elsewhere than Linux the pool kills the worker's process group, as far as that reaches
        _kill_descendants()
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(keeper, sig)
        time.sleep(1.0)  # a signal whose default is to stop or be ignored: fall through
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else 1)


def _vm_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize() / 2**20


def _init(sock: socket.socket, init: dict):
    """Load the functions and set the address-space limit; returns the functions, or None after
    reporting why they cannot run."""
    from relayrl.errors import ConfigError, UserError
    from relayrl.rewards.calls import load_functions

    sys.path[:] = init["sys_path"]  # where the driver finds modules, the user's reward modules among them
    try:
        fns = load_functions(init["functions"])
    except UserError as e:
        kind = "config" if isinstance(e, ConfigError) else "reward"
        sock.sendall(_record(0, INIT_ERROR, json.dumps({"kind": kind, "message": str(e)}).encode()))
        return None
    except BaseException as e:  # a user module may call sys.exit() while it is imported
        msg = f"cannot load the reward functions: {type(e).__name__}: {e}".splitlines()[0]
        sock.sendall(_record(0, INIT_ERROR, json.dumps({"kind": "reward", "message": msg}).encode()))
        return None
    memory_mb = init["memory_mb"]
    if memory_mb is not None and os.path.exists("/proc/self/statm"):
        need = _vm_mb() + HEADROOM_MB
        if need > memory_mb:
            msg = (f"config error: reward.memory_mb: {memory_mb} is less than a reward worker needs after loading "
                   f"its functions (about {need:.0f} MB of address space); raise it, or set it to null for no limit")
            sock.sendall(_record(0, INIT_ERROR, json.dumps({"kind": "config", "message": msg}).encode()))
            return None
    if memory_mb is not None:
        limit = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return fns


class _CpuLimit:
    """RLIMIT_CPU = CPU used so far + cpu_s, renewed before each call. The limit is in whole seconds, so
    it only changes when the used seconds do: one cheap clock read per call, a setrlimit now and then."""

    def __init__(self, cpu_s: int):
        self.cpu_s, self.hard, self.second = cpu_s, resource.getrlimit(resource.RLIMIT_CPU)[1], -1

    def renew(self) -> None:
        second = int(time.process_time())
        if second != self.second:
            soft = second + 1 + self.cpu_s  # +1: the current second may be almost spent
            if self.hard != resource.RLIM_INFINITY:
                soft = min(soft, self.hard)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, self.hard))
            self.second = second


def serve(sock: socket.socket) -> None:
    msg = _recv_frame(sock)
    if msg is None:
        return
    _, init = msg
    fns = _init(sock, init)
    if fns is None:
        return
    from relayrl.rewards.calls import BATCH as BATCH_FORM
    from relayrl.rewards.calls import call_batch, call_one

    vm = _vm_mb() if os.path.exists("/proc/self/statm") else 0.0
    sock.sendall(_record(0, READY, json.dumps({"vm_mb": vm, "forms": [f.form for f in fns]}).encode()))
    cpu = _CpuLimit(init["cpu_s"]) if init["cpu_s"] is not None else None
    me, forked = os.getpid(), []
    os.register_at_fork(after_in_parent=lambda: forked.append(1))
    while True:
        msg = _recv_frame(sock)
        if msg is None:  # the driver closed the pool (or died)
            return
        for tid, fidx, completion, example, *extra in msg[1]:
            if cpu is not None:
                cpu.renew()
            f = fns[fidx]
            if f.form == BATCH_FORM:  # the lists of one prompt's group, its completion_ids and trainer state
                items, error = call_batch(f, completion, example, *extra)
                record = None if error is not None else _record(tid, BATCH, json.dumps(items).encode())
            else:
                value, error = call_one(f, completion, example)
                record = None if error is not None else _record(tid, OK, VALUE.pack(value))
            if os.getpid() != me:  # a copy made by os.fork() in the reward, returning here: never answer
                os._exit(0)
            if forked:
                msg = ("the reward function forked (os.fork or multiprocessing's fork) during the call; its worker "
                       "was replaced: start helper processes with subprocess instead")
                sock.sendall(_record(tid, RETIRE, msg.encode()))
                return
            sock.sendall(record or _record(tid, FAIL, error[:MAX_MESSAGE].encode("utf-8", "replace")))


def main(argv: list[str]) -> None:
    fd, parent_pid = int(argv[1]), int(argv[2])
    _die_with_parent(parent_pid, signal.SIGTERM)  # the keeper: SIGTERM, so that it cleans up first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _keep(parent_pid, fd)  # returns in the worker proper only
    sock = socket.socket(fileno=fd)
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):  # the driver went away: nothing to report to
        pass
    # os._exit: a user's atexit hook or non-daemon thread must not keep a finished worker alive.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing left to save
            pass
    os._exit(0)
