"""A pool of long-lived worker processes that run reward functions with a bound on every call.

    driver (RewardPool.run)                         worker i (relayrl.rewards.worker)
      pending calls ── chunk of k calls ──────────>   for each call: set RLIMIT_CPU, fn(completion, example)
                                                      (a batch function: fn(completions=[...], completion_ids=
                                                      [...], trainer_state=..., ...) on a group)
      outcomes[id] <── one record per call ────────   (value | message), sent as soon as it is known
      a worker silent for timeout_s on one call:  kill -9 it, that call is a timeout, the rest of its
                                                  chunk goes back to the front of the queue
      a worker that dies (os._exit, a crash, SIGXCPU, the OOM killer): the call it was on is a failure
                                                  with the reason, the rest is requeued, a new worker starts
      a worker that breaks the protocol (a record for another call than the one it is on, of an unknown
      kind, malformed, or announcing more than reward.max_reply_mb), or whose reward forked: the same —
                                                  its call fails with the reason, it is killed and replaced

timeout_s is a total deadline for each call, its answer's transfer included: bytes that trickle in do not
renew it (only a whole record does, for the next call of the chunk).

A call is one sample, or for a batch function (TRL's form, relayrl.rewards.calls) one prompt's group of
samples, whose values come back in one record: the bound (timeout_s, cpu_s) is then on the whole group.

Chunks amortise the cost of a message over k calls (k shrinks as the queue drains, so the last
chunks balance the workers), while the per-call record keeps the bound per call: the driver always
knows which call a silent worker is on. Only idle workers are sent work, so a send never waits
on a busy worker.

Killing a worker means SIGTERM to its keeper (relayrl.rewards.worker): it SIGKILLs the worker and every
process the worker's subtree started, even one in a session of its own, then exits with the worker's status;
a keeper that has not exited within a few seconds gets its process group SIGKILLed.

Workers are fresh interpreters (`python -c "...worker.main()"`, the 'spawn' start method's
effect without multiprocessing re-importing the driver's __main__, which may import torch). They
are started from one long-lived thread of the pool, because Linux sends PR_SET_PDEATHSIG when the
thread that forked the child exits, not only the process: a worker started from a short-lived
caller thread would be killed with it.

It imports the standard library, the reward modules and relayrl.errors only; like all of rewards, it
must never import the trainer, the engine, sync or the controller (rewards may use relayrl.data and the
ground floor only).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from relayrl.errors import ConfigError, RewardError
from relayrl.rewards import worker as proto

# The directory that holds the relayrl package: a worker must import it even when the driver found it
# through a sys.path entry added at run time (benchmarks/ scripts do that). Added only when missing, and
# not through PYTHONPATH, which would put an installed package's site-packages ahead of the stdlib.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_BOOT = ("import sys; root = sys.argv[3]\n"
         "if root not in sys.path: sys.path.insert(1, root)\n"
         "from relayrl.rewards.worker import main; main(sys.argv)")
MAX_CHUNK = 64
KEEPER_GRACE_S = 10.0  # how long a keeper has to clean up after SIGTERM before its group is SIGKILLed
START_TIMEOUT_S = 120.0  # importing sympy for math-verify on a loaded 2-core machine can take seconds
MAX_START_FAILURES = 3


@dataclass
class Outcome:
    """The result of one call: a value, or the message of its failure (timed_out for timeouts); a batch
    call that returned has its samples' outcomes in `items` instead."""

    value: float | None
    error: str | None = None
    timed_out: bool = False
    items: list[Outcome] | None = None


@dataclass
class _Worker:
    proc: subprocess.Popen
    sock: socket.socket
    _: KW_ONLY
    ready: bool = False
    buf: bytearray = field(default_factory=bytearray)
    outstanding: deque = field(default_factory=deque)  # call ids sent, not yet answered, in order
    deadline: float = math.inf  # when the call it is on times out (or its start does)


class RewardPool:
    """`RewardPool(specs, workers=2, timeout_s=10, memory_mb=4096, cpu_s=10)`; `run(calls)` returns one
    Outcome per (function index, completion, example) in order (a batch function's call: (function index,
    completions, examples, completion_ids, state) of one group); `close()` stops every worker.

    specs are (name, params) or (name, params, batch) as in reward.functions; a call names its function
    by index. `forms` is each function's form ("sample", "batch", "verl", "keyword"), as the workers found it. One
    thread at a time may call run (the scorer is called by the driver's loop, one step at a time)."""

    def __init__(self, specs: list[tuple[str, dict[str, Any]]], *, workers: int, timeout_s: float,
                 memory_mb: int | None, cpu_s: int | None, max_reply_mb: int = 64):
        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.timeout_s = timeout_s
        self.max_reply_mb = max_reply_mb
        self.restarts = 0
        self._init = {"functions": [(s[0], dict(s[1]), *s[2:]) for s in specs], "memory_mb": memory_mb,
                      "cpu_s": cpu_s}
        self.forms: list[str] = []
        self._procs: dict[int, subprocess.Popen] = {}
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="relayrl-reward-spawner")
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, self._spawner)
        self._workers: list[_Worker] = []
        self._start_failures = 0
        self._closed = False
        self._pending: deque = deque()
        self._calls: list = []
        self._outcomes: list[Outcome | None] = []
        try:
            self._workers = [self._spawn() for _ in range(workers)]
            while not all(w.ready for w in self._workers):
                self._pump()
        except BaseException:
            self.close()
            raise

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def run(self, calls: list[tuple]) -> list[Outcome]:
        if self._closed:
            raise RuntimeError("this reward pool is closed")
        for w in list(self._workers):
            if w.outstanding:  # a run that was interrupted (KeyboardInterrupt) left it mid-chunk
                self._kill(w)
                self._replace(w)
        self._calls, self._outcomes = calls, [None] * len(calls)
        self._pending = deque(range(len(calls)))
        try:
            while self._pending or any(w.outstanding for w in self._workers):
                self._assign()
                self._pump()
            return self._outcomes  # type: ignore[return-value]
        finally:
            self._calls, self._pending = [], deque()

    def close(self) -> None:
        """Ask the idle workers to stop (EOF on their sockets) and give them a second or two to exit
        (flushing what they printed); then kill every worker's process group and reap the workers."""
        if self._closed:
            return
        self._closed = True
        idle = [w for w in self._workers if not w.outstanding]
        for w in idle:
            try:
                w.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        while idle and time.monotonic() < deadline:
            # A worker's socket reads EOF once it has exited; it is not reaped yet, so its pid (its group's
            # id) cannot have been reused when the finalizer kills the group.
            readable, _, _ = select.select([w.sock for w in idle], [], [], max(0.0, deadline - time.monotonic()))
            for sock in readable:
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    idle = [w for w in idle if w.sock is not sock]
        for w in self._workers:
            _close_sock(w.sock)
        self._finalizer()  # kills each worker's process group, reaps the workers, stops the spawner thread

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- workers --------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent, child = socket.socketpair()
        cmd = [sys.executable, "-c", _BOOT, str(child.fileno()), str(os.getpid()), _PACKAGE_ROOT]
        try:
            # A session (and process group) of its own: a kill reaches what the reward function started
            # too, and the terminal's Ctrl-C goes to the driver only.
            proc = self._spawner.submit(subprocess.Popen, cmd, pass_fds=(child.fileno(),),
                                        stdin=subprocess.DEVNULL, start_new_session=True).result()
        finally:
            child.close()
        self._procs[proc.pid] = proc
        # A send to a worker that stopped reading (it only reads between chunks) must not block us forever.
        parent.settimeout(max(self.timeout_s, 5.0))
        w = _Worker(proc, parent, deadline=time.monotonic() + START_TIMEOUT_S)
        proto.send_frame(parent, ("init", {**self._init, "sys_path": list(sys.path)}))
        return w

    def _replace(self, w: _Worker) -> None:
        _close_sock(w.sock)
        self._procs.pop(w.proc.pid, None)
        self._workers[self._workers.index(w)] = self._spawn()
        self.restarts += 1

    def _assign(self) -> None:
        for w in self._workers:
            if not self._pending:
                return
            if not w.ready or w.outstanding:
                continue
            k = max(1, min(MAX_CHUNK, math.ceil(len(self._pending) / (2 * len(self._workers)))))
            ids = [self._pending.popleft() for _ in range(min(k, len(self._pending)))]
            chunk = [(i, *self._calls[i]) for i in ids]
            try:
                proto.send_frame(w.sock, ("run", chunk))
            except OSError:  # it died (or stopped reading) while idle: no call of this chunk started
                self._pending.extendleft(reversed(ids))
                self._kill(w)
                self._replace(w)
                continue
            w.outstanding.extend(ids)
            w.deadline = time.monotonic() + self.timeout_s

    def _pump(self) -> None:
        """Wait for the next records, deaths or deadlines, and act on them."""
        now = time.monotonic()
        deadline = min((w.deadline for w in self._workers if w.outstanding or not w.ready), default=math.inf)
        wait = None if deadline == math.inf else max(0.0, deadline - now)
        readable, _, _ = select.select([w.sock for w in self._workers], [], [], wait)
        by_sock = {w.sock: w for w in self._workers}
        for sock in readable:
            w = by_sock[sock]
            try:
                data = sock.recv(1 << 16)
            except OSError:
                data = b""
            if data:
                self._on_data(w, data)
            else:
                self._on_death(w)
        now = time.monotonic()
        for w in list(self._workers):
            if w.deadline <= now and (w.outstanding or not w.ready):
                self._on_silence(w)

    def _on_data(self, w: _Worker, data: bytes) -> None:
        w.buf += data
        buf, pos, H = w.buf, 0, proto.HEADER
        answered = False
        while len(buf) - pos >= H.size:
            tid, kind, n = H.unpack_from(buf, pos)
            if kind not in _KINDS:
                return self._on_misbehaviour(w, f"sent a record of unknown kind {kind}")
            if n > self.max_reply_mb * 2**20:
                return self._on_misbehaviour(w, f"announced an answer of {n / 2**20:.0f} MB, more than "
                                                f"reward.max_reply_mb = {self.max_reply_mb}")
            if len(buf) - pos - H.size < n:
                break
            payload = bytes(buf[pos + H.size:pos + H.size + n])
            pos += H.size + n
            if kind in (proto.OK, proto.FAIL, proto.BATCH, proto.RETIRE):
                if not w.outstanding or tid != w.outstanding[0]:
                    expected = f"call {w.outstanding[0]}" if w.outstanding else "no call"
                    return self._on_misbehaviour(w, f"answered call {tid} while it was on {expected}")
                try:
                    outcome = _outcome(kind, payload)
                except ValueError as e:
                    return self._on_misbehaviour(w, f"sent a malformed answer ({e})")
                if kind == proto.RETIRE:
                    return self._on_misbehaviour(w, outcome.error, said=True)
                self._outcomes[w.outstanding.popleft()] = outcome
                answered = True
            elif kind == proto.READY:
                w.ready, self._start_failures = True, 0
                self.forms = json.loads(payload).get("forms", [])
            elif kind == proto.INIT_ERROR:
                info = json.loads(payload)
                raise (ConfigError if info["kind"] == "config" else RewardError)(info["message"])
        del buf[:pos]
        # the deadline is the call's, from when it started: only a whole answer (the next call starts) moves it
        if answered or not w.outstanding:
            w.deadline = time.monotonic() + self.timeout_s if w.outstanding else math.inf

    def _on_misbehaviour(self, w: _Worker, what: str, said: bool = False) -> None:
        """The worker broke the protocol (or said it must go): its call fails, it is killed and replaced."""
        self._kill(w)
        if not w.ready:
            raise RewardError(f"a reward worker {what} while it started")
        self._charge(w, Outcome(None, what if said else f"the reward worker {what}; it was replaced"))
        self._replace(w)

    def _on_death(self, w: _Worker) -> None:
        # EOF on its socket: it has exited (or closed the socket, and is of no further use). Killing its
        # group also ends anything it started; a process already exiting keeps its own exit status.
        rc = self._kill(w)
        reason = self._death_reason(rc)
        if not w.ready:
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                raise RewardError(f"reward workers keep dying while they start: {reason}")
        self._charge(w, Outcome(None, reason))
        self._replace(w)

    def _on_silence(self, w: _Worker) -> None:
        self._kill(w)
        if not w.ready:
            raise RewardError(f"a reward worker did not start within {START_TIMEOUT_S:g} s")
        self._charge(w, Outcome(None, f"timed out after {self.timeout_s:g} s (reward.timeout_s)", timed_out=True))
        self._replace(w)

    def _charge(self, w: _Worker, outcome: Outcome) -> None:
        """The call the worker was on gets `outcome`; the calls after it in its chunk go back to the queue."""
        if w.outstanding:
            self._outcomes[w.outstanding.popleft()] = outcome
            self._pending.extendleft(reversed(w.outstanding))
            w.outstanding.clear()

    def _kill(self, w: _Worker) -> int | None:
        """Stop the worker and all it started (_stop), return its exit status."""
        return _stop(w.proc)

    def _death_reason(self, rc: int) -> str:
        if rc is None or rc >= 0:
            return f"the reward worker exited with code {rc} during the call (os._exit or a crash)"
        sig = -rc
        if sig == signal.SIGXCPU:
            return f"used more than {self._init['cpu_s']} s of CPU time (reward.cpu_s) and was killed"
        if sig == signal.SIGKILL:
            return "the reward worker was killed by SIGKILL during the call (out of memory?)"
        return f"the reward worker died of {signal.Signals(sig).name} during the call"


def _close_sock(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


_KINDS = {proto.OK, proto.FAIL, proto.READY, proto.INIT_ERROR, proto.BATCH, proto.RETIRE}


def _outcome(kind: int, payload: bytes) -> Outcome:
    """A call's outcome from its record; ValueError when the payload is not what its kind says."""
    if kind == proto.OK:
        if len(payload) != proto.VALUE.size:
            raise ValueError(f"a value of {len(payload)} bytes")
        return Outcome(proto.VALUE.unpack(payload)[0])
    if kind in (proto.FAIL, proto.RETIRE):
        return Outcome(None, payload.decode("utf-8", "replace")[:proto.MAX_MESSAGE])
    try:  # BATCH: json numbers and strings: data, never code
        items = [Outcome(None if v is None else float(v), None if e is None else str(e)[:proto.MAX_MESSAGE])
                 for v, e in json.loads(payload)]
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"a batch answer that is not a list of [value, message] pairs: {type(e).__name__}") from None
    return Outcome(None, items=items)


def _stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM the worker's keeper (it kills the worker and everything below it, then exits with the worker's
    status), wait for it; a keeper that does not exit in time has its process group SIGKILLed. Returns the
    exit status, None if even that did not end it (stuck in the kernel: the finalizer retries)."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=KEEPER_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc)
    try:
        return proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return None


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.returncode is not None:  # reaped: its pid may belong to another process by now
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def _kill_all(procs: dict[int, subprocess.Popen], spawner: ThreadPoolExecutor) -> None:
    """Finalizer (close, garbage collection, interpreter exit): no worker outlives its pool, nor anything
    it started (each keeper is asked first, all at once, then each is waited for)."""
    for proc in procs.values():
        if proc.returncode is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in procs.values():
        _stop(proc)
    procs.clear()
    spawner.shutdown(wait=False)
