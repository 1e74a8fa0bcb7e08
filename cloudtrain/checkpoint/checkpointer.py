"""The Checkpointer: save() and load() of a training run, over the stores (stores.py), in the
format of manifest.py, with the ranks agreeing through the collectives of ranks.py.

A save has five phases, each ending in a collective, so that a failure on any rank is an error
on every rank and nothing half-written is ever committed:
1. the layout check: the ranks gather where each writes, and refuse places no manifest can
   describe (`check_layout`);
2. every rank writes its shard (the lowest rank of each store the model and optimizer too), and
   the ranks gather what they wrote - the barrier before any commit;
3. rank 0 builds the manifest and broadcasts it;
4. the lowest rank of every other store writes a copy there, and the ranks gather the outcome;
5. rank 0 writes its own copy, the commit, and broadcasts the outcome.

A load (and latest_step) takes the newest step that verifies on every rank; finder.py says how
the ranks agree on it.
"""

from __future__ import annotations

import logging
import numbers
import operator
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any

from ..bootstrap import timeout_seconds
from .errors import CheckpointError, IncompleteStep
from .finder import Reader, StepFinder, not_found
from .manifest import (
    DEFAULT_ZSTD_LEVEL,
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    build_manifest,
    deserialize,
    rank_file,
    serialize,
    sha256,
    sha256_file,
    state_of,
    step_dir,
    steps_in,
)
from .ranks import Ranks, dist_or_none, rank_and_size
from .stores import S3Config, open_store, resolve_root, uri_scheme, with_retries

log = logging.getLogger(__name__)
_OWN_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_RANK_FILE = re.compile(r"^rank-\d+\.pt$")
_RESERVED = {MANIFEST, MODEL_FILE, OPTIMIZER_FILE}


def _is_own_file(name: str) -> bool:
    """Whether a manifest's file is one a rank gave save() in `files` (not one it serialized)."""
    return name not in _RESERVED and not _RANK_FILE.match(name)


def check_layout(layout: list[tuple[str, str | None, bool, bool]]) -> None:
    """Raise the same CheckpointError on every rank if the ranks' roots do not fit together.

    layout: per rank (root, region, has model, has optimizer)."""
    by_region: dict[str | None, dict[str, list[int]]] = {}
    for rank, (root, region, _, _) in enumerate(layout):
        by_region.setdefault(region, {}).setdefault(root, []).append(rank)
    problems = []
    for region, roots in by_region.items():
        if len(roots) > 1:
            who = "; ".join(f"ranks {ranks} -> {root}" for root, ranks in roots.items())
            what = f"ranks of region {region!r}" if region else "ranks without a region"
            problems.append(f"{what} write to different places ({who})")
    roots = {root for root, *_ in layout}
    schemes = {uri_scheme(root) for root in roots}
    if len(roots) > 1 and schemes != {"s3"}:
        problems.append(
            f"ranks write to different roots of schemes {sorted(schemes)} ({sorted(roots)}): "
            "one manifest can describe several object stores (s3://), never other hosts' "
            "local folders; give every rank the same shared path, or s3://BUCKET-{region}/..."
        )
    leaders: dict[str, int] = {}
    for rank, (root, *_) in enumerate(layout):
        leaders.setdefault(root, rank)
    for root, rank in leaders.items():
        if layout[rank][2:] != layout[0][2:]:
            problems.append(
                f"rank {rank} writes the model and optimizer to {root} but was given "
                f"model={'yes' if layout[rank][2] else 'None'}, optimizer="
                f"{'yes' if layout[rank][3] else 'None'} while rank 0 was given "
                f"model={'yes' if layout[0][2] else 'None'}, optimizer="
                f"{'yes' if layout[0][3] else 'None'}: pass the same on every rank"
            )
    if problems:
        raise CheckpointError(
            "checkpoint not saved: the ranks do not write to a consistent place, so no load "
            "could find every file: " + "; ".join(problems)
        )


def _is_int(value: Any) -> bool:
    """An int (a numpy integer too, which operator.index makes one), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Checkpointer:
    """Saves and loads training state; see the package docstring for the layout.

    uri: a local path, file:///path or s3://bucket/prefix, the same on every rank; or a template
    with "{region}" (e.g. s3://ct-demo-{region}-ckpt/run1); or a map {region: root}.
    region: this rank's region, for a template or a map (default: region_of_this_host()).
    keep_last: committed steps to keep per store (None keeps all). s3: how to reach S3 (ignored
    for local paths). compression_level: zstd level of the files written (1-22; None: none).
    timeout_s: how long a collective waits for the other ranks (default CLOUDTRAIN_TIMEOUT).
    """

    def __init__(
        self,
        uri: str | Mapping[str, str],
        keep_last: int | None = 3,
        *,
        region: str | None = None,
        s3: S3Config | None = None,
        compression_level: int | None = DEFAULT_ZSTD_LEVEL,
        timeout_s: float | None = None,
    ) -> None:
        if keep_last is not None and (not _is_int(keep_last) or keep_last < 1):
            raise CheckpointError(
                f"keep_last={keep_last!r}: keep at least 1 step (an int), or None for all"
            )
        if compression_level is not None and (
            isinstance(compression_level, bool)
            or not isinstance(compression_level, int)
            or not 1 <= compression_level <= 22
        ):
            raise CheckpointError(
                f"compression_level={compression_level!r}: a zstd level 1-22 (3 is fast and "
                "near the best ratio for weights), or None for uncompressed files"
            )
        self.keep_last = None if keep_last is None else operator.index(keep_last)
        self.compression_level = compression_level
        self.timeout_s = timeout_seconds(timeout_s)
        self.s3 = s3 or S3Config()
        self.region, self.uri = resolve_root(uri, region)
        self._store = open_store(self.uri, self.s3)
        self._finder = StepFinder(self._store, self.uri, self.s3)

    def __repr__(self) -> str:
        return f"Checkpointer({self.uri!r}, keep_last={self.keep_last})"

    def save(
        self,
        step: int,
        *,
        model: Any = None,
        optimizer: Any = None,
        comm_state: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        files: Mapping[str, str | os.PathLike] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> str:
        """Write and commit checkpoint `step`; returns this rank's step folder. Call on every rank.

        model / optimizer: replicated state (a module, a DDP wrapper, an optimizer or a state
        dict), given on every rank: the first rank of each store writes it there. comm_state: this
        rank's communication state (CloudDDP.comm_state_dict()). extra: this rank's other state
        (RNG states, data position). files: this rank's own local files, {name in the step's
        folder: path}, stored as they are (streamed, not compressed) and listed in the manifest
        like the others; load() lists them and fetch() reads one back, verified (the sharded
        checkpoints' DCP files). rank / world_size default to torch.distributed's, else 0 / 1.
        When this returns on any rank, the step is committed on all of them; a failure on any rank
        raises CheckpointError on every rank.
        """
        if not _is_int(step) or step < 0:
            raise CheckpointError(f"step={step!r} must be an int >= 0 (the training step)")
        step = operator.index(step)  # a numpy integer: the manifest's JSON takes an int
        files = dict(files or {})
        for name in files:
            if not _OWN_FILE.match(name) or name in _RESERVED or _RANK_FILE.match(name):
                raise CheckpointError(
                    f"files: {name!r} cannot be a file of the step's folder: use letters, digits, "
                    f"'.', '_' and '-' (not first), not {MANIFEST}, {MODEL_FILE}, "
                    f"{OPTIMIZER_FILE} or a rank file"
                )
        rank, world_size = rank_and_size(rank, world_size)
        if world_size > 1 and dist_or_none() is None:
            raise CheckpointError(
                f"save(rank={rank}, world_size={world_size}) needs torch.distributed initialised, "
                "so that rank 0 commits only after every rank has written its shard"
            )
        ranks = Ranks(self.timeout_s, f" in save(step={step})")
        layout = ranks.all_gather(
            (self.uri, self.region, model is not None, optimizer is not None),
            "checkpoint layout check",
        )
        check_layout(layout)
        roots = [root for root, *_ in layout]
        leads_store = roots.index(self.uri) == rank  # the lowest rank writing to this root
        folder = step_dir(step)
        shard = {"comm_state": comm_state, "extra": extra}
        outcome = self._write_shards(folder, rank, leads_store, model, optimizer, shard, files)
        files = self._gather_written(ranks, step, outcome)
        manifest = None
        if rank == 0:
            manifest = build_manifest(step, world_size, roots, files, self.compression_level)
        manifest = ranks.broadcast(manifest, "checkpoint manifest broadcast")
        assert manifest is not None
        # Copies first, rank 0's own last: the step counts as committed (for load(), which reads
        # rank 0's store) only once every store has its copy.
        writes_copy = leads_store and rank != 0
        if len(set(roots)) > 1:
            self._copy_manifest(ranks, step, manifest, rank, writes_copy)
        self._commit(ranks, step, manifest, rank, writes_copy)
        if leads_store:
            log.info("checkpoint: committed step %d at %s", step, self._store.where(folder))
            self._prune(step)
        return self._store.where(folder)

    def _write_shards(
        self,
        folder: str,
        rank: int,
        leads_store: bool,
        model: Any,
        optimizer: Any,
        shard: dict[str, Mapping[str, Any] | None],
        files: dict[str, str | os.PathLike],
    ) -> tuple[list[dict[str, Any]], str | None]:
        """Write this rank's shard (comm_state, extra) and own `files` and, if it leads its
        store, the model and optimizer. Returns their manifest entries and what failed as text,
        never raised: the gather that follows reports it on every rank."""
        written: list[dict[str, Any]] = []
        try:
            if leads_store:
                # Re-saving a step: un-commit it first. Other ranks may already be overwriting
                # their shards; a reader would reject those against the old manifest's hashes.
                self._store.delete(f"{folder}/{MANIFEST}")
            payloads: dict[str, Any] = {}
            if leads_store and model is not None:
                payloads[MODEL_FILE] = state_of(model, "model")
            if leads_store and optimizer is not None:
                payloads[OPTIMIZER_FILE] = state_of(optimizer, "optimizer")
            payloads[rank_file(rank)] = {
                k: None if v is None else dict(v) for k, v in shard.items()
            }
            for name, obj in payloads.items():
                data = serialize(obj, self.compression_level)
                self._store.put(f"{folder}/{name}", data)
                written.append(
                    {"root": self.uri, "name": name, "size": len(data), "sha256": sha256(data)}
                )
            for name, path in files.items():
                self._store.put_file(f"{folder}/{name}", path)
                size, digest = os.path.getsize(path), sha256_file(path)
                written.append({"root": self.uri, "name": name, "size": size, "sha256": digest})
        except Exception as e:
            log.exception("checkpoint: rank %d could not write %s", rank, self._store.where(folder))
            return written, f"rank {rank}: {type(e).__name__}: {e}"
        return written, None

    @staticmethod
    def _gather_written(
        ranks: Ranks, step: int, outcome: tuple[list[dict[str, Any]], str | None]
    ) -> list[dict[str, Any]]:
        """Every rank's manifest entries, once every rank has written: the gather is the barrier,
        nothing is committed before every shard is written. One rank's failure raises on all."""
        gathered = ranks.all_gather(outcome, "checkpoint gather of written files")
        errors = [err for _, err in gathered if err]
        places: dict[tuple[str, str], int] = {}
        for rank, (files, _) in enumerate(gathered):
            for e in files:
                other = places.setdefault((e["root"], e["name"]), rank)
                if other != rank:
                    errors.append(f"ranks {other} and {rank} both wrote {e['name']} to {e['root']}")
        if errors:
            raise CheckpointError(f"checkpoint step {step} was not committed: " + "; ".join(errors))
        return [entry for files, _ in gathered for entry in files]

    def _copy_manifest(
        self, ranks: Ranks, step: int, manifest: bytes, rank: int, writes_copy: bool
    ) -> None:
        """The lowest rank of every store but rank 0's writes its copy of the manifest; if any
        copy fails, the others are withdrawn and every rank raises."""
        folder = step_dir(step)
        copy_error = self._write_manifest(folder, manifest, rank) if writes_copy else None
        copy_errors = [e for e in ranks.all_gather(copy_error, "checkpoint manifest copies") if e]
        if copy_errors:
            if writes_copy:
                self._withdraw_copy(folder)
            raise CheckpointError(
                f"checkpoint step {step}: files written but not committed (a manifest copy "
                f"failed): {'; '.join(copy_errors)}. The step will be ignored by readers."
            )

    def _commit(
        self, ranks: Ranks, step: int, manifest: bytes, rank: int, writes_copy: bool
    ) -> None:
        """Rank 0 writes its manifest: the commit. If that fails, every rank raises, and the
        copies are withdrawn."""
        folder = step_dir(step)
        commit_error = self._write_manifest(folder, manifest, rank) if rank == 0 else None
        commit_error = ranks.broadcast(commit_error, "checkpoint commit")
        if commit_error:
            if writes_copy:
                self._withdraw_copy(folder)
            raise CheckpointError(
                f"checkpoint step {step}: files written but the manifest was not: {commit_error}. "
                "The step will be ignored by readers."
            )

    def _write_manifest(self, folder: str, data: bytes, rank: int) -> str | None:
        """Write this store's manifest.json; the error as text (or None), never raised."""
        key = f"{folder}/{MANIFEST}"
        try:
            with_retries(
                self._store, self.s3, lambda: self._store.put(key, data), f"write {MANIFEST}"
            )
        except Exception as e:
            log.exception("checkpoint: could not write %s", self._store.where(folder))
            return f"rank {rank}, {self._store.where(key)}: {type(e).__name__}: {e}"
        return None

    def _withdraw_copy(self, folder: str) -> None:
        """Not committed: a region reading alone must not find this step either."""
        try:
            self._store.delete(f"{folder}/{MANIFEST}")
        except Exception:
            log.warning("checkpoint: could not withdraw %s", folder, exc_info=True)

    def _prune(self, newest: int) -> None:
        """Keep the newest `keep_last` committed steps; never fails the save that called it."""
        if self.keep_last is None:
            return
        try:
            steps = sorted(steps_in(self._store.list_dirs()), reverse=True)
            committed = [s for s in steps if MANIFEST in self._store.list_files(step_dir(s))]
            kept = committed[: self.keep_last]
            if newest not in kept:
                return  # a newer step exists than the one just written: leave it all alone
            for s in steps:
                if s < kept[-1]:
                    # Un-commit first, so a crash midway leaves a half-deleted step unreadable.
                    self._store.delete(f"{step_dir(s)}/{MANIFEST}")
                    self._store.delete_dir(step_dir(s))
                    log.info("checkpoint: deleted old step %d", s)
        except Exception:
            log.warning("checkpoint: could not delete old steps under %s", self.uri, exc_info=True)

    # ------------------------------------------------------------------------------ reading

    def latest_step(self) -> int | None:
        """Newest step whose manifest and files all verify (present, right size and sha256), or
        None. In a distributed run call it on every rank (it is collective, and all ranks get the
        same answer: each checks its own files). Alone, it checks every file of the step."""
        dist = dist_or_none()
        ranks = Ranks(self.timeout_s, " in latest_step()")
        if dist is None:
            reader = Reader(ranks, None, 0, strict_world_size=False)
        else:
            reader = Reader(ranks, dist.get_rank(), dist.get_world_size(), False)
        found, _ = self._finder.find(None, reader, keep=True)
        return None if found is None else found.manifest["step"]

    def load(
        self,
        step: int | None = None,
        *,
        map_location: Any = "cpu",
        rank: int | None = None,
        world_size: int | None = None,
        weights_only: bool = True,
        strict_world_size: bool = True,
    ) -> dict[str, Any]:
        """Load step `step`, or the newest complete one; call on every rank in a distributed run.

        Returns {"step", "model", "optimizer", "comm_state", "extra", "world_size", "path"}
        with this rank's comm_state and extra. Every file read is checked against the manifest's
        size and sha256; with step=None a step that fails is skipped for the next older one, and
        all ranks settle on the same step. A checkpoint written by a different number of ranks
        raises, unless strict_world_size=False, which returns comm_state and extra as None.
        Raises CheckpointNotFoundError when nothing complete is there.
        """
        rank, world_size = rank_and_size(rank, world_size)
        ranks = Ranks(self.timeout_s, " in load()")
        found, skipped = self._finder.find(step, Reader(ranks, rank, world_size, strict_world_size))
        if found is None:
            raise not_found(self.uri, step, skipped)
        # Popped as they are unpickled: a file's stored bytes are freed once it is an object.
        manifest, files = found.manifest, found.files
        folder = step_dir(manifest["step"])

        def read(name: str) -> Any:
            if name not in files:
                return None
            try:
                return deserialize(files.pop(name)[1], map_location, weights_only)
            except pickle.UnpicklingError as e:
                raise CheckpointError(
                    f"{self._store.where(f'{folder}/{name}')} holds objects that "
                    f"weights_only=True refuses ({e}). If you wrote this checkpoint yourself, "
                    "load(weights_only=False)"
                ) from e

        shard = read(rank_file(rank)) or {"comm_state": None, "extra": None}
        return {
            "step": manifest["step"],
            "model": read(MODEL_FILE),
            "optimizer": read(OPTIMIZER_FILE),
            "comm_state": shard["comm_state"],
            "extra": shard["extra"],
            "world_size": manifest["world_size"],
            "path": self._store.where(folder),
            "files": [e for e in manifest["files"] if _is_own_file(e["name"])],
        }

    def fetch(self, step: int, entry: Mapping[str, Any], dest: str | os.PathLike) -> None:
        """Copy one of the `files` that load() listed for `step` to the local path `dest`,
        checked against the manifest's size and sha256 before anyone reads it; CheckpointError
        (and no `dest`) if it is missing or does not match."""
        try:
            self._finder.fetch_verified(step, dict(entry), os.fspath(dest))
        except IncompleteStep as why:
            raise CheckpointError(
                f"checkpoint step {step} is committed but {why}: load an older step (step=...)"
            ) from None
