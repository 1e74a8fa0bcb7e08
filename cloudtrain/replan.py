"""An elastic outer loop's H and codecs, planned again for the regions present (cloudtrain.elastic).

Where outer.sync_every or outer.codec is "auto", the outer loop of a fixed set of regions
chooses them once, from the links probed at start-up (cloudtrain.outer.choose_schedule). An
elastic run has no start-up across regions - each region is launched alone - and its set of links
changes with every region lost or joined. So its schedule is planned at syncs of fragment 0: the
first time at step DECIDE_AFTER (the provisional schedule before it syncs fragment 0 there and
nothing else), then at the first fragment-0 sync whose regions differ from those the schedule in
force was planned for:

1. the regions' first ranks (the shard-0 owners, on the quorum's cross group) gather every
   region's median inner step and the links it knows (`LinkBook`: by ordered pair of region
   names, the round trip and one flow's bandwidth, as the start-up probe measures them);
2. the pairs of present regions that no region has measured are probed on that group
   (cloudtrain.probe: pairs that share no link at the same time). Only a region never seen
   before costs a probe: a region lost costs none, one restarted under its name none;
3. every rank of the region gets the merged book and the slowest region's step (a broadcast in
   the region) and computes the same schedule: each present region's link is its slowest
   measured link to another present region, shared by its k shard owners (as
   cloudtrain.estimates.region_links has it at start-up), and choose_schedule picks H and each
   region's codec for them;
4. the schedule names the regions it is for (its codecs by name: a region that joins before the
   next plan sends with the ladder's most compressing codec) and starts its rounds at the sync
   that made it, which already sends with it. It takes effect only where the sync commits; a
   region whose sync failed takes it from its source when it joins again.

So a slow region lost lets the others sync more often and compress less from their next
fragment-0 sync, and its return puts back what its link needs, without measuring it again. The
books are announced in the quorum too, where `cloudtrain.quorum.decide` gives each joiner the
contributor with the fastest measured link to it. Links are not measured again while the
regions stay the same (the start-up probe of a fixed set of regions is not repeated either).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .costs import LinkEstimate, bandwidth_in_range
from .estimates import region_links
from .probe import LinkMatrix, probe, rounds

PROBE_REPEATS = 2
"""Timed messages of the size that shows a pair's bandwidth (the re-probe's count)."""
MIN_STEP_S = 1e-3
"""The step time a plan assumes where no present region has timed a step yet (all joining)."""


@dataclass(frozen=True)
class PairLink:
    """The link from one region to another as a probe measured it."""

    rtt: float
    """Seconds: the fastest one-byte round trip."""
    bandwidth: float
    """Bytes per second of one flow."""
    stamp: float
    """When the quorum whose plan measured it was made (the Lighthouse's clock): the newer of
    two measurements counts."""


class LinkBook:
    """The links between regions measured so far, by (from, to) region name (module docstring).
    Announced in the region's quorum data; part of an outer loop's elastic state (checkpointed;
    a resumed per-step region measures what its book lacks again)."""

    def __init__(self, pairs: dict[tuple[str, str], PairLink] | None = None) -> None:
        self.pairs: dict[tuple[str, str], PairLink] = dict(pairs or {})

    def rows(self) -> list[list[Any]]:
        """[from, to, rtt, bandwidth, stamp] per pair, sorted: the book as plain data."""
        return [[a, b, p.rtt, p.bandwidth, p.stamp] for (a, b), p in sorted(self.pairs.items())]

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[Any]]) -> LinkBook:
        return cls(
            {
                (str(a), str(b)): PairLink(float(rtt), float(bw), float(s))
                for a, b, rtt, bw, s in rows
            }
        )

    @classmethod
    def merged(cls, books: Iterable[LinkBook]) -> LinkBook:
        """One book of several (every rank that merges the same books gets the same one): per
        pair the newest measurement, ties to the faster one."""
        out: dict[tuple[str, str], PairLink] = {}
        for book in books:
            for pair, link in book.pairs.items():
                held = out.get(pair)
                if held is None or (link.stamp, link.bandwidth, -link.rtt) > (
                    held.stamp, held.bandwidth, -held.rtt,
                ):  # fmt: skip
                    out[pair] = link
        return cls(out)

    def missing(self, regions: Sequence[str]) -> list[tuple[int, int]]:
        """The ordered pairs of `regions` (by index) that have no measurement."""
        return [
            (i, j)
            for i, a in enumerate(regions)
            for j, b in enumerate(regions)
            if i != j and (a, b) not in self.pairs
        ]

    def record(
        self, regions: Sequence[str], pairs: Sequence[tuple[int, int]], matrix: Any, stamp: float
    ) -> None:
        """The probe's measurements (`matrix`: a cloudtrain.probe.LinkMatrix by index in
        `regions`) of `pairs`."""
        for i, j in pairs:
            self.pairs[regions[i], regions[j]] = PairLink(
                float(matrix.alpha[i][j]), float(matrix.beta[i][j]), stamp
            )

    def bandwidth(self, a: str, b: str) -> float | None:
        link = self.pairs.get((a, b))
        return None if link is None else link.bandwidth

    def matrix(self, regions: Sequence[str], per_region: int) -> LinkMatrix:
        """The links as a probe of `regions` (each of `per_region` ranks: rank r*k + i is rank i
        of region r) would have them: between two regions the pair's measurement, inside a
        region nothing in the way. Every pair must have been measured."""
        region = [r for r in range(len(regions)) for _ in range(per_region)]

        def pair(i: int, j: int) -> PairLink | None:
            a, b = region[i], region[j]
            return None if a == b else self.pairs[regions[a], regions[b]]

        n = len(region)
        links = [[pair(i, j) for j in range(n)] for i in range(n)]
        alpha = tuple(tuple(0.0 if p is None else p.rtt for p in row) for row in links)
        beta = tuple(tuple(math.inf if p is None else p.bandwidth for p in row) for row in links)
        return LinkMatrix(alpha, beta)

    def links(self, regions: Sequence[str], shards: int) -> list[LinkEstimate]:
        """Each of `regions`' link for the outer loop's schedule (module docstring): as the
        start-up probe's (estimates.region_links) - its slowest measured link to another of
        them, shared by its `shards` shard owners, and its fastest round trip. Every pair must
        have been measured."""
        if len(regions) == 1:  # alone: nothing crosses
            return [LinkEstimate(bandwidth_in_range(math.inf), 0.0)]
        return region_links(self.matrix(regions, 1), [[r] for r in range(len(regions))], shards)


def agree_links(
    book: LinkBook, regions: Sequence[str], cross: Any, mine: Any, stamp: float
) -> tuple[LinkBook, list[Any], int]:
    """On each present region's first rank (the group `cross` of the shard-0 owners, rank =
    region index): every region's book and value (`mine`: its step time, for the outer loop)
    gathered, the books merged, the pairs nobody measured probed. Returns the merged book, the
    values by region and the pairs probed - the same on every rank of `cross`. A peer lost
    raises (torch.distributed's error)."""
    gathered: list[Any] = [None] * len(regions)
    dist.all_gather_object(gathered, (book.rows(), mine), group=cross)
    merged = LinkBook.merged(LinkBook.from_rows(rows) for rows, _ in gathered)
    todo = merged.missing(regions)
    # a probe per round of pairs, each ending in a gathering: no rank waits on the group (whose
    # timeout is an exchange's) for more than one round of others' pairs
    for pairs in rounds(todo, list(range(len(regions)))):
        matrix = probe(cross, pairs=pairs, region=list(range(len(regions))), repeats=PROBE_REPEATS)
        merged.record(regions, pairs, matrix, stamp)
    return merged, [value for _, value in gathered], len(todo)
