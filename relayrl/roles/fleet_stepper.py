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

The staleness bound per replica: only a replica that holds the newest weights any replica holds (what the last sync
wrote) takes a new request (serving_replicas says why not "within the bound of it"); one behind takes nothing new
until a sync brings it up, and runs on what it holds (it held the newest weights when it took them, so they stay
within the bound), while the others serve. A verified sync reaches every replica (their versions agree), so this
matters when a replica joins late: restarted after a fault, or added while the run goes on.

Faults and elastic replicas are the fleet's (relayrl.roles.fleet: its replicas' states): a replica the fleet does
not have in service takes no new request; one found lost in an advance is taken out of service (RolloutFleet.lose:
restarted at the next sync point, this being a driver thread) and what it held is routed again among the others,
from the tokens each had generated, as the replica's advances reported them (reroute: re-prefilled there, the
samples' seeded streams advanced past them, so every sample is the one it would have been); a draining replica
finishes what it holds (the fleet closes it at a sync point once it holds nothing: RolloutFleet.holding).

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relayrl.engine.outputs import RequestOutput
from relayrl.engine.sampling_params import SamplingParams
from relayrl.errors import RunFault
from relayrl.roles.fleet import RolloutFleet, settle
from relayrl.roles.rollout_worker import Advanced

# engine steps one advance may run without finishing a request: a replica whose requests are long does not hold the
# others (stepped in the same step()) for longer than this, and the stream admits new work at least this often
ADVANCE_STEPS = 8


def serving_replicas(versions: Sequence[int]) -> list[int]:
    """The replicas that may take a new request: those holding the newest weights any replica holds (every verified
    sync moves each replica it reaches one version on: the newest is what the last sync wrote).

    Why the newest and not "within the staleness bound of it": the stream admits batch j once the policy version S
    the engine holds has j <= S + eta, and every token of batch j must be sampled by a version >= j - eta; on one
    engine the version only grows after admission, so >= S holds. A request routed to a replica d syncs behind S
    would sample tokens trained up to eta + d versions later. A replica that falls behind after taking requests runs
    them on: it held the newest weights when it took them, and its version has not gone down since."""
    newest = max(versions)
    return [r for r, v in enumerate(versions) if v == newest]


@dataclass
class Placed:
    """A request from add_request until it comes back: its replica, its work (the router's load), what it is (to
    route it again if its replica is lost: its prompt as given, its ids, its params, and the tokens its samples
    generated so far, as the replica's advances reported them), and whether its replica has it yet."""

    replica: int
    work: int
    ids: list[int]
    params: SamplingParams
    prompt: object = None  # as the caller gave it (ids, or a string the replica's engine encodes); None: ids
    sent: bool = False
    prior: list | None = None  # per sample [token ids, logprobs, versions] generated so far
    carried: int = 0  # of those, the tokens it came to this replica with (generated on a lost one)

    def grow(self, delta: list[tuple]) -> None:
        if self.prior is None:
            self.prior = [([], [], []) for _ in delta]
        for (toks, lps, vs), (t, lp, v) in zip(self.prior, delta, strict=True):
            toks += t
            lps += lp
            vs += v

    @property
    def generated(self) -> int:
        return sum(len(t) for t, _, _ in self.prior) if self.prior else 0


class FleetStepper:
    """The replicas of a fleet as one StepEngine (see the module docstring)."""

    def __init__(self, fleet: RolloutFleet, max_steps: int = ADVANCE_STEPS, *, until_done: bool = False,
                 owner: bool = True):
        """until_done: an advance runs its replica's requests to the end (max_steps engine steps at most) instead of
        returning at the first one finished (the fleet's generate); owner: the stream's stepper, which tells the fleet
        what each replica holds (RolloutFleet.holding)."""
        if max_steps < 1:
            raise ValueError(f"a fleet stepper needs max_steps >= 1, got {max_steps}")
        self.fleet, self.max_steps, self.until_done = fleet, max_steps, until_done
        self.tokenizer = fleet.tokenizer
        self._ids = itertools.count()
        self.placed: dict[int, Placed] = {}  # request id -> where it is, until it comes back
        if owner:
            fleet.holding = self.holds  # a draining replica is closed only once it holds nothing

    # ---- what every replica's engine does with requests in flight across a weight update ----
    @property
    def partial(self) -> str | None:
        return self.fleet.partial

    @partial.setter
    def partial(self, value: str | None) -> None:
        self.fleet.set_partial(value)  # every replica in service now, and each that joins later

    # ---- which replicas work ----
    def in_service(self) -> list[int]:
        """The replicas that may take new requests: in service in the fleet (not lost, starting, joining or
        draining) and holding the newest weights (serving_replicas)."""
        serving = self.fleet.serving
        if not serving:
            return []
        return [serving[i] for i in serving_replicas([self.fleet.slots[r].role.weights_version for r in serving])]

    def holds(self, r: int) -> int:
        """Requests placed on replica r and not come back (sent to it or not yet)."""
        return sum(p.replica == r for p in self.placed.values())

    # ---- StepEngine ----
    def add_request(self, prompt, params: SamplingParams, request_id: int | None = None) -> int:
        """Route the request now (its replica's load grows by its work); it reaches the replica with the next step()."""
        ids = self.fleet._ids(prompt)
        rid = next(self._ids) if request_id is None else request_id
        if rid in self.placed:
            raise ValueError(f"request id {rid} is already in flight on the fleet")
        self.placed[rid] = self._route(ids, params, None if ids is prompt else prompt)
        return rid

    def _route(self, ids: list[int], params: SamplingParams, prompt=None, prior: list | None = None) -> Placed:
        work = len(ids) + params.n * params.max_tokens
        among = self.in_service()
        if not among:
            raise self.fleet.exhausted()
        carried = sum(len(t) for t, _, _ in prior) if prior else 0
        return Placed(self.fleet.router.route(ids, work, among=among), work, ids, params, prompt, prior=prior,
                      carried=carried)

    def has_unfinished(self) -> bool:
        return bool(self.placed)

    def step(self) -> list[RequestOutput]:
        """Every replica that holds work advances at once (a lost one holds none: reroute); the requests they
        finished, by replica."""
        which = sorted({p.replica for p in self.placed.values()})
        done = self._advance(which, {})
        return [o for r in sorted(done) for o in done[r].finished]

    def abort(self, request_ids: Iterable[int]) -> list[RequestOutput]:
        """Drop requests wherever they are (those not yet sent are sent and dropped at once); what they produced."""
        aborts: dict[int, list[int]] = {}
        for rid in request_ids:
            if rid in self.placed:
                aborts.setdefault(self.placed[rid].replica, []).append(rid)
        which = sorted(aborts)
        done = self._advance(which, aborts, max_steps=0)
        for rids in aborts.values():  # those whose replica was lost in this call were routed again: dropped here
            for rid in rids:
                p = self.placed.pop(rid, None)
                if p is not None:
                    self.fleet.router.done(p.replica, p.work)
        return [o for r in sorted(done) for o in done[r].aborted]

    # ---- a replica lost ----
    def reroute(self, r: int) -> int:
        """Replica r is lost (the fleet has it out of service), with what it held: every request placed on it (sent or
        not) is routed again among the replicas in service, resumed from the tokens it had reported (prior: its
        prompt and those re-prefilled, its samples' streams advanced past them): its own seed samples the same tokens
        under the same weights. Returns how many moved (counted in the fleet's figures: rerouted, reprefilled)."""
        moved = [rid for rid, p in self.placed.items() if p.replica == r]
        if moved and not self.in_service():
            raise self.fleet.exhausted()
        for rid in moved:  # (r's load left the router with it: RolloutFleet.lose cleared it)
            p = self.placed[rid]
            self.placed[rid] = self._route(p.ids, p.params, p.prompt, p.prior)  # resumed from what it generated
            self.fleet.reprefilled += p.generated
        self.fleet.rerouted += len(moved)
        return len(moved)

    def _advance(self, which: list[int], aborts: dict[int, list[int]], max_steps: int | None = None
                 ) -> dict[int, Advanced]:
        steps = self.max_steps if max_steps is None else max_steps
        sent: dict[int, list[tuple[int, list[int], SamplingParams]]] = {r: [] for r in which}
        for rid, p in self.placed.items():
            if p.replica in sent and not p.sent:
                prior = [tuple(x) for x in p.prior] if p.prior else None
                sent[p.replica].append((rid, p.ids if p.prompt is None else p.prompt, p.params, prior))
                p.sent = True
        done, failed = settle({r: self.fleet._pool.submit(self._advance_on, r, sent[r], aborts.get(r, []), steps)
                               for r in which})
        other = next((e for e in failed.values() if not isinstance(e, RunFault)), None)
        if other is not None:
            raise other
        for r, e in failed.items():  # lost: out of service, what it held routed again (sent with the next step)
            self.fleet.lose(r, e)
            self.reroute(r)
        for r, out in done.items():
            for o in out.finished + out.aborted:
                p = self.placed.pop(o.request_id)
                self.fleet.router.done(r, p.work)
                self.fleet.tokens[r] += sum(len(s.token_ids) for s in o.samples) - p.carried
            for rid, delta in (out.progress or {}).items():
                if rid in self.placed:
                    self.placed[rid].grow(delta)
            self.fleet.live[r] = {"queue": float(out.waiting), "running": float(out.running)}
        return done

    def _advance_on(self, r: int, new: list, aborts: list[int], steps: int) -> Advanced:
        t0 = time.perf_counter()
        try:
            return self.fleet.replicas[r].advance(new, aborts, steps, self.until_done)
        finally:
            self.fleet.busy[r] += time.perf_counter() - t0
