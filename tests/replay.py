"""A reference replay of CloudDDP's compressed data path, with the codec library alone.

    replay = Replay(config, topo.members, world)
    expected = replay.bucket(step, layout, flats)   # flats: every rank's local gradient as
                                                    # DDP's bucket `layout` lays it out

`bucket` is what every rank's DDP bucket must hold after the hook: each rank's local gradient
scaled by 1/world in the bucket's dtype, residuals of a changed layout added back into their
parameters (as cloudtrain.layout does), summed in each region, cut into shards, every region's
shard compressed with its own error feedback (keyed (bucket, shard), random key (seed, step,
bucket, region)), decoded and summed in region order, cast back to the bucket's dtype. It knows
nothing of the hook, the communication thread or DDP, so a data path that dropped, doubled,
misplaced or mis-scaled anything differs from it. One DDP bucket (the models in these tests are
small); regions of at most 2 ranks, whose dense sum does not depend on gloo's order.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        self.efs: dict[tuple[int, int], ErrorFeedback] = {}  # (region, shard) -> its owner's
        self.previous: Layout | None = None

    def bucket(self, step: int, layout: Layout, flats: Sequence[torch.Tensor]) -> torch.Tensor:
        """The bucket every rank must hold after the hook at `step` (flats: one per rank)."""
        n = sum(numel for _, _, numel in layout)
        dtype = flats[0].dtype
        shards = self.shards
        m = -(-n // shards)
        scaled = [f.mul(1.0 / self.world) for f in flats]  # as DDP: times the reciprocal
        if self.previous is not None and self.previous != layout:
            self._release(layout, scaled, m)
        self.previous = layout
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
                    (region, j), ErrorFeedback(self.config.residual_torch_dtype)
                )
                key = RandomKey(self.config.seed, step, j, region)
                x = total[j * m : (j + 1) * m]
                packets.append(ef.encode((0, j), x, self.codec, self.level, key, valid=n - j * m))
            for packet in packets:  # in region order, as every rank sums them
                self.codec.accumulate([packet], out)
        return expected[:n].to(dtype)

    def _release(self, layout: Layout, scaled: list[torch.Tensor], m: int) -> None:
        """DDP changed its bucket: each shard owner's residual goes back into its own gradient,
        at the parameters' new places."""
        new_offset = {pi: offset for pi, offset, _ in layout}
        for (region, j), ef in self.efs.items():
            residual = ef.residuals[(0, j)].float()
            owner = self.members[region][j]
            for pi, offset, numel in self.previous:
                a, b = max(j * m, offset), min((j + 1) * m, offset + numel)
                if a < b:
                    start = new_offset[pi] + a - offset
                    view = scaled[owner][start : start + b - a]
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
