"""The outer loop on shards (cloudtrain.fully_shard with config.outer), 2 regions x 2 ranks over
gloo: each rank keeps the outer copy and momentum of its own shard only; after every sync the
same shard is bit-identical in both regions (verify_replicas at each sync step), between syncs
the regions train apart; with lossless pseudo-gradients the sharded run equals CloudDDP's outer
loop on the same config to float tolerance; the diloco-4bit preset (4-bit pseudo-gradients with
error feedback) and the "diloco" preset's automatic schedule run on shards; host_copy keeps the
outer state in host memory and changes no bit.

    .venv/bin/python -m pytest tests/test_sharded_outer.py -x -q
"""

from __future__ import annotations

import dataclasses
import time

import torch
from distributed import run_ranks
from models import batch, loss_of, make_model
from test_sharded import REGIONS, shard

from cloudtrain import CompressionConfig
from cloudtrain.config import OuterConfig

H = 4
STEPS = 12
NESTEROV = OuterConfig(sync_every=H, codec="none", error_feedback=False, outer_lr=0.7,
                       outer_momentum=0.9)  # fmt: skip


def _train(model, opt, rank, steps):
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        opt.step()


def _sharded(rank, config, steps=STEPS):
    """Train a sharded model; the shards are verified across regions at every sync, and found
    apart between syncs. Returns its full parameters, the comm and whether the regions did
    train apart."""
    import cloudtrain

    model = shard(make_model(), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = cloudtrain.ShardedComm.of(model)
    apart = []

    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        opt.step()
        if config.outer.sync_every == "auto":
            continue
        if (step + 1) % config.outer.sync_every == 0:
            comm.verify_replicas()  # raises ReplicaMismatch unless every shard is the same
            continue
        try:
            comm.verify_replicas()
            apart.append(False)
        except cloudtrain.ReplicaMismatch:
            apart.append(True)
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return full, comm, any(apart)


def _outer_state_numel(comm) -> int:
    return sum(g.numel() for g in comm.outer.global_)


def _versus_clouddp(rank):
    import cloudtrain

    cfg = CompressionConfig(regions=",".join(REGIONS), outer=NESTEROV)
    sharded, comm, apart = _sharded(rank, cfg)
    local = sum(p.to_local().numel() for u in comm.units for p in u.params)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ddp = cloudtrain.CloudDDP(model, cfg, optimizer=opt)
    _train(ddp, opt, rank, STEPS)
    diff = max((a - b).abs().max().item() for a, b in zip(sharded, model.parameters(), strict=True))
    moved = max(
        (a - b).abs().max().item() for a, b in zip(sharded, make_model().parameters(), strict=True)
    )
    sizes = (_outer_state_numel(comm), local, _outer_state_numel(ddp))
    return diff, moved, apart, sizes


def _presets(rank):
    four = CompressionConfig.resolve("diloco-4bit", regions=REGIONS)
    four = dataclasses.replace(four, outer=dataclasses.replace(four.outer, sync_every=H))
    full4, comm4, apart = _sharded(rank, four)
    residuals = sum(r.numel() for r in comm4.outer.ef.residuals.values())
    host = dataclasses.replace(four, outer=dataclasses.replace(four.outer, host_copy=True))
    full_host, comm_host, _ = _sharded(rank, host)
    same = all(torch.equal(a, b) for a, b in zip(full4, full_host, strict=True))
    home = {str(g.device) for g in comm_host.outer.global_}
    _, comm_auto, _ = _sharded(rank, CompressionConfig.resolve("diloco", regions=REGIONS), 30)
    schedule = comm_auto.outer.schedule
    comm_auto.finish_outer()
    comm_auto.verify_replicas()
    wan = comm4.stats().wan_bytes_sent
    return apart, residuals, same, home, None if schedule is None else repr(schedule), wan


def _outer(rank, world):
    import cloudtrain

    cloudtrain.init()
    return _versus_clouddp(rank), _presets(rank)


def test_outer_loop_on_shards():
    t0 = time.monotonic()
    results = run_ranks(4, _outer, timeout=300)
    for rank, (versus, presets) in enumerate(results):
        diff, moved, apart, (outer_numel, local_numel, ddp_outer_numel) = versus
        assert moved > 1e-3
        assert diff <= 1e-5, f"rank {rank}: sharded outer loop differs from CloudDDP's by {diff}"
        assert apart, "between syncs the regions should train apart"
        assert outer_numel == local_numel, "the outer copy is of this rank's shard only"
        assert 2 * outer_numel <= ddp_outer_numel + 64, (outer_numel, ddp_outer_numel)
        apart4, residuals, same, home, schedule, wan = presets
        assert apart4 and residuals == local_numel and wan > 0
        assert same, "host_copy must not change a bit"
        assert home == {"cpu"}
        assert schedule is not None and schedule == results[0][1][4]
    print(f"outer loop on shards: {time.monotonic() - t0:.1f} s")
