"""Checkpoints of a training run in local folders or in S3, across regions, that a crash never
corrupts and a restart always finds.

One folder per step under a root URI (a path, `file:///path` or `s3://bucket/prefix`):

    <root>/step-00001234/model.pt        model.state_dict() (replicated: one copy per store)
                         optimizer.pt    optimizer.state_dict() (likewise)
                         rank-00000.pt   each rank its own: {"comm_state": ..., "extra": ...}
                         rank-00001.pt   (error-feedback residuals, RNG states)
                         manifest.json   written LAST: the commit marker

Across regions (terraform/ gives each region its own bucket, reachable only from that region's
hosts) the root is a template, `Checkpointer("s3://ct-demo-{region}-ckpt/run1")`, filled with the
rank's region (`region=`, else cloudtrain.topology.region_of_this_host(): CLOUDTRAIN_REGION or
what `cloudtrain launch` exported), or a map {region: root}. So each rank writes to its own
region's store, and nothing but a few KB of manifest crosses a region on the write path:

- every rank writes its shard to its store; the lowest rank of each store also writes the
  replicated model and optimizer there, so a restart reads them in-region too;
- the ranks exchange what they wrote (size and sha256 of every file, compressed bytes as stored);
- rank 0 builds the manifest: for every rank, the root its shard lives under; for every file, its
  root, size and sha256. It is sent to the ranks over torch.distributed, the lowest rank of every
  other store writes a copy into its own store, and rank 0 writes its own copy last - the commit.
  Any region can then find the newest complete step in its own store, with its own credentials.

Before anything is written, the ranks compare where they are about to write: ranks of one region
that point at different places, ranks with different local folders (a manifest cannot describe
another host's disk), or a mix of schemes fail save() with the same CheckpointError on every rank -
never a save that "succeeds" and a load that finds nothing.

A step without a manifest, or whose files do not match it in size and sha256, was cut short (a spot
reclaim, a crash) and is never loaded: latest_step() and load() fall back to the newest step that
verifies, and the ranks agree on which one (rank 0 lists its store and reads the manifest; every
rank checks its own files; one rank's failure is every rank's error). After a commit, each store
keeps its newest `keep_last` committed steps. Files are compressed with zstd (level 3; the sha256
is over the stored bytes); uncompressed checkpoints of older versions still load.

The collectives run in cloudtrain's own gloo group (cloudtrain.bootstrap.control_group) with its
timeout (CLOUDTRAIN_TIMEOUT, default 300 s): a rank that never arrives is an error, not a hang.

S3 goes through boto3 (the `cloud` extra): multipart transfers for big files (TransferConfig),
botocore's retry with backoff for every request, and a retry of our own around the manifest,
the one object whose loss would cost a whole checkpoint. The endpoint can be set with
`S3Config(endpoint_url=...)` or boto3's own `AWS_ENDPOINT_URL_S3`.

    ckpt = Checkpointer("s3://ct-demo-{region}-ckpt/run-7", keep_last=3)
    start = 0
    if ckpt.latest_step() is not None:      # every rank: in a distributed run it is collective
        state = ckpt.load(map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        ddp.load_comm_state_dict(state["comm_state"])
        start = state["step"]
    for step in range(start, total):
        ...
        ckpt.save(step + 1, model=model, optimizer=optimizer, comm_state=ddp.comm_state_dict())

Files are loaded with `torch.load(weights_only=True)` by default: tensors, dicts, lists, numbers
and strings. State holding other Python objects needs `load(weights_only=False)`, which runs
pickled code: only for checkpoints you wrote yourself.

The package: stores.py (S3Config, the local and S3 stores, open_store), manifest.py (the format:
names, manifest.json, file contents), ranks.py (the collectives of one save or load),
checkpointer.py (Checkpointer: the save and load protocols), errors.py; sharded.py
(ShardedCheckpointer: a model sharded with cloudtrain.fully_shard, through
torch.distributed.checkpoint, its files written and committed by the Checkpointer).
"""

from __future__ import annotations

from .checkpointer import Checkpointer
from .errors import CheckpointError, CheckpointNotFoundError
from .manifest import (
    DEFAULT_ZSTD_LEVEL,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    rank_file,
    step_dir,
)
from .sharded import ShardedCheckpointer
from .stores import S3Config

__all__ = [
    "DEFAULT_ZSTD_LEVEL",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "S3Config",
    "ShardedCheckpointer",
    "rank_file",
    "step_dir",
]
