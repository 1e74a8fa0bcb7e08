"""Checkpoints of cloudtrain.fully_shard through torch.distributed.checkpoint
(cloudtrain.checkpoint.ShardedCheckpointer), 2 regions x 2 ranks over gloo: a run saved mid-way
and resumed in new processes ends bit for bit where an uninterrupted run ends - per step with a
pipeline's sums in flight (quant4, staleness 1) and with the outer loop with a fragment in flight
(diloco-4bit, 2 fragments, overlap 1); a step cut short (no manifest) is never loaded; the comm
state refuses another mesh's ranks.

    .venv/bin/python -m pytest tests/test_sharded_checkpoint.py -x -q
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
from distributed import run_ranks
from models import batch, loss_of, make_model
from test_sharded import REGIONS, shard

STEPS, SAVE_AT = 10, 6
MODES = ("pipeline", "outer")


def _config(mode):
    from cloudtrain import CompressionConfig

    if mode == "pipeline":
        return CompressionConfig.resolve("quant4", regions=REGIONS, staleness=1)
    cfg = CompressionConfig.resolve("diloco-4bit", regions=REGIONS)
    outer = dataclasses.replace(cfg.outer, sync_every=4, fragments=2, overlap=1)
    return dataclasses.replace(cfg, outer=outer)


def _span(rank, mode, folder, start, stop, save_at=None):
    """Steps start..stop of a run (resumed from `folder` when start > 0); its final shards."""
    import cloudtrain
    from cloudtrain.checkpoint import ShardedCheckpointer

    model = shard(make_model(), _config(mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = cloudtrain.ShardedComm.of(model)
    ckpt = ShardedCheckpointer(folder)
    if start:
        assert ckpt.load(model, opt, comm) == start
    for step in range(start, stop):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        opt.step()
        if step + 1 == save_at:
            ckpt.save(step + 1, model, opt, comm)
    if mode == "pipeline":
        comm.verify_replicas()
    out = [p.to_local().detach().clone() for p in model.parameters()]
    comm.close()
    return out


def _first(rank, world, root):
    import cloudtrain

    cloudtrain.init()
    whole = {m: _span(rank, m, os.path.join(root, "unused"), 0, STEPS) for m in MODES}
    for m in MODES:
        _span(rank, m, os.path.join(root, m), 0, SAVE_AT, SAVE_AT)
    if rank == 0:  # a later save cut short: its folder is there, its manifest is not
        os.makedirs(os.path.join(root, "pipeline", "step-00000009", "region-0"))
    return whole


def _resumed(rank, world, root):
    import cloudtrain
    from cloudtrain.checkpoint import ShardedCheckpointer

    cloudtrain.init()
    resumed = {m: _span(rank, m, os.path.join(root, m), SAVE_AT, STEPS) for m in MODES}
    # the comm state of the saved run does not load into another rank's shards
    model = shard(make_model(), _config("pipeline"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = cloudtrain.ShardedComm.of(model)
    state = torch.load(os.path.join(root, "pipeline", "step-00000006", "rank-00000.pt"))
    comm.set_up()  # every rank (a collective); then a load that only rank 1 tries
    refused = None
    if rank == 1:
        try:
            comm.load_comm_state_dict(state)
        except ValueError as e:
            refused = str(e)
    ShardedCheckpointer(os.path.join(root, "pipeline")).load(model, opt, comm, comm_state=False)
    return resumed, refused


def test_resume_from_a_dcp_checkpoint_is_bit_identical(tmp_path):
    t0 = time.monotonic()
    whole = run_ranks(4, _first, str(tmp_path), timeout=300)
    assert not os.path.exists(tmp_path / "pipeline" / "step-00000009" / "manifest.json")
    resumed = run_ranks(4, _resumed, str(tmp_path), timeout=300)
    for rank in range(4):
        for mode in MODES:
            for a, b in zip(whole[rank][mode], resumed[rank][0][mode], strict=True):
                assert torch.equal(a, b), f"rank {rank} {mode}: resumed run differs"
    assert "each rank loads its own" in resumed[1][1]
    print(f"sharded checkpoint: {time.monotonic() - t0:.1f} s")
