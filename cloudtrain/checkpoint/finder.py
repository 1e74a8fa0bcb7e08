"""How the ranks agree on the step to load: the newest one whose manifest and files verify on
every rank, for Checkpointer.latest_step() and load().

The steps are tried newest first (`_candidates`); for each (`_verify`):
1. rank 0 reads the manifest of its store and broadcasts what it found;
2. every rank reads the files it needs (its shard; the model and optimizer from its own store
   where that holds a copy) and checks them against the manifest's size and sha256;
3. the ranks gather their verdicts: a step that is incomplete on any rank is skipped on all, an
   error that no older step cures is raised on all.
So every rank loads the same step, or every rank fails with the same reason.

    finder = StepFinder(store, uri, s3)
    verdict, skipped = finder.find(None, Reader(Ranks(None, " in load()"), 0, 2, True))
    verdict.manifest["step"], verdict.files["rank-00000.pt"]   # (entry, verified bytes)

A process alone (rank None) checks every file of the step. With keep=True (latest_step) the
verified bytes are kept for the next find (the load that usually follows), so a resume reads
each file once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError, CheckpointNotFoundError, IncompleteStep
from .manifest import (
    MANIFEST,
    files_to_read,
    parse_manifest,
    sha256,
    sha256_file,
    step_dir,
    steps_in,
)
from .ranks import Ranks
from .stores import S3Config, Store, open_store, with_retries

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What is known of one step. `problem`: it is not usable (half-written, corrupt): try an
    older one. `fatal`: an error no older step cures, raised on every rank. Neither: usable.
    `manifest`: rank 0's reading of it. `files`: this rank's verified files by name, (manifest
    entry, stored bytes); they stay on the rank (the ranks exchange verdicts without them)."""

    problem: str | None = None
    fatal: str | None = None
    manifest: dict[str, Any] | None = None
    files: dict[str, tuple[dict[str, Any], bytes]] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return self.problem is None and self.fatal is None


@dataclass(frozen=True)
class Reader:
    """Who looks for a step: `rank` of `world_size` (rank None: a process alone, which checks
    every file of the step), with the collectives of this call. strict_world_size: a step
    written by another number of ranks is an error (else: only the model and optimizer)."""

    ranks: Ranks
    rank: int | None
    world_size: int
    strict_world_size: bool

    @property
    def reads_manifest(self) -> bool:
        """Rank 0, or a process alone: the one rank that lists the store and reads manifests."""
        return self.rank in (0, None) or not self.ranks.many


class StepFinder:
    """Finds the step to load in this rank's store (`uri`), reading files from the stores its
    manifest names."""

    def __init__(self, store: Store, uri: str, s3: S3Config) -> None:
        self.store, self.uri, self.s3 = store, uri, s3
        self._stores: dict[str, Store] = {uri: store}
        # The files the last find(keep=True) verified, by (root, step, name, sha256).
        self._verified: dict[tuple[str, int, str, str], bytes] = {}

    def find(
        self, step: int | None, reader: Reader, keep: bool = False
    ) -> tuple[Verdict | None, list[str]]:
        """The newest step (or `step`) that verifies on every rank, as a usable Verdict (None if
        nothing does), and why each newer step was skipped. keep: hold on to the verified bytes
        for the next find."""
        skipped: list[str] = []
        found = None
        for candidate in self._candidates(step, reader):
            verdict = self._verify(candidate, reader)
            if verdict.usable:
                if skipped:
                    log.warning("checkpoint: using step %d, skipping newer: %s", candidate, skipped)
                found = verdict
                break
            log.warning("checkpoint: not using step %d: %s", candidate, verdict.problem)
            skipped.append(str(verdict.problem))
        self._verified = {}
        if keep and found is not None:
            step = found.manifest["step"]
            self._verified = {
                (e["root"], step, e["name"], e["sha256"]): data for e, data in found.files.values()
            }
        return found, skipped

    def _candidates(self, step: int | None, reader: Reader) -> list[int]:
        """The steps to try, newest first (only `step` if given), as rank 0 lists them."""
        listing: tuple[list[int], str | None] = ([], None)
        if reader.reads_manifest:
            try:
                steps = steps_in(self.store.list_dirs())
                listing = (sorted(steps, reverse=True) if step is None else [step], None)
            except Exception as e:
                listing = ([], f"{self.uri}: {type(e).__name__}: {e}")
        candidates, list_error = reader.ranks.broadcast(listing, "checkpoint listing of steps")
        if list_error:
            raise CheckpointError(f"cannot list the checkpoints on rank 0, under {list_error}")
        return candidates

    def _verify(self, candidate: int, reader: Reader) -> Verdict:
        """The ranks' common verdict on step `candidate`: rank 0 reads the manifest, every rank
        checks its own files against it; a problem on any rank skips the step on every rank.
        Raises on every rank what no older step cures."""
        where = self.store.where(step_dir(candidate))
        read = Verdict()
        if reader.reads_manifest:
            try:
                read = Verdict(manifest=self._manifest(candidate))
            except IncompleteStep as why:
                read = Verdict(problem=f"{where}: {why}")
            except Exception as e:
                read = Verdict(fatal=f"{type(e).__name__}: {e}")
        read = reader.ranks.broadcast(read, "checkpoint manifest")
        if read.fatal:
            raise CheckpointError(f"cannot read the manifest of {where} on rank 0: {read.fatal}")
        if read.manifest is None:
            return read
        fatal: Exception | None = None
        try:
            mine = self._check_files(candidate, read.manifest, reader, where)
        except Exception as e:
            fatal, mine = e, Verdict(fatal=f"{type(e).__name__}: {e}")
        verdicts = reader.ranks.all_gather(
            Verdict(mine.problem, mine.fatal), "checkpoint verdicts on a step"
        )
        if fatal is not None:
            raise fatal
        fatal_elsewhere = [f"rank {r}: {v.fatal}" for r, v in enumerate(verdicts) if v.fatal]
        if fatal_elsewhere:
            raise CheckpointError(
                f"checkpoint step {candidate} failed on other ranks: " + "; ".join(fatal_elsewhere)
            )
        problems = sorted({v.problem for v in verdicts if v.problem})
        return Verdict(problem="; ".join(problems)) if problems else mine

    def _check_files(
        self, candidate: int, manifest: dict[str, Any], reader: Reader, where: str
    ) -> Verdict:
        """This rank's files of the step, read and checked against the manifest: a usable verdict
        that holds them, or the problem. Raises if per-rank state cannot be mapped (a strict
        load by another number of ranks)."""
        per_rank = manifest["world_size"] == reader.world_size
        if not per_rank and reader.strict_world_size:
            raise CheckpointError(
                f"{where} was written by {manifest['world_size']} ranks; this run has "
                f"{reader.world_size}. Per-rank state (comm_state, extra) cannot be mapped: "
                f"resume with {manifest['world_size']} ranks, or load(strict_world_size=False) "
                "to restore only the model and optimizer"
            )
        try:
            entries = files_to_read(manifest, reader.rank, per_rank, self.uri)
            files = {name: (e, self._read_verified(candidate, e)) for name, e in entries.items()}
        except IncompleteStep as why:
            return Verdict(problem=f"{where}: {why}")
        return Verdict(manifest=manifest, files=files)

    def _manifest(self, step: int) -> dict[str, Any]:
        """This store's manifest of `step`, parsed (see parse_manifest); raises IncompleteStep."""
        folder = step_dir(step)
        key = f"{folder}/{MANIFEST}"
        try:
            raw = with_retries(self.store, self.s3, lambda: self.store.get(key), f"read {MANIFEST}")
        except KeyError:
            raise IncompleteStep(
                "no manifest.json (half-written: the save did not finish)"
            ) from None
        return parse_manifest(raw, step, self.store.where(folder), self.uri)

    def _read_verified(self, step: int, entry: dict[str, Any]) -> bytes:
        """The stored bytes of one file, checked against its size and sha256; IncompleteStep if
        not."""
        cached = self._verified.pop((entry["root"], step, entry["name"], entry["sha256"]), None)
        if cached is not None:
            return cached
        store, key = self._store_of(entry), f"{step_dir(step)}/{entry['name']}"
        try:
            data = store.get(key)
        except KeyError:
            raise IncompleteStep(f"{store.where(key)} is missing") from None
        _check(store.where(key), entry, len(data), sha256(data))
        return data

    def fetch_verified(self, step: int, entry: dict[str, Any], dest: str) -> None:
        """One file of `step` copied to the local path `dest` (streamed: it may not fit memory)
        and checked against its size and sha256; IncompleteStep if it does not match, and then
        `dest` is removed, never left for a reader."""
        store, key = self._store_of(entry), f"{step_dir(step)}/{entry['name']}"
        try:
            store.get_file(key, dest)
            _check(store.where(key), entry, os.path.getsize(dest), sha256_file(dest))
        except KeyError:
            raise IncompleteStep(f"{store.where(key)} is missing") from None
        except BaseException:
            if os.path.exists(dest):
                os.remove(dest)
            raise

    def _store_of(self, entry: dict[str, Any]) -> Store:
        if entry["root"] not in self._stores:
            self._stores[entry["root"]] = open_store(entry["root"], self.s3)
        return self._stores[entry["root"]]


def _check(where: str, entry: dict[str, Any], size: int, digest: str) -> None:
    """IncompleteStep unless a file's stored bytes are the manifest entry's size and sha256."""
    if size != entry["size"]:
        raise IncompleteStep(f"{where} is {size} bytes, the manifest says {entry['size']}")
    if digest != entry["sha256"]:
        raise IncompleteStep(
            f"{entry['name']} does not match its sha256 in the manifest (corrupt): {where}"
        )


def not_found(uri: str, step: int | None, skipped: list[str]) -> CheckpointNotFoundError:
    """The error of a load that found nothing to load under `uri`, with the reasons."""
    reasons = "; ".join(skipped)
    if step is not None:
        return CheckpointNotFoundError(
            f"checkpoint step {step} under {uri} cannot be loaded: {reasons}. "
            "Load another step, or step=None for the newest complete one"
        )
    detail = f" (skipped incomplete steps: {reasons})" if reasons else ""
    return CheckpointNotFoundError(
        f"no complete checkpoint under {uri}{detail}. Check the URI, or start from "
        "scratch: call load() only when latest_step() is not None"
    )
