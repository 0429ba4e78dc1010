"""This module changes a live run's rollout fleet from outside it: `relayrl fleet RUN_DIR --replicas N`.

    relayrl fleet RUN_DIR --replicas N     writes RUN_DIR/fleet_request.json {"replicas": N, "id": ...} (atomically)
                                           and, with --wait S, follows RUN_DIR/fleet.json until N replicas serve
    the run, between two steps             reads the request once (by its id), resizes the fleet (RolloutFleet.resize:
                                           replicas started now join at a later sync once built; drained ones are
                                           closed at the next sync point), and writes RUN_DIR/fleet.json: each
                                           state's replicas, the fleet's size, losses, restarts, weights version
    relayrl fleet RUN_DIR                  prints RUN_DIR/fleet.json

On Ray, rollout.replicas_max grows the fleet by itself: between two steps, one replica more when the cluster has room
for it (a node joined; RolloutFleet.autoscale), up to that many; a request from the command sets that ceiling.
The trainer does not wait for a replica being added: its process builds the engine while steps run, and it joins
at the first weight sync after it is built. Only a run started as a fleet (rollout.replicas >= 2, or
rollout.replicas_max) has one to resize.

It may import every layer below the CLI, and it must never import relayrl.cli.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from relayrl.errors import UserError
from relayrl.jobs.run_dir import LOCK_FILE

REQUEST, STATUS = "fleet_request.json", "fleet.json"
POLL_S = 0.5


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> dict | None:
    """The file's object, or None: absent, or not (yet) a JSON object — it is data we did not necessarily write."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------------------- the run's side
def fleet_control(engine, run_dir: Path) -> None:
    """Between two steps: a new request applied, then the fleet's status written (a run without a fleet: nothing)."""
    from relayrl.roles.fleet import RolloutFleet  # here: the command's side loads no torch

    if not isinstance(engine, RolloutFleet):
        return
    run_dir = Path(run_dir)
    status = _read_json(run_dir / STATUS) or {}
    applied, error = status.get("request"), None
    request = _read_json(run_dir / REQUEST)
    if request is not None and request.get("id") != applied:
        applied = request.get("id")
        n = request.get("replicas")
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            error = f"ignored a fleet request of replicas={n!r}: it must be a whole number >= 1"
        elif not engine.losable:
            error = "ignored a fleet request: a colocated fleet's replicas are the trainer's ranks (its size is fixed)"
        else:
            engine.resize(n)
        if error is not None:
            engine.notice(error)
    engine.autoscale()  # rollout.replicas_max on Ray: one more replica when a node with room joined
    _write_json(run_dir / STATUS, {**engine.status(), "request": applied, "error": error, "time": time.time()})


# ---------------------------------------------------------------------------- the command's side
def live(run_dir: Path) -> bool:
    """Whether a job holds the run directory's lock now (relayrl.jobs.run_dir)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def read_status(run_dir: str | os.PathLike[str]) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a run directory")
    status = _read_json(run_dir / STATUS)
    if status is None:
        raise UserError(f"{run_dir} has no fleet status ({STATUS}): the run is not a rollout fleet "
                        "(rollout.replicas >= 2, or rollout.replicas_max) or has not begun its first step")
    return status


def describe(status: dict) -> str:
    parts = [f"{len(status.get(s, []))} {s}" for s in ("serving", "starting", "joining", "draining") if status.get(s)]
    return (f"size {status.get('size')}: {', '.join(parts) or 'none in service'}; lost {status.get('lost_total', 0)}, "
            f"restarted {status.get('restarts_total', 0)}; weights version {status.get('version')}")


def request_size(run_dir: str | os.PathLike[str], replicas: int, wait_s: float = 0.0,
                 say: Callable[[str], None] = print) -> dict:
    """Ask the live run in `run_dir` for `replicas` replicas; with wait_s, follow it until that many serve (one line
    per change) or the time is up (one line, UserError). Returns the last status read."""
    run_dir = Path(run_dir)
    if replicas < 1:
        raise UserError(f"--replicas must be at least 1, got {replicas}")
    status = read_status(run_dir)
    if not live(run_dir):
        raise UserError(f"no run is live in {run_dir}: a fleet's size changes while its run trains (resume it with "
                        f"relayrl train --resume {run_dir} rollout.replicas={replicas})")
    rid = uuid.uuid4().hex
    _write_json(run_dir / REQUEST, {"replicas": replicas, "id": rid, "time": time.time()})
    say(f"asked {run_dir} for {replicas} replica(s); now {describe(status)}")
    if wait_s <= 0:
        return status
    deadline, last, t0 = time.monotonic() + wait_s, None, time.monotonic()
    while True:
        status = _read_json(run_dir / STATUS) or status
        seen = status.get("request") == rid
        line = describe(status)
        if seen and line != last:
            say(f"{time.monotonic() - t0:5.1f}s  {line}")
            last = line
        if seen and status.get("error"):
            raise UserError(status["error"])
        if seen and len(status.get("serving", [])) == replicas and status.get("size") == replicas:
            return status
        if time.monotonic() >= deadline:
            raise UserError(f"{run_dir}: {replicas} replica(s) not serving after {wait_s:.0f}s ({line}); the "
                            "request stands, see relayrl fleet RUN_DIR")
        if not live(run_dir):
            raise UserError(f"the run in {run_dir} ended before {replicas} replica(s) served ({line})")
        time.sleep(POLL_S)
