"""Checkpoints of a model sharded with cloudtrain.fully_shard, through torch.distributed.checkpoint
(DCP), in a local folder: every rank writes only its own shards, and a resumed run continues bit
for bit (also with a pipeline's sums or an outer loop's fragment in flight).

    ckpt = ShardedCheckpointer("/ckpt/run1")
    start = ckpt.load(model, optimizer, comm) or 0     # every rank; None: nothing saved yet
    for step in range(start, total):
        ...
        ckpt.save(step + 1, model, optimizer, comm)    # every rank, the same step

One folder per step:

    <root>/step-00001234/region-0/    DCP of region 0: model and optimizer (its ranks' shards:
                                      get_state_dict of FSDP2, DTensors on the region's mesh)
                         region-1/    the same for region 1 (between an outer loop's syncs the
                                      regions' parameters differ: each region keeps its own)
                         rank-00003.pt  rank 3's comm state (ShardedComm.comm_state_dict():
                                        residuals, step, controller, pipeline, outer state)
                         manifest.json  written last, by rank 0, when every region's DCP and
                                        every rank's comm state is written: the commit marker

DCP writes a region's `.metadata` after all its ranks' data, and the manifest comes after every
region's: a step without a manifest was cut short and is never loaded; `latest_step()` is the
newest step with one (rank 0 lists, every rank gets its answer). Loading into another mesh
shape (other ranks per region) is DCP's resharding for the model and optimizer; the comm state
belongs to the saved shards' owners, so `load(..., comm_state=False)` is then needed - a
ShardedComm refuses another mesh's state with an error saying so.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from .errors import CheckpointError, CheckpointNotFoundError
from .manifest import MANIFEST, rank_file, step_dir

SHARDED_FORMAT = "cloudtrain.sharded-checkpoint/1"


class ShardedCheckpointer:
    """Save and load a sharded model, its optimizer and its ShardedComm's state (module
    docstring). `root`: a local folder every rank can write (one host, or a shared file
    system)."""

    def __init__(self, root: str | os.PathLike) -> None:
        root = os.fspath(root)
        if root.startswith("s3://"):
            raise CheckpointError(
                "ShardedCheckpointer writes local folders only (a path or a shared file system); "
                "for S3 use cloudtrain.checkpoint.Checkpointer with a CloudDDP model"
            )
        self.root = root.removeprefix("file://")

    def __repr__(self) -> str:
        return f"ShardedCheckpointer({self.root!r})"

    # -- save ------------------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: Any, comm: Any) -> str:
        """Every rank, at the same step: write this rank's shards and comm state, then (rank 0,
        after every rank's) the manifest. Returns the step's folder."""
        from torch.distributed.checkpoint import save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        folder = os.path.join(self.root, step_dir(step))
        topo = comm.topo
        state = comm.comm_state_dict()  # first: it finishes what is in flight (a collective)
        os.makedirs(folder, exist_ok=True)
        model_state, optim_state = get_state_dict(model, optimizer)
        save(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=os.path.join(folder, f"region-{topo.region}"),
            process_group=comm.mesh["shard"].get_group(),
        )
        torch.save(state, os.path.join(folder, rank_file(topo.rank)))
        dist.barrier(group=topo.group("control"))  # every region's DCP and every rank's state
        if topo.rank == 0:
            manifest = {
                "format": SHARDED_FORMAT,
                "step": step,
                "regions": list(topo.regions),
                "ranks": list(topo.rank_regions),
                "config": comm.config.fingerprint(),
            }
            tmp = os.path.join(folder, MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(manifest, f)
            os.replace(tmp, os.path.join(folder, MANIFEST))  # the commit
        dist.barrier(group=topo.group("control"))
        return folder

    # -- load ------------------------------------------------------------------------------------
    def latest_step(self, comm: Any) -> int | None:
        """The newest committed step (every rank calls; rank 0 lists the folder)."""
        found: list[Any] = [None]
        if comm.topo.rank == 0:
            found[0] = self._newest()
        dist.broadcast_object_list(found, src=0, group=comm.topo.group("control"))
        return found[0]

    def _newest(self) -> int | None:
        if not os.path.isdir(self.root):
            return None
        steps = []
        for name in os.listdir(self.root):
            if name.startswith("step-") and os.path.exists(os.path.join(self.root, name, MANIFEST)):
                steps.append(int(name.removeprefix("step-")))
        return max(steps, default=None)

    def load(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        comm: Any,
        step: int | None = None,
        comm_state: bool = True,
    ) -> int | None:
        """Every rank: load the newest committed step (or `step`) into the sharded model, its
        optimizer and (comm_state) its ShardedComm. Returns the step, or None when nothing is
        saved."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        step = self.latest_step(comm) if step is None else step
        if step is None:
            return None
        folder = os.path.join(self.root, step_dir(step))
        manifest = self._manifest(folder)
        topo = comm.topo
        if manifest["regions"] != list(topo.regions):
            raise CheckpointError(
                f"{folder} was saved by regions {manifest['regions']}, this run has "
                f"{list(topo.regions)}: resume with the same regions"
            )
        comm.set_up()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        load(
            state,
            checkpoint_id=os.path.join(folder, f"region-{topo.region}"),
            process_group=comm.mesh["shard"].get_group(),
        )
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        if comm_state:
            mine = os.path.join(folder, rank_file(topo.rank))
            if manifest["ranks"] != list(topo.rank_regions) or not os.path.exists(mine):
                raise CheckpointError(
                    f"{folder} was saved on ranks {manifest['ranks']}, this run has "
                    f"{list(topo.rank_regions)}: the comm state belongs to the saved shards' "
                    "owners; load(..., comm_state=False) to reshard the model and optimizer only"
                )
            comm.attach(optimizer)
            comm.load_comm_state_dict(torch.load(mine, weights_only=True))
        return step

    @staticmethod
    def _manifest(folder: str) -> dict[str, Any]:
        path = os.path.join(folder, MANIFEST)
        if not os.path.exists(path):
            raise CheckpointNotFoundError(
                f"{folder} has no {MANIFEST}: the save was cut short, it is never loaded; "
                "load the newest committed step (leave step out)"
            )
        with open(path) as f:
            manifest = json.load(f)
        if manifest.get("format") != SHARDED_FORMAT:
            raise CheckpointError(
                f"{path} is not a sharded checkpoint ({manifest.get('format')!r}); a CloudDDP "
                "checkpoint loads with cloudtrain.checkpoint.Checkpointer"
            )
        return manifest
