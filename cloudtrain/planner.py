"""Rank 0's decision at a due step: from everyone's observations to the `Decision` every rank
applies (cloudtrain.controller carries the observations and the decision between the ranks).

    planner = Planner(options, codecs, topo, cpu_per_element, config)
    decision = planner.decide(current, gathered, ran, took)

The interval's observations update a copy of the estimates (cloudtrain.estimates); the cost model
(cloudtrain.costs) of those estimates gives each region's rung and the pipeline's depth; the
quality guard (cloudtrain.guard) caps both from what the interval measured of the update; a plan
measured faster than the model's choice replaces it; and the zstd stage goes on per link where it
pays. The estimates and the guard travel with the decision, so every rank holds rank 0's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .config import CompressionConfig, ControllerOptions
from .costs import CostModel, faster_measured, plan_levels, plan_staleness, plan_zstd
from .estimates import Estimates, Interval, intra_guess, region_links
from .guard import QualityGuard
from .plan import Codecs, Plan, Rung, describe
from .shares import plan_shares
from .stats import STAGES
from .topology import Topology

FIRST_DECISION = 2
"""The first due step (the first step whose compute time was measured is step 1)."""

COMPRESSED_STAGES = tuple(s for s in STAGES if s != "allreduce")
"""The hierarchy's stages: what a compressed step spends on its packets."""


@dataclass(frozen=True)
class Current:
    """What a decision starts from: the plan in force and what is known."""

    rungs: list[int]
    streak: list[int]
    staleness: int
    estimates: Estimates
    guard: QualityGuard | None
    shard_numels: Sequence[int]
    shares: Sequence[int] | None = None
    """The batch shares planned last (cloudtrain.shares), with a global batch."""
    interval: int = 1
    """The steps from one decision to the next, in force now (Decision.interval)."""
    start: int = 0
    """The step the controller started at (an elastic run's is made at a quorum): its first
    steps' times are its peers' warm-up, not the plan's."""


@dataclass(frozen=True)
class Decision:
    """What rank 0 decided from the observations gathered at due step `step`; it takes effect at
    the next due step, on every rank alike."""

    step: int
    rungs: tuple[int, ...]
    streak: tuple[int, ...]
    staleness: int
    zstd: tuple[bool, ...]
    interval: int
    """Steps until the next decision."""
    reprobe: bool
    """The region leaders measure the links at the next gathering."""
    estimates: dict[str, Any]
    """Estimates.state_dict(): every rank holds rank 0's."""
    guard: dict[str, Any] | None
    """QualityGuard.state_dict()."""
    record: dict[str, Any]
    """The history entry: levels by name, links, budgets, the log text, the guard's notes."""
    shares: tuple[int, ...] | None = None
    """Each rank's share of the global batch (cloudtrain.shares), with one."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Decision:
        fields = {f.name: state[f.name] for f in dataclasses.fields(cls) if f.name != "shares"}
        for name in ("rungs", "streak", "zstd"):
            fields[name] = tuple(fields[name])
        shares = state.get("shares")  # (not in states saved before batch shares)
        fields["shares"] = None if shares is None else tuple(shares)
        return cls(**fields)


def _record(
    step: int,
    ladder: Sequence[Rung],
    names: Sequence[str],
    model: CostModel,
    plan: tuple[list[int], int, list[bool]],
    interval: Interval,
    notes: list[str],
) -> dict[str, Any]:
    rungs, staleness, zstd = plan
    levels = [
        describe(ladder[r]) + (" + zstd" if z else "") for r, z in zip(rungs, zstd, strict=True)
    ]
    budgets = [link.bandwidth * model.usable for link in model.links]
    text = (
        "plan "
        + ", ".join(
            f"{name}: {level} ({8 * link.bandwidth / 1e6:.1f} Mbit/s, budget {b / 1e6:.2f} MB/step)"
            for name, level, link, b in zip(names, levels, model.links, budgets, strict=True)
        )
        + f"; staleness {staleness}; compute {1000 * model.compute_time:.0f} ms/step"
    )
    return {
        "step": step,
        "rungs": list(rungs),
        "levels": levels,
        "bandwidth_Bps": [link.bandwidth for link in model.links],
        "budget_B": budgets,
        "compute_s": model.compute_time,
        "staleness": staleness,
        "zstd": list(zstd),
        # packets timed on arrival, by sender region (what shows packets that slowed)
        "arrivals": [len(a) for a in interval.arrivals],
        "text": text,
        "guard_notes": notes,
    }


def _no_lighter(
    rungs: Sequence[int], now: Sequence[int], ceilings: Sequence[int] | None
) -> tuple[list[int], list[int]]:
    """While the estimates are unsettled (Estimates.unsettled): `rungs`, where one is lighter
    than the rung in force `now`, raised to it (within the quality guard's `ceilings`), and no
    streak towards a lighter rung (what the estimates of before counted towards one does not
    carry over)."""
    held = [max(r, n) for r, n in zip(rungs, now, strict=True)]
    if ceilings is not None:
        held = [min(h, c) for h, c in zip(held, ceilings, strict=True)]
    return held, [0] * len(held)


class Planner:
    """Rank 0's decision logic (module docstring): what is fixed for the run."""

    def __init__(
        self,
        config: CompressionConfig,
        codecs: Codecs,
        topo: Topology,
        cpu_per_element: Sequence[float],
    ) -> None:
        self.options: ControllerOptions = config.controller
        self.codecs, self.topo, self.cpu_per_element = codecs, topo, list(cpu_per_element)
        self.zstd_choice = config.zstd  # None: decided per link (plan_zstd)
        self.pinned_staleness = config.staleness is not None  # the user's, not the guard's
        self.allowed_staleness: tuple[int, ...] = (
            (config.staleness,) if self.pinned_staleness else tuple(range(self.options.max_staleness + 1))
        )  # fmt: skip

    def plan_of(self, rungs: Sequence[int], staleness: int = 0, zstd: tuple = ()) -> Plan:
        return Plan(tuple(self.options.ladder[r] for r in rungs), staleness, zstd)

    def cpu_seconds(self, shard_numels: Sequence[int]) -> list[float]:
        total = sum(shard_numels)
        return [c * total for c in self.cpu_per_element]

    def seed(
        self, estimates: Estimates, guard: QualityGuard | None, shard_numels: Sequence[int]
    ) -> tuple[list[int], list[int], int]:
        """The first rungs, streaks and depth, from the active probe (estimates.region_links,
        written into `estimates`) at the assumed compute time (every rank alike)."""
        links = region_links(self.topo.links, self.topo.members, self.topo.shards)
        estimates.bandwidth = [link.bandwidth for link in links]
        estimates.rtt = [link.rtt for link in links]
        model = CostModel(
            links, self.options.initial_compute_s, shard_numels, self.options,
            self.cpu_seconds(shard_numels), codecs=self.codecs,
        )  # fmt: skip
        depths = self._guarded(model.useful_depths(self.allowed_staleness), guard)
        ceilings = None if guard is None else guard.ceilings
        rungs, streak, _ = plan_levels(model, depths=depths, ceilings=ceilings)
        return rungs, streak, plan_staleness(model, rungs, depths)

    def decide(
        self, step: int, now: Current, gathered: list[Any], ran: tuple, took: float
    ) -> Decision:
        """The plan from everyone's observations gathered at due step `step`, measured under the
        plan `ran` (rungs, staleness; `now` may have taken effect since). `took`: seconds the
        gathering took; the next decisions come that much further apart in steps (twice it, for
        the broadcast back), so that each has arrived when due."""
        opts = self.options
        interval = Interval.of(gathered, self.topo.members)
        est, stages, reprobe = self._observe(step, now, interval, ran)
        model = self._cost_model(est, stages, now.shard_numels, ran[0])
        depths = model.useful_depths(self.allowed_staleness)
        guard, notes = self._guard_step(now, model, interval, ran, depths)
        depths = self._guarded(depths, guard)
        ceilings = None if guard is None else guard.ceilings
        rungs, streak, _ = plan_levels(model, now.rungs, now.streak, depths, ceilings)

        def depth_for(rungs: Sequence[int]) -> int:
            # a shallower pipeline one step at a time: each change of depth applies two steps'
            # gradients at once (or none), so it should not flap
            return max(plan_staleness(model, rungs, depths), min(now.staleness - 1, max(depths)))

        staleness = depth_for(rungs)
        rungs, streak, staleness = self._measured_best(
            est, rungs, streak, staleness, ceilings, depths
        )
        held_note = None
        if est.unsettled:
            held, streak = _no_lighter(rungs, now.rungs, ceilings)
            if held != list(rungs):
                staleness = depth_for(held)
                held_note = (
                    f"{', '.join(describe(opts.ladder[r]) for r in rungs)} held at "
                    f"{', '.join(describe(opts.ladder[r]) for r in held)}: the estimates await "
                    "a re-probe (a step-time jump, or a low reading to confirm)"
                )
            rungs = held
        est.observe_zstd(interval, ran[0], opts.ewma)
        zstd = self._zstd(est, rungs, staleness, model)
        per_step = interval.step_s if interval.step_s is not None else model.compute_time
        every = max(opts.interval, min(math.ceil(2 * took / max(per_step, 1e-3)) + 1, 10_000))
        plan = (rungs, staleness, zstd)
        record = _record(step, opts.ladder, self.topo.regions, model, plan, interval, notes)
        if held_note is not None:
            record["held"] = held_note
        shares = None
        if now.shares is not None:  # with a global batch: the shares split it
            shares = plan_shares(sum(now.shares), est.throughput, now.shares)
            record["shares"] = list(shares)
        return Decision(
            step, tuple(rungs), tuple(streak), staleness, tuple(zstd), every, reprobe,
            est.state_dict(), None if guard is None else guard.state_dict(), record, shares,
        )  # fmt: skip

    def _observe(
        self, step: int, now: Current, interval: Interval, ran: tuple
    ) -> tuple[Estimates, dict[str, float], bool]:
        """The estimates in force updated with the interval's measurements (compute, throughput,
        links, the step under the plan `ran`, the stages), the stages they take, and whether a
        re-probe is asked."""
        opts, warm = self.options, step - now.start > FIRST_DECISION  # peers warming up
        est = now.estimates.copy()
        est.compute_s = interval.compute_s or est.compute_s or 1.0
        if warm:  # (the first steps' compute is slow to warm up: not the ranks' throughput)
            est.observe_throughput(interval, opts.ewma)
        reprobe = est.observe_links(interval, warm, self.topo.shards, opts.ewma, now.interval)
        # before the cost model is built: a plan in force that took twice its time drops the
        # times measured before (the plain all-reduce's too) and asks for a re-probe; in its
        # first interval a plan's steps are not its own yet
        due = step - now.start > FIRST_DECISION + opts.interval
        ran_step = interval.step_s if due else None
        reprobe |= est.observe_step((tuple(ran[0]), ran[1]), ran_step, opts.ewma)
        stages = interval.stages if warm else {}
        est.observe_stages(stages, opts.ewma)
        return est, stages, reprobe

    def _cost_model(
        self, est: Estimates, stages: dict[str, float], shard_numels: Sequence[int], ran: list[int]
    ) -> CostModel:
        """The cost model of the estimates. Compressed rungs also pay for the reduction inside
        regions (measured once they ran, until then estimated from the probed links inside
        regions) and for what the model of bytes and CPU leaves out (thread hand-offs,
        per-bucket latency): the difference between a compressed interval's measured time and
        its model, smoothed."""
        opts, links, cpu = self.options, est.links(), self.cpu_seconds(shard_numels)
        overhead = est.intra_s
        if overhead is None:  # until it is measured: from the probed links inside regions
            topo = self.topo
            overhead = intra_guess(topo.links, topo.members, topo.shards, shard_numels)
        compressed = sum(stages.get(k, 0.0) for k in COMPRESSED_STAGES)
        if compressed > 0 and not self.plan_of(ran).lossless:
            receivers = max(len(links) - 1, 1)
            modelled = overhead + max(
                self.codecs.step_nbytes(opts.ladder[r], shard_numels, receivers) / link.bandwidth
                + cpu[r]
                for r, link in zip(ran, links, strict=True)
            )
            est.observe_unmodelled(compressed, modelled, opts.ewma)
        lossy = overhead + (est.unmodelled_s or 0.0)
        extra = [0.0 if name == "none" else lossy for name, _ in opts.ladder]
        return CostModel(
            links, est.compute_s, shard_numels, opts, cpu, extra, est.allreduce_s, self.codecs
        )

    def rungs_for(
        self,
        est: Estimates,
        shard_numels: Sequence[int],
        guard: QualityGuard | None,
        current: Sequence[int] | None = None,
    ) -> list[int]:
        """The rungs the cost model picks from the estimates `est` alone, under the guard's
        ceilings, no measured plans, only the model (to check a run's plan against the true
        link). Without `current`: its pick afresh, no hysteresis. With the rungs in force as
        `current`: what decisions made one after another from them would settle on were `est`
        the truth - hysteresis included, which keeps a rung whose neighbour is not clearly
        better."""
        model = self._cost_model(est, {}, shard_numels, [0] * len(est.rtt))
        depths = self._guarded(model.useful_depths(self.allowed_staleness), guard)
        ceilings = None if guard is None else guard.ceilings
        if current is None:
            return plan_levels(model, depths=depths, ceilings=ceilings)[0]
        rungs, streak = list(current), [0] * len(current)
        for _ in range(self.options.patience + 1):  # a lighter rung waits `patience` decisions
            rungs, streak, _ = plan_levels(model, rungs, streak, depths, ceilings)
        return rungs

    def _guard_step(
        self, now: Current, model: CostModel, interval: Interval, ran: tuple, depths: Sequence[int]
    ) -> tuple[QualityGuard | None, list[str]]:
        """The quality guard's next state (a copy: the decision carries it), from what the links
        want and what the interval measured."""
        if now.guard is None:
            return None, []
        wanted, _, _ = plan_levels(model, now.rungs, now.streak, depths)
        wanted_staleness = plan_staleness(model, wanted, depths)
        guard = QualityGuard.from_state(now.guard.state_dict())
        opts = self.options
        notes = guard.decide(
            interval.quality, ran[0], ran[1], wanted, wanted_staleness, opts.quality_bound,
            opts.drift_bound, opts.patience,
        )  # fmt: skip
        return guard, notes

    def _guarded(self, depths: Sequence[int], guard: QualityGuard | None) -> tuple[int, ...]:
        """The pipeline depths the quality guard allows of `depths` (all of a pinned one)."""
        if guard is None or self.pinned_staleness:
            return tuple(depths)
        return tuple(d for d in depths if d <= guard.max_staleness) or (min(depths),)

    def _measured_best(
        self,
        est: Estimates,
        rungs: list[int],
        streak: list[int],
        staleness: int,
        ceilings: Sequence[int] | None,
        depths: Sequence[int],
    ) -> tuple[list[int], list[int], int]:
        """A rung that does not make the step faster is never taken - checked against what was
        measured, not only the model: the model's choice is replaced by a plan measured more than
        5 % faster than the choice was measured to be (Estimates.measured_steps), among the plans
        the quality guard allows."""
        allowed = {
            plan: m
            for plan, m in est.measured_steps.items()
            if ceilings is None
            or (all(r <= c for r, c in zip(plan[0], ceilings, strict=True)) and plan[1] in depths)
        }
        best = faster_measured(allowed, (tuple(rungs), staleness))
        if best is None:
            return rungs, streak, staleness
        return list(best[0]), [0] * len(rungs), best[1]

    def _zstd(
        self, est: Estimates, rungs: list[int], staleness: int, model: CostModel
    ) -> list[bool]:
        """The zstd stage per link at the rungs chosen (plan_zstd), from the smoothed gains."""
        regions = len(rungs)
        if self.zstd_choice is not None:  # the config says
            return [self.zstd_choice] * regions
        if staleness == 0 and self.plan_of(rungs).lossless:
            return [False] * regions  # one plain all-reduce: no packets to compress
        return plan_zstd([est.zstd_gains.get((r, rungs[r])) for r in range(regions)], model.links)
