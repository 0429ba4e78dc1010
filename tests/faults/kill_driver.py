"""The relayrl command line in this process, SIGKILLed by itself at a chosen point: how the fault suite
kills the driver at exact places (a test outside the process could only guess when a checkpoint is
half written).

    python kill_driver.py POINT N relayrl-arguments...

    rollout          the N-th rollout starts (mid-step: samples drawn, nothing trained)
    shards-written   the N-th checkpoint's DCP shards and index are on disk, its run state and
                     manifest are not (mid-checkpoint, in the temporary directory)
    before-rename    the N-th checkpoint's shards and run state are in its temporary directory; its
                     meta, manifest and the rename are not
    after-save       the N-th checkpoint is published; the step's evaluation and the next step are not run

The patches wrap relayrl's own functions where the run looks them up, so what runs up to the kill is
the unmodified code.
"""

from __future__ import annotations

import os
import signal
import sys


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _after(n: int, fn, *, before: bool):
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if before and calls["n"] == n:
            _die()
        out = fn(*args, **kwargs)
        if not before and calls["n"] == n:
            _die()
        return out

    return wrapped


def main() -> int:
    point, n, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    import torch.distributed.checkpoint as dcp

    import relayrl.checkpoint.distributed as ckpt_distributed
    import relayrl.roles.actor_workers as actor_workers
    import relayrl.rollout.source as source
    from relayrl.cli.main import main as cli

    if point == "rollout":
        source.LockstepSource.rollout = _after(n, source.LockstepSource.rollout, before=True)
    elif point == "shards-written":
        dcp.save = _after(n, dcp.save, before=False)
    elif point == "before-rename":
        ckpt_distributed.publish = _after(n, ckpt_distributed.publish, before=True)
    elif point == "after-save":
        actor_workers.save_actor = _after(n, actor_workers.save_actor, before=False)
    else:
        raise SystemExit(f"unknown kill point {point!r}")
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
