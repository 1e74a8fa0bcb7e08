"""cloudtrain.fully_shard's errors and failures, on 2 regions x 2 ranks over gloo: bad inputs
(a mesh that is not the regions', several dtypes in one unit, an optimizer built before
sharding, units sharded differently in the two regions, a unit left to torch's own fully_shard
in every region or in one, a config given after the mesh was made, CloudDDP around a sharded
model or inside one)
raise a ValueError naming the fix, on every rank, before the first step's exchange; NaN in one
rank's gradient raises on every rank ("raise") or reaches every rank without poisoning the
residuals ("pass"); stats() counts what crossed; a killed peer is a CommError.

    .venv/bin/python -m pytest tests/test_sharded_errors.py -x -q
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from distributed import RankFailed, run_ranks
from models import batch, loss_of, make_model
from test_sharded import REGIONS, shard

BAD = (
    "mesh", "dtypes", "optimizer", "units", "torch_unit", "torch_unit_us", "late_config",
    "ddp_around", "shard_inside", "twice",
)  # fmt: skip


def _bad(kind, rank):
    """The error one bad input raises (None: none was raised)."""
    import cloudtrain
    from cloudtrain import CompressionConfig

    cfg = CompressionConfig.resolve("quant4", regions=REGIONS)
    model = make_model()
    try:
        if kind == "mesh":  # one flat dimension: not regions x ranks
            from torch.distributed.device_mesh import init_device_mesh

            cloudtrain.fully_shard(model, mesh=init_device_mesh("cpu", (4,)), config=cfg)
        elif kind == "dtypes":
            model[0].bias = torch.nn.Parameter(model[0].bias.detach().to(torch.bfloat16))
            shard(model, cfg)
        elif kind == "optimizer":
            opt = torch.optim.AdamW(model.parameters())
            shard(model, cfg)
            loss_of(model, *batch(rank, 0)).backward()
            opt.step()
        elif kind == "units":  # region "eu" leaves out the middle block
            shard(model, cfg, (0, 2, 4) if rank < 2 else (0, 4))
            loss_of(model, *batch(rank, 0)).backward()
        elif kind in ("torch_unit", "torch_unit_us"):  # in every region, or in "us" only
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            if kind == "torch_unit" or rank < 2:
                torch_fully_shard(model[2], mesh=cloudtrain.device_mesh(cfg)["shard"])
            else:
                cloudtrain.fully_shard(model[2], config=cfg)
            cloudtrain.fully_shard(model[0], config=cfg)
            cloudtrain.fully_shard(model, config=cfg)
            loss_of(model, *batch(rank, 0)).backward()
        elif kind == "late_config":  # the blocks' calls made the mesh of the default regions
            for i in (0, 2, 4):
                cloudtrain.fully_shard(model[i])
            cloudtrain.fully_shard(model, config=cfg)
        elif kind == "twice":
            shard(model, cfg)
            cloudtrain.fully_shard(model[0], config=cfg)
        elif kind == "ddp_around":
            cloudtrain.CloudDDP(shard(model, cfg), cfg)
        elif kind == "shard_inside":
            ddp = cloudtrain.CloudDDP(model, cfg)
            try:
                cloudtrain.fully_shard(ddp.module[0], config=cfg)
            finally:
                ddp.close()
    except ValueError as e:
        return str(e)
    return None


def _root_config(rank):
    """A config given at the root only, naming the default's regions: the model takes it."""
    import cloudtrain
    from cloudtrain import CompressionConfig

    model = make_model()
    for i in (0, 2, 4):
        cloudtrain.fully_shard(model[i])
    cloudtrain.fully_shard(model, config=CompressionConfig.resolve("quant4"))
    loss_of(model, *batch(rank, 0)).backward()
    return cloudtrain.ShardedComm.of(model).config.codec


def _nonfinite(rank, mode):
    """NaN in rank 1's input at step 1: what every step gave (True: finite gradients)."""
    import cloudtrain
    from cloudtrain import CompressionConfig

    cfg = CompressionConfig.resolve("quant4", regions=REGIONS, nonfinite=mode)
    model = shard(make_model(), cfg)
    comm = cloudtrain.ShardedComm.of(model)
    outcome = []
    for step in range(3):
        x, y = batch(rank, step)
        if step == 1 and rank == 1:
            x[0, 0] = float("nan")
        model.zero_grad()
        try:
            loss_of(model, x, y).backward()
            outcome.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        except ValueError as e:  # raised from backward() as itself
            outcome.append(str(e))
            break
    residuals = comm.path.ef.residuals.values()
    return outcome, all(bool(torch.isfinite(r).all()) for r in residuals), comm.stats()


def _checks(rank, world):
    import cloudtrain

    cloudtrain.init()
    errors = {kind: _bad(kind, rank) for kind in BAD}
    errors["root_config"] = _root_config(rank)
    return errors, _nonfinite(rank, "raise"), _nonfinite(rank, "pass")


MESSAGES = {
    "mesh": "is not the mesh of the regions",
    "dtypes": "several dtypes",
    "optimizer": "built before cloudtrain.fully_shard",
    "units": "shards the model differently",
    "torch_unit": "was sharded by torch's fully_shard",
    "torch_unit_us": "was sharded by torch's fully_shard",
    "late_config": "give config= to the first call",
    "ddp_around": "Shard it with cloudtrain.fully_shard alone",
    "shard_inside": "this module is inside a CloudDDP",
    "twice": "is sharded already",
}


def test_bad_inputs_and_nonfinite_gradients_raise_clearly_on_every_rank():
    t0 = time.monotonic()
    for rank, (errors, raised, passed) in enumerate(run_ranks(4, _checks, timeout=300)):
        for kind in BAD:
            assert errors[kind] is not None, f"{kind}: no error raised"
            assert MESSAGES[kind] in errors[kind], errors[kind]
        # "us" sharded a unit with torch's fully_shard: its rank 0 names it, "eu" says where
        assert ("on rank 0:" in errors["torch_unit_us"]) == (rank >= 2), errors["torch_unit_us"]
        assert errors["root_config"] == "quant", errors["root_config"]
        outcome, _, _ = raised
        assert outcome[0] is True and "has NaN or Inf (raised on every rank)" in outcome[1]
        outcome, residuals_finite, stats = passed
        assert outcome == [True, False, True] and residuals_finite
        assert stats.steps == stats.compressed_steps == 3 and stats.wan_bytes_sent > 0
    print(f"bad inputs and nonfinite: {time.monotonic() - t0:.1f} s")


def _dies(rank, world, timeout_s):
    import cloudtrain
    from cloudtrain import CompressionConfig

    cloudtrain.init(timeout_s=timeout_s)
    cfg = CompressionConfig.resolve("quant4", regions=REGIONS, timeout_s=timeout_s)
    model = shard(make_model(), cfg)
    for step in range(10):
        if rank == 3 and step == 3:
            os._exit(1)  # a peer dies mid-run
        t0 = time.monotonic()
        try:
            loss_of(model, *batch(rank, step)).backward()
        except cloudtrain.CommError as e:
            return str(e), time.monotonic() - t0
        except RuntimeError as e:  # torch's own collectives inside the region (rank 2)
            return f"RuntimeError: {e}", time.monotonic() - t0
    return None, 0.0


@pytest.mark.parametrize("timeout_s", [8.0])
def test_a_killed_peer_is_a_comm_error(timeout_s):
    results = run_ranks(4, _dies, timeout_s, timeout=120, allow_failures=True)
    assert isinstance(results[3], RankFailed)
    text, seconds = results[1]  # rank 3's partner in the other region: the same shard
    assert text is not None and "A peer may have died" in text, text
    assert seconds < timeout_s + 5, seconds
    for rank in (0, 2):
        assert results[rank][0] is not None, f"rank {rank} went on as if nothing happened"
    print(f"killed peer reported after {seconds:.2f} s (timeout {timeout_s} s)")
