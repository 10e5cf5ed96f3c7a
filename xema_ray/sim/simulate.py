"""Discrete-event simulation of the serving runtime (paper §9) driven by a plan table.

Requests arrive (Poisson, or a recorded trace), are queued and batched by the very
``Dispatcher`` the live ModelGroup uses, and each batch takes the plan's predicted latency
(profile store or cost model). A request meets its SLO when it finishes within
``slo_scale × base SLO`` of its arrival; a template with no plan (infeasible for that planner)
fails every request, as an OOM would.

With ``preemption`` the dispatcher may pause running batches for waiting ones (step-level
preemption, ``xema_ray.scheduling.preemption_policy``): a paused batch runs on to its next step boundary
(where its phase shares put it: after the text encoding, a step's share of the latency each; in
its last step or decode tail it is not paused but finishes, as on a worker), the
preempting batch starts then, and the paused one resumes when its workers are free, charged the
residency switches and the move of its state back from the host where it was offloaded (the move
out delays the preempting batch: the state leaves the device before that batch may start, as on a
worker).

A template whose plan hands its latents to a decode pool (``ExecutionConfig.decode``) runs as two
stages, both with the same ``Dispatcher``: its batch holds the group's DiT workers (the group's GPUs
less the pool's) until its last step (``scheduling.decode_stage.dit_stage_latency``), then each of
its requests queues for a decode worker of the pool's dispatcher (``<model>:decode``), keeping the
deadline it got at the door, and meets its SLO when its decode ends in time.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field

from xema_ray.plan import PlanTable
from xema_ray.profiling.phases import PhaseShares, phase_shares
from xema_ray.scheduling.admission import Refused
from xema_ray.scheduling.batch import Assignment, DispatchPlan
from xema_ray.scheduling.batch_key import DEFAULT_BATCH_POLICY, BatchKey, BatchPolicy, batch_seconds
from xema_ray.scheduling.decode_stage import decode_plans, dit_stage_latency, pool_size, pooled
from xema_ray.scheduling.dispatcher import Dispatcher

#: the pool dispatcher of a model group's decode stage is keyed by the model's name with this suffix
DECODE_SUFFIX = ":decode"
from xema_ray.scheduling.preemption_policy import Decision, PreemptionPolicy

#: a template whose phases are unknown: all of its latency is steps
_NO_PHASES = PhaseShares(text=0.0, denoise=1.0, decode_encode=0.0)
#: seconds a wake-up is set past a partial batch's wait-window end (float rounding, see the loop)
_WAKE_EPS = 1e-9


class Arrival(BaseModel):
    """One request of an arrival trace (seconds from the start)."""

    t: float = Field(ge=0)
    template: str = Field(description="RequestTemplate.shape_key")
    request_id: str = ""
    steps: int | None = Field(default=None, ge=1, description="its own denoising steps (None: the template's); "
                              "the dispatcher batches one step count and scales latency and SLO by it")
    guidance_scale: float | None = Field(default=None, description="its guidance scale (None: the model's default); "
                                         "a batch runs one call per guidance (``BatchKey``)")
    guidance_scale_2: float | None = Field(default=None, description="a two-expert model's low-noise expert guidance")

    def key(self, template_steps: int) -> BatchKey:
        """What its batch cannot mix (``template_steps``: its template's, where it names none)."""
        return BatchKey(steps=template_steps if self.steps is None else self.steps,
                        guidance=(self.guidance_scale, self.guidance_scale_2))


class TemplateStats(BaseModel):
    sent: int = 0
    met: int = 0
    failed: int = 0
    latencies_s: list[float] = Field(default_factory=list)


class SimResult(BaseModel):
    """Outcome of one simulated run."""

    duration_s: float
    sent: int
    met: int
    failed: int = Field(description="requests for templates the plan table cannot serve")
    attainment: float = Field(description="share of requests finishing within their SLO")
    goodput_rpm: float = Field(description="requests per minute finishing within their SLO")
    per_template: dict[str, TemplateStats]
    shed: int = Field(default=0, description="requests the admission policy refused or shed (counted as missed)")
    preemptions: int = Field(default=0, description="batches paused for another (step-level preemption)")
    decisions: list[Decision] = Field(default_factory=list, description="the preempt / resume decisions, in order "
                                      "(the latest dispatcher.MAX_DECISIONS_KEPT per model)")
    latency_by_request: dict[str, float] = Field(default_factory=dict, description="request id -> its latency (the "
                                                 "requests that finished; to compare with a live run request by request)")


def base_slos(table: PlanTable) -> dict[str, float]:
    """Each planned template's SLO at scale 1 (the table stores it at its planning scale)."""
    return {k: e.prediction.slo_s / table.slo_scale for k, e in table.entries.items()}


def template_weights(latent_lengths: dict[str, float], mix: str, alpha: float = 1.0) -> dict[str, float]:
    """Sampling weights per template: uniform, or the skewed mix of Figure 10
    (p_i ∝ exp(α L_i / L_max), L_i the template's latent length, ``RequestTemplate.latent_length``)."""
    if mix == "uniform":
        return {k: 1.0 for k in latent_lengths}
    if mix == "skewed":
        top = max(latent_lengths.values())
        return {k: math.exp(alpha * v / top) for k, v in latent_lengths.items()}
    raise ValueError(f"unknown mix {mix!r}; use 'uniform' or 'skewed'")


def poisson_arrivals(rate_per_min: float, duration_s: float, weights: dict[str, float], seed: int = 0) -> list[Arrival]:
    """Open-loop Poisson arrivals with templates drawn by ``weights``."""
    if rate_per_min <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate_per_min}/min for {duration_s} s")
    rng = random.Random(seed)
    keys = sorted(weights)
    w = [weights[k] for k in keys]
    out, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(rate_per_min / 60.0)
        if t >= duration_s:
            return out
        out.append(Arrival(t=t, template=rng.choices(keys, w)[0], request_id=f"r{i}"))
        i += 1


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """How ``simulate`` runs a trace: every field's default is an ideal front end on real GPUs,
    without preemption, under the table's admission policies."""

    #: the SLO is ``slo_scale`` x each template's base SLO
    slo_scale: float = 1.0
    #: base SLO per template (default: from the table); requests of templates missing from the
    #: table still need an SLO to count (they fail)
    slos: dict[str, float] | None = None
    #: the dispatcher's wait window for a partial batch
    wait_window_s: float = 0.05
    #: ``(template, n) -> seconds`` for a batch of n (default: the plan's prediction,
    #: ``latency_by_batch[n]`` for a partial batch)
    batch_latency: Callable[[str, int], float] | None = None
    #: fixed time each request spends outside its batch (HTTP, router, handles), measured on the live
    #: system; 0 models an ideal front end. A dict gives it per template (a video's bytes cost the
    #: front end more than an image's); templates it does not name get 0.
    overhead_s: float | dict[str, float] = 0.0
    #: None for real GPUs (each worker runs at full speed). On a CPU the workers are logical and share
    #: the cores: running batches then progress at ``min(1, shared_cores / busy workers)`` of full
    #: speed (processor sharing).
    shared_cores: float | None = None
    #: let the dispatcher pause running batches (``PreemptionPolicy`` with the table's budget and
    #: residency switch costs, ``max_preemptions`` per request, ``host_bytes`` of host memory per
    #: worker for paused state, None: unbounded)
    preemption: bool = False
    max_preemptions: int = 2
    host_bytes: int | None = None
    #: bytes/s of a paused state's move (None: ``PreemptionPolicy``'s default); an emulated box's clock
    #: runs ``time_scale`` times faster, and so do its moves
    host_bandwidth: float | None = None
    #: request id -> its own front-end time, measured live (replaces ``overhead_s`` for the requests it
    #: names): a loaded front end's tail, not its mean
    request_overhead_s: dict[str, float] | None = None
    #: apply the table's per-group admission policies (``PlanTable.admission``; refused and shed
    #: requests count as missed)
    admission: bool = True
    #: each template's phase shares (text, denoise, decode_encode), which the dispatcher's preemption
    #: and the paused batches' step boundaries follow, as the live model group's (default, with
    #: preemption: ``phase_shares(table)``)
    phases: Mapping[str, PhaseShares] | None = None
    #: what one batch may mix (``xema_ray.scheduling.batch_key``): each batch is priced as it runs,
    #: one call per key, as the live group runs it
    batching: BatchPolicy = DEFAULT_BATCH_POLICY
    #: seconds a preempting batch waits beyond its victims' step boundaries and state moves (the pause
    #: handshake: the pause call, the parked run's return, the group's event loop), measured live
    #: (``/v1/stats`` ``preemption.<model>.park_overhead``); 0: none
    park_overhead_s: float = 0.0


def simulate(table: PlanTable, arrivals: Sequence[Arrival], config: SimulationConfig = SimulationConfig()) -> SimResult:
    """Run ``arrivals`` through the table's plans, each model on its group's workers
    (``table.group_gpus``, else ``table.gpus``), residency switches charged where the table's
    group residency is per template."""
    return _Simulation(table, config).run(arrivals)


def _dispatchers(table: PlanTable, config: SimulationConfig,
                 shares: Mapping[str, PhaseShares]) -> dict[str, Dispatcher[None]]:
    """One dispatcher per model group, over its templates' dispatch plans, as the live groups'."""
    slos = dict(config.slos or base_slos(table))
    by_model: dict[str, dict[str, DispatchPlan]] = {}
    for k, e in table.entries.items():
        by_model.setdefault(e.config.template.model, {})[k] = DispatchPlan.of_entry(
            e, slo_s=slos[k] * config.slo_scale, shares=shares.get(k))

    def policy(model: str) -> PreemptionPolicy | None:
        if not config.preemption:
            return None
        r = table.residency.get(model)
        return PreemptionPolicy(budget_bytes=table.budget_bytes, host_bytes=config.host_bytes,
                                max_preemptions=config.max_preemptions,
                                switch_s=dict(r.switch_s) if r is not None and r.policy == "per_template" else {},
                                **({"host_bandwidth": config.host_bandwidth} if config.host_bandwidth is not None else {}))
    out: dict[str, Dispatcher[None]] = {}
    for m, p in by_model.items():
        entries = {k: e for k, e in table.entries.items() if e.config.template.model == m}
        workers, pool_gpus = pool_size(entries)
        out[m] = Dispatcher(p, workers=table.group_gpus.get(m, table.gpus) - pool_gpus,
                            wait_window_s=config.wait_window_s, max_queue=10**9, preemption=policy(m),
                            admission=table.admission.get(m) if config.admission else None, batching=config.batching)
        if workers:  # its decode pool: a batch of one per decode worker, no wait for a batch to fill
            out[m + DECODE_SUFFIX] = Dispatcher(decode_plans(entries), workers=workers, wait_window_s=0.0,
                                                max_queue=10**9)
    return out


class _ResidencySwitches:
    """Per-template residency: a worker whose last batch was another template first moves the
    blocks whose home differs (the planner's switch costs); a shared residency never switches."""

    def __init__(self, table: PlanTable) -> None:
        self._residency = table.residency
        self._last_template: dict[tuple[str, int], str] = {}

    def cost(self, model: str, template: str, workers: tuple[int, ...]) -> float:
        """Seconds before a batch of ``template`` may start on ``workers`` (the slowest worker's switch)."""
        r = self._residency.get(model)
        if r is None or r.policy != "per_template" or not r.switch_s:
            return 0.0
        cost = 0.0
        for w in workers:
            prev = self._last_template.get((model, w))
            if prev is not None and prev != template:
                cost = max(cost, r.switch_s.get(prev, {}).get(template, 0.0))
            self._last_template[(model, w)] = template
        return cost


class _Simulation:
    """One run's state: the dispatchers, the batches running and paused, and the tally."""

    def __init__(self, table: PlanTable, config: SimulationConfig) -> None:
        self.table = table
        self.config = config
        self.batch_latency = config.batch_latency or self._predicted
        # where each template's step boundaries fall: only a preempting dispatcher asks
        self.shares = (dict(config.phases) if config.phases is not None
                       else phase_shares(table) if config.preemption else {})
        self.disps = _dispatchers(table, config, self.shares)
        self.switches = _ResidencySwitches(table)
        self.model_of = {k: e.config.template.model for k, e in table.entries.items()}
        self.pooled = {k for k, e in table.entries.items() if pooled(e)}
        self.arrived_at: dict[str, float] = {}  # request id -> arrival (a pooled request's decode is counted from it)
        # a batch's own latency, and what was left of it when it (re)started: the work before that
        # (waiting for its victims to park, residency switches, state moves) runs first
        self.own: dict[tuple[str, int], tuple[float, float]] = {}
        self.paused_left: dict[tuple[str, int], float] = {}
        self.offloaded: dict[tuple[str, int], bool] = {}
        self.running: dict[tuple[str, int], tuple[float, int]] = {}  # (model, batch id) -> (work left s, workers)
        self.stats: dict[str, TemplateStats] = {}
        self.by_request: dict[str, float] = {}
        self.shed = 0

    def _predicted(self, template: str, n: int) -> float:
        e = self.table.entries[template]
        if template in self.pooled:
            return dit_stage_latency(e, n)
        return e.prediction.latency_by_batch.get(n, e.prediction.latency_s)

    def _tail(self, template: str) -> float:
        """What the DiT stage's deadline leaves for the decode (the DiT's SLO is the template's less it)."""
        from xema_ray.scheduling.decode_stage import decode_tail_s

        return decode_tail_s(self.table.entries[template])

    def _boundary_of(self, template: str, steps: int, latency: float, ran: float) -> float | None:
        """Where (seconds into its latency) a batch that ran ``ran`` parks: after its next step, if that
        step is not its last (a worker pauses only between steps); None: it finishes instead."""
        sh = self.shares.get(template, _NO_PHASES)
        text, step_s = latency * sh.text, latency * sh.denoise / steps
        k = 1 if ran < text else math.floor((ran - text) / step_s + 1e-9) + 1
        return text + k * step_s if k < steps else None

    @staticmethod
    def _move_s(d: Dispatcher[None], template: str) -> float:
        assert d.preemption is not None
        return d.preemption.move_s(d.plans[template].pause_bytes)

    def _start(self, m: str, a: Assignment[None], d: Dispatcher[None]) -> float:
        """Work (seconds at full speed) of a batch starting or resuming now."""
        key = (m, a.batch_id)
        if a.resume:  # its residency back, then its state from the host where it was moved there
            rest = self.paused_left.pop(key)
            self.own[key] = (self.own[key][0], rest)
            return (rest + self.switches.cost(m, a.template, a.workers)
                    + (self._move_s(d, a.template) if self.offloaded.pop(key, False) else 0.0))
        if m.endswith(DECODE_SUFFIX):  # one request's decode on a decode worker
            latency = d.plans[a.template].latency_s
            self.own[key] = (latency, latency)
            return latency
        wait = self._park_victims(m, a, d)
        plan = d.plans[a.template]

        def call_s(key: BatchKey, n: int) -> float:  # one call of n at the key's step count: the dispatcher's scaling
            return self.batch_latency(a.template, n) * (plan.for_steps(key.steps).latency_s / plan.latency_s
                                                        if plan.latency_s > 0 else 1.0)
        latency = batch_seconds([r.key for r in a.requests], call_s)  # one call per key, as the group runs them
        self.own[key] = (latency, latency)
        return wait + latency + self.switches.cost(m, a.template, a.workers)

    def _park_victims(self, m: str, a: Assignment[None], d: Dispatcher[None]) -> float:
        """Park the batches ``a`` preempts; the seconds until the last of them is out of its way:
        each runs on to its next step boundary, then parks (its state moved out first)."""
        wait = 0.0
        for pre in a.preempts:
            vkey = (m, pre.batch_id)
            left, _ = self.running[vkey]
            latency, at_start = self.own[vkey]
            victim = d.assignment(pre.batch_id)
            boundary = self._boundary_of(victim.template, max(1, victim.plan.steps), latency,
                                         latency - min(left, at_start))
            if boundary is None:
                wait = max(wait, left)  # already in its last step: it finishes instead
                continue
            wait = max(wait, left - latency + boundary + self.config.park_overhead_s
                       + (self._move_s(d, victim.template) if pre.offload else 0.0))
            del self.running[vkey]
            self.paused_left[vkey] = latency - boundary
            self.offloaded[vkey] = pre.offload
        return wait

    def _front_end_s(self, template: str, request_id: str) -> float:
        """Time a request spends outside its batch: its own, measured, else its template's."""
        c = self.config
        if c.request_overhead_s is not None and request_id in c.request_overhead_s:
            return c.request_overhead_s[request_id]
        return c.overhead_s.get(template, 0.0) if isinstance(c.overhead_s, dict) else c.overhead_s

    def _finish_done(self, now: float) -> None:
        """Complete every batch whose work is done, and count its requests' latencies."""
        for key, (left, _) in list(self.running.items()):
            if left <= 1e-9:
                del self.running[key]
                self.own.pop(key, None)
                a = self.disps[key[0]].complete(key[1])
                if a.template in self.pooled and not key[0].endswith(DECODE_SUFFIX):
                    # denoised: its requests' latents go to the pool, their deadlines kept
                    pool = self.disps[key[0] + DECODE_SUFFIX]
                    for r in a.requests:
                        self.arrived_at[r.request_id] = r.arrival
                        pool.submit(r.template, r.request_id, now, key=BatchKey(steps=1), deadline=r.deadline + self._tail(r.template))
                    continue
                for r in a.requests:
                    arrival = self.arrived_at.pop(r.request_id, r.arrival)
                    st = self.stats[r.template]
                    lat = now - arrival + self._front_end_s(r.template, r.request_id)
                    st.latencies_s.append(lat)
                    self.by_request[r.request_id] = lat
                    st.met += lat <= r.deadline - arrival + 1e-9

    def _arrive(self, arr: Arrival, now: float) -> None:
        """Submit one arrival to its model's dispatcher (a template with no plan fails it)."""
        st = self.stats.setdefault(arr.template, TemplateStats())
        st.sent += 1
        if arr.template not in self.model_of:
            st.failed += 1
            return
        try:
            d = self.disps[self.model_of[arr.template]]
            # the trace's front door, as the API for an HTTP request: no steps, its plan's own
            d.submit(arr.template, arr.request_id, now, key=arr.key(d.plans[arr.template].steps))
        except Refused:
            self.shed += 1

    def _dispatch(self, now: float, wakes: list[float]) -> None:
        """Start what every dispatcher releases now, and set its next wake-up."""
        for m, d in self.disps.items():
            for a in d.dispatch(now):
                self.running[(m, a.batch_id)] = (self._start(m, a, d), len(a.workers))
            self.shed += len(d.take_shed())
            w = d.next_wakeup(now)
            if w is not None:
                # a hair past the window's end: arrival + window can round below the sum the
                # dispatcher checks (now - arrival >= window), and a wake-up that finds the batch
                # not ready would strand it until the next unrelated event
                w += _WAKE_EPS
                if w > now and w not in wakes:
                    heapq.heappush(wakes, w)

    def run(self, arrivals: Sequence[Arrival]) -> SimResult:
        """The event loop: to the next batch end, arrival or wake-up, until none is left."""
        pending = sorted(arrivals, key=lambda a: a.t)
        nxt = 0
        wakes: list[float] = []
        now = 0.0
        inf = float("inf")
        while True:
            busy = sum(w for _, w in self.running.values())
            rate = 1.0 if self.config.shared_cores is None else min(1.0, self.config.shared_cores / max(1, busy))
            t_done = min((now + left / rate for left, _ in self.running.values()), default=inf)
            t_arr = pending[nxt].t if nxt < len(pending) else inf
            t_wake = wakes[0] if wakes else inf
            t = min(t_done, t_arr, t_wake)
            if t == inf:
                break
            for key, (left, w) in list(self.running.items()):
                self.running[key] = (left - (t - now) * rate, w)
            now = t
            if t == t_done:
                self._finish_done(now)
            elif t == t_arr:
                self._arrive(pending[nxt], now)
                nxt += 1
            else:
                heapq.heappop(wakes)
            self._dispatch(now, wakes)
        return self._result(arrivals, now)

    def _result(self, arrivals: Sequence[Arrival], now: float) -> SimResult:
        stats = self.stats
        sent = sum(s.sent for s in stats.values())
        met = sum(s.met for s in stats.values())
        duration = max((a.t for a in arrivals), default=0.0) or 1.0
        return SimResult(
            duration_s=now, sent=sent, met=met, failed=sum(s.failed for s in stats.values()),
            attainment=met / sent if sent else 0.0, goodput_rpm=met / duration * 60.0, per_template=stats,
            shed=self.shed, preemptions=sum(d.preemptions_total for d in self.disps.values()),
            decisions=[x for d in self.disps.values() for x in d.decisions], latency_by_request=self.by_request,
        )
