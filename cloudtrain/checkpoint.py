"""Checkpoints of a training run in a local directory or in S3, that a crash never corrupts.

One folder per step under a root URI (a path, `file:///path` or `s3://bucket/prefix`):

    <root>/step-00001234/model.pt        rank 0: model.state_dict() (replicated: written once)
                         optimizer.pt    rank 0: optimizer.state_dict()
                         rank-00000.pt   every rank: {"comm_state": ..., "extra": ...}
                         rank-00001.pt   (per-rank state: error-feedback residuals, RNG states)
                         manifest.json   rank 0, written LAST: every file's size and sha256,
                                         the step, the world size, the format version

Every rank writes its own shard, the ranks exchange what they wrote (an all_gather_object, which
is also the barrier), then rank 0 writes the manifest: the manifest is the commit marker. A step
without a manifest, or whose files do not match it in size and sha256, was cut short (a spot
reclaim, a crash) and is never loaded; the reader falls back to the newest step that verifies, and
the ranks agree on which one. After a commit, rank 0 deletes all but the newest `keep_last`
committed steps (and any unfinished step older than those).

S3 goes through boto3 (the `cloud` extra): multipart transfers for big files (TransferConfig),
botocore's retry with backoff for every request, and a retry of our own around the manifest,
the one object whose loss would cost a whole checkpoint. The endpoint can be set with
`S3Config(endpoint_url=...)` or boto3's own `AWS_ENDPOINT_URL_S3`.

    ckpt = Checkpointer("s3://my-bucket/run-7", keep_last=3)
    start = 0
    if ckpt.latest_step() is not None:
        state = ckpt.load(map_location="cpu")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    for step in range(start, total):
        ...
        ckpt.save(step + 1, model=model, optimizer=optimizer, comm_state=ddp.comm_state_dict())

Files are loaded with `torch.load(weights_only=True)` by default: tensors, dicts, lists, numbers
and strings. State holding other Python objects needs `load(weights_only=False)`, which runs
pickled code: only for checkpoints you wrote yourself.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import torch

log = logging.getLogger(__name__)

FORMAT = "cloudtrain.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_T = TypeVar("_T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says where and what to do."""


class CheckpointNotFoundError(CheckpointError):
    """No complete checkpoint exists under the URI (or not the step asked for)."""


class _Incomplete(Exception):
    """This step is not a usable checkpoint (half-written or corrupt): try an older one."""


def step_dir(step: int) -> str:
    """Name of the folder that holds `step` (`step-00001234`)."""
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    """Name of the file that holds the per-rank state of `rank`."""
    return f"rank-{rank:05d}.pt"


@dataclass(frozen=True)
class S3Config:
    """How S3 is reached. The defaults suit checkpoints of a few GB to a bucket in-region."""

    endpoint_url: str | None = None
    """S3 endpoint; None = boto3's choice (AWS, or the AWS_ENDPOINT_URL_S3 environment variable)."""
    region: str | None = None
    """Region of the client; None = boto3's choice (AWS_REGION, ~/.aws/config)."""
    multipart_threshold: int = 64 * 2**20
    """Files at least this big (bytes) are uploaded and downloaded in parts."""
    multipart_chunksize: int = 64 * 2**20
    """Size of one part (S3 needs >= 5 MiB; at most 10,000 parts per file)."""
    max_concurrency: int = 8
    """Parts transferred in parallel."""
    max_attempts: int = 8
    """Attempts per request (botocore 'standard' retry mode: exponential backoff with jitter)."""
    manifest_attempts: int = 5
    """Attempts at writing or reading a manifest, on top of botocore's own retries."""
    retry_base_delay_s: float = 0.5
    """First wait between manifest attempts; doubled after each failure."""

    def __post_init__(self) -> None:
        if self.multipart_chunksize < 5 * 2**20:
            raise ValueError(
                f"S3Config.multipart_chunksize={self.multipart_chunksize}: S3 parts must be at "
                "least 5 MiB (5242880 bytes)"
            )
        for name in ("multipart_threshold", "max_concurrency", "max_attempts", "manifest_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"S3Config.{name}={getattr(self, name)} must be at least 1")
        if self.retry_base_delay_s < 0:
            raise ValueError(f"S3Config.retry_base_delay_s={self.retry_base_delay_s} must be >= 0")


# --------------------------------------------------------------------------------------- stores
# A store maps keys "step-00000012/model.pt" to bytes. Writes of one key are atomic: a reader
# sees the whole old object, the whole new one, or nothing.


class _LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def where(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        # Make the rename itself durable: the manifest must not outlive a crash without its files.
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def list_dirs(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return [p.name for p in self.root.iterdir() if p.is_dir()]

    def list_files(self, folder: str) -> dict[str, int]:
        path = self.root / folder
        if not path.is_dir():
            return {}
        return {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}

    def delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def delete_dir(self, folder: str) -> None:
        shutil.rmtree(self.root / folder, ignore_errors=True)

    def is_transient(self, exc: BaseException) -> bool:
        return False


class _S3Store:
    def __init__(self, uri: str, bucket: str, prefix: str, config: S3Config) -> None:
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError as e:
            raise CheckpointError(
                f"checkpoint URI {uri} needs boto3, which is not installed: "
                "pip install 'cloudtrain[cloud]'"
            ) from e
        self.uri, self.bucket, self.prefix = uri, bucket, prefix
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=config.endpoint_url,
            region_name=config.region,
            config=Config(
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                connect_timeout=10,
                read_timeout=120,
            ),
        )
        self.transfer = TransferConfig(
            multipart_threshold=config.multipart_threshold,
            multipart_chunksize=config.multipart_chunksize,
            max_concurrency=config.max_concurrency,
        )
        self._check_bucket()

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def where(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._key(key)}" if key else self.uri

    def _check_bucket(self) -> None:
        """Fail at construction, not hours later at the first save."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket"):
                raise CheckpointError(
                    f"S3 bucket {self.bucket!r} does not exist (checkpoint URI {self.uri}): "
                    "create it (terraform/ makes one per region) or fix the URI"
                ) from e
            if code in ("403", "AccessDenied"):
                raise CheckpointError(
                    f"access denied to S3 bucket {self.bucket!r} (checkpoint URI {self.uri}): "
                    "check the AWS credentials or instance role; checkpoints need s3:ListBucket, "
                    "s3:GetObject, s3:PutObject and s3:DeleteObject"
                ) from e
            raise CheckpointError(f"cannot use S3 bucket {self.bucket!r} ({self.uri}): {e}") from e
        except BotoCoreError as e:
            raise CheckpointError(
                f"cannot reach S3 for checkpoint URI {self.uri}: {e}; check the network, "
                "the region and AWS_ENDPOINT_URL_S3 if you set it"
            ) from e

    def put(self, key: str, data: bytes) -> None:
        # upload_fileobj switches to a multipart upload above transfer.multipart_threshold.
        self.client.upload_fileobj(
            io.BytesIO(data), self.bucket, self._key(key), Config=self.transfer
        )

    def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        buf = io.BytesIO()
        try:
            self.client.download_fileobj(self.bucket, self._key(key), buf, Config=self.transfer)
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) in ("404", "NoSuchKey"):
                raise KeyError(key) from None
            raise
        return buf.getvalue()

    def _list(self, prefix: str, delimiter: str | None) -> list[dict[str, Any]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, **({"Delimiter": delimiter} if delimiter else {})
        )
        return list(pages)

    def list_dirs(self) -> list[str]:
        base = self._key("")
        pages = self._list(base, "/")
        return [
            p["Prefix"][len(base) :].rstrip("/")
            for page in pages
            for p in page.get("CommonPrefixes", [])
        ]

    def list_files(self, folder: str) -> dict[str, int]:
        base = self._key(folder) + "/"
        return {
            o["Key"][len(base) :]: int(o["Size"])
            for page in self._list(base, None)
            for o in page.get("Contents", [])
            if "/" not in o["Key"][len(base) :]
        }

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_dir(self, folder: str) -> None:
        keys = [self._key(f"{folder}/{name}") for name in self.list_files(folder)]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )

    def is_transient(self, exc: BaseException) -> bool:
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            ReadTimeoutError,
        )

        if isinstance(
            exc,
            EndpointConnectionError
            | ConnectionClosedError
            | ReadTimeoutError
            | ConnectTimeoutError,
        ):
            return True
        if isinstance(exc, ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = str(exc.response.get("Error", {}).get("Code", ""))
            return status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout")
        return False


def _open_store(uri: str, s3: S3Config) -> _LocalStore | _S3Store:
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", uri)
    scheme = match.group(1).lower() if match else ""
    if scheme == "":
        return _LocalStore(Path(uri).expanduser())
    if scheme == "file":
        path = urlparse(uri).path
        if not path:
            raise CheckpointError(f"checkpoint URI {uri!r} has no path: use file:///abs/path")
        return _LocalStore(Path(path))
    if scheme == "s3":
        parsed = urlparse(uri)
        if not parsed.netloc:
            raise CheckpointError(f"checkpoint URI {uri!r} names no bucket: use s3://BUCKET/PREFIX")
        return _S3Store(uri, parsed.netloc, parsed.path.strip("/"), s3)
    raise CheckpointError(
        f"unsupported checkpoint URI scheme {scheme!r} in {uri!r}: use a local path, "
        "file:///path or s3://bucket/prefix"
    )


# ---------------------------------------------------------------------------------- helpers


def _dist() -> Any:
    """torch.distributed when a process group is up, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = _dist()
    if dist is not None:
        real_rank, real_size = dist.get_rank(), dist.get_world_size()
        if rank not in (None, real_rank) or world_size not in (None, real_size):
            raise CheckpointError(
                f"rank={rank}, world_size={world_size} contradict torch.distributed "
                f"(rank {real_rank} of {real_size}): leave them out in a distributed run"
            )
        return real_rank, real_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise CheckpointError(f"rank={rank} is not in [0, world_size={world_size})")
    return rank, world_size


def _all_gather(obj: _T) -> list[_T]:
    dist = _dist()
    if dist is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: _T) -> _T:
    dist = _dist()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _state_of(obj: Any, what: str) -> Mapping[str, Any]:
    """A state dict from a module, an optimizer, or a ready mapping."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(obj, DistributedDataParallel):
        obj = obj.module  # save the bare model: its keys have no "module." prefix
    if isinstance(obj, Mapping):
        return obj
    if callable(getattr(obj, "state_dict", None)):
        return obj.state_dict()
    raise TypeError(f"{what} must be a module, an optimizer or a state dict, not {type(obj)}")


def _serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------ checkpointer


class Checkpointer:
    """Saves and loads training state under one URI; see the module docstring for the layout.

    uri: a local path, file:///path or s3://bucket/prefix. keep_last: committed steps to keep
    (None keeps all). s3: how to reach S3 (ignored for local paths).
    """

    def __init__(self, uri: str, keep_last: int | None = 3, *, s3: S3Config | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least 1 step, or None for all")
        self.uri = uri
        self.keep_last = keep_last
        self.s3 = s3 or S3Config()
        self._store = _open_store(uri, self.s3)

    def __repr__(self) -> str:
        return f"Checkpointer({self.uri!r}, keep_last={self.keep_last})"

    # ------------------------------------------------------------------------------ writing

    def save(
        self,
        step: int,
        *,
        model: Any = None,
        optimizer: Any = None,
        comm_state: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> str:
        """Write and commit checkpoint `step`; returns where it is. Call on every rank.

        model / optimizer: replicated state, written by rank 0 (a module, a DDP wrapper, an
        optimizer or a state dict). comm_state: this rank's communication state
        (CloudDDP.comm_state_dict()). extra: this rank's other state (RNG states, data position).
        rank / world_size default to torch.distributed's, else 0 / 1. When this returns on any
        rank, the step is committed on all of them; a failure on any rank raises on every rank.
        """
        if step < 0:
            raise CheckpointError(f"step={step} must be >= 0")
        rank, world_size = _rank_and_size(rank, world_size)
        if world_size > 1 and _dist() is None:
            raise CheckpointError(
                f"save(rank={rank}, world_size={world_size}) needs torch.distributed initialised, "
                "so that rank 0 commits only after every rank has written its shard"
            )
        folder = step_dir(step)
        written: dict[str, dict[str, Any]] = {}
        error = None
        try:
            if rank == 0:
                # Re-saving a step: un-commit it first. Other ranks may already be overwriting
                # their shards; a reader would reject those against the old manifest's hashes.
                self._store.delete(f"{folder}/{MANIFEST}")
            payloads: dict[str, Any] = {}
            if rank == 0 and model is not None:
                payloads[MODEL_FILE] = _state_of(model, "model")
            if rank == 0 and optimizer is not None:
                payloads[OPTIMIZER_FILE] = _state_of(optimizer, "optimizer")
            payloads[rank_file(rank)] = {
                "comm_state": dict(comm_state) if comm_state is not None else None,
                "extra": dict(extra) if extra is not None else None,
            }
            for name, obj in payloads.items():
                data = _serialize(obj)
                self._store.put(f"{folder}/{name}", data)
                written[name] = {"size": len(data), "sha256": _sha256(data)}
        except Exception as e:
            log.exception("checkpoint: rank %d could not write %s", rank, self._store.where(folder))
            error = f"rank {rank}: {type(e).__name__}: {e}"

        # The gather is the barrier: rank 0 commits only once every shard is written.
        gathered = _all_gather((written, error))
        errors = [err for _, err in gathered if err]
        if errors:
            raise CheckpointError(
                f"checkpoint step {step} at {self._store.where(folder)} was not committed: "
                + "; ".join(errors)
            )

        commit_error = None
        if rank == 0:
            try:
                files: dict[str, Any] = {}
                for shard in gathered:
                    files.update(shard[0])
                manifest = {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "step": step,
                    "world_size": world_size,
                    "files": dict(sorted(files.items())),
                    "created_unix": time.time(),
                    "torch_version": torch.__version__,
                }
                data = json.dumps(manifest, indent=1).encode()
                self._retry(
                    lambda: self._store.put(f"{folder}/{MANIFEST}", data), f"write {MANIFEST}"
                )
            except Exception as e:
                log.exception("checkpoint: could not commit %s", self._store.where(folder))
                commit_error = f"{type(e).__name__}: {e}"
            else:
                log.info("checkpoint: committed step %d at %s", step, self._store.where(folder))
                self._prune(step)
        commit_error = _broadcast(commit_error)
        if commit_error:
            raise CheckpointError(
                f"checkpoint step {step}: shards written to {self._store.where(folder)} but "
                f"the manifest was not: {commit_error}. The step will be ignored by readers."
            )
        return self._store.where(folder)

    def _prune(self, newest: int) -> None:
        """Keep the newest `keep_last` committed steps; never fails the save that called it."""
        if self.keep_last is None:
            return
        try:
            steps = sorted(self._steps(), reverse=True)
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

    def _retry(self, fn: Callable[[], _T], what: str) -> _T:
        attempts = self.s3.manifest_attempts if isinstance(self._store, _S3Store) else 1
        for attempt in range(attempts):
            try:
                return fn()
            except Exception as e:
                if attempt + 1 == attempts or not self._store.is_transient(e):
                    raise
                delay = self.s3.retry_base_delay_s * 2**attempt
                log.warning("checkpoint: %s failed (%s); retrying in %.1fs", what, e, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------ reading

    def _steps(self) -> list[int]:
        return [int(m.group(1)) for d in self._store.list_dirs() if (m := _STEP_DIR.match(d))]

    def _manifest(self, step: int) -> dict[str, Any]:
        """The manifest of `step`, checked against the files present; raises _Incomplete."""
        folder = step_dir(step)
        try:
            raw = self._retry(lambda: self._store.get(f"{folder}/{MANIFEST}"), f"read {MANIFEST}")
        except KeyError:
            raise _Incomplete("no manifest.json (half-written: the save did not finish)") from None
        try:
            manifest = json.loads(raw)
            if manifest.get("format") != FORMAT:
                raise ValueError(f"format is {manifest.get('format')!r}, not {FORMAT!r}")
            if int(manifest["step"]) != step:
                raise ValueError(f"it says step {manifest['step']}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise _Incomplete(f"unreadable manifest.json ({e})") from None
        if manifest.get("version", 0) > FORMAT_VERSION:
            raise CheckpointError(
                f"{self._store.where(folder)} has checkpoint format version "
                f"{manifest['version']}; this cloudtrain reads up to {FORMAT_VERSION}: upgrade it"
            )
        present = self._store.list_files(folder)
        for name, entry in manifest["files"].items():
            if name not in present:
                raise _Incomplete(f"{name} is missing")
            if present[name] != entry["size"]:
                raise _Incomplete(
                    f"{name} is {present[name]} bytes, the manifest says {entry['size']}"
                )
        return manifest

    def latest_step(self) -> int | None:
        """Newest step with a manifest whose files are all present at the right sizes, or None.

        Cheap (listings and one small read per step tried); load() also checks the sha256 of
        what it reads and falls back further if that fails.
        """
        for step in sorted(self._steps(), reverse=True):
            try:
                self._manifest(step)
            except _Incomplete as why:
                log.warning("checkpoint: skipping %s: %s", self._store.where(step_dir(step)), why)
                continue
            return step
        return None

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
        rank, world_size = _rank_and_size(rank, world_size)
        # All ranks must try the same steps in the same order: rank 0's listing decides.
        candidates = _broadcast(sorted(self._steps(), reverse=True) if step is None else [step])
        skipped: list[str] = []
        for candidate in candidates:
            state, problem, fatal = None, None, None
            try:
                state = self._load_step(
                    candidate, rank, world_size, map_location, weights_only, strict_world_size
                )
            except _Incomplete as why:
                problem = f"{self._store.where(step_dir(candidate))}: {why}"
            except Exception as e:
                fatal = e
            verdicts = _all_gather(
                (problem, None if fatal is None else f"{type(fatal).__name__}: {fatal}")
            )
            if fatal is not None:
                raise fatal
            fatal_elsewhere = [f"rank {r}: {f}" for r, (_, f) in enumerate(verdicts) if f]
            if fatal_elsewhere:
                raise CheckpointError(
                    f"loading checkpoint step {candidate} failed on other ranks: "
                    + "; ".join(fatal_elsewhere)
                )
            problems = sorted({p for p, _ in verdicts if p})
            if not problems:
                if skipped:
                    log.warning(
                        "checkpoint: loaded step %d, skipping newer: %s", candidate, skipped
                    )
                return state  # type: ignore[return-value]
            log.warning("checkpoint: not loading step %d: %s", candidate, "; ".join(problems))
            skipped.extend(problems)
        if step is not None:
            raise CheckpointNotFoundError(
                f"checkpoint step {step} under {self.uri} cannot be loaded: {'; '.join(skipped)}. "
                "Load another step, or step=None for the newest complete one"
            )
        detail = f" (skipped incomplete steps: {'; '.join(skipped)})" if skipped else ""
        raise CheckpointNotFoundError(
            f"no complete checkpoint under {self.uri}{detail}. Check the URI, or start from "
            "scratch: call load() only when latest_step() is not None"
        )

    def _load_step(
        self,
        step: int,
        rank: int,
        world_size: int,
        map_location: Any,
        weights_only: bool,
        strict_world_size: bool,
    ) -> dict[str, Any]:
        manifest = self._manifest(step)
        folder = step_dir(step)
        saved_size = int(manifest["world_size"])
        per_rank = saved_size == world_size
        if not per_rank and strict_world_size:
            raise CheckpointError(
                f"{self._store.where(folder)} was written by {saved_size} ranks; this run has "
                f"{world_size}. Per-rank state (comm_state, extra) cannot be mapped: resume with "
                f"{saved_size} ranks, or load(strict_world_size=False) to restore only the "
                "model and optimizer"
            )
        files = manifest["files"]

        def read(name: str) -> Any:
            if name not in files:
                raise _Incomplete(f"the manifest lists no {name}")
            entry = files[name]
            try:
                data = self._store.get(f"{folder}/{name}")
            except KeyError:
                raise _Incomplete(f"{name} is missing") from None
            if len(data) != entry["size"] or _sha256(data) != entry["sha256"]:
                raise _Incomplete(f"{name} does not match its sha256 in the manifest (corrupt)")
            try:
                return torch.load(
                    io.BytesIO(data), map_location=map_location, weights_only=weights_only
                )
            except pickle.UnpicklingError as e:
                raise CheckpointError(
                    f"{self._store.where(f'{folder}/{name}')} holds objects that "
                    f"weights_only=True refuses ({e}). If you wrote this checkpoint yourself, "
                    "load(weights_only=False)"
                ) from e

        shard = read(rank_file(rank)) if per_rank else {"comm_state": None, "extra": None}
        return {
            "step": step,
            "model": read(MODEL_FILE) if MODEL_FILE in files else None,
            "optimizer": read(OPTIMIZER_FILE) if OPTIMIZER_FILE in files else None,
            "comm_state": shard["comm_state"],
            "extra": shard["extra"],
            "world_size": saved_size,
            "path": self._store.where(folder),
        }
