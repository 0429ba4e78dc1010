"""This module steps a rollout fleet (relayrl.roles.fleet) as ONE StepEngine (relayrl.engine.protocols), so that the
rollout stream (relayrl.rollout.stream: rollout.mode one_step_off / async) runs over many engine replicas, each in a
rollout worker process of its own:

    rollout thread ── FleetStepper ──> add_request: routed at once (the fleet's Router, among the replicas in
                      (a StepEngine)       service), queued for its replica; sent with that replica's next advance
                                   ──> step(): every replica with work advances at once (a pool thread each), in ONE
                                       call per replica (RolloutWorker.advance: the new requests in, the aborted out,
                                       engine steps until a request finishes or ADVANCE_STEPS steps ran); the
                                       requests they finished come back together

Between two step() calls nothing runs in any replica, so a weight sync under the stream's pause (FleetWeightSync)
meets every engine between two of its steps, as it meets one engine; requests in flight across it keep the engines'
own `partial` behaviour (set on every replica). What a request samples does not depend on the replica or the batch it
runs in (its own seed); an advance's budget counts engine steps, not seconds, so a run does not depend on timing
either.

The staleness bound per replica (relayrl.rollout.stream bounds the engine's version at admission): a replica whose
weights are more than `staleness` syncs behind the newest any replica holds takes no new request and is not stepped
until a sync brings it up (its requests in flight wait, so none samples a token behind the bound); the others serve
meanwhile. A verified sync reaches every replica (their versions agree), so this matters when a replica joins late:
restarted after a fault, or added while the run goes on.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence

from relayrl.engine.outputs import RequestOutput
from relayrl.engine.sampling_params import SamplingParams
from relayrl.roles.fleet import RolloutFleet, wait_all
from relayrl.roles.rollout_worker import Advanced

# engine steps one advance may run without finishing a request: a replica whose requests are long does not hold the
# others (stepped in the same step()) for longer than this, and the stream admits new work at least this often
ADVANCE_STEPS = 8
IDLE_S = 0.005


def fresh_replicas(versions: Sequence[int], staleness: int) -> list[int]:
    """The replicas whose weights are within `staleness` syncs of the newest any replica holds: those that may take
    and run requests. Every verified sync moves each replica it reaches one version on, so the newest version is
    what the last sync wrote, and a replica at v >= newest - staleness samples no token older than the bound."""
    newest = max(versions)
    return [r for r, v in enumerate(versions) if v >= newest - staleness]


class FleetStepper:
    """The replicas of a fleet as one StepEngine (see the module docstring)."""

    def __init__(self, fleet: RolloutFleet, staleness: int, max_steps: int = ADVANCE_STEPS):
        if staleness < 0 or max_steps < 1:
            raise ValueError(f"a fleet stepper needs staleness >= 0 and max_steps >= 1, got {staleness}, {max_steps}")
        self.fleet, self.staleness, self.max_steps = fleet, staleness, max_steps
        self.tokenizer = fleet.tokenizer
        self._ids = itertools.count()
        self.placed: dict[int, tuple[int, int]] = {}  # request id -> (replica, its work), until it comes back
        self.new: dict[int, list[tuple[int, list[int], SamplingParams]]] = {}  # replica -> requests not yet sent
        self.running: dict[int, int] = {}  # replica -> requests it holds (sent, not come back)
        self._partial: str | None = None

    # ---- what every replica's engine does with requests in flight across a weight update ----
    @property
    def partial(self) -> str | None:
        return self._partial

    @partial.setter
    def partial(self, value: str | None) -> None:
        wait_all([self.fleet._pool.submit(role.set_partial, value) for role in self.fleet.replicas])
        self._partial = value

    # ---- StepEngine ----
    def in_service(self) -> list[int]:
        """The replicas that may take and run requests now: within the staleness bound (fresh_replicas)."""
        return fresh_replicas(self.fleet.versions, self.staleness)

    def add_request(self, prompt, params: SamplingParams, request_id: int | None = None) -> int:
        """Route the request now (its replica's load grows by its work); it reaches the replica with the next step()."""
        ids = self.fleet._ids(prompt)
        rid = next(self._ids) if request_id is None else request_id
        if rid in self.placed:
            raise ValueError(f"request id {rid} is already in flight on the fleet")
        work = len(ids) + params.n * params.max_tokens
        r = self.fleet.router.route(ids, work, among=self.in_service())
        self.placed[rid] = (r, work)
        self.new.setdefault(r, []).append((rid, ids, params))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.placed)

    def step(self) -> list[RequestOutput]:
        """Every replica in service that has work advances at once; the requests they finished, by replica."""
        serving = set(self.in_service())
        which = sorted(r for r in set(self.new) | {r for r, n in self.running.items() if n} if r in serving)
        if not which and self.placed:  # only replicas behind the bound hold work: wait for their sync, do not spin
            time.sleep(IDLE_S)
        done = self._advance(which, {})
        return [o for r in which for o in done[r].finished]

    def abort(self, request_ids: Iterable[int]) -> list[RequestOutput]:
        """Drop requests wherever they are (those not yet sent are sent and dropped at once); what they produced."""
        aborts: dict[int, list[int]] = {}
        for rid in request_ids:
            if rid in self.placed:
                aborts.setdefault(self.placed[rid][0], []).append(rid)
        which = sorted(aborts)
        done = self._advance(which, aborts, max_steps=0)
        return [o for r in which for o in done[r].aborted]

    def _advance(self, which: list[int], aborts: dict[int, list[int]], max_steps: int | None = None
                 ) -> dict[int, Advanced]:
        steps = self.max_steps if max_steps is None else max_steps
        sent = {r: self.new.pop(r, []) for r in which}
        futures = [self.fleet._pool.submit(self._advance_on, r, sent[r], aborts.get(r, []), steps) for r in which]
        done = dict(zip(which, wait_all(futures), strict=True))
        for r, out in done.items():
            self.running[r] = self.running.get(r, 0) + len(sent[r])
            for o in out.finished + out.aborted:
                _, work = self.placed.pop(o.request_id)
                self.fleet.router.done(r, work)
                self.running[r] -= 1
                self.fleet.tokens[r] += sum(len(s.token_ids) for s in o.samples)
            self.fleet.live[r] = {"queue": float(out.waiting), "running": float(out.running)}
        return done

    def _advance_on(self, r: int, new: list, aborts: list[int], steps: int) -> Advanced:
        t0 = time.perf_counter()
        try:
            return self.fleet.replicas[r].advance(new, aborts, steps)
        finally:
            self.fleet.busy[r] += time.perf_counter() - t0
