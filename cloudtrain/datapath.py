"""The path of one gradient bucket across regions, as the steps a reader can follow in order.

    shard = path.reduce_in_region(buf)         # 2. dense reduce-scatter: each of the region's
                                               #    k ranks owns the region's sum of 1/k
    summed = path.exchange(shard.mine, ...)    # 3. compress with error feedback, swap packets
                                               #    with the same shard's owners in the other
                                               #    regions, check, decode and sum them
    path.gather_in_region(shard, summed)       # 4. dense all-gather of the summed shards

(Step 1, scaling by 1/world as DDP does, is the hook's.) `start` and `finish` chain them. Each step
is its own method so a pipelined mode can start step 3 now and finish it steps later, and an
outer loop (DiLoCo's pseudo-gradients) can call `exchange` on tensors that are no bucket at all.

Invariants kept here: every owner of a shard decodes every packet - its own from the same bytes
- and sums them in region order, so every rank gets the same bits; packet sizes come from the
plan, never from local measurements; every packet is checked (`from_wire(..., expect=...)`)
before anything it declares is believed or summed; every collective has a deadline
(`collectives.run_and_wait`). Padding (a bucket that does not divide into shards) is not gradient:
the error feedback keeps nothing for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .collectives import (
    PacketStream,
    Pending,
    ReceivesAhead,
    all_gather_single,
    exchange_sized,
    reduce_scatter_direct,
    reduce_scatter_single,
    run_and_wait,
)
from .compress import ErrorFeedback, Expected, RandomKey, cut, from_wire, to_wire, wire_zstd_gain
from .guard import QualityProbe
from .plan import ZSTD_LEVEL, Codecs, Plan, ceil_div
from .stats import TRIAL_BYTES, CommStats, Observer
from .topology import Topology


def pad_to_shards(buf: torch.Tensor, shards: int) -> tuple[torch.Tensor, int, int]:
    """(padded, n, m): `buf`'s n elements cut into `shards` pieces of m, the last padded with
    zeros (`buf` itself where they divide)."""
    n = buf.numel()
    m = ceil_div(n, shards)
    padded = buf if n == shards * m else torch.cat([buf, buf.new_zeros(shards * m - n)])
    return padded, n, m


@dataclass
class Shard:
    """A bucket cut into `topo.shards` pieces of m elements (the last padded with zeros), and
    the region's sum of this rank's piece."""

    padded: torch.Tensor
    """(shards * m,) the bucket, padded; the region's reduction and the result land here."""
    n: int
    """Elements of the bucket (without padding)."""
    m: int
    """Elements of one shard."""
    mine: torch.Tensor | None
    """(m,) the region's sum of this rank's shard, or None when this rank owns no shard."""


@dataclass
class Swap:
    """This rank's packet of one shard, on its way to the owners of the same shard in the other
    regions (`CrossRegion.issue`), until it is waited for, checked and summed
    (`CrossRegion.collect`)."""

    step: int
    plan: Plan
    bucket: int
    """The packet id (`CrossRegion.packet_id`)."""
    m: int
    """Elements of the shard."""
    dtype: torch.dtype
    device: torch.device
    pending: Pending
    arrivals: dict[int, tuple[int, float]] = field(default_factory=dict)


@dataclass
class Exchange:
    """A bucket whose exchange across regions was issued (`CrossRegion.start`) and is not yet
    finished (`CrossRegion.finish`)."""

    step: int
    index: int
    plan: Plan
    shard: Shard
    where: str
    swap: Swap | None = None
    """The packets' swap; None when this rank owns no shard (it only takes part in the gather)."""


class _Received:
    """A swap's Pending whose packets, once waited for, are cut to their own size where their
    sender zstd-compressed them (received into a buffer of the size without zstd) and, with
    `timings`, leave each sender's (bytes, seconds) in `arrivals`."""

    __slots__ = ("_arrivals", "_pending", "_timings", "_zstd")

    def __init__(
        self,
        pending: Pending,
        zstd: list[bool],
        timings: dict[int, float] | None,
        arrivals: dict[int, tuple[int, float]],
    ) -> None:
        self._pending, self._zstd, self._timings, self._arrivals = (
            pending,
            zstd,
            timings,
            arrivals,
        )

    def wait(self) -> list[torch.Tensor]:
        wires = [
            cut(wire) if zstd else wire
            for wire, zstd in zip(self._pending.wait(), self._zstd, strict=True)
        ]
        for region, seconds in (self._timings or {}).items():
            self._arrivals[region] = (wires[region].numel(), seconds)
        return wires


class CrossRegion:
    """The data path's state across steps: topology, codecs, error feedback, counters."""

    __slots__ = ("codecs", "config", "ef", "observer", "probe", "stats", "timeout", "topo")

    def __init__(
        self,
        config: Any,
        topo: Topology,
        codecs: Codecs,
        ef: ErrorFeedback | None,
        stats: CommStats,
        observer: Observer | None = None,
        probe: QualityProbe | None = None,
    ) -> None:
        self.config = config
        self.topo = topo
        self.codecs = codecs
        self.ef = ef
        self.stats = stats
        self.observer = observer  # set: time every packet's arrival (packets that slowed)
        self.probe = probe  # set: measure how far each packet's update is from the exact one
        self.timeout = config.timeout

    def state_dict(self) -> dict[str, Any]:
        """What the data path keeps across steps: residuals, counters, the quality probe."""
        return {
            "residuals": None if self.ef is None else self.ef.state_dict(),
            "stats": self.stats.state_dict(),
            "quality_probe": None if self.probe is None else self.probe.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ef is not None:
            residuals = state["residuals"] or {}
            if "dtype" not in residuals:  # saved before residuals had ErrorFeedback's own form
                dtype = str(self.ef.dtype).removeprefix("torch.")
                residuals = {"dtype": dtype, "residuals": residuals}
            self.ef.load_state_dict(residuals)
        self.stats.load_state_dict(state["stats"])
        if self.observer is not None:
            self.observer.reset()  # stage times start again from zero
        if self.probe is not None and state.get("quality_probe") is not None:
            self.probe.load_state_dict(state["quality_probe"])

    def start(self, buf: torch.Tensor, plan: Plan, step: int, index: int, where: str) -> Exchange:
        """Steps 2 and 3's first half: reduce in the region, encode, issue the swap."""
        shard = self.reduce_in_region(buf, where)
        flight = Exchange(step, index, plan, shard, where)
        if shard.mine is not None:
            valid = shard.n - self.topo.shard * shard.m
            flight.swap = self.issue(shard.mine, plan, step, index, where, valid)
        return flight

    def finish(self, flight: Exchange) -> torch.Tensor:
        """Steps 3's second half and 4: wait for the packets, check and sum them, gather in the
        region. Returns the bucket's sum over all ranks (n elements, a view of shard.padded)."""
        shard = flight.shard
        summed = None if flight.swap is None else self.collect(flight.swap)
        self.gather_in_region(shard, summed, flight.where)
        return shard.padded[: shard.n]

    def exchange(
        self, x: torch.Tensor, plan: Plan, step: int, index: int, n: int, where: str
    ) -> torch.Tensor:
        """This rank's shard `x` of bucket `index` (n elements in all): compress, swap, sum.
        Returns the sum over regions, float32, on x's device (no reduction or gather in the
        region: for tensors every rank of a region already holds, e.g. pseudo-gradients)."""
        valid = n - self.topo.shard * x.numel()
        return self.collect(self.issue(x, plan, step, index, where, valid))

    def issue(
        self, x: torch.Tensor, plan: Plan, step: int, index: int, where: str, valid: int
    ) -> Swap:
        """Step 3's first half for this rank's shard `x` of bucket `index`: encode it with error
        feedback and issue its swap (`collect` waits for it). Elements from `valid` on are
        padding."""
        bucket, m = self.packet_id(index), x.numel()
        wire = self.encode(x, plan, step, (index, self.topo.shard), bucket, valid=valid)
        arrivals: dict[int, tuple[int, float]] = {}
        pending = self.swap(wire, plan, bucket, (m, x.dtype), where, arrivals)
        return Swap(step, plan, bucket, m, x.dtype, x.device, pending, arrivals)

    def collect(self, swap: Swap) -> torch.Tensor:
        """Step 3's second half: wait for the packets of `swap`, check, decode and sum them in
        region order. Returns the sum over regions, float32, on the shard's device."""
        with self.stats.timed("exchange"):
            wires = swap.pending.wait()
        if self.observer is not None:
            for region, (nbytes, seconds) in swap.arrivals.items():
                self.observer.arrived(region, nbytes, seconds)
        with self.stats.timed("decode"):
            return self.accumulate(
                wires, swap.plan, swap.step, swap.bucket, swap.m, swap.dtype, swap.device
            )

    def packet_id(self, index: int) -> int:
        """The id that names this rank's packets of bucket `index` (with the seed, step and
        sender region: their RandomKey): one per (bucket, shard)."""
        return index * self.topo.shards + self.topo.shard

    # -- 2. inside the region -----------------------------------------------------------------
    def reduce_in_region(self, buf: torch.Tensor, where: str) -> Shard:
        topo = self.topo
        padded, n, m = pad_to_shards(buf, topo.shards)
        shards = topo.shards
        members = topo.members[topo.region]
        group = topo.groups.get(f"region{topo.region}")
        with self.stats.timed("intra_reduce"):
            if len(members) == shards and shards > 1:
                mine = buf.new_empty(m)
                if buf.is_cuda:
                    run_and_wait(
                        "intra-region reduce-scatter",
                        members,
                        self.timeout,
                        lambda: reduce_scatter_single(mine, padded, group=group, async_op=True),
                        where,
                    )
                else:  # gloo: point-to-point beats its reduce_scatter
                    reduce_scatter_direct(
                        mine, padded, members, topo.local_index, group, self.timeout, where
                    )
            elif len(members) > 1:  # a region larger than the smallest: reduce all, owners slice
                run_and_wait(
                    "intra-region all-reduce",
                    members,
                    self.timeout,
                    lambda: dist.all_reduce(padded, group=group, async_op=True),
                    where,
                )
                local = topo.local_index
                mine = padded[local * m : (local + 1) * m] if topo.shard is not None else None
            else:
                mine = padded
        return Shard(padded, n, m, mine)

    # -- 3. across regions ----------------------------------------------------------------------
    def encode(
        self,
        x: torch.Tensor,
        plan: Plan,
        step: int,
        ef_key: Any,
        bucket: int,
        valid: int,
    ) -> torch.Tensor:
        """This region's packet for `x`, with error feedback (also at "none": what earlier
        levels kept back goes out now), through the zstd stage where the plan says. Elements
        from `valid` on are padding. Once per decision interval, with an observer, the zstd
        stage is also tried on (a sample of) the packet without it: what it would save and cost
        at this rung, for the controller's choice."""
        me = self.topo.region
        name, level = plan.senders[me]
        codec = self.codecs(name)
        key = RandomKey(self.config.seed, step, bucket, me)
        zstd = ZSTD_LEVEL if plan.zstd_for(me) else None
        sampled = self._sample(ef_key, x, valid)
        with self.stats.timed("encode"):
            if self.ef is not None:
                packet = self.ef.encode(ef_key, x, codec, level, key, valid=valid)
            else:
                packet = codec.encode(x, level, key)
            wire = to_wire(packet, zstd)
        if sampled is not None:
            with self.stats.timed("guard"):
                at, exact, before = sampled
                after = self.ef.residuals.get(ef_key) if self.ef is not None else None
                after = None if after is None else after[at]
                self.probe.observe(ef_key, step, plan.staleness, exact, before, after)
        if self.observer is not None and self.observer.zstd_trial_due():
            plain = wire if zstd is None else to_wire(packet)
            sample = min(plain.numel(), TRIAL_BYTES // 4)
            gain = wire_zstd_gain(plain, ZSTD_LEVEL, sample_bytes=sample)
            self.observer.zstd_tried(gain, sample)
        return wire

    def _sample(
        self, ef_key: Any, x: torch.Tensor, valid: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """With a quality probe: its positions of this packet stream, the exact gradient there
        and the residual there before encoding (which rewrites the residual in place)."""
        if self.probe is None:
            return None
        with self.stats.timed("guard"):
            at = self.probe.positions(ef_key, min(valid, x.numel())).to(x.device)
            residual = self.ef.residuals.get(ef_key) if self.ef is not None else None
            before = None if residual is None else residual[at].clone()
            return at, x[at].clone(), before

    def swap(
        self,
        wire: torch.Tensor,
        plan: Plan,
        bucket: int,
        shard: tuple[int, torch.dtype],
        where: str,
        arrivals: dict[int, tuple[int, float]],
    ) -> Pending:
        """Issue the swap of this shard's packets (packet id `bucket`; `shard`: its elements and
        dtype) with the other regions' owners; wait() gives every region's packet in region
        order (this rank's own included). With an observer, `arrivals` gets (bytes, seconds
        until it arrived) per sender region."""
        m, dtype = shard
        topo = self.topo
        peers = topo.shard_owners(topo.shard)
        group = topo.group(f"cross{topo.shard}")
        self.stats.wan_bytes_sent += wire.numel() * (len(peers) - 1)
        # per-sender sizes known to all from the plan (a zstd sender's: at most that);
        # arrivals timed for the controller
        sizes = [self.codecs.wire_nbytes(rung, m, dtype) for rung in plan.senders]
        timings: dict[int, float] | None = {} if self.observer is not None else None
        pending = exchange_sized(
            wire,
            sizes,
            peers,
            topo.region,
            group,
            self.timeout,
            where,
            timings,
            shorter=plan.zstd_for(topo.region),
            stream=self._stream(group, plan, bucket, m, dtype),
        )
        zstd = [plan.zstd_for(r) for r in range(len(sizes))]
        if timings is None and not any(zstd):
            return pending
        return _Received(pending, zstd, timings, arrivals)

    def receive_buffers(self) -> list[torch.Tensor]:
        """The buffers of the receives posted ahead on this rank's group across regions (held
        while the group lives: collectives.ReceivesAhead); none before its first swap."""
        group = self.topo.groups.get(f"cross{self.topo.shard}")
        return [] if group is None else ReceivesAhead.of(group).buffers()

    def _stream(
        self, group: Any, plan: Plan, bucket: int, m: int, dtype: torch.dtype
    ) -> PacketStream:
        """The swap's packet stream (collectives.ReceivesAhead): one per packet id, element
        count, dtype and the most bytes a packet of it can have - the largest at any rung the
        group's packets were sent at, so a receive posted ahead fits the next packet whatever
        rung it comes at; a rung whose packet is larger than any before starts a new stream.
        Every owner of the shard sees the same plans at the same swaps, so all name the same
        stream."""
        receives = ReceivesAhead.of(group)
        receives.rungs.update(plan.senders)
        nbytes = max(self.codecs.wire_nbytes(rung, m, dtype) for rung in receives.rungs)
        return receives.stream((bucket, m, str(dtype)), nbytes)

    def accumulate(
        self,
        wires: list[torch.Tensor],
        plan: Plan,
        step: int,
        bucket: int,
        m: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Check every packet against what the plan says it must be (`Expected`: step, bucket,
        sender, numel, level, dtype, zstd), decode, and sum in region order."""
        out = torch.zeros(m, dtype=torch.float32, device=device)
        for region, data in enumerate(wires):
            name, level = plan.senders[region]
            codec = self.codecs(name)
            key = RandomKey(self.config.seed, step, bucket, region)
            expect = Expected(m, level, key, zstd=plan.zstd_for(region), dtype=dtype)
            packet = from_wire(data, codec, expect=expect)
            if device.type != "cpu":
                parts = tuple(p.to(device, non_blocking=True) for p in packet.parts)
                packet = dataclasses.replace(packet, parts=parts)
            codec.accumulate([packet], out)
        return out

    # -- 4. inside the region -------------------------------------------------------------------
    def gather_in_region(self, shard: Shard, summed: torch.Tensor | None, where: str) -> None:
        """Every rank of the region gets every summed shard, in `shard.padded`."""
        topo = self.topo
        padded, m, shards = shard.padded, shard.m, topo.shards
        members = topo.members[topo.region]
        group = topo.groups.get(f"region{topo.region}")
        if summed is not None:
            summed = summed.to(padded.dtype)
        with self.stats.timed("intra_gather"):
            if len(members) == shards and shards > 1:
                run_and_wait(
                    "intra-region all-gather",
                    members,
                    self.timeout,
                    lambda: all_gather_single(padded, summed, group=group, async_op=True),
                    where,
                )
            elif len(members) > 1:
                local = topo.local_index
                if summed is not None:
                    padded[local * m : (local + 1) * m] = summed
                for j in range(shards):
                    piece = padded[j * m : (j + 1) * m]
                    run_and_wait(
                        "intra-region broadcast",
                        members,
                        self.timeout,
                        lambda piece=piece, j=j: dist.broadcast(
                            piece, src=members[j], group=group, async_op=True
                        ),
                        where,
                    )
            else:
                padded.copy_(summed)
