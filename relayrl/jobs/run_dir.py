"""One run per directory: the lock a job holds on its run directory (run.out_dir, sft.out_dir) while it writes
there, the directory's own faults in one line, and what a `--resume` may not change.

    with RunDirLock(run_dir, "train") as lock:   a directory that exists is locked at once: a live run in it is
        ...checks, nothing written...            refused (RunDirError naming its pid, host and start), before
        lock.create()                            anything is read or written; create() makes a new directory
        ...the run...                            (one line if it cannot: a file, read-only, full) and locks it
    check_resume_model(saved, cfg)               a --resume whose overrides change model.* (the checkpoints'
                                                 shape or source) is refused in one line
    disk_error(e, run_dir, then)                 a write failing for a full, read-only or quota'd disk: one line

The lock is `run.lock` in the directory, held with flock(2): the kernel drops it when the holder's process dies,
however it dies, so a lock left by a killed run is stale by construction and the next run takes it (its file
names the pid, host and start of the holder, for the refusal's line only). Only the driver holds it: the file is
opened close-on-exec (workers are spawned, reward and sandbox processes exec), and a process forked from the
driver closes its copy (os.register_at_fork), so a leftover child never keeps a directory locked. The holder
removes the file when it lets go; whoever locks checks that the file it locked is still the one at the path
(a file removed meanwhile is locked again), so two runs never hold two files of one name. A file system without
flock (some network mounts) is refused in one line rather than run unlocked.

It may import every layer below the CLI (it needs none but relayrl.errors and relayrl.controller's config), and
must never import relayrl.cli or the jobs that call it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Any

from relayrl.errors import RunDirError

LOCK_FILE = "run.lock"
# a write that failed for lack of room or permission on the run directory's file system: the user's to fix
DISK_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
               getattr(errno, "EDQUOT", errno.ENOSPC)}

_held: set[int] = set()  # this process's lock descriptors: a forked child closes its copies


def _close_in_child() -> None:
    for fd in list(_held):
        try:
            os.close(fd)  # a close, never an unlock: the lock is the parent's and stays with it
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunDirLock:
    """The exclusive lock of one job on `run_dir` (see the module docstring); `command` names the job in the
    refusal another run gets."""

    def __init__(self, run_dir: str | os.PathLike[str], command: str, key: str = "run.out_dir") -> None:
        self.run_dir = Path(run_dir)
        self.command = command
        self.key = key  # the setting that names the directory, for the lines that say to change it
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        check_not_file(self.run_dir, self.key)
        if self.run_dir.is_dir():
            self._take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def create(self) -> None:
        """Make the run directory (one line if it cannot be made) and lock it, if not locked yet."""
        if self._fd is not None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a dangling link, or a file made meanwhile
            raise RunDirError(f"{self.run_dir} exists and is not a directory: set {self.key} to a directory") from None
        except OSError as e:
            raise RunDirError(cannot_write(self.run_dir, e, self.key)) from e
        self._take()

    def _take(self) -> None:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise RunDirError(cannot_write(self.run_dir, e, self.key)) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunDirError(self._held_by(holder)) from None
                raise RunDirError(f"cannot lock {self.run_dir} ({e.strerror}): its file system does not offer "
                                  f"flock, so two runs could write it at once; set {self.key} to a local "
                                  "directory") from e
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its holder removed it as we opened it: lock the file that is there now
        self._fd = fd
        _held.add(fd)
        record = f"pid={os.getpid()} host={socket.gethostname()} started={time.strftime('%Y-%m-%dT%H:%M:%S%z')} " \
                 f"command={self.command}\n".encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
        except OSError as e:
            self.release()
            raise RunDirError(cannot_write(self.run_dir, e, self.key)) from e

    def _held_by(self, holder: dict[str, str]) -> str:
        who = f"pid {holder['pid']}" if "pid" in holder else "another process"
        if "host" in holder:
            who += f" on {holder['host']}"
        if "started" in holder:
            who += f", started {holder['started']}"
        what = f"relayrl {holder['command']}" if "command" in holder else "a run"
        return (f"{self.run_dir} is in use by {what} ({who}); one run writes a directory at a time: wait for it to "
                f"end (or stop it), or set {self.key} to another directory")

    def release(self) -> None:
        """Let go: the file goes first (while still locked), then the lock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _held.discard(fd)
        try:
            os.unlink(self.path)
        except OSError:
            pass  # a read-only remount: the lock file stays, free, and the next run takes it
        os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_holder(fd: int) -> dict[str, str]:
    """The holder's record (pid=, host=, started=, command=); {} while it is being written."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return {}
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def check_not_file(run_dir: Path, key: str = "run.out_dir") -> None:
    """A run directory that exists as something else (a file), or below a file, is one line."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} exists and is not a directory: set {key} to a directory (a new one, or a run's)")
    for parent in run_dir.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunDirError(f"{parent} is a file, so {run_dir} cannot be made in it: set {key} to a directory")
            return


def cannot_write(path: Path, e: OSError, key: str = "run.out_dir") -> str:
    where = e.filename or path
    why = {errno.EROFS: "its file system is read-only", errno.ENOSPC: "its disk is full",
           errno.EFBIG: "the file grew past the file-size limit", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied", getattr(errno, "EDQUOT", -1): "the disk quota is exceeded"}
    reason = why.get(e.errno, e.strerror or str(e))
    return f"cannot write {where}: {reason}; set {key} to a writable directory with free space"


def disk_error(e: BaseException, run_dir: Path, then: str) -> RunDirError | None:
    """The one-line error for `e` (or an OSError it was raised from) when it is the run directory's disk that
    failed a write (full, read-only, over quota, over the file-size limit), ending with `then` (what to do once
    the disk is fixed); None for any other error."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            if e.errno in (errno.EACCES, errno.EPERM) and not (e.filename and _under(e.filename, run_dir)):
                return None  # a permission refused elsewhere (a signal, another directory) is not the run directory's
            line = cannot_write(run_dir, e).rsplit(";", 1)[0]
            return RunDirError(f"{line}; free space (or make it writable), then {then}")
        e = e.__cause__ or e.__context__
    return None


def _under(path: str | os.PathLike[str], run_dir: Path) -> bool:
    try:
        Path(path).resolve().relative_to(run_dir.resolve())
        return True
    except ValueError:
        return False


def _flat(d: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}"))
    return out


def check_resume_model(saved: dict[str, Any], given: dict[str, Any]) -> None:
    """`saved`, `given`: the model sections (as dicts) of the run's config.yaml and of the resume's config. A
    change is refused: the checkpoints hold that model's weights, of its shape, from its source."""
    a, b = _flat(saved, "model"), _flat(given, "model")
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if changed:
        k = changed[0]
        raise RunDirError(f"--resume cannot change the model: {k} is {a.get(k)!r} in the run, {b.get(k)!r} given "
                          f"({len(changed)} model key(s) changed); its checkpoints hold that model's weights: drop "
                          "the model.* overrides, or start a new run in a new run.out_dir")
