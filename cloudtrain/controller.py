"""The adaptive controller: each region's shard owners compress exactly as much as their link
needs, and fast links not at all.

Every `interval` steps, per sender region (Kimad's rule, budget = bandwidth x time), with
latency before compression:

    time the exchange may stay hidden   T = hidden_fraction x compute time of a step
    transfer of a rung                  bytes / bandwidth + its encode/decode CPU time
                                        + (compressed rungs) the dense reduction inside regions
    time a rung takes                   synchronous: a round trip per bucket + transfer;
                                        pipelined s steps deep: a round trip + transfer
                                        - s x compute, but never less than the transfer
                                        - (1 - hidden_fraction) x compute (bandwidth is not
                                        hidden by a pipeline)
    level                               the lightest rung whose time, at its best depth, fits T
    staleness                           the smallest depth at which the chosen rungs fit

Round trips are hidden by pipelining (cloudtrain.pipeline), not by compressing: a long round
trip alone raises the staleness, never the compression. The ladder runs from no compression
through 16-bit, 8- and 4-bit quantization to top-k 10% and 1% with 8-bit values (0.1% and 0.01%
are there for users who lower `min_density`, the accuracy guard: "auto" never sends less than 1%
of a shard - below it error feedback holds most of the gradient back for many steps, which is
what collapsed accuracy at 80 ms before there was a pipeline). Without compression and without a
pipeline a step's gradients cross as one plain all-reduce, which moves every byte twice; its
measured time stands in where the last interval ran it. When no rung fits, more compression is
worth its accuracy only while it still makes the step faster: the lightest rung at most `slack`
x compute time slower than the fastest.

The zstd stage (lossless, level 1) goes on per link, after the rung is chosen, where the link
time it saves beats the CPU it costs by ZSTD_MARGIN (`plan_zstd`): once per interval each shard
owner tries it on a sample of its own packet at the rung it sends with, and rank 0 keeps the
smoothed ratio and CPU seconds per byte of every (region, rung) it has seen.

Measurements: bandwidth starts from the active probe (cloudtrain.probe) and follows the real
transfers - each owner times every packet it receives; a drop counts at once, a rise is smoothed
(EWMA), packets too small to show bandwidth are ignored, and links left unmeasured for a while
are re-probed briefly by the region leaders. CPU time per rung is timed once at start
(`calibrate`); compute time and the dense reduction's cost come from the running steps.
Hysteresis keeps the plan from flapping: more compression at once when the current rung no
longer fits, less only after `patience` decisions in a row in which a lighter rung fits with
`margin` to spare.

The decision is made on rank 0 from everyone's observations (gathered) and broadcast, so every
rank uses the same plan - and so knows every packet's size. Gathering and broadcasting cross
regions (round trips of their own: about a second at 180 ms), so they run on a background thread
on process groups of the controller's own, and a decision takes effect at the next due step; the
steps between decisions grow to twice what the last gathering took, so it has arrived by then.
`plan_levels` is the pure function at its heart; the Controller class adds the measurements, the
state (part of comm_state_dict) and the logging (each change is logged; metrics() feeds TensorBoard when it is installed).
Its interface to the hook is narrow: `due(step)`, then `decide(step, observations, shard_numels)`
-> Plan (cloudtrain.stats.Observations: what a rank measured; cloudtrain.plan.Plan).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .compress import ErrorFeedback, RandomKey, ZstdGain, from_wire, to_wire
from .config import CompressionConfig, ControllerOptions
from .guard import QualityGuard, QualitySums
from .plan import Codecs, Plan, Rung, rung_density
from .probe import probe
from .stats import STAGES, Observations
from .topology import Topology

log = logging.getLogger("cloudtrain")


MIN_BANDWIDTH = 1e3  # bytes/s: below 8 kbit/s a link is not a link
MAX_BANDWIDTH = 1e12  # bytes/s: above 8 Tbit/s an estimate is not a measurement
BURST_BYTES = 1 << 18
"""Shapers and policers are token buckets: messages smaller than this may pass at line rate, so
they can show a link slower than thought, never one faster."""


@dataclass(frozen=True)
class LinkEstimate:
    """What one sender region's link looks like to the controller."""

    bandwidth: float
    """Bytes per second its packets reach the other regions at."""
    rtt: float
    """Round trip in seconds (a fixed cost of every exchange)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth) and MIN_BANDWIDTH <= self.bandwidth <= MAX_BANDWIDTH):
            raise ValueError(
                f"bandwidth={self.bandwidth!r} B/s is not a plausible link "
                f"({MIN_BANDWIDTH:g}..{MAX_BANDWIDTH:g} B/s)"
            )
        if not (math.isfinite(self.rtt) and 0 <= self.rtt <= 60):
            raise ValueError(f"rtt={self.rtt!r} s is not a plausible round trip (0..60 s)")


def rung_bytes(
    rung: Rung, shard_numels: Sequence[int], receivers: int, codecs: Codecs | None = None
) -> int:
    """Bytes a sender puts on its link per step at this rung (Codecs.step_nbytes), with the
    codecs of the run's config (default: a default config's)."""
    return (codecs or _default_codecs()).step_nbytes(rung, shard_numels, receivers)


def _default_codecs() -> Codecs:
    return Codecs(CompressionConfig())


def exchange_seconds(
    transfer: float, rtt: float, buckets: int, compute_time: float, staleness: int, hidden: float
) -> float:
    """Seconds of a step's exchange that count against the time it may take hidden (`hidden` x
    compute): the latency model behind plan_levels.

    Synchronous (staleness 0), the communication thread waits for every bucket's exchange in
    turn: a round trip per bucket, plus the transfer. Pipelined, all of a step's exchanges
    are in flight at once and have s more steps of compute to arrive in: a round trip once,
    less s x compute. Either way the link must carry each step's bytes within a step (a pipeline
    hides round trips, never bandwidth): transfer - (1 - hidden) x compute.

    A whole round trip, not half: gloo sends a message only once its receiver has posted the
    receive and said so over the wire, so an exchange whose peers post together takes a round
    trip before the data moves (measured: 180 ms per step, one bucket, at 180 ms RTT).
    """
    if staleness == 0:
        return buckets * rtt + transfer
    latency = rtt + transfer - staleness * compute_time
    return max(latency, transfer - (1 - hidden) * compute_time)


def plain_seconds(
    nbytes: int, link: LinkEstimate, buckets: int, measured: float | None = None
) -> float:
    """A step's plain (ring) all-reduce of `nbytes` per sender: every byte crosses twice, a round
    trip per bucket at least; `measured` (where the last interval ran it) replaces the model."""
    if measured is not None:
        return measured
    return 2 * nbytes / link.bandwidth + buckets * link.rtt


def faster_measured(
    measured: dict[tuple, tuple[float, ...]], chosen: tuple, margin: float = 0.05
) -> tuple | None:
    """The plan measured fastest, where `chosen` was measured and is more than `margin` slower
    than it; else None (keep the choice: unmeasured plans are tried, not guessed at)."""
    if chosen not in measured:
        return None
    best = min(measured, key=lambda plan: measured[plan][0])
    return best if measured[best][0] < (1 - margin) * measured[chosen][0] else None


def useful_depths(
    links: Sequence[LinkEstimate],
    compute_time: float,
    options: ControllerOptions,
    allowed: Sequence[int],
) -> tuple[int, ...]:
    """The pipeline depths worth considering: all allowed ones where a round trip is long enough
    to matter (at least half the time the exchange may stay hidden), else only the
    shallowest. A pipeline is for round trips: bytes are the compression's job, and a pipelined
    exchange costs a dense reduction in the region that a plain all-reduce does not."""
    hidden = options.hidden_fraction * compute_time
    if any(link.rtt >= 0.5 * hidden for link in links):
        return tuple(allowed)
    return (min(allowed),)


def plan_levels(
    links: Sequence[LinkEstimate],
    compute_time: float,
    shard_numels: Sequence[int],
    current: Sequence[int] | None = None,
    streak: Sequence[int] | None = None,
    options: ControllerOptions | None = None,
    cpu_seconds: Sequence[float] | None = None,
    extra_seconds: Sequence[float] | None = None,
    none_seconds: float | None = None,
    codecs: Codecs | None = None,
    staleness: Sequence[int] = (0,),
    ceilings: Sequence[int] | None = None,
) -> tuple[list[int], list[int], list[float]]:
    """Choose a ladder rung per sender region (pure function).

    links: one LinkEstimate per region; compute_time: seconds of compute per step (> 0);
    shard_numels: elements of each bucket's shard. current/streak: the rungs in use and how many
    decisions in a row a lighter one has fitted with margin (hysteresis state). cpu_seconds: what
    encoding and decoding a step costs at each rung (see Controller.calibrate; default 0);
    extra_seconds: any other per-step cost of a rung (the dense reduction inside regions that
    only compressed rungs need); none_seconds: the measured time of the "none" rung's plain
    all-reduce, which then replaces its estimate; codecs: the run's (Codecs), so that bytes are
    what will be sent; staleness: the pipeline depths allowed (each rung is timed at its best);
    ceilings: by region, the most compressed rung the quality guard allows (cloudtrain.guard;
    a region above its ceiling moves under it at once, without hysteresis).

    Latency before compression: a rung's time is its transfer (bytes / bandwidth + CPU + extra)
    plus the round trips the step waits for (`exchange_seconds`); a pipeline takes the round
    trips off the critical path, compression only shortens the transfer. A rung fits when its
    time is within the time the exchange can stay hidden behind compute (hidden_fraction x
    compute). When none fits, the lightest rung at most `slack` x compute_time slower than the
    fastest is taken: compressing harder is worth its accuracy only while it makes the step
    faster. Rungs sparser than `min_density` are never taken. Returns
    (rungs, streaks, budgets in bytes per step).
    """
    options = options or ControllerOptions()
    if not (math.isfinite(compute_time) and compute_time > 0):
        raise ValueError(f"compute_time={compute_time!r} must be a positive number of seconds")
    if not shard_numels or any(m < 0 for m in shard_numels):
        raise ValueError("shard_numels: the element count of every bucket's shard (non-negative)")
    if not staleness or any(s < 0 for s in staleness):
        raise ValueError("staleness: the pipeline depths allowed, each >= 0")
    ladder = options.ladder
    cpu = list(cpu_seconds) if cpu_seconds is not None else [0.0] * len(ladder)
    extra = list(extra_seconds) if extra_seconds is not None else [0.0] * len(ladder)
    for name, values in (("cpu_seconds", cpu), ("extra_seconds", extra)):
        if len(values) != len(ladder) or not all(math.isfinite(c) and c >= 0 for c in values):
            raise ValueError(f"{name}: one non-negative number of seconds per ladder rung")
    cost = [c + e for c, e in zip(cpu, extra, strict=True)]
    regions = len(links)
    receivers = max(regions - 1, 1)
    current = list(current) if current is not None else [0] * regions
    streak = list(streak) if streak is not None else [0] * regions
    ceilings = list(ceilings) if ceilings is not None else [len(ladder) - 1] * regions
    if len(current) != regions or len(streak) != regions or len(ceilings) != regions:
        raise ValueError("current, streak and ceilings need one entry per region")
    codecs = codecs or _default_codecs()
    sizes = [codecs.step_nbytes(r, shard_numels, receivers) for r in ladder]
    usable = options.hidden_fraction * compute_time
    slack = options.slack * compute_time
    uncompressed = ladder[0][0] == "none"
    guarded = [rung_density(r) < options.min_density for r in ladder]
    if all(guarded):
        guarded = [False] * len(ladder)  # a ladder of nothing but sparse rungs: take it as given

    def seconds(transfer: float, rtt: float) -> float:
        return min(
            exchange_seconds(
                transfer, rtt, len(shard_numels), compute_time, s, options.hidden_fraction
            )
            for s in staleness
        )

    def choose(flat: bool) -> tuple[list[int], list[int], list[float]]:
        rungs, streaks, budgets = [], [], []
        for link, now, run, top in zip(links, current, streak, ceilings, strict=True):
            times = [
                math.inf if guard or i > top else seconds(size / link.bandwidth + c, link.rtt)
                for i, (size, c, guard) in enumerate(zip(sizes, cost, guarded, strict=True))
            ]
            if now > top:  # the quality guard lowered the ceiling: under it now
                now, run = top, 0
            if uncompressed:  # "none" through the hierarchy pays the dense reduction too
                times[0] = seconds(sizes[0] / link.bandwidth + cost[0] + max(extra), link.rtt)
            if uncompressed and flat and 0 in staleness:
                # when no region compresses and nothing is pipelined, a step's gradients cross as
                # one plain all-reduce (plain_seconds); the pipelined hierarchy where it is faster
                plain = plain_seconds(sizes[0], link, len(shard_numels), none_seconds)
                times[0] = plain if staleness == (0,) else min(plain, times[0])
            measured = uncompressed and flat and none_seconds is not None and now == 0
            choice, run = _hysteresis(times, usable, now, run, options, slack, measured)
            rungs.append(choice)
            streaks.append(run)
            budgets.append(link.bandwidth * usable)
        return rungs, streaks, budgets

    rungs, streaks, budgets = choose(flat=True)
    if uncompressed and 0 in rungs and any(rungs):  # a mixed plan: "none" is not a plain all-reduce
        rungs, streaks, budgets = choose(flat=False)
    return rungs, streaks, budgets


def plan_staleness(
    links: Sequence[LinkEstimate],
    compute_time: float,
    shard_numels: Sequence[int],
    rungs: Sequence[int],
    options: ControllerOptions | None = None,
    cpu_seconds: Sequence[float] | None = None,
    extra_seconds: Sequence[float] | None = None,
    none_seconds: float | None = None,
    codecs: Codecs | None = None,
    allowed: Sequence[int] = (0,),
) -> int:
    """The pipeline depth for these rungs (pure function): the smallest allowed staleness at
    which every region's exchange stays hidden, else the one that hides the most (the smallest
    of those). 0 when the plan compresses nothing and the plain all-reduce is as fast."""
    options = options or ControllerOptions()
    ladder = options.ladder
    codecs = codecs or _default_codecs()
    receivers = max(len(links) - 1, 1)
    cpu = list(cpu_seconds) if cpu_seconds is not None else [0.0] * len(ladder)
    extra = list(extra_seconds) if extra_seconds is not None else [0.0] * len(ladder)
    usable = options.hidden_fraction * compute_time

    def worst(s: int) -> float:
        out = 0.0
        for link, r in zip(links, rungs, strict=True):
            transfer = codecs.step_nbytes(ladder[r], shard_numels, receivers) / link.bandwidth
            # "none" through the hierarchy pays the dense reduction too (as in plan_levels)
            cost = cpu[r] + (max(extra) if ladder[r][0] == "none" else extra[r])
            t = exchange_seconds(
                transfer + cost,
                link.rtt,
                len(shard_numels),
                compute_time,
                s,
                options.hidden_fraction,
            )
            if s == 0 and ladder[r][0] == "none" and not any(rungs):
                size = codecs.step_nbytes(ladder[r], shard_numels, receivers)
                t = plain_seconds(size, link, len(shard_numels), none_seconds)
            out = max(out, t)
        return out

    choices = sorted(set(allowed))
    times = {s: worst(s) for s in choices}
    if 0 in times and none_seconds is not None and not any(rungs):
        # the plain all-reduce was measured, the pipelined hierarchy is a model: it is left
        # only for a clearly (1.5x) shorter exposed time, not for a model's few milliseconds
        plain = max(times[0] - usable, 0.0)
        times = {s: v if s == 0 or max(v - usable, 0.0) * 1.5 < plain else math.inf
                 for s, v in times.items()}  # fmt: skip
    hidden = [s for s in choices if times[s] <= usable]
    if hidden:
        return hidden[0]
    best = min(times.values())
    return next(s for s in choices if times[s] <= best + 0.05 * compute_time)


def _hysteresis(
    times: Sequence[float],
    usable: float,
    now: int,
    run: int,
    options: ControllerOptions,
    slack: float,
    measured: bool = False,
) -> tuple[int, int]:
    """(rung, streak): the lightest rung whose time fits `usable`, moving to more compression at
    once and to less only after `patience` decisions in which it fits with `margin` to spare.
    When none fits: the lightest at most `slack` seconds slower than the fastest. `measured`:
    the current rung's time was measured, the others' are a model; it is left for them only
    when clearly (1.5x) slower, not on a model's few milliseconds."""
    fits = next((i for i, t in enumerate(times) if t <= usable), None)
    roomy = next((i for i, t in enumerate(times) if t <= options.margin * usable), None)
    if fits is None:
        # nothing fits: more compression is worth its accuracy only while it still saves time -
        # the lightest rung within `slack` of the fastest; a lighter one is taken after
        # `patience`, and the current one left at once only if it falls well behind
        fastest = min(times)
        target = next(i for i, t in enumerate(times) if t <= fastest + slack)
        if target < now:
            run += 1
            return (target, 0) if run >= options.patience else (now, run)
        behind = times[now] > fastest + 2 * slack
        if behind and (not measured or times[now] > 1.5 * fastest):
            return target, 0
        return now, 0
    if fits > now:  # the current rung no longer fits: compress more, now
        return fits, 0
    if roomy is not None and roomy < now:  # lighter with room: after `patience` decisions
        run += 1
        return (roomy, 0) if run >= options.patience else (now, run)
    return now, 0


def passive_bandwidth(
    samples: Sequence[tuple[int, float]],
    latency: float,
    current: float | None = None,
    significant: float = 0.002,
    burst: int = BURST_BYTES,
) -> float | None:
    """Bytes/s of a sender from (bytes, seconds) arrivals of its packets, or None if they say
    nothing about bandwidth.

    Waiting for a late sender only ever adds time, so packets of one size count with their
    fastest arrival; the latency is taken off. Transfers that took under `significant` seconds
    in all are latency and scheduling noise, and so are packets that small at the `current`
    estimate however late they came: a small packet's time is its sender's lateness (regions
    run a step apart in a pipeline), not bandwidth, and must not shrink the estimate, or the
    controller would compress ever more (seen: 2 KB packets 60 ms late put a 50 Mbit/s link at
    0.1 Mbit/s). A link that fell while packets are small is found by the leaders' re-probe.
    Packets all under `burst` bytes cannot raise it either: a token bucket let them through
    faster than the link's rate.
    """
    fastest: dict[int, float] = {}
    for nbytes, seconds in samples:
        fastest[nbytes] = min(seconds, fastest.get(nbytes, math.inf))
    moving = sum(max(t - latency, 0.0) for t in fastest.values())
    expected = sum(fastest) / current if current else math.inf
    if moving < significant or expected < significant:
        return None
    measured = min(max(sum(fastest) / moving, MIN_BANDWIDTH), MAX_BANDWIDTH)
    if current and measured > current and max(fastest) < burst:
        return None
    return measured


def _smoothed(new: float, old: float | None, weight: float) -> float:
    """An exponentially weighted moving average's next value (`new` itself when there is no old
    one yet)."""
    return new if old is None else weight * new + (1 - weight) * old


ZSTD_MARGIN = 1.5
"""The zstd stage goes on for a link when the link time it saves is this many times the CPU it
costs (the CPU competes with compute; the saving is a measured ratio that varies)."""


def plan_zstd(gains: Sequence[ZstdGain | None], links: Sequence[LinkEstimate]) -> list[bool]:
    """Per sender region (pure function): the zstd stage on where its measured gain at the rung
    it sends with saves more link time than it costs CPU, by ZSTD_MARGIN
    (`ZstdGain.pays_below`: its packet crosses the link once to each other region; the sender
    compresses once and each receiver decompresses once, in parallel). A region without a
    measurement at its rung goes without."""
    receivers = max(len(links) - 1, 1)
    return [
        gain is not None and link.bandwidth < gain.pays_below(receivers, ZSTD_MARGIN)
        for gain, link in zip(gains, links, strict=True)
    ]


class Controller:
    """Plans levels for CloudDDP's "auto" config (module docstring)."""

    FIRST_DECISION = 2  # the first step whose compute time was measured is step 1
    STALE_DECISIONS = 12  # decisions without a usable measurement of a link before re-probing
    COMPRESSED_STAGES = tuple(s for s in STAGES if s != "allreduce")  # the hierarchy's stages

    def __init__(
        self,
        config: CompressionConfig,
        topo: Topology,
        codecs: Codecs,
        shard_numels: Sequence[int],
        device: Any = "cpu",
    ) -> None:
        self.options: ControllerOptions = config.controller
        self.codecs = codecs
        self.topo = topo
        regions = len(topo.regions)
        self.bandwidth: list[float | None] = [None] * regions
        self.rtt: list[float] = [0.0] * regions
        self.rungs = [0] * regions
        self.streak = [0] * regions
        self.zstd_choice = config.zstd  # None: decided per link (plan_zstd)
        self.zstd = [config.zstd is True] * regions
        self.zstd_gains: dict[tuple[int, int], ZstdGain] = {}  # (region, rung) -> smoothed
        self.staleness = 0 if config.staleness is None else config.staleness
        self.allowed_staleness: tuple[int, ...] = (
            (config.staleness,)
            if config.staleness is not None
            else tuple(range(self.options.max_staleness + 1))
        )
        self.compute_time: float | None = None
        self.history: list[dict[str, Any]] = []
        self._writer = None
        self.cpu_per_element = self.calibrate(shard_numels, device)
        self.intra_s: float | None = None  # dense reduce + gather inside regions, per step
        self.allreduce_s: float | None = None  # a plain all-reduce's time per step, as measured
        self.allreduce_bw = 0.0  # the slowest link's bandwidth estimate when it was measured
        self.unmodelled_s: float | None = None  # compressed steps' time beyond the model
        self.unmeasured = [0] * regions  # decisions since each region's link was last measured
        self.reprobe = False  # the leaders measure the links at the next decision
        # (rungs, staleness) -> (step seconds, slowest link, compute) as measured (_measured_best)
        self.measured_steps: dict[tuple, tuple[float, float, float]] = {}
        # decisions are gathered and made on a thread of their own (decide)
        self.own = topo.private(("control", "leaders"), config.timeout)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cloudtrain-plan")
        self._pending: concurrent.futures.Future | None = None
        self.next_due = self.FIRST_DECISION
        self.interval = self.options.interval
        # the quality guard's ceilings on compression and pipeline depth (cloudtrain.guard);
        # a pinned staleness is the user's, not the guard's
        self.guard = (
            QualityGuard.start(self.options.ladder, regions)
            if self.options.quality_bound is not None
            else None
        )
        self.pinned_staleness = config.staleness is not None
        if topo.links is not None:
            self.seed_from_probe(topo.links, shard_numels)

    def calibrate(self, shard_numels: Sequence[int], device: Any = "cpu") -> list[float]:
        """Seconds per shard element that encoding (with error feedback) and decoding the other
        regions' packets take at each rung, timed on rank 0 and broadcast (all ranks call).

        Compressing more is not always cheaper: on a CPU, top-k 10% costs more than top-k 1%.
        The "none" rung costs nothing here: a plan without compression is one plain all-reduce.
        """
        per_element: list[Any] = [None]
        if self.topo.rank == 0:
            n = max(1, min(sum(shard_numels), 1 << 20))
            gen = torch.Generator().manual_seed(0)
            x = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 3).to(device)
            senders = len(self.topo.regions)
            costs = []
            for name, level in self.options.ladder:
                if name == "none":
                    costs.append(0.0)
                    continue
                codec = self.codecs(name)
                ef, best = ErrorFeedback(), math.inf
                for rep in range(2):
                    t0 = time.perf_counter()
                    wire = to_wire(ef.encode(0, x, codec, level, RandomKey(step=rep)))
                    codec.accumulate([from_wire(wire, codec)] * senders, torch.zeros_like(x))
                    best = min(best, time.perf_counter() - t0)
                costs.append(best / n)
            per_element[0] = costs
        dist.broadcast_object_list(per_element, src=0, group=self.topo.group("control"))
        return per_element[0]

    def cpu_seconds(self, shard_numels: Sequence[int]) -> list[float]:
        total = sum(shard_numels)
        return [c * total for c in self.cpu_per_element]

    # -- measurements (every rank) ----------------------------------------------------------
    def seed_from_probe(self, links: Any, shard_numels: Sequence[int]) -> None:
        """Initial estimates from the active probe: a region's bandwidth is its slowest link to
        another region, shared by its shard owners' parallel flows; then the initial rungs."""
        topo = self.topo
        for r, members in enumerate(topo.members):
            others = [j for q, m in enumerate(topo.members) if q != r for j in m]
            pairs = [(i, j) for i in members for j in others]
            self.bandwidth[r] = min(links.beta[i][j] for i, j in pairs) / topo.shards
            self.rtt[r] = min(min(links.alpha[i][j] for i, j in pairs), 60.0)  # noise only adds
        estimates = [
            LinkEstimate(min(max(b, MIN_BANDWIDTH), MAX_BANDWIDTH), t)
            for b, t in zip(self.bandwidth, self.rtt, strict=True)
        ]
        compute, cpu = self.options.initial_compute_s, self.cpu_seconds(shard_numels)
        depths = self._guarded(
            useful_depths(estimates, compute, self.options, self.allowed_staleness)
        )
        self.rungs, self.streak, _ = plan_levels(
            estimates,
            compute,
            shard_numels,
            options=self.options,
            cpu_seconds=cpu,
            codecs=self.codecs,
            staleness=depths,
            ceilings=None if self.guard is None else self.guard.ceilings,
        )
        self.staleness = plan_staleness(
            estimates,
            compute,
            shard_numels,
            self.rungs,
            self.options,
            cpu,
            codecs=self.codecs,
            allowed=depths,
        )

    # -- decisions (all ranks call, rank 0 decides) ----------------------------------------------
    def plan(self) -> Plan:
        """The plan of the current rungs and pipeline depth."""
        zstd = tuple(self.zstd) if any(self.zstd) else ()
        return self._plan_of(self.rungs, self.staleness, zstd)

    def _plan_of(self, rungs: Sequence[int], staleness: int = 0, zstd: tuple = ()) -> Plan:
        return Plan(tuple(self.options.ladder[r] for r in rungs), staleness, zstd)

    def due(self, step: int) -> bool:
        """Whether `step` starts with a decision (all ranks then call `decide`)."""
        return step >= self.next_due

    def decide(
        self, step: int, seen: Observations, shard_numels: Sequence[int], wan_bytes_sent: int = 0
    ) -> Plan:
        """All ranks call at a due step, with what each saw since the last one. The decision
        started at the previous due step takes effect now (waited for, if it is still on its
        way), and the next one starts from `seen`: gathered, decided on rank 0 and broadcast on
        a background thread, on process groups of the controller's own, so its round trips
        across regions never hold a step up. Every rank returns the same plan."""
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
        }
        if seen.quality is not None and seen.quality.steps:
            mine["quality"] = dataclasses.astuple(seen.quality)
        self._pending = self._pool.submit(self._gather, step, mine, list(shard_numels), ran)
        self.next_due = step + self.interval
        self._write_metrics(step, wan_bytes_sent)
        return self.plan()

    def _gather(
        self, step: int, mine: dict[str, Any], shard_numels: list[int], ran: tuple
    ) -> tuple:
        """On the controller's thread: everyone's observations to rank 0, its decision back."""
        t0 = time.perf_counter()
        if self.reprobe and self.topo.local_index == 0:
            # no packets crossed regions to time for a while (or too small ones): the region
            # leaders measure the links instead (briefly)
            # (from 256 KiB: smaller messages ride tbf-like token buckets at line rate)
            mine["leader_links"] = probe(
                self.own.group("leaders"), max_seconds=0.05, repeats=1, start_bytes=BURST_BYTES
            ).beta
        gathered: list[Any] = [None] * self.topo.world_size
        dist.all_gather_object(gathered, mine, group=self.own.group("control"))
        decision: list[Any] = [None]
        if self.topo.rank == 0:
            took = time.perf_counter() - t0
            decision[0] = self._decide(step, gathered, shard_numels, took, ran)
        dist.broadcast_object_list(decision, src=0, group=self.own.group("control"))
        return decision[0]

    def _apply(self, step: int, decision: tuple) -> None:
        rungs, streak, bandwidth, compute_time, self.reprobe, record = decision
        changed = rungs != self.rungs or record["staleness"] != self.staleness
        self.rungs, self.streak, self.bandwidth, self.compute_time = (
            rungs,
            streak,
            bandwidth,
            compute_time,
        )
        self.staleness = record["staleness"]
        self.interval = record["interval"]
        zstd = record.get("zstd", [False] * len(rungs))  # (a decision saved before zstd was)
        changed = changed or zstd != self.zstd
        self.zstd = zstd
        if record.get("guard") is not None:
            self.guard = QualityGuard.from_state(record["guard"])
        self.history.append(record)
        if self.topo.rank != 0:  # one line per change, not one per rank
            return
        for note in record.get("guard_notes", ()):
            log.warning("cloudtrain: step %d: quality guard: %s", step, note)
        if changed:
            log.warning(
                "cloudtrain: step %d: %s (decided from the steps before %d)",
                step,
                record["text"],
                record["step"],
            )

    def settle(self) -> None:
        """Wait until the decision on its way has crossed (its gather and broadcast, which every
        rank has started, complete); it still takes effect at the next due step and its error,
        if any, is raised there. Its collectives must not meet destroyed process groups."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _guarded(self, depths: Sequence[int], guard: QualityGuard | None = None) -> tuple[int, ...]:
        """The pipeline depths the quality guard allows of `depths` (all of a pinned one)."""
        guard = guard or self.guard
        if guard is None or self.pinned_staleness:
            return tuple(depths)
        return tuple(d for d in depths if d <= guard.max_staleness) or (min(depths),)

    def _quality(self, gathered: list[Any]) -> list[QualitySums]:
        """Each region's quality measurement: the sums of its shard owners' probes."""
        reports = []
        for members in self.topo.members:
            total = QualitySums()
            for rank in members:
                sums = gathered[rank].get("quality")
                if sums is not None:
                    total = total + QualitySums(*sums)
            reports.append(total)
        return reports

    def _measured_best(
        self,
        step: int,
        step_s: float | None,
        ran: tuple[list[int], int],
        rungs: list[int],
        streak: list[int],
        staleness: int,
        bandwidth: float,
        compute_time: float,
        ceilings: Sequence[int] = (),
        depths: Sequence[int] = (),
    ) -> tuple[list[int], list[int], int]:
        """A rung that does not make the step faster is never taken - checked against what was
        measured, not only the model: the whole step time of every plan run lately (median over
        the interval, smoothed) is kept with the link and compute it was measured at; the model's
        choice is replaced by a measured plan more than 5 % faster than the choice was measured
        to be. A measurement holds until the slowest link or the compute time changes by 2x."""
        now = (tuple(ran[0]), ran[1])
        # the first steps (DDP's bucket rebuild, first allocations, a pipeline filling) are not
        # the time of the plan they ran
        if step_s is not None and step > self.FIRST_DECISION + self.options.interval:
            old = self.measured_steps.get(now)
            took = _smoothed(step_s, None if old is None else old[0], self.options.ewma)
            self.measured_steps[now] = (took, bandwidth, compute_time)
        self.measured_steps = {
            plan: m
            for plan, m in self.measured_steps.items()
            if 0.5 <= m[1] / bandwidth <= 2 and 0.5 <= m[2] / compute_time <= 2
        }
        allowed = {
            plan: m
            for plan, m in self.measured_steps.items()
            if self.guard is None
            or (all(r <= c for r, c in zip(plan[0], ceilings, strict=True)) and plan[1] in depths)
        }
        best = faster_measured(allowed, (tuple(rungs), staleness))
        if best is None:
            return rungs, streak, staleness
        return list(best[0]), [0] * len(rungs), best[1]

    def _intra_guess(self, shard_numels: Sequence[int]) -> float:
        """Seconds per step of the dense reduce-scatter and all-gather inside regions, from the
        probed links: each moves about the whole bucket (fp32) once."""
        links, topo = self.topo.links, self.topo
        pairs = [(i, j) for m in topo.members for i in m for j in m if i != j]
        if links is None or not pairs:
            return 0.0
        slowest = min(links.beta[i][j] for i, j in pairs)
        return 2 * 4 * sum(shard_numels) * topo.shards / slowest

    def _decide(
        self,
        step: int,
        gathered: list[Any],
        shard_numels: Sequence[int],
        took: float,
        ran: tuple[list[int], int],
    ) -> tuple:
        """Rank 0, on the controller's thread: the plan from everyone's observations, which were
        measured under the plan `ran` (rungs, staleness; the current one may have taken effect
        since). `took`: seconds the gathering took; the next decisions come that much further
        apart in steps (twice it, for the broadcast back), so that each has arrived when due."""
        opts = self.options
        computes = sorted(c for g in gathered for c in g["compute"])
        compute_time = computes[len(computes) // 2] if computes else self.compute_time or 1.0
        bandwidth = list(self.bandwidth)
        probed = next((g["leader_links"] for g in gathered if "leader_links" in g), None)
        if probed is not None:  # indexed by rank in the leaders' group, which is by global rank
            leaders = [m[0] for m in self.topo.members]
            at = [sorted(leaders).index(leader) for leader in leaders]  # region -> group rank
            for r in range(len(bandwidth)):
                slowest = min(probed[at[r]][at[q]] for q in range(len(leaders)) if q != r)
                bandwidth[r] = min(max(slowest / self.topo.shards, MIN_BANDWIDTH), MAX_BANDWIDTH)
        warm = step > self.FIRST_DECISION  # the first steps wait for peers still warming up
        for region in range(len(bandwidth)):
            samples = [s for g in gathered if warm for s in g["received"].get(region, [])]
            measured = passive_bandwidth(samples, self.rtt[region], bandwidth[region])
            if measured is None:
                self.unmeasured[region] += 1
                continue
            self.unmeasured[region] = 0
            old = bandwidth[region]
            # a drop counts at once (the link is slow now); a rise is smoothed
            rise = old is not None and measured > old
            bandwidth[region] = _smoothed(measured, old if rise else None, opts.ewma)
        # what the dense parts cost per step (rank 0's view), where this interval ran them -
        # not in the first steps, whose collectives also set up connections and buffers
        stages = gathered[0].get("stage_seconds", {}) if warm else {}
        intra = stages.get("intra_reduce", 0.0) + stages.get("intra_gather", 0.0)
        if intra > 0:
            self.intra_s = _smoothed(intra, self.intra_s, opts.ewma)
        if probed is not None:
            self.unmeasured = [0] * len(bandwidth)
        reprobe = max(self.unmeasured) >= self.STALE_DECISIONS
        # the plain all-reduce of an uncompressed interval is the "none" rung's measured time; it
        # holds until the links are found much faster than when it was measured
        slowest = min((b for b in bandwidth if b is not None), default=MAX_BANDWIDTH)
        if stages.get("allreduce"):
            # smoothed: one slow interval is noise, a drop shows at once
            self.allreduce_s = _smoothed(stages["allreduce"], self.allreduce_s, opts.ewma)
            self.allreduce_bw = slowest
        elif self.allreduce_s is not None and slowest > 2 * self.allreduce_bw:
            self.allreduce_s = None
        # compressed rungs also pay for the reduction inside regions (measured once they ran,
        # until then estimated from the probed links inside regions) and for what the model of
        # bytes and CPU leaves out (thread hand-offs, per-bucket latency): the difference between
        # a compressed interval's measured time and its model, smoothed
        overhead = self.intra_s if self.intra_s is not None else self._intra_guess(shard_numels)
        links = [
            LinkEstimate(b if b is not None else MAX_BANDWIDTH, r)
            for b, r in zip(bandwidth, self.rtt, strict=True)
        ]
        compressed = sum(stages.get(k, 0.0) for k in self.COMPRESSED_STAGES)
        ran_rungs = ran[0]
        if compressed > 0 and not self._plan_of(ran_rungs).lossless:
            cpu, receivers = self.cpu_seconds(shard_numels), max(len(links) - 1, 1)
            model = overhead + max(
                self.codecs.step_nbytes(opts.ladder[r], shard_numels, receivers) / link.bandwidth
                + cpu[r]
                for r, link in zip(ran_rungs, links, strict=True)
            )
            unmodelled = max(compressed - model, 0.0)
            self.unmodelled_s = _smoothed(unmodelled, self.unmodelled_s, opts.ewma)
        lossy = overhead + (self.unmodelled_s or 0.0)
        extra = [0.0 if name == "none" else lossy for name, _ in opts.ladder]
        cpu = self.cpu_seconds(shard_numels)

        def levels(ceilings: Sequence[int] | None, depths: Sequence[int]) -> tuple:
            rungs, streak, budgets = plan_levels(
                links,
                compute_time,
                shard_numels,
                self.rungs,
                self.streak,
                opts,
                cpu,
                extra,
                self.allreduce_s,
                self.codecs,
                depths,
                ceilings,
            )
            staleness = plan_staleness(
                links, compute_time, shard_numels, rungs, opts, cpu, extra, self.allreduce_s,
                self.codecs, depths,
            )  # fmt: skip
            return rungs, streak, budgets, staleness

        depths = useful_depths(links, compute_time, opts, self.allowed_staleness)
        guard, notes = self.guard, []
        if guard is not None:  # what the links want, then what the quality guard allows of it
            wanted, _, _, wanted_staleness = levels(None, depths)
            guard = QualityGuard.from_state(guard.state_dict())  # the decision carries it
            notes = guard.decide(
                self._quality(gathered),
                ran[0],
                ran[1],
                wanted,
                wanted_staleness,
                opts.quality_bound,
                opts.drift_bound,
                opts.patience,
            )
            depths = self._guarded(depths, guard)
        rungs, streak, budgets, staleness = levels(
            None if guard is None else guard.ceilings, depths
        )
        # a shallower pipeline one step at a time: each change of depth applies two steps'
        # gradients at once (or none), so it should not flap
        staleness = max(staleness, min(self.staleness - 1, max(depths)))
        steps = sorted(s for g in gathered for s in g.get("steps", []))
        step_s = steps[len(steps) // 2] if steps else None  # the interval's median step
        rungs, streak, staleness = self._measured_best(
            step,
            step_s,
            ran,
            rungs,
            streak,
            staleness,
            slowest,
            compute_time,
            () if guard is None else guard.ceilings,
            depths,
        )
        zstd = self._zstd(gathered, ran[0], rungs, staleness, links)
        names = self.topo.regions
        text = (
            "plan "
            + ", ".join(
                f"{names[r]}: {_describe(opts.ladder[rungs[r]])}{' + zstd' if zstd[r] else ''} "
                f"({8 * links[r].bandwidth / 1e6:.1f} Mbit/s, "
                f"budget {budgets[r] / 1e6:.2f} MB/step)"
                for r in range(len(names))
            )
            + f"; staleness {staleness}; compute {1000 * compute_time:.0f} ms/step"
        )
        per_step = step_s if step_s is not None else compute_time
        interval = max(opts.interval, min(math.ceil(2 * took / max(per_step, 1e-3)) + 1, 10_000))
        record = {
            "step": step,
            "interval": interval,
            "rungs": rungs,
            "levels": [
                _describe(opts.ladder[r]) + (" + zstd" if z else "")
                for r, z in zip(rungs, zstd, strict=True)
            ],
            "bandwidth_Bps": [link.bandwidth for link in links],
            "budget_B": budgets,
            "compute_s": compute_time,
            "intra_s": self.intra_s,
            "allreduce_s": self.allreduce_s,
            "staleness": staleness,
            "zstd": zstd,
            # packets timed on arrival, by sender region (the passive bandwidth estimate's data)
            "arrivals": [
                sum(len(g["received"].get(r, [])) for g in gathered) for r in range(len(links))
            ],
            "text": text,
            "guard": None if guard is None else guard.state_dict(),
            "guard_notes": notes,
        }
        return rungs, streak, bandwidth, compute_time, reprobe, record

    def _zstd(
        self,
        gathered: list[Any],
        ran_rungs: list[int],
        rungs: list[int],
        staleness: int,
        links: list[LinkEstimate],
    ) -> list[bool]:
        """Rank 0: the interval's zstd trials (made at the rungs `ran_rungs`) into the smoothed
        gain of each (region, rung); then the stage per link at the rungs chosen (plan_zstd)."""
        regions = len(links)
        if self.zstd_choice is not None:  # the config says
            return [self.zstd_choice] * regions
        ewma = self.options.ewma
        for region, ranks in enumerate(self.topo.members):
            tried = [t for rank in ranks for t in gathered[rank].get("zstd", [])]
            total = sum(t[3] for t in tried)
            if total <= 0:
                continue
            # weighted by the bytes tried: the packets' ratio, and CPU per byte
            mean = ZstdGain(
                total / sum(t[3] / t[0] for t in tried),
                sum(t[1] * t[3] for t in tried) / total,
                sum(t[2] * t[3] for t in tried) / total,
            )
            key = (region, ran_rungs[region])
            old = self.zstd_gains.get(key)
            if old is not None:
                mean = ZstdGain(
                    *(
                        _smoothed(m, o, ewma)
                        for m, o in zip(
                            dataclasses.astuple(mean), dataclasses.astuple(old), strict=True
                        )
                    )
                )
            self.zstd_gains[key] = mean
        if staleness == 0 and self._plan_of(rungs).lossless:
            return [False] * regions  # one plain all-reduce: no packets to compress
        return plan_zstd([self.zstd_gains.get((r, rungs[r])) for r in range(regions)], links)

    # -- state and metrics -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # the decision on its way first: rank 0 updates its measurements while deciding
        pending = None if self._pending is None else self._pending.result()
        return {
            "bandwidth": list(self.bandwidth),
            "rtt": list(self.rtt),
            "rungs": list(self.rungs),
            "streak": list(self.streak),
            "compute_time": self.compute_time,
            "intra_s": self.intra_s,
            "allreduce_s": self.allreduce_s,
            "allreduce_bw": self.allreduce_bw,
            "unmodelled_s": self.unmodelled_s,
            "staleness": self.staleness,
            "zstd": list(self.zstd),
            "zstd_gains": [
                [r, rung, *dataclasses.astuple(gain)] for (r, rung), gain in self.zstd_gains.items()
            ],
            "next_due": self.next_due,
            "interval": self.interval,
            "pending": pending,
            "measured_steps": [
                [list(rungs), staleness, *m]
                for (rungs, staleness), m in self.measured_steps.items()
            ],
            "history": list(self.history),
            "guard": None if self.guard is None else self.guard.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._pending is not None:  # rank 0 may still be deciding: it writes measurements
            self._pending.result()
        if len(state["rungs"]) != len(self.rungs):
            raise ValueError("controller state is for another number of regions")
        self.bandwidth = list(state["bandwidth"])
        self.rtt = list(state["rtt"])
        self.rungs = list(state["rungs"])
        self.streak = list(state["streak"])
        self.compute_time = state["compute_time"]
        self.intra_s, self.allreduce_s = state["intra_s"], state["allreduce_s"]
        self.allreduce_bw, self.unmodelled_s = state["allreduce_bw"], state["unmodelled_s"]
        self.staleness = int(state["staleness"])
        self.zstd = [bool(z) for z in state.get("zstd", self.zstd)]
        self.zstd_gains = {
            (int(r), int(rung)): ZstdGain(ratio, encode, decode)
            for r, rung, ratio, encode, decode in state.get("zstd_gains", [])
        }
        # (a state saved before decisions ran in the background: the next one is due at once)
        self.next_due = int(state.get("next_due", self.FIRST_DECISION))
        self.interval = int(state.get("interval", self.options.interval))
        self._pending = None
        if state.get("pending") is not None:  # the decision on its way when it was saved
            self._pending = concurrent.futures.Future()
            self._pending.set_result(tuple(state["pending"]))
        self.measured_steps = {
            (tuple(rungs), int(staleness)): (took, bandwidth, compute)
            for rungs, staleness, took, bandwidth, compute in state.get("measured_steps", [])
        }
        self.history = list(state["history"])
        if self.guard is not None and state.get("guard") is not None:
            self.guard = QualityGuard.from_state(state["guard"])

    def snapshot(self) -> dict[str, Any]:
        """What the controller believes and decided last, by region name: the link estimates,
        the plan in force, and the quality guard's measurements and ceilings (the same on every
        rank: decisions are broadcast). For CloudDDP.stats()."""
        names, ladder = self.topo.regions, self.options.ladder
        out: dict[str, Any] = {
            "links": {
                name: {
                    "bandwidth_mbit": None if b is None else 8 * b / 1e6,
                    "rtt_ms": 1000 * rtt,
                }
                for name, b, rtt in zip(names, self.bandwidth, self.rtt, strict=True)
            },
            "plan": {
                name: _describe(ladder[r]) + (" + zstd" if z else "")
                for name, r, z in zip(names, self.rungs, self.zstd, strict=True)
            },
            "staleness": self.staleness,
            "guard": None,
        }
        if self.guard is not None:
            last = self.guard.last
            out["guard"] = {
                "ceiling": {
                    name: _describe(ladder[c])
                    for name, c in zip(names, self.guard.ceilings, strict=True)
                },
                "max_staleness": self.guard.max_staleness,
                "compression_error": dict(
                    zip(names, last.get("compression", [None] * len(names)), strict=True)
                ),
                "update_error": dict(
                    zip(names, last.get("error", [None] * len(names)), strict=True)
                ),
                "drift": dict(zip(names, last.get("drift", [None] * len(names)), strict=True)),
                "keeps_quality_over_speed": any(last.get("limits_speed", ())),
            }
        return out

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r, name in enumerate(self.topo.regions):
            out[f"level/{name}"] = float(self.rungs[r])
            if self.bandwidth[r] is not None:
                out[f"bandwidth_mbit/{name}"] = 8 * self.bandwidth[r] / 1e6
        return out

    def _write_metrics(self, step: int, wan_bytes_sent: int) -> None:
        if self.options.tensorboard_dir is None or self.topo.rank != 0:
            return
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning("cloudtrain: tensorboard is not installed; metrics go to the log only")
                self.options = dataclasses.replace(self.options, tensorboard_dir=None)
                return
            self._writer = SummaryWriter(self.options.tensorboard_dir)
        for key, value in self.metrics().items():
            self._writer.add_scalar(key, value, step)
        self._writer.add_scalar("wan_bytes_sent", wan_bytes_sent, step)


def _describe(rung: tuple[str, Any]) -> str:
    name, level = rung
    if name == "none":
        return "no compression"
    if name == "quant":
        return f"{level}-bit"
    if name.startswith("topk"):
        density, bits = level
        return f"top-k {100 * density:g}% + {bits}-bit"
    return name
