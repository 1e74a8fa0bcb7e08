"""Checkpoints of a model sharded with cloudtrain.fully_shard: the model and optimizer through
torch.distributed.checkpoint (DCP), one DCP per region, written and committed by the
Checkpointer, so they go where CloudDDP's go - a local folder, or each region's shards to its own
S3 bucket - under the same commit rules, and a resumed run continues bit for bit (also with a
pipeline's sums or an outer loop's fragment in flight).

    ckpt = ShardedCheckpointer("s3://ct-demo-{region}-ckpt/run1")   # or a folder
    start = ckpt.load(model, optimizer, comm) or 0     # every rank; None: nothing saved yet
    for step in range(start, total):
        ...
        ckpt.save(step + 1, model, optimizer, comm)    # every rank, the same step

One folder per step, in each region's store ("{region}" is the region's name in
CompressionConfig.regions):

    <root>/step-00001234/region-0-.metadata       region 0's DCP (get_state_dict of FSDP2:
                         region-0-__0_0.distcp    DTensors on the region's mesh), a file per
                         region-0-__1_0.distcp    rank of the region; between an outer loop's
                                                  syncs the regions' parameters differ, each
                                                  region keeps its own
                         rank-00000.pt            each rank's ShardedComm.comm_state_dict()
                         sharded.json             (rank 0) the regions and their ranks
                         manifest.json            written last: the commit (cloudtrain.checkpoint)

A save writes the region's DCP to a local staging folder (`staging`, default the system's
temporary folder), then hands each rank's files to the Checkpointer: streamed to the store,
sized and hashed into the manifest, committed when every rank's are written. A load takes the
newest committed step (the Checkpointer's verdict, the same on every rank), copies the region's
.metadata and then, at DCP's plan step, only the files this rank's plan reads, each checked
against the manifest's sha256 before DCP opens it; a file that does not match fails the load on
every rank, before any rank of its region has copied a tensor. The DCP files are checked when a
load reads them, not when the step is chosen: a committed step with a corrupt shard is an error
(load an older `step=`), not skipped. Loading into another mesh shape (other ranks per
region) is DCP's resharding for the model and optimizer; the comm state belongs to the saved
shards' owners, so `load(..., comm_state=False)` is then needed - without it the load refuses,
saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from .checkpointer import Checkpointer
from .errors import CheckpointError
from .ranks import Ranks, by_text
from .stores import S3Config

SHARDED_FORMAT = "cloudtrain.sharded-checkpoint/2"
LAYOUT_FILE = "sharded.json"


def region_prefix(region: int) -> str:
    """The prefix of region `region`'s DCP files in a step's folder."""
    return f"region-{region}-"


def _dcp(call: Callable[[], Any]) -> Callable[[], None]:
    """call() with DCP's CheckpointException (a BaseException holding every rank's traceback)
    turned into a CheckpointError that says what failed, by rank of the region's group."""

    def run() -> None:
        try:
            call()
        except CheckpointException as e:
            failures = sorted((r, str(exc)) for r, (exc, _) in e.failures.items())
            raise CheckpointError(by_text(failures, "the region's rank")) from None

    return run


class _FetchingReader(FileSystemReader):
    """DCP's reader of a staging folder that fetches (verified) the files a plan reads: at the
    plan step, which DCP agrees on inside the region before any rank copies a tensor, so a
    file that fails its check leaves every rank of the region as it was."""

    def __init__(self, path: str, fetch: Callable[[list[str]], None]) -> None:
        super().__init__(path)
        self._fetch = fetch

    def _fetch_for(self, plan: Any) -> None:
        needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        self._fetch(sorted(needed))

    def prepare_local_plan(self, plan: Any) -> Any:
        self._fetch_for(plan)
        return super().prepare_local_plan(plan)

    def read_data(self, plan: Any, planner: Any) -> Any:
        self._fetch_for(plan)  # the final plan's files: fetched at the plan step already
        return super().read_data(plan, planner)


class ShardedCheckpointer:
    """Save and load a sharded model, its optimizer and its ShardedComm's state (module
    docstring). uri, keep_last, s3, timeout_s: as for Checkpointer ("{region}" in the URI, or a
    map {region: root}, is filled with the rank's region of CompressionConfig.regions).
    staging: the local folder where a rank's DCP files wait for their upload, and its fetched
    files for DCP's reads (default: the system's temporary folder)."""

    def __init__(
        self,
        uri: str | os.PathLike | Mapping[str, str],
        keep_last: int | None = 3,
        *,
        s3: S3Config | None = None,
        timeout_s: float | None = None,
        staging: str | os.PathLike | None = None,
    ) -> None:
        self.uri = uri if isinstance(uri, Mapping) else os.fspath(uri)
        self.keep_last, self.s3, self.timeout_s = keep_last, s3, timeout_s
        self.staging = None if staging is None else os.fspath(staging)
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least 1 step, or None for all")
        self._store: Checkpointer | None = None

    def __repr__(self) -> str:
        return f"ShardedCheckpointer({self.uri!r}, keep_last={self.keep_last})"

    def _checkpointer(self, comm: Any) -> Checkpointer:
        """The Checkpointer of this rank's region (made at the first save or load: the region
        is the ShardedComm's)."""
        if self._store is None:
            topo = comm.topo
            self._store = Checkpointer(
                self.uri,
                self.keep_last,
                region=topo.regions[topo.region],
                s3=self.s3,
                timeout_s=self.timeout_s,
            )
        return self._store

    # -- save ------------------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: Any, comm: Any) -> str:
        """Every rank, at the same step: write this rank's shards and comm state; the step is
        committed (on every rank) when this returns. Returns this rank's step folder."""
        from torch.distributed.checkpoint import save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        store = self._checkpointer(comm)
        topo = comm.topo
        state = comm.comm_state_dict()  # first: it finishes what is in flight (a collective)
        model_state, optim_state = get_state_dict(model, optimizer)
        ranks = Ranks(store.timeout_s, f" in ShardedCheckpointer.save(step={step})")
        staged: dict[str, str] = {}

        def stage() -> None:  # the local steps, gathered before any rank enters DCP's
            staged["tmp"] = tempfile.mkdtemp(prefix="cloudtrain-dcp-", dir=self.staging)
            if topo.rank == 0:
                with open(os.path.join(staged["tmp"], LAYOUT_FILE), "w") as f:
                    json.dump(_layout(comm), f)

        try:
            ranks.run_everywhere(stage, "sharded checkpoint staging")
            tmp = staged["tmp"]
            dcp = os.path.join(tmp, "dcp")
            ranks.run_everywhere(  # the other regions hear of a failure here, not at a timeout
                _dcp(
                    lambda: save(
                        {"model": model_state, "optimizer": optim_state},
                        storage_writer=FileSystemWriter(dcp),
                        process_group=comm.mesh["shard"].get_group(),
                    )
                ),
                "sharded checkpoint DCP save",
            )
            files = {region_prefix(topo.region) + n: os.path.join(dcp, n) for n in os.listdir(dcp)}
            if topo.rank == 0:
                files[LAYOUT_FILE] = os.path.join(tmp, LAYOUT_FILE)
            return store.save(step, comm_state=state, files=files)
        finally:
            if "tmp" in staged:
                shutil.rmtree(staged["tmp"], ignore_errors=True)

    # -- load ------------------------------------------------------------------------------------
    def latest_step(self, comm: Any) -> int | None:
        """The newest committed step that verifies (every rank calls; all get the same)."""
        return self._checkpointer(comm).latest_step()

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
        saved (and `step` was not asked for)."""
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        store = self._checkpointer(comm)
        if step is None and store.latest_step() is None:
            return None
        saved = store.load(step, strict_world_size=False)
        step, topo = saved["step"], comm.topo
        files = {e["name"]: e for e in saved["files"]}
        ranks = Ranks(store.timeout_s, f" in ShardedCheckpointer.load(step={step})")
        read: tuple[dict[str, Any] | None, str | None] = (None, None)
        if topo.rank == 0:  # one read of the layout, and every rank has it (or its error)
            try:
                read = (self._saved_layout(store, step, files, self.staging), None)
            except CheckpointError as e:
                read = (None, str(e))
            except Exception as e:  # a store or file error: every rank raises it, none waits
                read = (None, f"reading step {step}'s sharded.json on rank 0: {e!r}")
        layout, error = ranks.broadcast(read, "sharded checkpoint layout")
        if layout is None:
            raise CheckpointError(str(error))
        if layout["regions"] != list(topo.regions):
            raise CheckpointError(
                f"checkpoint step {step} was saved by regions {layout['regions']}, this run has "
                f"{list(topo.regions)}: resume with the same regions"
            )
        if comm_state and layout["ranks"] != list(topo.rank_regions):
            raise CheckpointError(
                f"checkpoint step {step} was saved on ranks {layout['ranks']}, this run has "
                f"{list(topo.rank_regions)}: the comm state belongs to the saved shards' "
                "owners; load(..., comm_state=False) to reshard the model and optimizer only"
            )
        saved_config = (saved.get("comm_state") or {}).get("config")
        if comm_state and saved_config != comm.config.fingerprint():
            raise CheckpointError(
                f"checkpoint step {step} was saved with another CompressionConfig than this "
                "model's (nothing was loaded): resume with the config it was saved with, or "
                "load(..., comm_state=False) to take the model and optimizer only"
            )
        comm.set_up()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        prefix = region_prefix(topo.region)
        with tempfile.TemporaryDirectory(prefix="cloudtrain-dcp-", dir=self.staging) as tmp:

            def fetch(names: list[str]) -> None:
                for name in names:
                    if os.path.exists(os.path.join(tmp, name)):
                        continue  # fetched (and checked) already
                    if prefix + name not in files:
                        raise CheckpointError(f"step {step}'s manifest lists no {prefix + name}")
                    store.fetch(step, files[prefix + name], os.path.join(tmp, name))

            # Each stage ends in a gather: a rank that failed never leaves the others waiting
            # in DCP's collectives, and every rank raises, not only the failed one's region.
            ranks.run_everywhere(lambda: fetch([".metadata"]), "sharded checkpoint .metadata")
            ranks.run_everywhere(
                _dcp(
                    lambda: load(
                        state,
                        storage_reader=_FetchingReader(tmp, fetch),
                        process_group=comm.mesh["shard"].get_group(),
                    )
                ),
                "sharded checkpoint DCP load",
            )
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        if comm_state:
            comm.attach(optimizer)
            comm.load_comm_state_dict(saved["comm_state"])
        return step

    @staticmethod
    def _saved_layout(
        store: Checkpointer, step: int, files: dict[str, Any], staging: str | None
    ) -> dict[str, Any]:
        if LAYOUT_FILE not in files:
            raise CheckpointError(
                f"checkpoint step {step} under {store.uri} is not a sharded checkpoint (no "
                f"{LAYOUT_FILE}); a CloudDDP checkpoint loads with cloudtrain.checkpoint.Checkpointer"
            )
        with tempfile.TemporaryDirectory(prefix="cloudtrain-dcp-", dir=staging) as tmp:
            path = os.path.join(tmp, LAYOUT_FILE)
            store.fetch(step, files[LAYOUT_FILE], path)
            with open(path) as f:
                layout = json.load(f)
        if layout.get("format") != SHARDED_FORMAT:
            raise CheckpointError(
                f"checkpoint step {step} under {store.uri} has sharded format "
                f"{layout.get('format')!r}; this cloudtrain reads {SHARDED_FORMAT!r}"
            )
        return layout


def _layout(comm: Any) -> dict[str, Any]:
    """What a load checks before it reads a shard: the regions and each rank's region."""
    topo = comm.topo
    return {
        "format": SHARDED_FORMAT,
        "regions": list(topo.regions),
        "ranks": list(topo.rank_regions),
        "config": comm.config.fingerprint(),
    }
