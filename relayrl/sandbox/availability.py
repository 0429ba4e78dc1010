"""This module says whether the sandbox can run on this machine, and if not, why, in one line.

`sandbox_available()` returns None when it can, else the reason: bwrap is not installed, is too old,
finds no Python the sandbox user may run, or the kernel refuses it namespaces. It answers from a
real probe (bwrap starting an interpreter that prints a known line), once per process.
`require_sandbox()` raises `SandboxUnavailable` with that reason, for config validation to call
before a run starts rather than at its first sandboxed reward.

It imports the standard library and relayrl.errors only, and must never import another relayrl layer.
"""

from __future__ import annotations

import functools
import os
import subprocess

from relayrl.errors import UserError
from relayrl.sandbox import bwrap, seccomp

INSTALL_HINT = "apt-get install bubblewrap"
# --size bounds the tmpfs mounts (bubblewrap 0.7), --disable-userns stops nested user namespaces (0.8)
_REQUIRED_OPTIONS = ("--add-seccomp-fd", "--size", "--disable-userns", "--as-pid-1", "--ro-bind-data", "--info-fd",
                     "--block-fd")


class SandboxUnavailable(UserError):
    """The code sandbox cannot run here: the message says what is missing and how to install it."""


def require_sandbox() -> None:
    reason = sandbox_available()
    if reason is not None:
        raise SandboxUnavailable(reason)


@functools.cache
def sandbox_available() -> str | None:
    """None if sandboxed runs work on this machine, else a one-line reason naming the fix."""
    path = bwrap.find_bwrap()
    if path is None:
        return f"the code sandbox needs bubblewrap (bwrap), which is not installed: {INSTALL_HINT}"
    try:
        options = bwrap.bwrap_options(path)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{path} does not run ({e}): reinstall it with {INSTALL_HINT}"
    missing = [opt for opt in _REQUIRED_OPTIONS if opt not in options]
    if missing:
        return (f"{path} is too old for the code sandbox (it lacks {', '.join(missing)}): "
                f"install bubblewrap 0.8 or newer ({INSTALL_HINT} on Debian 12 / Ubuntu 24.04)")
    try:
        seccomp.denied_numbers(seccomp.machine(), deny_unbounded_memory=True)
    except seccomp.UnsupportedArch as e:
        return f"{e}: the code sandbox cannot run on this machine"
    interpreter = bwrap.find_interpreter()
    if interpreter is None:
        return (f"no Python interpreter the sandbox user (uid {bwrap.SANDBOX_UID}) may run: this one lives under "
                f"a directory others cannot enter; install a system one (apt-get install python3)")
    return _probe(path, interpreter)


def _probe(path: str, interpreter: bwrap.Interpreter) -> str | None:
    """Start a real sandbox with the run's own command line; None if it printed what it should."""
    from relayrl.sandbox.limits import Limits

    code_r = os.memfd_create("relayrl-sandbox-probe", os.MFD_CLOEXEC)
    filter_r = os.memfd_create("relayrl-sandbox-seccomp", os.MFD_CLOEXEC)
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    try:
        os.write(code_r, b"print('sandbox ok')\n")
        os.lseek(code_r, 0, os.SEEK_SET)
        os.write(filter_r, seccomp.program(deny_unbounded_memory=True))  # the strictest filter a run gets
        os.lseek(filter_r, 0, os.SEEK_SET)
        os.write(block_w, b"1")  # the probe need not wait for a handle on its pid-1
        argv = bwrap.command(path, interpreter, Limits(), files={}, code_fd=code_r, info_fd=info_w, block_fd=block_r,
                              seccomp_fd=filter_r)
        drop = {"user": bwrap.SANDBOX_UID, "group": bwrap.SANDBOX_UID, "extra_groups": []} \
            if bwrap.drops_privileges() else {}
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={}, cwd="/",
                             pass_fds=(code_r, filter_r, info_w, block_r), stdin=subprocess.DEVNULL, **drop)
    except (OSError, subprocess.SubprocessError) as e:
        return f"bubblewrap cannot start here ({type(e).__name__}: {e})"
    finally:
        for fd in (code_r, filter_r, info_r, info_w, block_r, block_w):
            os.close(fd)
    if out.returncode == 0 and out.stdout == "sandbox ok\n":
        return None
    lines = (out.stderr or out.stdout).strip().splitlines()
    detail = lines[-1] if lines else f"exit status {out.returncode}"
    if "namespace" in detail.lower() or "operation not permitted" in detail.lower():
        return (f"bubblewrap cannot create the sandbox's namespaces here ({detail}): user namespaces are disabled "
                f"(sysctl user.max_user_namespaces / kernel.unprivileged_userns_clone) or refused by the container")
    return f"bubblewrap cannot start the sandbox here: {detail}"
