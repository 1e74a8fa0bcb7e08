"""The pipelined exchange: step t's gradients cross regions while steps t+1 ... t+s compute, and
are applied at step t+s (staleness s; Pipe-SGD's bounded-staleness pipeline).

    staleness s = 0   every step applies its own summed gradient (exact synchronous SGD)
    staleness s > 0   step t applies the summed gradient of step t - s; the first s steps apply
                      zero; the round trip of step t's exchange is hidden behind s steps of
                      compute instead of sitting on every step's critical path

What a step applies is the same on every rank - the whole sum over all ranks of an earlier step,
decoded from the same bytes - so replicas stay bit-identical. The trade: an update computed s
steps ago (momentum SGD tolerates small s well; with Adam, measure). Pin staleness=0 in the
config for exact synchronous SGD.

Every bucket of a step is started at once (`CrossRegion.start`) and kept here with the layout it
was reduced in, as a `Delayed`. When a DDP bucket of step t is reduced, every flight due by then
(step <= t - s) that holds any of its parameters is finished (`CrossRegion.finish`: wait for the
packets, sum, gather in the region) and its values are written at those parameters' places in
DDP's bucket. Matching by parameter, not by bucket index, keeps flights right when DDP rebuilds
its buckets, after a resume, and when s changes (a larger s leaves some steps with nothing to
apply, a smaller one applies several flights at once: every gradient is applied exactly once).
In-flight exchanges are finished and kept, as values, in `comm_state_dict`, so a resume in the
middle of the pipeline continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .datapath import Exchange
from .layout import BucketLayout


@dataclass
class Delayed:
    """One bucket of one step in the pipeline: its exchange in flight, or its summed values."""

    step: int
    layout: BucketLayout
    exchange: Exchange | None
    values: torch.Tensor | None = None
    """(n,) the bucket's sum over all ranks once finished, laid out as `layout`."""
    applied: frozenset[int] = frozenset()
    """Parameters whose values were already written into a DDP bucket."""


class Pipeline:
    """The flights of the steps not yet applied, in the order they were started."""

    __slots__ = ("flights",)

    def __init__(self) -> None:
        self.flights: list[Delayed] = []

    def __bool__(self) -> bool:
        return bool(self.flights)

    def add(self, step: int, layout: BucketLayout, exchange: Exchange) -> None:
        self.flights.append(Delayed(step, layout, exchange))

    def apply_due(
        self,
        upto: int,
        signature: BucketLayout,
        buf: torch.Tensor,
        finish: Callable[[Exchange], torch.Tensor],
    ) -> None:
        """Write into `buf` (DDP's bucket with `signature`, zeroed) the values of every flight
        of step <= upto at its parameters' places, finishing flights as they are needed."""
        where = {pi: (offset, numel) for pi, offset, numel in signature}
        for flight in self.flights:
            if flight.step > upto:
                continue
            mine = [entry for entry in flight.layout if entry[0] in where]
            if not mine:
                continue
            if flight.values is None:
                flight.values = finish(flight.exchange).clone()
                flight.exchange = None
            for pi, offset, numel in mine:
                at, _ = where[pi]
                target = buf[at : at + numel]
                target.add_(flight.values[offset : offset + numel].to(target.dtype))
            flight.applied = flight.applied | {pi for pi, _, _ in mine}
        self.flights = [
            f for f in self.flights if len(f.applied) < len({pi for pi, _, _ in f.layout})
        ]

    def finish_all(self, finish: Callable[[Exchange], torch.Tensor]) -> None:
        """Finish every flight in the order they were started (all ranks together): before a
        checkpoint, so that what is in flight is saved as values, and before a re-probe of the
        links, so that nothing else crosses them."""
        for flight in self.flights:
            if flight.values is None:
                flight.values = finish(flight.exchange).clone()
                flight.exchange = None

    def state_dict(self) -> list[dict[str, Any]]:
        if any(f.values is None for f in self.flights):
            raise RuntimeError("pipeline: finish_all() before state_dict()")
        return [
            {
                "step": f.step,
                "layout": [list(t) for t in f.layout],
                "values": f.values.detach().cpu().clone(),
                "applied": sorted(f.applied),
            }
            for f in self.flights
        ]

    def load_state_dict(self, state: list[dict[str, Any]], device: torch.device | str) -> None:
        self.flights = [
            Delayed(
                int(f["step"]),
                tuple(tuple(int(v) for v in t) for t in f["layout"]),
                None,
                f["values"].to(device),
                frozenset(int(pi) for pi in f["applied"]),
            )
            for f in state
        ]
