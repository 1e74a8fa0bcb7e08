"""Module buffers in the outer loop (cloudtrain.buffers): DDP's per-step buffer broadcast stays
inside the region, and the regions' buffers are reconciled at the syncs (floating buffers
averaged, the others rank 0's), so every replica holds the same buffers after finish_outer()."""

from __future__ import annotations

import pytest
from distributed import run_over_wan
from test_netem import needs_root

SCRIPT = r"""
import json, statistics, time, zlib
import torch
import cloudtrain
from cloudtrain.config import OuterConfig

torch.set_num_threads(1)
cloudtrain.init()
import torch.distributed as dist

rank = dist.get_rank()


REGIONS = [dist.new_group([0, 1]), dist.new_group([2, 3])]


def run(outer):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    if outer:
        config = cloudtrain.CompressionConfig(
            outer=OuterConfig(sync_every=10, codec="quant", level=8)
        )
        ddp = cloudtrain.CloudDDP(net, config, optimizer=opt)
    else:  # the same model in its region alone: torch's DDP over the region's ranks
        ddp = torch.nn.parallel.DistributedDataParallel(net, process_group=REGIONS[rank // 2])
    gen = torch.Generator().manual_seed(rank)
    inner = []
    for step in range(STEPS):
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if step >= 5 and (step + 1) % 10:  # an inner step: no sync in it
            inner.append(time.perf_counter() - t0)
    if not outer:
        return statistics.median(inner), True, 0.0
    ddp.finish_outer()
    crc = 0
    for b in net.buffers():
        crc = zlib.crc32(b.detach().reshape(-1).view(torch.uint8).numpy().data, crc)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, crc)
    moved = float(net[1].running_mean.abs().sum())
    ddp.close()
    return statistics.median(inner), len(set(everyone)) == 1, moved


alone, _, _ = run(False)
inner, equal, moved = run(True)
print(json.dumps({"inner_s": inner, "region_alone_s": alone, "equal": equal, "moved": moved}))
dist.destroy_process_group()  # as README's scripts end (a live gloo group can abort at exit)
"""


@needs_root
@pytest.mark.timeout(300)
def test_buffers_stay_in_the_region_between_syncs_at_50mbit_180ms() -> None:
    """2 regions x 2 ranks, 50 Mbit/s and 180 ms: a BatchNorm model's inner steps cross no region
    (each well under the 90 ms one-way delay, as the same model's in its region alone - torch's
    DDP over the region's ranks; DDP's buffer broadcast across regions took >= 90 ms a step),
    and after finish_outer() every rank holds the same buffers."""
    reports = run_over_wan("bf", SCRIPT.replace("STEPS", "45"), 29571, mbit=50, rtt_ms=180)
    for r in reports:
        assert r["equal"] and r["moved"] > 0, r
        # far below the 90 ms one-way delay, and within 30 ms of the region alone's step (no
        # ratio: both are 2-7 ms steps on a shared machine, measured 0.53-1.9x of each other)
        assert r["inner_s"] < 0.045 and r["inner_s"] < r["region_alone_s"] + 0.03, r
