"""This module builds the bubblewrap command line that runs one program in the sandbox, and finds
the bwrap binary and a Python interpreter the sandbox may run.

What the sandbox sees (everything else of the host, /home, /root, /work, /etc, /tmp included, is
absent):

    /usr, /bin, /lib*      the host's, read-only (the interpreter and its shared libraries)
    <python prefix>        read-only, only when the interpreter lives outside /usr; its
                           site-packages/dist-packages are covered by empty read-only tmpfs mounts
    /proc                  a new procfs: it shows the sandbox's own pid namespace only
    /dev                   null, zero, random, urandom, tty, pts (read-only apart from those)
    /code/main.py          the program, read-only
    /sandbox               the working directory: a tmpfs of Limits.disk_mb holding the run's files
    /tmp, /dev/shm         tmpfs of Limits.disk_mb each
                           (each holds at most Limits.files files and directories where the host is root:
                           relayrl.sandbox.stage mounts them with nr_inodes=, which bwrap's --tmpfs cannot;
                           an unprivileged host gets bwrap's --tmpfs, whose inodes only the run's memory
                           cgroup bounds, where it has one)
    /                      bwrap's own tmpfs root, remounted read-only once the rest is in place

A seccomp filter (relayrl.sandbox.seccomp) holds every process: denied calls fail with EPERM.
Every namespace is new (user, pid, network, ipc, uts, cgroup): the only network is a loopback of
its own, and it cannot create further user namespaces. Its pid 1 is relayrl's launcher
(`relayrl.sandbox.launcher`), limited like the program and closed to it. The program runs in a new session
(--new-session: it cannot push keystrokes into a terminal), bwrap dies with its parent
(--die-with-parent), and the environment holds PATH, HOME and TMPDIR only.

Run as root, the host drops to uid/gid SANDBOX_UID before starting bwrap, because the kernel neither
enforces RLIMIT_NPROC for root nor lets a root-owned sandbox give the program another kernel uid.
That unprivileged bwrap then cannot enter directories closed to others (pyenv under /root), so the
interpreter is chosen among those every user can reach.

It imports the standard library only, and must never import another relayrl layer.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from relayrl.sandbox.limits import Limits

SANDBOX_UID = 65534  # "nobody": owns nothing on the host
WORK_DIR = "/sandbox"
CODE_PATH = "/code/main.py"
LAUNCHER_SOURCE = (Path(__file__).parent / "launcher.py").read_text()
STAGE_SOURCE = (Path(__file__).parent / "stage.py").read_text()
# Host directories the stage may hide (in its own mount namespace) under the run's tmpfs mounts
_STAGING_CANDIDATES = ("/srv", "/media", "/mnt", "/var/tmp", "/opt")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "TMPDIR": "/tmp"}
_TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # symlinks into /usr on merged-/usr systems


@dataclass(frozen=True)
class Interpreter:
    """A Python the sandbox runs: its real executable and the prefix directory bound read-only."""

    executable: str
    prefix: str


def find_bwrap() -> str | None:
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None)


def drops_privileges() -> bool:
    """Whether the host switches to SANDBOX_UID before starting bwrap (it does when it is root)."""
    return os.geteuid() == 0


@functools.cache
def bwrap_options(bwrap: str) -> frozenset[str]:
    """The options this bwrap accepts (its --help), so that an old one is refused by name."""
    out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    return frozenset(word for word in (out.stdout + out.stderr).split() if word.startswith("--"))


def find_interpreter() -> Interpreter | None:
    """The host's own interpreter if the sandbox user can reach it, else the system python3."""
    host_exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    candidates = [(host_exe, sys.base_prefix), ("/usr/bin/python3", "/usr"), ("/usr/local/bin/python3", "/usr/local")]
    for exe, prefix in candidates:
        real, prefix = os.path.realpath(exe), os.path.realpath(prefix)
        if not os.path.isfile(real) or not os.path.isdir(prefix) or not _is_under(real, prefix):
            continue
        if drops_privileges() and not (_others_can_reach(real) and _others_can_reach(prefix)):
            continue
        return Interpreter(real, prefix)
    return None


@functools.cache
def staging_dir(interpreter: Interpreter) -> str | None:
    """The host directory relayrl.sandbox.stage mounts the run's bounded tmpfs under, where the host is
    root and a probe of the stage succeeds; None where runs get bwrap's --tmpfs instead."""
    if not drops_privileges():
        return None
    bwrap = find_bwrap() or ""
    for candidate in _STAGING_CANDIDATES:
        if not os.path.isdir(candidate) or os.path.islink(candidate) or any(
                _is_under(os.path.realpath(p), candidate) for p in (interpreter.prefix, interpreter.executable, bwrap)):
            continue
        probe = [stage_interpreter(), "-I", "-S", "-c", STAGE_SOURCE, str(SANDBOX_UID), str(1 << 20), "16",
                 candidate, "--"]
        try:
            ok = subprocess.run(probe, capture_output=True, timeout=10, env={}, cwd="/").returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        return candidate if ok else None
    return None


def stage_interpreter() -> str:
    """The host's interpreter, which runs the stage as root before bubblewrap."""
    return os.path.realpath(sys.executable)


def staged(argv: list[str], limits: Limits, staging: str) -> list[str]:
    """`argv` (a bwrap command built with staging=) run through relayrl.sandbox.stage, which mounts the
    bounded tmpfs, drops to SANDBOX_UID itself and executes bwrap."""
    return [stage_interpreter(), "-I", "-S", "-c", STAGE_SOURCE, str(SANDBOX_UID),
            str(int(limits.disk_mb) * 1024 * 1024), str(int(limits.files)), staging, "--", *argv]


def command(bwrap: str, interpreter: Interpreter, limits: Limits, *, files: dict[str, int], code_fd: int,
            info_fd: int, block_fd: int, seccomp_fd: int, staging: str | None = None) -> list[str]:
    """The argv that runs the program in `code_fd` under `limits`, with each `files[name]` descriptor's
    content copied to /sandbox/name and the seccomp filter in `seccomp_fd` (relayrl.sandbox.seccomp)
    installed on pid 1. bwrap writes the child's host pid to `info_fd` and waits for one byte on
    `block_fd` before the program starts, so the host holds a handle on the sandbox first (and puts it
    in its memory cgroup). With `staging`, /sandbox, /tmp and /dev/shm are the tmpfs relayrl.sandbox.stage
    mounted there (run the argv through `staged`)."""
    tmpfs_bytes = str(int(limits.disk_mb) * 1024 * 1024)
    # --as-pid-1: the launcher, held to the limits, is the namespace's pid 1 (not bwrap's reaper, which is not)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox", "--clearenv"]
    for key, value in _ENV.items():
        argv += ["--setenv", key, value]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in _TOP_DIRS:
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    if not _is_under(interpreter.prefix, "/usr"):
        argv += ["--ro-bind", interpreter.prefix, interpreter.prefix]
    hidden = _package_dirs(interpreter.prefix)
    for path in hidden:
        argv += ["--tmpfs", path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if staging is not None:
        argv += ["--bind", f"{staging}/shm", "/dev/shm", "--bind", f"{staging}/tmp", "/tmp",
                 "--bind", f"{staging}/sandbox", WORK_DIR]
    else:
        argv += ["--size", tmpfs_bytes, "--tmpfs", "/dev/shm", "--size", tmpfs_bytes, "--tmpfs", "/tmp",
                 "--size", tmpfs_bytes, "--tmpfs", WORK_DIR]
    for name, fd in files.items():
        argv += ["--perms", "0644", "--file", str(fd), f"{WORK_DIR}/{name}"]
    argv += ["--ro-bind-data", str(code_fd), CODE_PATH]
    for path in ("/", "/dev", *hidden):  # non-recursive: the tmpfs mounted below these stay writable
        argv += ["--remount-ro", path]
    argv += ["--add-seccomp-fd", str(seccomp_fd)]
    argv += ["--chdir", WORK_DIR, "--info-fd", str(info_fd), "--block-fd", str(block_fd), "--"]
    # -E -s -S: no PYTHON* variables, no user site, no site module (so no .pth files, no site-packages);
    # -u: unbuffered, so output written before a kill is not lost in a buffer; -B: no __pycache__ in /sandbox.
    argv += [interpreter.executable, "-E", "-s", "-S", "-u", "-B", "-c", LAUNCHER_SOURCE]
    argv += [f"{name}={value}" for name, value in limits.rlimits().items()]
    argv.append(CODE_PATH)
    return argv


def check_file_name(name: str) -> str:
    """A files= key is a relative path inside the working directory: no '..', no absolute path."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\0" in name:
        raise ValueError(f"sandbox file name {name!r} must be a non-empty relative path")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"sandbox file name {name!r} may not contain empty, '.' or '..' parts")
    return name


def _package_dirs(prefix: str) -> list[str]:
    """Installed-package directories the sandbox must not see (it gets the standard library only)."""
    patterns = [f"{prefix}/lib/python3*/site-packages", f"{prefix}/lib/python3*/dist-packages",
                "/usr/lib/python3/dist-packages", "/usr/local/lib/python3*/dist-packages",
                "/usr/local/lib/python3*/site-packages"]
    found = {os.path.realpath(p) for pattern in patterns for p in glob.glob(pattern) if os.path.isdir(p)}
    return sorted(p for p in found if _is_under(p, "/usr") or _is_under(p, prefix))


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _others_can_reach(path: str) -> bool:
    """Whether a user owning nothing can open `path`: every directory on the way searchable by
    others, and the path itself readable (approximate: groups and ACLs are not consulted)."""
    p = Path(path)
    for parent in reversed(p.parents):
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(p).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))
