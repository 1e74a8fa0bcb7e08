"""What the controller has measured: each interval's observations from every rank, summed up
(`Interval`), and the smoothed estimates they feed (`Estimates`) - link bandwidth and round trip,
compute time, the dense reduction inside regions, the plain all-reduce, what the byte model leaves
out, zstd gains, and the measured step time of every plan run lately.

    interval = Interval.of(gathered, topo.members, warm=True)
    estimates.observe(interval, ...)            # rank 0, at a decision
    links = estimates.links()                   # -> [LinkEstimate] for the cost model

Bandwidth starts from the active probe (cloudtrain.probe, read by `region_links`) and is set again
only by brief re-probes, made while nothing else crosses regions (the controller finishes the
exchanges in flight first, and every rank takes part): a re-probe that agrees with the estimate
doubles the wait for the next one (from PROBE_EVERY decisions up to MAX_PROBE_EVERY), one that
moves it starts again from STALE_DECISIONS, and none comes sooner than keeps re-probes to
REPROBE_SHARE of the run's time. A re-probe that reads a link well under its estimate is repeated
(asked for at the next decision, it runs at the one after), and the better of the two readings
sets it, so that one transfer that read low lowers nothing (on the emulated links at 80 ms, one
probe read 0.64-1.12x of one TCP flow from one run to the next before it re-timed a message that
read slow, 0.90-1.15x since: cloudtrain.probe). Between re-probes each shard owner times every
packet it receives. Packets set no estimate: their receives are posted an exchange ahead
(cloudtrain.collectives.ReceivesAhead), so a packet's time is the one-way latency and its
transfer, plus its sender's lateness, less its earliness (it may have been on its way before the
exchange began) - it reads the link slower or faster than it is (only a link never probed takes
its packets' rate). Packets that arrive much slower than packets of their size did after the
last re-probe ask for the next one early.
Rank 0 updates the estimates at each decision, and every rank gets them with the decision, so
all ranks hold the same.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .compress import ErrorFeedback, RandomKey, ZstdGain, from_wire, to_wire
from .costs import MAX_BANDWIDTH, LinkEstimate, bandwidth_in_range
from .guard import QualitySums
from .plan import Codecs, Rung

BURST_BYTES = 1 << 18
"""Shapers and policers are token buckets: messages smaller than this may pass at line rate, so
they can show a link slower than thought, never one faster."""

STALE_DECISIONS = 12
"""Decisions from a re-probe that moved an estimate to the next; also the fewest between two
re-probes that packets arriving slowly asked for."""

PROBE_EVERY = 4 * STALE_DECISIONS
"""Decisions from the start-up probe to the first re-probe. A re-probe holds every rank up for
a few round trips and its transfers (0.5-1 s at 0-80 ms, 3-8 s at 180 ms on the emulated
50 Mbit/s link), so links that agree are re-probed rarely."""

MAX_PROBE_EVERY = 8 * STALE_DECISIONS
"""The longest wait between re-probes, reached after one that agreed with the estimates."""

MEASURED_DECISIONS = 6
"""Decisions after the one that measured it that a plan's step time reading faster than the plan
in force is compared for (Planner._measured_best), and the plain all-reduce's time stands for:
long enough to settle between plans tried one after another, short enough that where a link fell
unseen by the estimates (until a re-probe confirms it) a time of before does not read fast for
long - the drop scenario's plain path, measured at 1000 Mbit/s in the first steps, read faster
than 8-bit over the fallen 50 Mbit/s link 60 steps later."""

AGREES = 0.25
"""A re-probe within this share of a link's estimate agrees with it."""

SUSPECT = 0.7
"""Packets arriving at under this share of the rate they arrived at after the last re-probe ask
for the next one early: they lower nothing themselves (a late sender, or the round trip, makes
a fast link look slow)."""

REPROBE_SHARE = 0.02
"""Re-probes take at most this share of the run: every rank waits out a re-probe (0.5-1 s at
0-80 ms, 3-8 s at 180 ms on the emulated 50 Mbit/s link), so after one the next - scheduled or
asked for by slow packets - waits at least its seconds / REPROBE_SHARE of steps (at 180 ms and
0.44 s steps, 6 s: about 680 steps). Only a fall's confirmation comes sooner."""

LIKE_SIZED = 1.25
"""Packets are compared with the baseline's only where the largest is within this factor of the
baseline's largest: a smaller packet arrives at a lower rate on the same link (the round trip
and its sender's lateness weigh more in its time), so a plan that compresses more - or the
quality guard moving a rung - would read as a link that slowed. Packets of another size set a
new baseline instead."""


def smoothed(new: float, old: float | None, weight: float) -> float:
    """An exponentially weighted moving average's next value (`new` itself when there is no old
    one yet)."""
    return new if old is None else weight * new + (1 - weight) * old


def region_links(matrix: Any, members: Sequence[Sequence[int]], shards: int) -> list[LinkEstimate]:
    """Each region's link as the probe measured it: its slowest link to another region, the
    bandwidth shared by the region's shard owners' parallel flows, and the fastest round trip
    either way (noise only adds to a round trip, and a round trip out and back is one back and
    out: the pings of the links in both directions time it). `matrix`: a
    cloudtrain.probe.LinkMatrix by rank."""
    out = []
    for r, mine in enumerate(members):
        others = [j for q, m in enumerate(members) if q != r for j in m]
        pairs = [(i, j) for i in mine for j in others]
        bandwidth = min(matrix.beta[i][j] for i, j in pairs) / shards
        rtt = min(min(matrix.alpha[i][j], matrix.alpha[j][i]) for i, j in pairs)
        rtt = min(rtt, 60.0)
        out.append(LinkEstimate(bandwidth_in_range(bandwidth), rtt))
    return out


def intra_guess(
    matrix: Any, members: Sequence[Sequence[int]], shards: int, shard_numels: Sequence[int]
) -> float:
    """Seconds per step of the dense reduce-scatter and all-gather inside regions, from the
    probed links (a cloudtrain.probe.LinkMatrix, or None): each moves about the whole bucket
    (fp32) once."""
    pairs = [(i, j) for m in members for i in m for j in m if i != j]
    if matrix is None or not pairs:
        return 0.0
    slowest = min(matrix.beta[i][j] for i, j in pairs)
    return 2 * 4 * sum(shard_numels) * shards / slowest


def time_rungs(
    codecs: Codecs, ladder: Sequence[Rung], numel: int, senders: int, device: Any = "cpu"
) -> list[float]:
    """Seconds per element that encoding (with error feedback) a packet of `numel` elements and
    decoding `senders` of them take at each rung, on heavy-tailed data (the best of two).

    Compressing more is not always cheaper: on a CPU, top-k 10% costs more than top-k 1%. The
    "none" rung costs nothing here: a plan without compression is one plain all-reduce."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 3).to(device)
    costs = []
    for name, level in ladder:
        if name == "none":
            costs.append(0.0)
            continue
        codec, ef, best = codecs(name), ErrorFeedback(), math.inf
        for rep in range(2):
            t0 = time.perf_counter()
            wire = to_wire(ef.encode(0, x, codec, level, RandomKey(step=rep)))
            codec.accumulate([from_wire(wire, codec)] * senders, torch.zeros_like(x))
            best = min(best, time.perf_counter() - t0)
        costs.append(best / numel)
    return costs


def passive_bandwidth(
    samples: Sequence[tuple[int, float]],
    latency: float,
    current: float | None = None,
    significant: float = 0.002,
    burst: int = BURST_BYTES,
) -> float | None:
    """Bytes/s of a sender from (bytes, seconds) arrivals of its packets, or None if they say
    nothing about bandwidth: what packets that slowed are compared by (Estimates.observe_links).

    Packets of one size count with their fastest arrival (a late sender adds time); the
    latency is taken off, and a size whose fastest took no longer than it counts not at all: it
    was on its way before the exchange began (its receive was posted ahead), and its time says
    nothing of the link. Transfers that took under `significant` seconds
    in all are latency and scheduling noise, and so are packets that small at the `current`
    estimate however late they came: a small packet's time is its sender's lateness (regions
    run a step apart in a pipeline), not bandwidth, and must not shrink the estimate, or the
    controller would compress ever more. A link that fell while packets are small is found by
    the next re-probe. Packets all under `burst` bytes read nothing above `current` either: a
    token bucket let them through faster than the link's rate. Nor do packets whose time was
    mostly the latency taken off (more than half what is left): a rate read from the rest rests
    on the latency's estimate, and with at most that share taken off, a latency that was in fact
    none makes it read at most 1.5x the link (on the emulated 1000 Mbit/s link without delay, a
    1.9 ms estimate off packets of a few milliseconds read 1.6-1.8x).
    """
    fastest: dict[int, float] = {}
    for nbytes, seconds in samples:
        fastest[nbytes] = min(seconds, fastest.get(nbytes, math.inf))
    fastest = {n: t for n, t in fastest.items() if t > latency}
    moving = sum(t - latency for t in fastest.values())
    expected = sum(fastest) / current if current else math.inf
    if moving < significant or expected < significant:
        return None
    measured = bandwidth_in_range(sum(fastest) / moving)
    rests_on_latency = latency * len(fastest) > moving / 2
    if current and measured > current and (max(fastest) < burst or rests_on_latency):
        return None
    return measured


def _like_sized(nbytes: int, baseline: int) -> bool:
    """Whether packets whose largest is `nbytes` compare with a baseline set by ones whose
    largest was `baseline` (LIKE_SIZED)."""
    return baseline > 0 and 1 / LIKE_SIZED <= nbytes / baseline <= LIKE_SIZED


def _median(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def _throughput(samples: Sequence[int], compute_s: Sequence[float]) -> float | None:
    """Samples per second of compute over the steps timed (None: no samples counted)."""
    seconds = sum(compute_s[: len(samples)])
    return sum(samples) / seconds if seconds > 0 and sum(samples) > 0 else None


@dataclass(frozen=True)
class Interval:
    """Every rank's observations since the last decision (cloudtrain.stats.Observations, as
    gathered), summed up by region."""

    compute_s: float | None
    """A step's compute time: the slowest rank's median (the step waits for it)."""
    step_s: float | None
    """The median whole step."""
    arrivals: list[list[tuple[int, float]]]
    """By sender region: (bytes, seconds) of every packet timed on arrival."""
    stages: dict[str, float]
    """Seconds per step of each stage, on rank 0."""
    zstd: list[list[tuple[float, float, float, int]]]
    """By region: its owners' zstd trials (ratio, encode and decode s/B, bytes tried)."""
    quality: list[QualitySums]
    """By region: its owners' quality probes (cloudtrain.guard)."""
    probed: list[list[float]] | None = None
    """The re-probe, where one ran: bandwidth from region to region (rank 0's)."""
    throughput: list[float | None] | None = None
    """By rank: samples per second of its compute over the interval (None: none timed)."""
    probe_s: float = 0.0
    """The seconds the re-probe held every rank up, where one ran."""

    @classmethod
    def of(cls, gathered: list[dict[str, Any]], members: Sequence[Sequence[int]]) -> Interval:
        regions = range(len(members))
        quality = []
        for ranks in members:
            total = QualitySums()
            for rank in ranks:
                if gathered[rank].get("quality") is not None:
                    total = total + QualitySums(*gathered[rank]["quality"])
            quality.append(total)
        slowest = max((m for g in gathered if (m := _median(g["compute"])) is not None),
                      default=None)  # fmt: skip
        return cls(
            slowest,
            _median([s for g in gathered for s in g.get("steps", [])]),
            [[s for g in gathered for s in g["received"].get(r, [])] for r in regions],
            dict(gathered[0].get("stage_seconds", {})),
            [[t for rank in ranks for t in gathered[rank].get("zstd", [])] for ranks in members],
            quality,
            gathered[0].get("probed"),
            [_throughput(g.get("samples", []), g["compute"]) for g in gathered],
            float(gathered[0].get("probe_s", 0.0)),
        )  # fmt: skip


@dataclass
class Estimates:
    """The controller's smoothed measurements (module docstring)."""

    bandwidth: list[float | None]
    """By region: bytes/s of its packets to the other regions (None: not known)."""
    rtt: list[float]
    """By region: its round trip in seconds."""
    compute_s: float | None = None
    intra_s: float | None = None
    """The dense reduce-scatter and all-gather inside regions, seconds per step."""
    allreduce_s: float | None = None
    """A plain all-reduce's time per step, as measured."""
    allreduce_bw: float = 0.0
    """The slowest link's bandwidth when `allreduce_s` was measured."""
    unmodelled_s: float | None = None
    """Compressed steps' time beyond the model (thread hand-offs, per-bucket latency)."""
    since_probe: int = 0
    """Decisions since the links were last probed."""
    probe_every: int = PROBE_EVERY
    """Decisions from one re-probe to the next (module docstring)."""
    packet_rate: list[float | None] = field(default_factory=list)
    """By region: the rate its packets arrived at in the first interval after the last probe
    that timed them, or since their size last changed (what a drop is judged against: the
    packets' lateness is in it too)."""
    packet_bytes: list[int] = field(default_factory=list)
    """By region: the largest packet of the interval that set `packet_rate` (0: none yet)."""
    fall: list[float | None] = field(default_factory=list)
    """By region: a re-probe's reading well under the estimate, not yet confirmed by the next
    re-probe (None: none): one transfer that lost packets must not lower an estimate."""
    probe_s: float = 0.0
    """The seconds the last re-probe held every rank up (REPROBE_SHARE)."""
    step_s: float | None = None
    """A whole step's seconds, smoothed (REPROBE_SHARE)."""
    zstd_gains: dict[tuple[int, int], ZstdGain] = field(default_factory=dict)
    """(region, rung) -> the smoothed gain of the zstd stage there."""
    measured_steps: dict[tuple, tuple[float, float, float, int]] = field(default_factory=dict)
    """(rungs, staleness) -> (step seconds, slowest link, compute) as measured, and the
    decisions since (MEASURED_DECISIONS)."""
    throughput: list[float | None] = field(default_factory=list)
    """By rank: samples per second of its own compute (communication excluded), smoothed."""
    allreduce_age: int = 0
    """Decisions since `allreduce_s` was last measured (MEASURED_DECISIONS)."""
    jumped: bool = False
    """The plan in force took twice (or half) its time since the last re-probe (observe_step):
    the links may have moved where the estimates have not seen it yet (`unsettled`)."""

    def __post_init__(self) -> None:
        regions = len(self.bandwidth)  # the per-region lists, one entry per region
        self.packet_rate = list(self.packet_rate) or [None] * regions
        self.packet_bytes = list(self.packet_bytes) or [0] * regions
        self.fall = list(self.fall) or [None] * regions
        for name in ("rtt", "packet_rate", "packet_bytes", "fall"):
            if len(getattr(self, name)) != regions:
                raise ValueError(
                    f"Estimates.{name} has {len(getattr(self, name))} entries for {regions} "
                    "regions: give one per region (Estimates.start(regions) builds them)"
                )

    @classmethod
    def start(cls, regions: int) -> Estimates:
        return cls([None] * regions, [0.0] * regions)

    def links(self) -> list[LinkEstimate]:
        """The links for the cost model (an unknown bandwidth: as fast as a link can be)."""
        return [
            LinkEstimate(b if b is not None else MAX_BANDWIDTH, r)
            for b, r in zip(self.bandwidth, self.rtt, strict=True)
        ]

    @property
    def unsettled(self) -> bool:
        """Whether the estimates may be of before a change: a step-time jump, or a re-probe's
        low reading (`fall`), not yet answered by a re-probe. Until then the controller takes no
        lighter rung than the plan in force (Planner.decide): a link that fell shows in the
        compressed steps' time first, which the cost model charges to compressed rungs only
        (`unmodelled_s`), and the plain path at the old estimate would read the fastest."""
        return self.jumped or any(f is not None for f in self.fall)

    @property
    def slowest(self) -> float:
        return min((b for b in self.bandwidth if b is not None), default=MAX_BANDWIDTH)

    def observe_links(
        self, interval: Interval, warm: bool, shards: int, ewma: float, steps_per_decision: int = 1
    ) -> bool:
        """The interval's re-probe and packet arrivals into the bandwidth estimates; returns
        whether the links should be re-probed at the next decision.

        Only a probe - one flow of a size that shows bandwidth, with nothing else on the link -
        sets an estimate (but a link never probed: its packets' rate stands until a probe).
        A packet's time is its transfer and the one-way latency, plus its sender's lateness,
        less its earliness (module docstring), so packets neither lower an estimate, which
        would ask for more compression, smaller packets and a slower-looking link still, nor
        raise it (a sender early by half its transfer would read the link twice as fast).

        A re-probe that reads a link well under its estimate lowers it only once the next
        re-probe (asked for at the next decision) reads it low too (`fall`); re-probes otherwise
        keep to REPROBE_SHARE of the run's time (`steps_per_decision`: the steps from one
        decision to the next)."""
        self.since_probe += 1
        if interval.step_s is not None:
            self.step_s = smoothed(interval.step_s, self.step_s, ewma)
        if interval.probed is not None:
            # the interval's packets came before the probe: they say nothing beside it
            self._reprobed(interval.probed, shards, interval.probe_s)
            return False
        if any(f is not None for f in self.fall):
            return True  # a fall seen once: the next re-probe confirms it or not
        suspect = False
        for region in range(len(self.bandwidth)):
            samples = interval.arrivals[region] if warm else []
            old = self.bandwidth[region]
            measured = passive_bandwidth(samples, self.rtt[region] / 2, old)  # posted ahead
            if measured is None:
                continue
            if old is None:
                self.bandwidth[region] = measured
            largest, baseline = max(n for n, _ in samples), self.packet_rate[region]
            if baseline is None or not _like_sized(largest, self.packet_bytes[region]):
                self.packet_rate[region], self.packet_bytes[region] = measured, largest
            elif measured < SUSPECT * baseline:
                suspect = True
        affordable = self.affordable(steps_per_decision)
        early = suspect and self.since_probe >= max(STALE_DECISIONS, affordable)
        return early or self.since_probe >= max(self.probe_every, affordable)

    def affordable(self, steps_per_decision: int) -> int:
        """The fewest decisions from the last re-probe to the next that keep re-probes to
        REPROBE_SHARE of the run's time."""
        if not self.probe_s or not self.step_s:
            return 0
        return math.ceil(self.probe_s / (REPROBE_SHARE * self.step_s * steps_per_decision))

    def _reprobed(self, probed: list[list[float]], shards: int, seconds: float) -> None:
        """The re-probe (bandwidth from region to region, by region) sets every estimate but one
        it reads well under the estimate (by more than AGREES) for the first time: that reading
        waits in `fall` for the next re-probe, and the better of the two then sets it (a link
        that fell reads low twice; a step-time jump does not stand for the second reading: the
        steps are every link's, and on the hetero link a jump of eu's steps came with a reading
        of us's 1000 Mbit/s link at 170). The next re-probe comes twice as late if this one
        agreed with every estimate."""
        agreed, held = True, False
        for r in range(len(self.bandwidth)):
            slowest = min(probed[r][q] for q in range(len(probed)) if q != r)
            new, old = bandwidth_in_range(slowest / shards), self.bandwidth[r]
            if self.fall[r] is not None:  # the second reading of a fall
                new, self.fall[r] = max(new, self.fall[r]), None
            elif old is not None and new < (1 - AGREES) * old:
                self.fall[r], held = new, True
                continue
            agreed = agreed and old is not None and abs(new / old - 1) <= AGREES
            self.bandwidth[r] = new
        self.since_probe, self.packet_rate = 0, [None] * len(self.bandwidth)
        self.packet_bytes = [0] * len(self.bandwidth)
        self.probe_s, self.jumped = seconds, False
        if not agreed:
            self.probe_every = STALE_DECISIONS
        elif not held:  # (a reading held in `fall` moved nothing: its confirmation judges it)
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)

    def observe_stages(self, stages: dict[str, float], ewma: float) -> None:
        """What the dense parts cost per step (rank 0's view), where the interval ran them. The
        plain all-reduce of an uncompressed interval is the "none" rung's measured time; it holds
        while the links stay within 2x of what they were when it was measured, and for
        MEASURED_DECISIONS decisions, as a plan's step time does. Found much faster, it
        overstates the plain path; found much slower (a link that fell), it understates it,
        and held, it would send the plain path over a link it no longer fits: the cost model's
        bound (costs.plain_seconds without a ring) then stands for it until the plain path is
        measured again. observe_step drops it too, where the plan in force took twice its
        time."""
        intra = stages.get("intra_reduce", 0.0) + stages.get("intra_gather", 0.0)
        if intra > 0:
            self.intra_s = smoothed(intra, self.intra_s, ewma)
        slowest = self.slowest
        if stages.get("allreduce"):
            # smoothed: one slow interval is noise, a drop shows at once
            self.allreduce_s = smoothed(stages["allreduce"], self.allreduce_s, ewma)
            self.allreduce_bw, self.allreduce_age = slowest, 0
        elif self.allreduce_s is not None:
            self.allreduce_age += 1
            moved = not self.allreduce_bw / 2 <= slowest <= 2 * self.allreduce_bw
            if moved or self.allreduce_age > MEASURED_DECISIONS:
                self.allreduce_s, self.allreduce_age = None, 0

    def observe_unmodelled(self, compressed: float, model: float, ewma: float) -> None:
        """A compressed interval's measured seconds per step against its model's."""
        self.unmodelled_s = smoothed(max(compressed - model, 0.0), self.unmodelled_s, ewma)

    def observe_zstd(self, interval: Interval, ran: Sequence[int], ewma: float) -> None:
        """The interval's zstd trials (made at the rungs `ran`) into the smoothed gain of each
        (region, rung), weighted by the bytes tried."""
        for region, tried in enumerate(interval.zstd):
            total = sum(t[3] for t in tried)
            if total <= 0:
                continue
            mean = ZstdGain(
                total / sum(t[3] / t[0] for t in tried),
                sum(t[1] * t[3] for t in tried) / total,
                sum(t[2] * t[3] for t in tried) / total,
            )
            key = (region, ran[region])
            old = self.zstd_gains.get(key)
            if old is not None:
                pairs = zip(dataclasses.astuple(mean), dataclasses.astuple(old), strict=True)
                mean = ZstdGain(*(smoothed(m, o, ewma) for m, o in pairs))
            self.zstd_gains[key] = mean

    def observe_throughput(self, interval: Interval, ewma: float) -> None:
        """Each rank's samples per second over the interval, smoothed."""
        measured = interval.throughput or []
        if len(self.throughput) != len(measured):
            self.throughput = [None] * len(measured)
        for rank, rate in enumerate(measured):
            if rate is not None:
                self.throughput[rank] = smoothed(rate, self.throughput[rank], ewma)

    def observe_step(self, plan: tuple, step_s: float | None, ewma: float) -> bool:
        """The whole step time of the plan that ran (smoothed), kept with the link and compute it
        was measured at, one decision at a time; measurements go when the slowest link or the
        compute time has changed by 2x since, or where, measured over MEASURED_DECISIONS
        decisions before, they read faster than the plan that ran (a time of before that reads
        fast is the hazard; a slower one kept does no harm, and dropped it would be tried again).
        Where the plan that ran took over twice (or under half) what it took before, something
        the estimates have not seen yet has changed (a link that fell shows in the steps before a
        re-probe reads it): every other plan's time is of before, and goes, the plain
        all-reduce's (`allreduce_s`) with them; returns True then, for a re-probe, and the
        estimates are `unsettled` until it comes."""
        compute, slowest = self.compute_s or 1.0, self.slowest
        aged = {p: (*m[:3], m[3] + 1) for p, m in self.measured_steps.items()}
        jump = False
        if step_s is not None:
            old = aged.get(plan)
            if old is not None and not 0.5 <= step_s / old[0] <= 2:
                aged, self.allreduce_s, self.allreduce_age, old = {}, None, 0, None
                jump = self.jumped = True
            took = smoothed(step_s, None if old is None else old[0], ewma)
            aged[plan] = (took, slowest, compute, 0)
        now = aged.get(plan)
        self.measured_steps = {
            p: m
            for p, m in aged.items()
            if 0.5 <= m[1] / slowest <= 2
            and 0.5 <= m[2] / compute <= 2
            and not (m[3] > MEASURED_DECISIONS and now is not None and m[0] < now[0])
        }
        return jump

    def state_dict(self) -> dict[str, Any]:
        return {
            "bandwidth": list(self.bandwidth),
            "rtt": list(self.rtt),
            "compute_time": self.compute_s,
            "intra_s": self.intra_s,
            "allreduce_s": self.allreduce_s,
            "allreduce_bw": self.allreduce_bw,
            "unmodelled_s": self.unmodelled_s,
            "since_probe": self.since_probe,
            "probe_every": self.probe_every,
            "packet_rate": list(self.packet_rate),
            "packet_bytes": list(self.packet_bytes),
            "fall": list(self.fall),
            "probe_s": self.probe_s,
            "step_s": self.step_s,
            "zstd_gains": [
                [r, rung, *dataclasses.astuple(g)] for (r, rung), g in self.zstd_gains.items()
            ],
            "measured_steps": [
                [list(rungs), staleness, *m]
                for (rungs, staleness), m in self.measured_steps.items()
            ],
            "throughput": list(self.throughput),
            "allreduce_age": self.allreduce_age,
            "jumped": self.jumped,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Estimates:
        regions = len(state["bandwidth"])
        return cls(
            list(state["bandwidth"]),
            list(state["rtt"]),
            state["compute_time"],
            state["intra_s"],
            state["allreduce_s"],
            state["allreduce_bw"],
            state["unmodelled_s"],
            int(state.get("since_probe", 0)),
            int(state.get("probe_every", PROBE_EVERY)),
            list(state.get("packet_rate", [None] * regions)),
            list(state.get("packet_bytes", [0] * regions)),
            list(state.get("fall", [None] * regions)),
            float(state.get("probe_s", 0.0)),
            state.get("step_s"),
            {
                (int(r), int(rung)): ZstdGain(ratio, encode, decode)
                for r, rung, ratio, encode, decode in state.get("zstd_gains", [])
            },
            {
                (tuple(m[0]), int(m[1])): (m[2], m[3], m[4], int(m[5]) if len(m) > 5 else 0)
                for m in state.get("measured_steps", [])
            },  # (a state saved before the decisions since were kept: measured now)
            list(state.get("throughput", [])),
            allreduce_age=int(state.get("allreduce_age", 0)),
            # (a state saved before `jumped` was kept: settled; its re-probe, if one was asked
            # for, is one decision away and sized for the estimates)
            jumped=bool(state.get("jumped", False)),
        )

    def copy(self) -> Estimates:
        return Estimates.from_state(self.state_dict())
