"""A reference replay of CloudDDP's compressed data path, with the codec library alone.

    replay = Replay(config, topo.members, world)
    expected = replay.step(step, layouts, flats)    # by bucket index; flats[b]: every rank's
                                                    # local gradient as DDP's bucket b lays it out

`step` gives what every rank's DDP buckets must hold after the hook: each rank's local gradient
scaled by 1/world in the bucket's dtype, residuals of a changed layout added back into their
parameters (as cloudtrain.layout does), summed in each region, cut into shards, every region's
shard compressed with its own error feedback (keyed (bucket, shard), random key (seed, step,
bucket * shards + shard, region)), decoded and summed in region order, cast back to the
bucket's dtype. It knows nothing of the hook, the communication thread or DDP, so a data path
that dropped, doubled, misplaced or mis-scaled anything differs from it. Regions of at most 2
ranks, whose dense sum does not depend on gloo's order.

It shares the codecs and ErrorFeedback with the system on purpose: what it checks is the data
path around them (scaling, layout, sharding, keys, sums), so a codec bug would be in both and
pass here. The codecs have their own oracle, built from the reference ops and not from the
codecs' composition code: `replay` in test_codecs.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cloudtrain import CompressionConfig
from cloudtrain.compress import ErrorFeedback, RandomKey

Layout = tuple[tuple[int, int, int], ...]
"""(parameter index, offset in the bucket, numel) of every parameter in the bucket."""


class Replay:
    """Every region's error feedback, replayed on every rank from every rank's gradients."""

    def __init__(
        self, config: CompressionConfig, members: Sequence[Sequence[int]], world: int
    ) -> None:
        self.config = config
        self.members = [list(m) for m in members]
        self.world = world
        self.shards = min(len(m) for m in self.members)
        self.codec = config.make_codec()
        self.level = self.codec.check_level(config.level)
        self.efs: dict[tuple[int, int, int], ErrorFeedback] = {}  # (region, bucket, shard)
        self.previous: dict[int, Layout] | None = None

    def step(
        self, step: int, layouts: Mapping[int, Layout], flats: Mapping[int, Sequence[torch.Tensor]]
    ) -> dict[int, torch.Tensor]:
        """What every DDP bucket must hold after the hook at `step`: layouts and flats (every
        rank's local gradient in that layout) by bucket index."""
        layouts = dict(layouts)
        scaled = {b: [f.mul(1.0 / self.world) for f in flats[b]] for b in layouts}  # as DDP
        if self.previous is not None and self.previous != layouts:
            self._release(layouts, scaled)
        self.previous = layouts
        return {b: self._bucket(step, b, layouts[b], scaled[b]) for b in sorted(layouts)}

    def _bucket(
        self, step: int, index: int, layout: Layout, scaled: list[torch.Tensor]
    ) -> torch.Tensor:
        n = sum(numel for _, _, numel in layout)
        dtype, shards = scaled[0].dtype, self.shards
        m = -(-n // shards)
        totals = []
        for members in self.members:
            total = torch.zeros(shards * m, dtype=dtype)
            for r in members:
                total[:n] += scaled[r]
            totals.append(total)
        expected = torch.zeros(shards * m, dtype=torch.float32)
        for j in range(shards):
            out = expected[j * m : (j + 1) * m]
            packets = []
            for region, total in enumerate(totals):
                ef = self.efs.setdefault(
                    (region, index, j), ErrorFeedback(self.config.residual_torch_dtype)
                )
                key = RandomKey(self.config.seed, step, index * shards + j, region)
                x = total[j * m : (j + 1) * m]
                packets.append(
                    ef.encode((index, j), x, self.codec, self.level, key, valid=n - j * m)
                )
            for packet in packets:  # in region order, as every rank sums them
                self.codec.accumulate([packet], out)
        return expected[:n].to(dtype)

    def _release(self, layouts: dict[int, Layout], scaled: dict[int, list[torch.Tensor]]) -> None:
        """DDP changed its buckets: each shard owner's residuals go back into its own gradient,
        at the parameters' new places."""
        place = {pi: (b, offset) for b, layout in layouts.items() for pi, offset, _ in layout}
        for (region, index, j), ef in self.efs.items():
            residual = ef.residuals[(index, j)].float()
            m = residual.numel()
            owner = self.members[region][j]
            for pi, offset, numel in self.previous[index]:
                a, b = max(j * m, offset), min((j + 1) * m, offset + numel)
                if a < b:
                    bucket, new_offset = place[pi]
                    start = new_offset + a - offset
                    view = scaled[bucket][owner][start : start + b - a]
                    view.add_(residual[a - j * m : b - j * m].to(view.dtype))
        self.efs = {}


def flat_gradient(params: Sequence[torch.nn.Parameter], layout: Layout) -> torch.Tensor:
    """The parameters' gradients as DDP lays them out in the bucket (a missing one as zeros,
    as DDP fills the slot of a parameter unused in this rank's forward)."""
    n = sum(numel for _, _, numel in layout)
    flat = torch.zeros(n, dtype=params[layout[0][0]].dtype)
    for pi, offset, numel in layout:
        grad = params[pi].grad
        if grad is not None:
            flat[offset : offset + numel] = grad.reshape(-1)
    return flat


def every_rank(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's `flat` (all_gather in float32, which holds bf16 and fp16 exactly)."""
    import torch.distributed as dist

    everyone = [torch.empty(flat.numel()) for _ in range(world)]
    dist.all_gather(everyone, flat.float())
    return [e.to(flat.dtype) for e in everyone]


class ShardedReplay:
    """What cloudtrain.fully_shard's exchange must leave in every rank's gradient shards,
    replayed from every rank's local (unsharded) gradient with the codec library alone.

        replay = ShardedReplay(config, members, units)    # units: the parameters' shapes, unit
        expected = replay.step(step, grads)                # by unit, in FSDP's order
        # grads[rank][u][i]: rank's local gradient of parameter i of unit u
        # expected[rank][u][i]: what that rank's shard of it must hold

    Per unit u and shard j (FSDP's dim-0 chunk j of each parameter, `torch.chunk`), each region's
    owner of shard j holds the region's mean of it (FSDP's reduce-scatter), times 1 / regions,
    laid end to end; it is compressed with that region's error feedback (keyed (u, j), random key
    (seed, step, u * shards + j, region)), and every region's packet is decoded and summed in
    region order. Knows nothing of FSDP's hooks, the communication thread or the pipeline: a path
    that dropped, doubled, misplaced or mis-scaled a shard differs from it. Shares the codecs and
    ErrorFeedback with the system, as `Replay` does (why: its docstring).
    """

    def __init__(
        self,
        config: CompressionConfig,
        members: Sequence[Sequence[int]],
        units: Sequence[Sequence[torch.Size]],
    ) -> None:
        self.config = config
        self.members = [list(m) for m in members]
        self.shards = len(self.members[0])
        self.units = [list(u) for u in units]
        self.codec = config.make_codec()
        self.level = self.codec.check_level(config.level)
        self.efs: dict[tuple[int, int, int], ErrorFeedback] = {}  # (region, unit, shard)

    def step(
        self, step: int, grads: Mapping[int, Sequence[Sequence[torch.Tensor]]]
    ) -> dict[int, list[list[torch.Tensor]]]:
        k, regions = self.shards, len(self.members)
        expected: dict[int, list[list[torch.Tensor]]] = {
            r: [[] for _ in self.units] for m in self.members for r in m
        }
        for u, shapes in enumerate(self.units):
            if not shapes:  # a unit holding no parameters of its own (a root): nothing crosses
                continue
            for j in range(k):
                flats = []
                for members in self.members:
                    pieces = []
                    for i in range(len(shapes)):
                        chunks = [_chunk(grads[r][u][i], k, j) for r in members]
                        mean = sum(chunks[1:], chunks[0]) / len(members)  # FSDP's reduce-scatter
                        pieces.append(mean.reshape(-1))
                    flats.append(torch.cat(pieces) * (1.0 / regions))
                out = torch.zeros(flats[0].numel())
                packets = []
                for region, x in enumerate(flats):
                    ef = self.efs.setdefault(
                        (region, u, j), ErrorFeedback(self.config.residual_torch_dtype)
                    )
                    key = RandomKey(self.config.seed, step, u * k + j, region)
                    packets.append(ef.encode((u, j), x, self.codec, self.level, key))
                for packet in packets:  # in region order, as every owner sums them
                    self.codec.accumulate([packet], out)
                at = 0
                for i, shape in enumerate(shapes):
                    like = _chunk(torch.zeros(shape), k, j)
                    piece = out[at : at + like.numel()].view(like.shape)
                    at += like.numel()
                    for members in self.members:
                        expected[members[j]][u].append(piece.to(grads[members[j]][u][i].dtype))
        return expected


def _chunk(t: torch.Tensor, k: int, j: int) -> torch.Tensor:
    """FSDP's shard j of k of `t` (dim 0; empty where torch.chunk gives fewer chunks)."""
    chunks = torch.chunk(t, k, dim=0)
    if j < len(chunks):
        return chunks[j]
    return t.new_zeros((0, *t.shape[1:]))
