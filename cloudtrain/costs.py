"""The cost model of a step's exchange across regions: what each ladder rung costs on each link, and
the choice of rung and pipeline depth it implies. Pure functions of typed inputs; the controller
(cloudtrain.controller) feeds it measurements and keeps the state.

    model = CostModel(links, compute_time, shard_numels, options, cpu, extra, none_seconds, codecs)
    rungs, streaks, budgets = plan_levels(model, current, streak, depths, ceilings)
    staleness = plan_staleness(model, rungs, depths)

Per sender region (Kimad's rule, budget = bandwidth x time), with latency before compression:

    time the exchange may stay hidden   T = hidden_fraction x compute time of a step
    transfer of a rung                  bytes / bandwidth + its encode/decode CPU time
                                        + (every rung through the hierarchy) the dense reduction
                                        inside regions
    time a rung takes                   synchronous: half a round trip + transfer (a
                                        step's exchanges are in flight together, their
                                        receives posted ahead);
                                        pipelined s steps deep: half a round trip + transfer
                                        - s x compute, but never less than the transfer
                                        - (1 - hidden_fraction) x compute (bandwidth is not
                                        hidden by a pipeline)
    level                               the lightest rung whose time, at its best depth, fits T
    staleness                           the smallest depth at which the chosen rungs fit

Round trips are hidden by pipelining (cloudtrain.pipeline), not by compressing: a long round trip
alone raises the staleness, never the compression. Without compression and without a pipeline a
step's gradients cross as one plain all-reduce, which moves every byte twice; its measured time
stands in while it is recent and the links are as they were (Estimates.observe_stages). When no rung
fits, more compression is worth its accuracy only while it still makes the step faster: the lightest
rung at most `slack` x compute time slower than the fastest. Rungs sparser than `min_density`, and
above the quality guard's ceiling (cloudtrain.guard), are never taken.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .compress import ZstdGain
from .config import CompressionConfig, ControllerOptions
from .plan import Codecs, Rung, rung_density

MIN_BANDWIDTH = 1e3  # bytes/s: below 8 kbit/s a link is not a link
MAX_BANDWIDTH = 1e12  # bytes/s: above 8 Tbit/s an estimate is not a measurement


def bandwidth_in_range(bytes_per_s: float) -> float:
    """A bandwidth (bytes/s) held to what a link can be: MIN_BANDWIDTH to MAX_BANDWIDTH."""
    return min(max(bytes_per_s, MIN_BANDWIDTH), MAX_BANDWIDTH)


@dataclass(frozen=True)
class LinkEstimate:
    """What one sender region's link looks like: the one link type of the controller, the outer
    loop's schedule and the planner."""

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
    return (codecs or default_codecs()).step_nbytes(rung, shard_numels, receivers)


@functools.cache
def default_codecs() -> Codecs:
    """A default config's codecs, made once (what the forecasts count with)."""
    return Codecs(CompressionConfig())


def exchange_seconds(
    transfer: float, rtt: float, compute_time: float, staleness: int, hidden: float
) -> float:
    """Seconds of a step's exchange that count against the time it may take hidden (`hidden` x
    compute): the latency model behind plan_levels.

    Synchronous (staleness 0), a step's exchanges are all in flight before the first is waited
    for (the hook finishes them at the step's last bucket): half a round trip, plus the
    transfer. Pipelined, they also have s more steps of compute to arrive in: less s x compute.
    Either way the link must carry each step's bytes within a step (a pipeline hides round
    trips, never bandwidth): transfer - (1 - hidden) x compute.

    Half a round trip, not a whole one: gloo sends a message only once its receiver has posted
    the receive and said so over the wire, and the data path posts each packet stream's
    receives an exchange ahead (cloudtrain.collectives.ReceivesAhead), so by the next exchange
    the notice has crossed. (A step shorter than half a round trip, or a stream's first
    exchange, still waits for part of it.)
    """
    one_way = rtt / 2
    if staleness == 0:
        return one_way + transfer
    latency = one_way + transfer - staleness * compute_time
    return max(latency, transfer - (1 - hidden) * compute_time)


@dataclass(frozen=True)
class Ring:
    """A ring all-reduce over `ranks` ranks in `regions` regions, contiguous in rank order.
    `handshake`: each message goes only once its receiver has said it posted the receive (gloo,
    CPU tensors); NCCL's rings pipeline their steps without that."""

    ranks: int
    regions: int
    handshake: bool = False

    def __post_init__(self) -> None:
        if self.ranks < 2 or not 1 <= self.regions <= self.ranks:
            raise ValueError(f"Ring: {self.ranks} ranks in {self.regions} regions")


def plain_seconds(
    nbytes: int,
    link: LinkEstimate,
    buckets: int,
    measured: float | None = None,
    ring: Ring | None = None,
) -> float:
    """A step's plain (ring) all-reduce of `nbytes` per sender; `measured` (where it was
    measured recently, the links as they were: Estimates.observe_stages) replaces the model.

    `ring`: a sender puts 2 (ranks - 1) / ranks of its buffer on the link, in the ring's
    2 (ranks - 1) steps. Pipelined (NCCL), a bucket's latency is the longest chain of hops
    through those steps: regions / ranks of them cross a region boundary (one-way delays; hops
    inside a region count as none). With the handshake (gloo), every step of a ring across
    regions waits on its crossing hop - the receiver's word back, then the message: a round
    trip, or, where a step's message takes longer than half of one, its transfer and half a
    round trip - and the last half a round trip more. For 12 gloo all-reduces on the emulated
    network (0.4-4.4 MB, 2-6 ranks in 2 regions, 50-1000 Mbit/s, 80-180 ms) this gives
    0.84-1.10x of what they took, the chain 0.20-0.87x (5.9-6.6 round trips a bucket at 4
    ranks, where the chain gives 1.5). Without `ring` (the controller, before it has measured
    one), the bound: every byte crosses twice, a round trip per bucket."""
    if measured is not None:
        return measured
    if ring is None:
        return 2 * nbytes / link.bandwidth + buckets * link.rtt
    hops = 2 * (ring.ranks - 1)
    transfer = hops / ring.ranks * nbytes / link.bandwidth
    if ring.regions == 1:
        return transfer
    if ring.handshake:
        step = nbytes / buckets / ring.ranks / link.bandwidth  # a step's message, a bucket's
        return buckets * (hops * max(link.rtt, step + link.rtt / 2) + link.rtt / 2)
    crossings = math.ceil(hops * ring.regions / ring.ranks)
    return transfer + buckets * crossings * link.rtt / 2


@dataclass(frozen=True)
class CostModel:
    """What a step's exchange costs at each rung, on each region's link (module docstring)."""

    links: Sequence[LinkEstimate]
    """One per sender region."""
    compute_time: float
    """Seconds of compute per step (> 0)."""
    shard_numels: Sequence[int]
    """Elements of each bucket's shard."""
    options: ControllerOptions = field(default_factory=ControllerOptions)
    cpu: Sequence[float] | None = None
    """Seconds per step that encoding and decoding cost at each rung (Controller.calibrate;
    default 0)."""
    extra: Sequence[float] | None = None
    """Any other per-step cost of each rung: the dense reduction inside regions that packets
    need, and what the byte model leaves out (default 0). "none" through the hierarchy pays the
    heaviest of them too."""
    none_seconds: float | None = None
    """The measured time of the "none" rung's plain all-reduce, which replaces its model."""
    codecs: Codecs | None = None
    """The run's codecs, so that bytes are what will be sent (default: a default config's)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compute_time) and self.compute_time > 0):
            raise ValueError(
                f"compute_time={self.compute_time!r} must be a positive number of seconds"
            )
        if not self.shard_numels or any(m < 0 for m in self.shard_numels):
            raise ValueError(
                "shard_numels: the element count of every bucket's shard (non-negative)"
            )
        rungs = len(self.options.ladder)
        for name in ("cpu", "extra"):
            values = getattr(self, name)
            values = [0.0] * rungs if values is None else list(values)
            if len(values) != rungs or not all(math.isfinite(c) and c >= 0 for c in values):
                raise ValueError(
                    f"{name}_seconds: one non-negative number of seconds per ladder rung"
                )
            object.__setattr__(self, name, tuple(values))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "shard_numels", tuple(self.shard_numels))
        object.__setattr__(self, "codecs", self.codecs or default_codecs())

    @property
    def ladder(self) -> tuple[Rung, ...]:
        return self.options.ladder

    @property
    def buckets(self) -> int:
        return len(self.shard_numels)

    @property
    def usable(self) -> float:
        """Seconds of a step the exchange may take hidden behind compute."""
        return self.options.hidden_fraction * self.compute_time

    @property
    def slack(self) -> float:
        """Seconds of a step given up for accuracy when no rung fits."""
        return self.options.slack * self.compute_time

    @functools.cached_property
    def sizes(self) -> list[int]:
        """Bytes a sender puts on its link per step, by rung."""
        receivers = max(len(self.links) - 1, 1)
        return [self.codecs.step_nbytes(r, self.shard_numels, receivers) for r in self.ladder]

    @functools.cached_property
    def guarded(self) -> list[bool]:
        """By rung: sparser than `min_density` (never taken; a ladder of nothing but sparse
        rungs is taken as given)."""
        guarded = [rung_density(r) < self.options.min_density for r in self.ladder]
        return [False] * len(guarded) if all(guarded) else guarded

    def rung_seconds(self, link: LinkEstimate, rung: int, depth: int, plain: bool) -> float:
        """Seconds of rung `rung`'s exchange on `link` at pipeline `depth` that count against
        the hidden time. `plain`: no region compresses, so at depth 0 "none" is one plain
        all-reduce rather than the hierarchy."""
        size, cost = self.sizes[rung], self.cpu[rung] + self.extra[rung]
        if self.ladder[rung][0] == "none":
            if plain and depth == 0:
                return plain_seconds(size, link, self.buckets, self.none_seconds)
            cost += max(self.extra)  # "none" through the hierarchy pays the dense reduction too
        hidden = self.options.hidden_fraction
        return exchange_seconds(
            size / link.bandwidth + cost, link.rtt, self.compute_time, depth, hidden
        )

    def useful_depths(self, allowed: Sequence[int]) -> tuple[int, ...]:
        """The pipeline depths worth considering: all allowed ones where a round trip is long
        enough to matter (at least half the time the exchange may stay hidden), else only the
        shallowest. A pipeline is for round trips: bytes are the compression's job, and a
        pipelined exchange costs a dense reduction in the region that a plain all-reduce does
        not."""
        if any(link.rtt >= 0.5 * self.usable for link in self.links):
            return tuple(allowed)
        return (min(allowed),)


def useful_depths(
    links: Sequence[LinkEstimate],
    compute_time: float,
    options: ControllerOptions,
    allowed: Sequence[int],
) -> tuple[int, ...]:
    """CostModel.useful_depths for these links and compute time alone."""
    return CostModel(links, compute_time, (0,), options).useful_depths(allowed)


def plan_levels(
    model: CostModel,
    current: Sequence[int] | None = None,
    streak: Sequence[int] | None = None,
    depths: Sequence[int] = (0,),
    ceilings: Sequence[int] | None = None,
) -> tuple[list[int], list[int], list[float]]:
    """A ladder rung per sender region (pure function): the lightest whose time, at its best
    depth of `depths`, fits the time the exchange may stay hidden; when none fits, the lightest
    at most `slack` slower than the fastest. current/streak: the rungs in use and how many
    decisions in a row a lighter one has fitted with margin (hysteresis); ceilings: by region,
    the most compressed rung the quality guard allows (a region above it moves under it at once,
    without hysteresis). Returns (rungs, streaks, budgets in bytes per step)."""
    if not depths or any(s < 0 for s in depths):
        raise ValueError("staleness: the pipeline depths allowed, each >= 0")
    regions, top = len(model.links), len(model.ladder) - 1
    current = list(current) if current is not None else [0] * regions
    streak = list(streak) if streak is not None else [0] * regions
    ceilings = list(ceilings) if ceilings is not None else [top] * regions
    if len(current) != regions or len(streak) != regions or len(ceilings) != regions:
        raise ValueError("current, streak and ceilings need one entry per region")
    uncompressed = model.ladder[0][0] == "none"

    def choose(plain: bool) -> tuple[list[int], list[int], list[float]]:
        rungs, streaks, budgets = [], [], []
        for link, now, run, ceiling in zip(model.links, current, streak, ceilings, strict=True):
            times = [
                math.inf
                if model.guarded[r] or r > ceiling
                else min(model.rung_seconds(link, r, d, plain) for d in depths)
                for r in range(top + 1)
            ]
            if now > ceiling:  # the quality guard lowered the ceiling: under it now
                now, run = ceiling, 0
            measured = uncompressed and plain and model.none_seconds is not None and now == 0
            choice, run = _hysteresis(times, now, run, model, measured)
            rungs.append(choice)
            streaks.append(run)
            budgets.append(link.bandwidth * model.usable)
        return rungs, streaks, budgets

    # when no region compresses, "none" is one plain all-reduce; in a mixed plan it is not
    rungs, streaks, budgets = choose(plain=0 in depths)
    if uncompressed and 0 in rungs and any(rungs):
        rungs, streaks, budgets = choose(plain=False)
    return rungs, streaks, budgets


def plan_staleness(model: CostModel, rungs: Sequence[int], allowed: Sequence[int] = (0,)) -> int:
    """The pipeline depth for these rungs (pure function): the smallest allowed staleness at
    which every region's exchange stays hidden, else the one that hides the most (the smallest
    of those). 0 when the plan compresses nothing and the plain all-reduce is as fast."""
    plain = not any(rungs)
    choices = sorted(set(allowed))
    pairs = list(zip(model.links, rungs, strict=True))
    times = {
        s: max([0.0, *(model.rung_seconds(lk, r, s, plain) for lk, r in pairs)]) for s in choices
    }
    usable = model.usable
    if 0 in times and model.none_seconds is not None and plain:
        # the plain all-reduce was measured, the pipelined hierarchy is a model: it is left
        # only for a clearly (1.5x) shorter exposed time, not for a model's few milliseconds
        exposed = max(times[0] - usable, 0.0)
        times = {s: v if s == 0 or max(v - usable, 0.0) * 1.5 < exposed else math.inf
                 for s, v in times.items()}  # fmt: skip
    hidden = [s for s in choices if times[s] <= usable]
    if hidden:
        return hidden[0]
    best = min(times.values())
    return next(s for s in choices if times[s] <= best + 0.05 * model.compute_time)


def _hysteresis(
    times: Sequence[float], now: int, run: int, model: CostModel, measured: bool = False
) -> tuple[int, int]:
    """(rung, streak): the lightest rung whose time fits the hidden time, moving to more
    compression at once and to less only after `patience` decisions in which it fits with
    `margin` to spare. When none fits: the lightest at most `slack` seconds slower than the
    fastest. `measured`: the current rung's time was measured, the others' are a model; it is
    left for them only when clearly (1.5x) slower, not on a model's few milliseconds."""
    options, usable, slack = model.options, model.usable, model.slack
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


def faster_measured(
    measured: dict[tuple, tuple[float, ...]], chosen: tuple, margin: float = 0.05
) -> tuple | None:
    """The plan measured fastest, where `chosen` was measured and is more than `margin` slower
    than it; else None (keep the choice: unmeasured plans are tried, not guessed at)."""
    if chosen not in measured:
        return None
    best = min(measured, key=lambda plan: measured[plan][0])
    return best if measured[best][0] < (1 - margin) * measured[chosen][0] else None


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
