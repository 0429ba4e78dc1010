"""The relayrl command line in this process, its disk full from the N-th line written to metrics.jsonl on: that
write puts half its bytes on disk, then it and every later write to the file fail with ENOSPC, as a disk that
another process filled does (tests/faults/test_rundir_faults.py).

    python full_disk.py N relayrl-arguments...

The patch wraps os.write, which every write to the file goes through; what runs up to the fault is the
unmodified code.
"""

from __future__ import annotations

import errno
import os
import sys


def main() -> int:
    n, argv = int(sys.argv[1]), sys.argv[2:]
    real, calls = os.write, {"n": 0}

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.endswith("/metrics.jsonl"):
            calls["n"] += 1
            if calls["n"] >= n:
                if calls["n"] == n:
                    real(fd, bytes(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    os.write = write
    from relayrl.cli.main import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
