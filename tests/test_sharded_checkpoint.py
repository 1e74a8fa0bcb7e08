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


def _config(mode, regions=REGIONS):
    from cloudtrain import CompressionConfig

    if mode == "pipeline":
        return CompressionConfig.resolve("quant4", regions=regions, staleness=1)
    cfg = CompressionConfig.resolve("diloco-4bit", regions=regions)
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
    saved = _span(rank, "pipeline", os.path.join(root, "pipeline"), 0, SAVE_AT, SAVE_AT)
    _span(rank, "outer", os.path.join(root, "outer"), 0, SAVE_AT, SAVE_AT)
    if rank == 0:  # a later save cut short: its folder and a file are there, its manifest is not
        os.makedirs(os.path.join(root, "pipeline", "step-00000009"))
        with open(os.path.join(root, "pipeline", "step-00000009", "region-0-.metadata"), "wb"):
            pass
    return whole, saved


def _resumed(rank, world, root):
    import cloudtrain
    from cloudtrain.checkpoint import CheckpointError, ShardedCheckpointer
    from cloudtrain.checkpoint.manifest import deserialize

    cloudtrain.init()
    resumed = {m: _span(rank, m, os.path.join(root, m), SAVE_AT, STEPS) for m in MODES}
    # the comm state of the saved run does not load into another rank's shards
    model = shard(make_model(), _config("pipeline"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = cloudtrain.ShardedComm.of(model)
    with open(os.path.join(root, "pipeline", "step-00000006", "rank-00000.pt"), "rb") as f:
        state = deserialize(f.read(), "cpu", True)["comm_state"]  # the Checkpointer's rank file
    comm.set_up()  # every rank (a collective); then a load that only rank 1 tries
    refused = None
    if rank == 1:
        try:
            comm.load_comm_state_dict(state)
        except ValueError as e:
            refused = str(e)
    ShardedCheckpointer(os.path.join(root, "pipeline")).load(model, opt, comm, comm_state=False)
    # a model of another config: refused before anything is loaded into it
    other = shard(make_model(), _config("outer"))
    before = [p.to_local().detach().clone() for p in other.parameters()]
    mismatch = None
    try:
        ShardedCheckpointer(os.path.join(root, "pipeline")).load(
            other, torch.optim.AdamW(other.parameters()), cloudtrain.ShardedComm.of(other)
        )
    except CheckpointError as e:
        mismatch = str(e)
    untouched = all(
        torch.equal(a, p.to_local()) for a, p in zip(before, other.parameters(), strict=True)
    )
    return resumed, refused, (mismatch, untouched)


def _resharded(rank, world, root, comm_state):
    """Step SAVE_AT of the 2 x 2 run loaded into 2 regions of 1 rank (DCP's resharding): each
    rank's shard is now its region's whole parameter. The comm state cannot follow."""
    import cloudtrain
    from cloudtrain.checkpoint import CheckpointError, ShardedCheckpointer

    cloudtrain.init()
    model = shard(make_model(), _config("pipeline", regions=("us", "eu")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = cloudtrain.ShardedComm.of(model)
    ckpt = ShardedCheckpointer(os.path.join(root, "pipeline"))
    try:
        assert ckpt.load(model, opt, comm, comm_state=comm_state) == SAVE_AT
        out = [p.to_local().detach().clone() for p in model.parameters()]
    except CheckpointError as e:
        out = str(e)
    comm.close()
    return out


def test_resume_from_a_dcp_checkpoint_is_bit_identical(tmp_path):
    t0 = time.monotonic()
    first = run_ranks(4, _first, str(tmp_path), timeout=300)
    whole = [w for w, _ in first]
    assert not os.path.exists(tmp_path / "pipeline" / "step-00000009" / "manifest.json")
    resumed = run_ranks(4, _resumed, str(tmp_path), timeout=300)
    for rank in range(4):
        for mode in MODES:
            for a, b in zip(whole[rank][mode], resumed[rank][0][mode], strict=True):
                assert torch.equal(a, b), f"rank {rank} {mode}: resumed run differs"
    assert "each rank loads its own" in resumed[1][1]
    for _, _, (mismatch, untouched) in resumed:
        assert "saved with another CompressionConfig" in mismatch and untouched, mismatch
    resharded = run_ranks(2, _resharded, str(tmp_path), False, timeout=300)
    for rank, (low, _) in enumerate(((0, 1), (2, 3))):  # rank 0: region us (ranks 0, 1) ...
        saved = zip(first[low][1], first[low + 1][1], strict=True)
        for got, halves in zip(resharded[rank], saved, strict=True):
            assert torch.equal(got, torch.cat(halves)), f"resharded rank {rank} differs"
    refused = run_ranks(2, _resharded, str(tmp_path), True, timeout=300)
    assert all("load(..., comm_state=False) to reshard" in r for r in refused), refused
    print(f"sharded checkpoint: {time.monotonic() - t0:.1f} s")


# ------------------------------------------------- S3: each region's shards in its own bucket


def _s3_first(rank, world, uri):
    """An uninterrupted outer-loop run, then one that a spot notice on rank 3 stops after
    SAVE_AT steps: every rank sees it at the same step, saves it to S3 and leaves."""
    import cloudtrain
    from cloudtrain.checkpoint import ShardedCheckpointer
    from cloudtrain.spot import PreemptionGuard

    cloudtrain.init()
    whole = _span(rank, "outer", uri, 0, STEPS)
    model = shard(make_model(), _config("outer"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = cloudtrain.ShardedComm.of(model)
    guard = PreemptionGuard(None)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        opt.step()
        if rank == 3 and step + 1 == SAVE_AT:
            guard.request_stop()  # what a SpotWatcher's notice does
        if guard.should_stop():
            ShardedCheckpointer(uri).save(step + 1, model, opt, comm)
            break
    comm.close()
    return whole, step + 1


def _s3_resumed(rank, world, uri, corrupt):
    """The run resumed from S3 in new processes; then rank 0 corrupts one of region eu's DCP
    files in its bucket, and every rank's load of the step must fail."""
    import boto3
    import torch.distributed as dist

    import cloudtrain
    from cloudtrain.checkpoint import CheckpointError, ShardedCheckpointer

    cloudtrain.init()
    resumed = _span(rank, "outer", uri, SAVE_AT, STEPS)
    if rank == 0:
        bucket, key = corrupt
        body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=bytes(len(body)))
    dist.barrier()
    model = shard(make_model(), _config("outer"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = cloudtrain.ShardedComm.of(model)
    try:
        ShardedCheckpointer(uri).load(model, opt, comm)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    comm.close()
    return resumed, refused


def test_s3_region_buckets_spot_notice_resume_and_a_corrupt_shard(monkeypatch, moto_url):
    """2 regions x 2 ranks on moto's S3 server, a bucket per region: a spot notice on one rank
    stops every rank at the same step, which is committed with each region's DCP files and its
    ranks' comm state in that region's bucket only (the manifest in both); a resume in new
    processes ends bit for bit where the uninterrupted run ends; a shard whose bytes no longer
    match the manifest fails the load on every rank, naming the file."""
    import uuid

    import boto3
    from support import fake_aws_env

    for name, value in fake_aws_env(moto_url, "S3").items():
        monkeypatch.setenv(name, value)
    suffix = uuid.uuid4().hex[:10]
    buckets = {region: f"ct-shard-{region}-{suffix}" for region in ("us", "eu")}
    for bucket in buckets.values():
        boto3.client("s3").create_bucket(Bucket=bucket)
    uri = f"s3://ct-shard-{{region}}-{suffix}/run"
    first = run_ranks(4, _s3_first, uri, timeout=300)
    assert [stopped for _, stopped in first] == [SAVE_AT] * 4

    def names(region):
        listed = boto3.client("s3").list_objects_v2(
            Bucket=buckets[region], Prefix=f"run/step-{SAVE_AT:08d}/"
        )
        return sorted(o["Key"].rsplit("/", 1)[1] for o in listed.get("Contents", []))

    # regions sort as ("eu", "us"): eu is region 0 (ranks 2, 3), us region 1 (ranks 0, 1)
    dcp = [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert names("eu") == sorted(
        ["manifest.json", "rank-00002.pt", "rank-00003.pt", *(f"region-0-{n}" for n in dcp)]
    )
    assert names("us") == sorted(
        ["manifest.json", "rank-00000.pt", "rank-00001.pt", "sharded.json",
         *(f"region-1-{n}" for n in dcp)]
    )  # fmt: skip
    corrupt = (buckets["eu"], f"run/step-{SAVE_AT:08d}/region-0-__1_0.distcp")
    resumed = run_ranks(4, _s3_resumed, uri, corrupt, timeout=300)
    for rank in range(4):
        for a, b in zip(first[rank][0], resumed[rank][0], strict=True):
            assert torch.equal(a, b), f"rank {rank}: the run resumed from S3 differs"
        refused = resumed[rank][1]
        assert refused is not None, f"rank {rank} loaded a corrupt shard"
        assert "region-0-__1_0.distcp does not match its sha256" in refused, refused
        assert "ranks 2, 3:" in refused, refused  # region eu's ranks, named on every rank
