"""The adaptive controller: each region's shard owners compress exactly as much as their link
needs, fast links not at all, and never more than the model keeps its quality under.

Every `interval` steps, all ranks' observations (cloudtrain.stats.Observations) are gathered on
rank 0, which updates its estimates of the links and costs (cloudtrain.estimates), asks the cost
model for each region's rung and the pipeline's depth (cloudtrain.costs), lets the quality guard
cap both (cloudtrain.guard), prefers a plan measured faster than the model's choice, and chooses
the zstd stage per link; the `Decision` is broadcast, so every rank uses the same plan - and so
knows every packet's size. Hysteresis keeps the plan from flapping: more compression at once when
the current rung no longer fits, less only after `patience` decisions in a row in which a lighter
rung fits with `margin` to spare.

Gathering and broadcasting cross regions (round trips of their own: about a second at 180 ms),
so they run on a background thread on process groups of the controller's own, and a decision
takes effect at the next due step; the steps between decisions grow to twice what the last
gathering took, so it has arrived by then. Its interface to the hook is narrow: `due(step)`,
then `decide(step, observations, shard_numels)` -> Plan. CPU time per rung is timed once at start;
each change of plan is logged, and `metrics()` feeds TensorBoard where it is installed.

The zstd stage (lossless, level 1) goes on per link, after the rung is chosen, where the link
time it saves beats the CPU it costs (`costs.plan_zstd`): once per interval each shard owner tries
it on a sample of its own packet at the rung it sends with.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from .collectives import CommError, collective_failure
from .config import CompressionConfig, ControllerOptions
from .costs import bandwidth_in_range
from .estimates import (
    BURST_BYTES,
    Estimates,
    time_rungs,
)
from .guard import QualityGuard
from .plan import Codecs, Plan, describe
from .planner import FIRST_DECISION, Current, Decision, Planner
from .probe import MIN_TRANSFER_S
from .shares import SHARE_LEAD, BatchShares
from .stats import Observations, Scalars
from .topology import Topology

log = logging.getLogger("cloudtrain")


def calibrate(
    codecs: Codecs,
    options: ControllerOptions,
    shard_numels: Sequence[int],
    senders: int,
    device: Any = "cpu",
) -> list[float]:
    """CPU seconds per shard element of each rung of the ladder, timed on this rank
    (estimates.time_rungs) on a shard of the model's size (at most 1 M elements)."""
    numel = max(1, min(sum(shard_numels), 1 << 20))
    return time_rungs(codecs, options.ladder, numel, senders, device)


def reprobe_start_bytes(est: Estimates, shards: int) -> int:
    """The size a re-probe's timed messages start at: what shows the slowest link as estimated
    (MIN_TRANSFER_S or two round trips of it, its `shards` owners' share together; never under
    BURST_BYTES: smaller messages ride tbf-like token buckets at line rate; at most 16 MiB).
    Sized so even where the estimates are unsettled: starting at BURST_BYTES there, and letting
    the warm-up size the rest, took the drop scenario's re-probes at 0 ms from 4.6 s to
    0.8-1.7 s, but at 80 ms one took 5.4 s and they read a 100 Mbit/s link at 63-70 (the
    demo); the growth from a warm-up in slow start costs round trips."""
    shows = est.slowest * shards * max(MIN_TRANSFER_S, 2 * max(est.rtt))
    return int(min(max(shows, BURST_BYTES), 1 << 24))


class Controller:
    """Plans levels for CloudDDP's "auto" config (module docstring)."""

    def __init__(
        self,
        config: CompressionConfig,
        topo: Topology,
        codecs: Codecs,
        shard_numels: Sequence[int],
        device: Any = "cpu",
        shares: BatchShares | None = None,
        *,
        calibration: Sequence[float] | None = None,
        own: Topology | None = None,
        start: int = 0,
    ) -> None:
        """`shares`: with a global batch, the schedule of batch shares the decisions write. An
        elastic run's controller of the regions present (cloudtrain.elastic.ElasticSteps) is
        given the CPU seconds per element of each rung agreed by the regions (`calibration`;
        else timed on rank 0 now), `own`, a topology whose "control" group is the decisions'
        alone (else made now: Topology.private), and the step it starts at (`start`)."""
        self.options: ControllerOptions = config.controller
        self._timeout = (  # the decisions' groups' (an elastic run makes its own per quorum)
            (config.elastic.exchange_timeout_s, "elastic.exchange_timeout_s")
            if config.elastic is not None
            else (config.timeout_s, "CompressionConfig.timeout_s")
        )
        self.shares = shares
        self.codecs, self.topo = codecs, topo
        regions = len(topo.regions)
        self.estimates = Estimates.start(regions)
        self.rungs, self.streak = [0] * regions, [0] * regions
        self.zstd = [config.zstd is True] * regions
        self.first_zstd = tuple(self.zstd)  # the start-up plan's zstd stage (the config's)
        self.staleness = config.staleness or 0
        self.guard = (
            QualityGuard.start(self.options.ladder, regions)
            if self.options.quality_bound is not None
            else None
        )
        self.history: list[dict[str, Any]] = []
        self._scalars = (
            Scalars(self.options.tensorboard_dir)
            if self.options.tensorboard_dir is not None and topo.rank == 0
            else None
        )
        self.reprobe = False  # the links are re-probed at the next decision
        self.probe_sent = 0  # bytes this rank sent re-probing, not yet taken into CommStats
        if calibration is None:
            calibration = self._calibrate(shard_numels, device)
        self.planner = Planner(config, codecs, topo, calibration)
        # decisions are gathered and made on a thread of their own (decide)
        self.own = own or topo.private(("control",), config.timeout)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cloudtrain-plan")
        self._pending: concurrent.futures.Future | None = None
        self.start = start
        self.next_due, self.interval = start + FIRST_DECISION, self.options.interval
        if topo.links is not None:
            seeded = self.planner.seed(self.estimates, self.guard, shard_numels)
            self.rungs, self.streak, self.staleness = seeded
        self.first_rungs = tuple(self.rungs)  # the plan in force until the first decision lands

    def _calibrate(self, shard_numels: Sequence[int], device: Any = "cpu") -> list[float]:
        """CPU seconds per shard element of each rung (estimates.time_rungs), timed on rank 0 and
        broadcast (all ranks call)."""
        per_element: list[Any] = [None]
        if self.topo.rank == 0:
            senders = len(self.topo.regions)
            per_element[0] = calibrate(self.codecs, self.options, shard_numels, senders, device)
        dist.broadcast_object_list(per_element, src=0, group=self.topo.group("control"))
        return per_element[0]

    # -- decisions (all ranks call, rank 0 decides) ----------------------------------------------
    def plan(self) -> Plan:
        """The plan of the current rungs and pipeline depth."""
        zstd = tuple(self.zstd) if any(self.zstd) else ()
        return self.planner.plan_of(self.rungs, self.staleness, zstd)

    def due(self, step: int) -> bool:
        """Whether `step` starts with a decision (all ranks then call `decide`)."""
        return step >= self.next_due

    def decide(
        self,
        step: int,
        seen: Observations,
        shard_numels: Sequence[int],
        wan_bytes_sent: int = 0,
        quiet: Callable[[], None] | None = None,
    ) -> Plan:
        """All ranks call at a due step, with what each saw since the last one. The decision
        started at the previous due step takes effect now (waited for, if it is still on its
        way), and the next one starts from `seen`: gathered, decided on rank 0 and broadcast on
        a background thread, on process groups of the controller's own, so its round trips
        across regions do not hold a step up. Every rank returns the same plan.

        When the decision asked for a re-probe, the links are measured first, on this thread
        and by every rank (the first and last ranks of each region measure its link each way;
        the others wait in the probe's collective): `quiet` finishes the exchanges in flight,
        so the probe is the one flow on the link - it measures the link, not what training
        leaves of it. This holds the step up for the probe's seconds."""
        ran = (list(self.rungs), self.staleness)  # the plan `seen` was measured under
        if self._pending is not None:
            decision, self._pending = self._pending.result(), None  # a failure raises here
            self._apply(step, decision)
        mine: dict[str, Any] = {
            "compute": list(seen.compute_s),
            "steps": list(seen.step_s),
            "received": dict(seen.arrivals),
            "stage_seconds": dict(seen.stage_s),
            "zstd": list(seen.zstd),
            "samples": list(seen.samples),
        }
        if seen.quality is not None and seen.quality.steps:
            mine["quality"] = dataclasses.astuple(seen.quality)
        if self.reprobe:
            if quiet is not None:
                quiet()
            t0 = time.perf_counter()
            probed = self._reprobe()
            if self.topo.rank == 0:
                mine["probed"], mine["probe_s"] = probed, time.perf_counter() - t0
        self._pending = self._pool.submit(self._gather, step, mine, list(shard_numels), ran)
        self.next_due = step + self.interval
        self._write_metrics(step, wan_bytes_sent)
        return self.plan()

    def _gather(
        self, step: int, mine: dict[str, Any], shard_numels: list[int], ran: tuple
    ) -> Decision:
        """On the controller's thread: everyone's observations to rank 0, its decision back."""
        t0 = time.perf_counter()
        gathered: list[Any] = [None] * self.topo.world_size
        group = self.own.group("control")
        with self._lost_peer("the decision's gathering", step, t0):
            dist.all_gather_object(gathered, mine, group=group)
        decision: list[Any] = [None]
        if self.topo.rank == 0:
            took = time.perf_counter() - t0
            now = Current(
                self.rungs, self.streak, self.staleness, self.estimates, self.guard, shard_numels,
                None if self.shares is None else self.shares.latest, self.interval, self.start,
            )  # fmt: skip
            decision[0] = self.planner.decide(step, now, gathered, ran, took)
        with self._lost_peer("the decision's broadcast", step, t0):
            dist.broadcast_object_list(decision, src=0, group=group)
        return decision[0]

    @contextlib.contextmanager
    def _lost_peer(self, what: str, step: int, t0: float) -> Iterator[None]:
        """A collective of the decisions across regions: a peer lost in it is a CommError (an
        elastic run's step then fails, not the run: cloudtrain.elastic)."""
        try:
            yield
        except Exception as e:
            ranks = list(range(self.topo.world_size))
            text = collective_failure(
                what, ranks, self.topo.rank, f" at step {step}", time.perf_counter() - t0, e,
                timeout_s=self._timeout[0], knob=self._timeout[1],
            )  # fmt: skip
            raise CommError(text) from e

    def _reprobe(self) -> list[list[float]]:
        """A brief measurement of the links between regions (all ranks call; no gathering in
        flight), each way between every two regions at once as at start-up: bandwidth by
        region. It starts at reprobe_start_bytes, and every rank waits for it, so none sends
        across regions while it runs."""
        topo = self.topo
        with self._lost_peer("the links' re-probe", self.next_due, time.perf_counter()):
            links = topo.measure(
                self.own.group("control"), "links re-probed", across=True, repeats=2,
                start_bytes=reprobe_start_bytes(self.estimates, topo.shards),
            )  # fmt: skip
        self.probe_sent += links.sent  # taken by the hook between steps (take_probe_sent)
        leaders = [m[0] for m in topo.members]
        return [[links.beta[la][lb] for lb in leaders] for la in leaders]

    def _apply(self, step: int, decision: Decision) -> None:
        changed = (
            list(decision.rungs) != self.rungs
            or decision.staleness != self.staleness
            or list(decision.zstd) != self.zstd
        )
        self.rungs, self.streak = list(decision.rungs), list(decision.streak)
        self.staleness, self.zstd = decision.staleness, list(decision.zstd)
        self.interval, self.reprobe = decision.interval, decision.reprobe
        self.estimates = Estimates.from_state(decision.estimates)
        if decision.guard is not None:
            self.guard = QualityGuard.from_state(decision.guard)
        self.history.append({**decision.record, "applied": step})  # in force from `step`
        shared = (
            self.shares is not None
            and decision.shares is not None
            and self.shares.change(step, decision.shares)
        )
        if self.topo.rank != 0:  # one line per change, not one per rank
            return
        if shared:
            rates = ", ".join(f"{t:.0f}" for t in self.estimates.throughput)
            log.warning(
                "cloudtrain: step %d: batch shares %s from step %d (samples/s by rank: %s)",
                step, list(decision.shares), step + SHARE_LEAD, rates,
            )  # fmt: skip
        for note in decision.record.get("guard_notes", ()):
            log.warning("cloudtrain: step %d: quality guard: %s", step, note)
        if "held" in decision.record:
            log.warning("cloudtrain: step %d: %s", step, decision.record["held"])
        if changed:
            log.warning(
                "cloudtrain: step %d: %s (decided from the steps before %d)",
                step,
                decision.record["text"],
                decision.step,
            )

    def take_probe_sent(self) -> int:
        """Bytes this rank sent re-probing the links since the last call (for CommStats)."""
        sent, self.probe_sent = self.probe_sent, 0
        return sent

    def settle(self) -> None:
        """Wait until the decision on its way has crossed (its gather and broadcast, which every
        rank has started, complete); it still takes effect at the next due step and its error,
        if any, is raised there. Its collectives must not meet destroyed process groups."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        if self._scalars is not None:
            self._scalars.close()

    # -- state and metrics -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        pending = None if self._pending is None else self._pending.result()
        return {
            "estimates": self.estimates.state_dict(),
            "rungs": list(self.rungs),
            "streak": list(self.streak),
            "staleness": self.staleness,
            "zstd": list(self.zstd),
            "next_due": self.next_due,
            "interval": self.interval,
            "reprobe": self.reprobe,
            "pending": None if pending is None else pending.state_dict(),
            "history": list(self.history),
            "first_rungs": list(self.first_rungs),
            "guard": None if self.guard is None else self.guard.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._pending is not None:  # a decision on its way: let it land first
            self._pending.result()
        if len(state["rungs"]) != len(self.rungs):
            raise ValueError("controller state is for another number of regions")
        self.estimates = Estimates.from_state(state["estimates"])
        self.rungs, self.streak = list(state["rungs"]), list(state["streak"])
        self.staleness, self.zstd = int(state["staleness"]), [bool(z) for z in state["zstd"]]
        self.next_due, self.interval = int(state["next_due"]), int(state["interval"])
        self.reprobe = bool(state["reprobe"])
        self._pending = None
        if state["pending"] is not None:  # the decision on its way when it was saved
            pending = Decision.from_state(state["pending"])
            ranks = None if self.shares is None else self.shares.ranks
            if pending.shares is not None and len(pending.shares) != ranks:
                # saved with another number of ranks: their shares start equal again
                # (BatchShares.load_state_dict) and are planned anew from what they measure
                pending = dataclasses.replace(pending, shares=None)
            self._pending = concurrent.futures.Future()
            self._pending.set_result(pending)
        self.history = list(state["history"])
        # (states saved before 2026-12 have no first_rungs: this process's start-up plan stands)
        self.first_rungs = tuple(state.get("first_rungs", self.first_rungs))
        if self.guard is not None and state.get("guard") is not None:
            self.guard = QualityGuard.from_state(state["guard"])

    def snapshot(self) -> dict[str, Any]:
        """What the controller believes and decided last, by region name: the link estimates,
        the plan in force, and the quality guard's measurements and ceilings (the same on every
        rank: decisions are broadcast). For CloudDDP.stats()."""
        names, ladder, est = self.topo.regions, self.options.ladder, self.estimates
        out: dict[str, Any] = {
            "links": {
                name: {
                    "bandwidth_mbit": None if b is None else 8 * b / 1e6,  # one sender's share
                    "senders": self.topo.shards,  # the region's shard owners, sending at once
                    "rtt_ms": 1000 * rtt,
                }
                for name, b, rtt in zip(names, est.bandwidth, est.rtt, strict=True)
            },
            "plan": {
                name: describe(ladder[r]) + (" + zstd" if z else "")
                for name, r, z in zip(names, self.rungs, self.zstd, strict=True)
            },
            "staleness": self.staleness,
            # decisions since the links were last probed, and between re-probes now
            "probed": {
                "decisions_ago": est.since_probe,
                "every": max(est.probe_every, est.affordable(self.interval)),
                # a re-probe's low reading waiting for the next re-probe to confirm it
                "unconfirmed_fall": {
                    name: 8 * f / 1e6 for name, f in zip(names, est.fall, strict=True) if f is not None
                },
                # a step-time jump or a low reading awaits a re-probe: no lighter rung until then
                "unsettled": est.unsettled,
            },
            "guard": None if self.guard is None else self.guard.snapshot(names, ladder),
            "throughput": {
                "by_rank": list(est.throughput),
                "by_region": {
                    name: None if any(est.throughput[r] is None for r in ranks) else
                    sum(est.throughput[r] for r in ranks)
                    for name, ranks in zip(names, self.topo.members, strict=True)
                } if len(est.throughput) == self.topo.world_size else {},
            },  # samples per second of compute
            "batch_shares": None if self.shares is None else list(self.shares.latest),
        }  # fmt: skip
        return out

    def plan_for_links(
        self,
        links: Mapping[str, tuple[float, float]],
        shard_numels: Sequence[int],
        from_plan: bool = False,
    ) -> dict[str, str]:
        """By region name: the rung the cost model picks, under the guard's ceilings, were each
        region's link (`links[name]`: Mbit/s, round trip in ms - the whole link, which the
        region's shard owners share as they do in the estimates) as given and everything else as
        measured (Planner.rungs_for): to check the plan in force against a known link.
        `from_plan`: what decisions from the plan in force would settle on (with hysteresis),
        rather than the pick afresh."""
        missing = [name for name in self.topo.regions if name not in links]
        if missing:
            raise ValueError(f"plan_for_links: no link given for region(s) {missing}")
        bad = {
            n: links[n] for n in self.topo.regions
            if not (math.isfinite(links[n][0]) and links[n][0] > 0)
            or not (math.isfinite(links[n][1]) and links[n][1] >= 0)
        }  # fmt: skip
        if bad:
            raise ValueError(
                f"plan_for_links: links {bad} are not (Mbit/s > 0, round trip in ms >= 0)"
            )
        est = self.estimates.copy()
        est.bandwidth = [
            bandwidth_in_range(links[n][0] * 1e6 / 8 / self.topo.shards) for n in self.topo.regions
        ]
        est.rtt = [links[n][1] / 1000 for n in self.topo.regions]
        current = self.rungs if from_plan else None
        rungs = self.planner.rungs_for(est, shard_numels, self.guard, current)
        ladder = self.options.ladder
        return {name: describe(ladder[r]) for name, r in zip(self.topo.regions, rungs, strict=True)}

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r, name in enumerate(self.topo.regions):
            out[f"level/{name}"] = float(self.rungs[r])
            if self.estimates.bandwidth[r] is not None:
                out[f"bandwidth_mbit/{name}"] = 8 * self.estimates.bandwidth[r] / 1e6
        for rank, rate in enumerate(self.estimates.throughput):
            if rate is not None:
                out[f"samples_per_s/rank{rank}"] = rate
        if self.shares is not None:
            for rank, share in enumerate(self.shares.latest):
                out[f"batch_share/rank{rank}"] = float(share)
        return out

    def _write_metrics(self, step: int, wan_bytes_sent: int) -> None:
        if self._scalars is not None:
            self._scalars.write(step, {**self.metrics(), "wan_bytes_sent": wan_bytes_sent})
