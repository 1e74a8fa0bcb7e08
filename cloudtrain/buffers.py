"""Module buffers in an outer-loop run: they stay inside the region between syncs.

DDP broadcasts every buffer from rank 0 before each forward over its process group, which in an
outer-loop run spans the regions: a round trip across the WAN every inner step for any model with
buffers (BatchNorm's running statistics, a transformer's registered mask), and a region that
fails between syncs would stop the others' steps. So in outer-loop mode CloudDDP gives DDP
broadcast_buffers=False and does the broadcast itself, from the region's first rank, inside the
region (`in_region`, before every training forward, as DDP would). The regions reconcile their
buffers at the syncs (`across_regions`, once per sync of fragment 0 and in sync_all):

- floating-point buffers (running means and variances) are averaged over every rank - the
  statistics of all regions' data, as the parameters are averaged;
- the others (counters such as num_batches_tracked, integer or boolean masks) are rank 0's
  (region 0's): they are the same everywhere or count the same steps.

In an elastic run (cloudtrain.elastic) each region is its own torch.distributed world, so DDP's
own broadcast already stays in the region; there the buffers are reconciled the same way at each
committed sync over the quorum's cross group, and a joiner receives its source's.

    buffers = RegionBuffers.of(module, region_group)   # None when the module has no buffers
    buffers.in_region()                                 # before a training forward
    buffers.across_regions(group, timeout)              # at a sync, every rank of every region
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .collectives import run_and_wait

BROADCAST_BUCKET_BYTES = 256 * 1024 * 1024
"""Buffers are broadcast in buckets of at most this many bytes (DDP's default is 250 MB)."""


class RegionBuffers:
    """The buffers of one module (module docstring)."""

    def __init__(self, buffers: Sequence[torch.Tensor], region_group: Any) -> None:
        self.buffers = list(buffers)
        self.floating = [b for b in self.buffers if b.is_floating_point()]
        self.other = [b for b in self.buffers if not b.is_floating_point()]
        self.region_group = region_group
        """The region's process group (None: a region of one rank)."""

    @classmethod
    def of(cls, module: torch.nn.Module, region_group: Any) -> RegionBuffers | None:
        buffers = [b for b in module.buffers() if b is not None]
        return cls(buffers, region_group) if buffers else None

    @torch.no_grad()
    def in_region(self) -> None:
        """The region's first rank's buffers to its other ranks (group rank 0)."""
        if self.region_group is not None:
            dist._broadcast_coalesced(self.region_group, self.buffers, BROADCAST_BUCKET_BYTES, 0)

    @torch.no_grad()
    def across_regions(self, group: Any, timeout: timedelta, where: str = "") -> None:
        """Floating buffers averaged over `group`'s ranks, the others its rank 0's (gloo, CPU).
        Every rank of `group` calls it; `timeout` bounds it (CommError)."""
        if group is None:
            return
        size = dist.get_world_size(group)
        peers = list(range(size))
        if self.floating:
            flat = torch.cat([b.detach().float().flatten().cpu() for b in self.floating])
            run_and_wait(
                "buffer average", peers, timeout,
                lambda: dist.all_reduce(flat, group=group, async_op=True), where,
            )  # fmt: skip
            flat /= size
            _unflatten_into(flat, self.floating)
        for b in self.other:
            host = b.detach().cpu().clone()
            run_and_wait(
                "buffer broadcast", peers, timeout,
                lambda host=host: dist.broadcast(host, group_src=0, group=group, async_op=True),
                where,
            )  # fmt: skip
            b.copy_(host)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
