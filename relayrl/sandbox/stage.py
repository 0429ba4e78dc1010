"""This script runs on the host, as root, between relayrl and bubblewrap: it gives the run writable
directories whose file count is bounded, then drops to the sandbox user and executes bubblewrap.

bubblewrap's own --tmpfs takes a size (--size) but no inode count, and a tmpfs mounted without
nr_inodes= takes half the machine's pages in inodes: a program creating empty files fills the
kernel's slab at no cost to its disk_mb. So, where the host is root (and only there: an unprivileged
host cannot mount), this script

    unshare(CLONE_NEWNS) and makes every mount private   nothing it mounts is seen by the host
    mounts a small tmpfs on STAGING (a host directory it hides, in this namespace only), and below it
    one tmpfs per writable directory of the run:  size=<disk_mb>, nr_inodes=<files>, owned by the
    sandbox user                                 STAGING/sandbox, STAGING/tmp, STAGING/shm
    setgroups([]), setresgid, setresuid to the sandbox user, then exec bubblewrap, which binds them
    on /sandbox, /tmp and /dev/shm

The mounts live in this private mount namespace only, so they go away with the run's last process:
nothing is left to unmount. The host passes the source with -c; the host never imports this file to
run it.

    python -I -S -c <source> UID SIZE_BYTES FILES STAGING -- bwrap ARGS...

It must run on any Python 3.9+ and import the standard library only.
"""

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000
DIRS = {"sandbox": "0755", "tmp": "1777", "shm": "1777"}


def _mount(libc, source, target, fstype, flags, options):
    if libc.mount(source, target.encode(), fstype, flags, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def stage(uid, size, files, staging):
    """Mount the run's bounded tmpfs under `staging` in a new private mount namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    _mount(libc, b"tmpfs", staging, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,nr_inodes=16,mode=0755")
    for name, mode in DIRS.items():
        path = os.path.join(staging, name)
        os.mkdir(path)
        options = f"size={size},nr_inodes={files},mode={mode},uid={uid},gid={uid}"
        _mount(libc, b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, options.encode())


def main(argv):
    sep = argv.index("--")
    uid, size, files, staging = argv[1:sep]
    stage(int(uid), int(size), int(files), staging)
    if len(argv) == sep + 1:  # the probe: staging works here
        return
    os.setgroups([])
    os.setresgid(int(uid), int(uid), int(uid))
    os.setresuid(int(uid), int(uid), int(uid))
    os.execv(argv[sep + 1], argv[sep + 1:])


if __name__ == "__main__":  # as `python -c` runs it; importing this module on the host does nothing
    main(sys.argv)
