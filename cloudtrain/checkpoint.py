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

from .bootstrap import control_group, timeout_seconds
from .topology import region_of_this_host

log = logging.getLogger(__name__)

FORMAT = "cloudtrain.checkpoint"
FORMAT_VERSION = 2
"""2: files may live in several stores (a root per file and per rank); files may be zstd frames."""
DEFAULT_ZSTD_LEVEL = 3
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
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


def _scheme(uri: str) -> str:
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", uri)
    return match.group(1).lower() if match else ""


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


class _Ranks:
    """The collectives of one save/load, in cloudtrain's own group and timeout; one process alone
    (no torch.distributed) is a world of one."""

    def __init__(self, timeout_s: float | None) -> None:
        self.dist = _dist()
        self.timeout_s = timeout_seconds(timeout_s)
        self.group = control_group(self.timeout_s) if self.dist is not None else None

    @property
    def many(self) -> bool:
        return self.dist is not None and self.dist.get_world_size() > 1

    def _fail(self, what: str, e: Exception) -> CheckpointError:
        return CheckpointError(
            f"checkpoint: {what} failed across ranks ({type(e).__name__}: {e}); a rank died, or "
            f"did not reach the same call within {self.timeout_s:g} s (CLOUDTRAIN_TIMEOUT): every "
            "rank must call save(), load() and latest_step() at the same points"
        )

    def all_gather(self, obj: _T, what: str) -> list[_T]:
        if not self.many:
            return [obj]
        out: list[Any] = [None] * self.dist.get_world_size()
        try:
            self.dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:
            raise self._fail(what, e) from e
        return out

    def broadcast(self, obj: _T, what: str) -> _T:
        """Rank 0's `obj` on every rank."""
        if not self.many:
            return obj
        box = [obj]
        try:
            self.dist.broadcast_object_list(box, src=0, group=self.group)
        except Exception as e:
            raise self._fail(what, e) from e
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


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as e:
        raise CheckpointError(
            "zstd-compressed checkpoints need the zstandard package: pip install zstandard, "
            "or Checkpointer(..., compression_level=None) to write uncompressed files"
        ) from e
    return zstandard


def _serialize(obj: Any, level: int | None) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    if level is None:
        return data
    return _zstd().ZstdCompressor(level=level).compress(data)


def _deserialize(data: bytes, map_location: Any, weights_only: bool) -> Any:
    if data[:4] == _ZSTD_MAGIC:
        # Trusted size: these bytes already matched the manifest's sha256.
        data = _zstd().ZstdDecompressor().decompressobj().decompress(data)
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parse_manifest(raw: bytes, step: int, where: str) -> dict[str, Any]:
    """The manifest in one shape for every version: step, world_size, version, files (a list of
    {root, name, size, sha256}: root None = the store it was read from), ranks (root of each
    rank's shard, None likewise). Raises _Incomplete for anything unreadable or missing."""
    try:
        manifest = json.loads(raw)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format is {manifest.get('format')!r}, not {FORMAT!r}")
        version = manifest.get("version", 0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version is {version!r}")
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{where} has checkpoint format version {version}; this cloudtrain reads up to "
                f"{FORMAT_VERSION}: upgrade it"
            )
        if int(manifest["step"]) != step:
            raise ValueError(f"it says step {manifest['step']}")
        world_size = manifest["world_size"]
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size is {world_size!r}")
        if version < 2:
            files = [
                {"root": None, "name": str(name), "size": e["size"], "sha256": e["sha256"]}
                for name, e in manifest["files"].items()
            ]
            ranks: list[str | None] = [None] * world_size
        else:
            files = [
                {"root": str(e["root"]), "name": str(e["name"]), "size": e["size"],
                 "sha256": e["sha256"]}
                for e in manifest["files"]
            ]  # fmt: skip
            ranks = [str(r) for r in manifest["ranks"]]
            if len(ranks) != world_size:
                raise ValueError(f"{len(ranks)} ranks listed for world_size {world_size}")
        for e in files:
            if not isinstance(e["size"], int) or not isinstance(e["sha256"], str):
                raise ValueError(f"entry {e['name']} has no integer size and sha256")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _Incomplete(f"unreadable manifest.json ({type(e).__name__}: {e})") from None
    return {"step": step, "world_size": world_size, "version": version, "files": files,
            "ranks": ranks}  # fmt: skip


# ------------------------------------------------------------------------------ checkpointer


class Checkpointer:
    """Saves and loads training state; see the module docstring for the layout.

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
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least 1 step, or None for all")
        if compression_level is not None and (
            isinstance(compression_level, bool)
            or not isinstance(compression_level, int)
            or not 1 <= compression_level <= 22
        ):
            raise CheckpointError(
                f"compression_level={compression_level!r}: a zstd level 1-22 (3 is fast and "
                "near the best ratio for weights), or None for uncompressed files"
            )
        self.keep_last = keep_last
        self.compression_level = compression_level
        self.timeout_s = timeout_seconds(timeout_s)
        self.s3 = s3 or S3Config()
        self.region, self.uri = self._resolve(uri, region)
        self._store = _open_store(self.uri, self.s3)
        self._stores: dict[str, _LocalStore | _S3Store] = {self.uri: self._store}
        # The files latest_step() verified, by (root, step, name, sha256): the load() that
        # usually follows takes them from here instead of reading them twice. One step only.
        self._verified: dict[tuple[str, int, str, str], bytes] = {}

    @staticmethod
    def _resolve(uri: str | Mapping[str, str], region: str | None) -> tuple[str | None, str]:
        """(this rank's region, None where unknown, and this rank's root URI)."""
        templated = not isinstance(uri, str) or "{region}" in uri
        if region is None:
            # Known even where the URI needs none: save() checks that ranks of one region agree.
            try:
                region = region_of_this_host()
            except ValueError:
                if templated:
                    raise
        if templated and region is None:
            raise CheckpointError(
                f"checkpoint URI {uri!r} depends on the region, and this rank's region is "
                "unknown: set CLOUDTRAIN_REGION (cloudtrain launch sets each host's), or "
                "pass Checkpointer(..., region=...)"
            )
        if isinstance(uri, str):
            return region, uri.replace("{region}", region) if templated else uri
        if region not in uri:
            raise CheckpointError(
                f"no checkpoint URI for region {region!r}: the map names {sorted(uri)}"
            )
        return region, uri[region]

    def __repr__(self) -> str:
        return f"Checkpointer({self.uri!r}, keep_last={self.keep_last})"

    def _store_at(self, root: str | None) -> _LocalStore | _S3Store:
        """The store of `root` (None: this rank's own)."""
        root = self.uri if root is None else root
        if root not in self._stores:
            self._stores[root] = _open_store(root, self.s3)
        return self._stores[root]

    # ------------------------------------------------------------------------------ writing

    @staticmethod
    def _check_layout(layout: list[tuple[str, str | None, bool, bool]]) -> None:
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
        schemes = {_scheme(root) for root in roots}
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
        """Write and commit checkpoint `step`; returns this rank's step folder. Call on every rank.

        model / optimizer: replicated state (a module, a DDP wrapper, an optimizer or a state
        dict), given on every rank: the first rank of each store writes it there. comm_state: this
        rank's communication state (CloudDDP.comm_state_dict()). extra: this rank's other state
        (RNG states, data position). rank / world_size default to torch.distributed's, else 0 / 1.
        When this returns on any rank, the step is committed on all of them; a failure on any rank
        raises CheckpointError on every rank.
        """
        if step < 0:
            raise CheckpointError(f"step={step} must be >= 0")
        rank, world_size = _rank_and_size(rank, world_size)
        if world_size > 1 and _dist() is None:
            raise CheckpointError(
                f"save(rank={rank}, world_size={world_size}) needs torch.distributed initialised, "
                "so that rank 0 commits only after every rank has written its shard"
            )
        ranks = _Ranks(self.timeout_s)
        folder = step_dir(step)
        layout = ranks.all_gather(
            (self.uri, self.region, model is not None, optimizer is not None), "the layout check"
        )
        self._check_layout(layout)
        roots = [root for root, *_ in layout]
        leads_store = roots.index(self.uri) == rank  # the lowest rank writing to this root

        written: list[dict[str, Any]] = []
        error = None
        try:
            if leads_store:
                # Re-saving a step: un-commit it first. Other ranks may already be overwriting
                # their shards; a reader would reject those against the old manifest's hashes.
                self._store.delete(f"{folder}/{MANIFEST}")
            payloads: dict[str, Any] = {}
            if leads_store and model is not None:
                payloads[MODEL_FILE] = _state_of(model, "model")
            if leads_store and optimizer is not None:
                payloads[OPTIMIZER_FILE] = _state_of(optimizer, "optimizer")
            payloads[rank_file(rank)] = {
                "comm_state": dict(comm_state) if comm_state is not None else None,
                "extra": dict(extra) if extra is not None else None,
            }
            for name, obj in payloads.items():
                data = _serialize(obj, self.compression_level)
                self._store.put(f"{folder}/{name}", data)
                written.append(
                    {"root": self.uri, "name": name, "size": len(data), "sha256": _sha256(data)}
                )
        except Exception as e:
            log.exception("checkpoint: rank %d could not write %s", rank, self._store.where(folder))
            error = f"rank {rank}: {type(e).__name__}: {e}"

        # The gather is the barrier: nothing is committed before every shard is written.
        gathered = ranks.all_gather((written, error), "the gather of written files")
        errors = [err for _, err in gathered if err]
        if errors:
            raise CheckpointError(f"checkpoint step {step} was not committed: " + "; ".join(errors))

        manifest_data = None
        if rank == 0:
            manifest = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "step": step,
                "world_size": world_size,
                "ranks": roots,
                "files": [entry for files, _ in gathered for entry in files],
                "compression": None if self.compression_level is None else "zstd",
                "created_unix": time.time(),
                "torch_version": torch.__version__,
            }
            manifest_data = json.dumps(manifest, indent=1).encode()
        manifest_data = ranks.broadcast(manifest_data, "the manifest broadcast")
        assert manifest_data is not None

        # Copies first, rank 0's own last: the step counts as committed (for load(), which reads
        # rank 0's store) only once every store has its copy.
        def withdraw_copy() -> None:
            """Not committed: a region reading alone must not find this step either."""
            if leads_store and rank != 0:
                try:
                    self._store.delete(f"{folder}/{MANIFEST}")
                except Exception:
                    log.warning("checkpoint: could not withdraw %s", folder, exc_info=True)

        copy_error = None
        if leads_store and rank != 0:
            copy_error = self._write_manifest(folder, manifest_data, rank)
        if len(set(roots)) > 1:
            copy_errors = [e for e in ranks.all_gather(copy_error, "the manifest copies") if e]
            if copy_errors:
                withdraw_copy()
                raise CheckpointError(
                    f"checkpoint step {step}: files written but not committed (a manifest copy "
                    f"failed): {'; '.join(copy_errors)}. The step will be ignored by readers."
                )
        commit_error = self._write_manifest(folder, manifest_data, rank) if rank == 0 else None
        commit_error = ranks.broadcast(commit_error, "the commit")
        if commit_error:
            withdraw_copy()
            raise CheckpointError(
                f"checkpoint step {step}: files written but the manifest was not: {commit_error}. "
                "The step will be ignored by readers."
            )
        if leads_store:
            log.info("checkpoint: committed step %d at %s", step, self._store.where(folder))
            self._prune(step)
        return self._store.where(folder)

    def _write_manifest(self, folder: str, data: bytes, rank: int) -> str | None:
        """Write this store's manifest.json; the error as text (or None), never raised."""
        try:
            self._retry(lambda: self._store.put(f"{folder}/{MANIFEST}", data), f"write {MANIFEST}")
        except Exception as e:
            log.exception("checkpoint: could not write %s", self._store.where(folder))
            return (
                f"rank {rank}, {self._store.where(f'{folder}/{MANIFEST}')}: {type(e).__name__}: {e}"
            )
        return None

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
        """This store's manifest of `step`, parsed (see _parse_manifest); raises _Incomplete."""
        folder = step_dir(step)
        try:
            raw = self._retry(lambda: self._store.get(f"{folder}/{MANIFEST}"), f"read {MANIFEST}")
        except KeyError:
            raise _Incomplete("no manifest.json (half-written: the save did not finish)") from None
        manifest = _parse_manifest(raw, step, self._store.where(folder))
        # Roots the manifest leaves implicit (version 1) are the store it was read from.
        for entry in manifest["files"]:
            entry["root"] = entry["root"] or self.uri
        manifest["ranks"] = [root or self.uri for root in manifest["ranks"]]
        return manifest

    def _needed(
        self, manifest: dict[str, Any], rank: int | None, per_rank: bool
    ) -> dict[str, dict[str, Any]]:
        """The files (by name) that `rank` reads: its shard, and the model and optimizer from its
        own store where that holds a copy, else from the first store that does. rank None: every
        file of the step, keyed root/name."""
        files = manifest["files"]
        if rank is None:
            return {f"{e['root']}/{e['name']}": e for e in files}
        needed = {}
        if per_rank:
            name, root = rank_file(rank), manifest["ranks"][rank]
            match = [e for e in files if e["name"] == name and e["root"] == root]
            if not match:
                raise _Incomplete(f"the manifest lists no {name} under {root}")
            needed[name] = match[0]
        for name in (MODEL_FILE, OPTIMIZER_FILE):
            copies = [e for e in files if e["name"] == name]
            own = [e for e in copies if e["root"] == self.uri]
            if own or copies:
                needed[name] = (own or copies)[0]
        return needed

    def _read_verified(self, step: int, entry: dict[str, Any]) -> bytes:
        """The stored bytes of one file, checked against its size and sha256; _Incomplete if not."""
        cached = self._verified.pop((entry["root"], step, entry["name"], entry["sha256"]), None)
        if cached is not None:
            return cached
        store = self._store_at(entry["root"])
        key = f"{step_dir(step)}/{entry['name']}"
        try:
            data = store.get(key)
        except KeyError:
            raise _Incomplete(f"{store.where(key)} is missing") from None
        if len(data) != entry["size"]:
            raise _Incomplete(
                f"{store.where(key)} is {len(data)} bytes, the manifest says {entry['size']}"
            )
        if _sha256(data) != entry["sha256"]:
            raise _Incomplete(
                f"{entry['name']} does not match its sha256 in the manifest (corrupt): "
                f"{store.where(key)}"
            )
        return data

    def _find(
        self,
        step: int | None,
        rank: int | None,
        world_size: int,
        strict_world_size: bool,
    ) -> tuple[dict[str, Any], dict[str, bytes], dict[str, dict[str, Any]]] | None:
        """The newest step (or `step`) whose manifest and this rank's files verify on every rank:
        (manifest, verified bytes by name). Rank 0 lists its store and reads the manifest; every
        rank reads its own files, and the entries they were checked against (same keys). None if
        nothing verifies (`self._skipped` says why)."""
        ranks = _Ranks(self.timeout_s)
        reads_manifest = rank in (0, None) or not ranks.many  # rank 0, or a process alone
        listing: tuple[list[int], str | None] = ([], None)
        if reads_manifest:
            try:
                listing = (sorted(self._steps(), reverse=True) if step is None else [step], None)
            except Exception as e:
                listing = ([], f"{self.uri}: {type(e).__name__}: {e}")
        candidates, list_error = ranks.broadcast(listing, "the listing of steps")
        if list_error:
            raise CheckpointError(f"cannot list the checkpoints on rank 0, under {list_error}")
        self._skipped: list[str] = []
        for candidate in candidates:
            where = self._store.where(step_dir(candidate))
            read: tuple[dict[str, Any] | None, str | None, str | None] = (None, None, None)
            if reads_manifest:
                try:
                    read = (self._manifest(candidate), None, None)
                except _Incomplete as why:
                    read = (None, f"{where}: {why}", None)
                except Exception as e:
                    read = (None, None, f"{type(e).__name__}: {e}")
            manifest, problem, fatal = ranks.broadcast(read, "the manifest")
            if fatal:
                raise CheckpointError(f"cannot read the manifest of {where} on rank 0: {fatal}")
            blobs: dict[str, bytes] = {}
            entries: dict[str, dict[str, Any]] = {}
            if manifest is not None:
                problem, fatal = None, None
                try:
                    per_rank = manifest["world_size"] == world_size
                    if not per_rank and strict_world_size:
                        raise CheckpointError(
                            f"{where} was written by {manifest['world_size']} ranks; this run "
                            f"has {world_size}. Per-rank state (comm_state, extra) cannot be "
                            f"mapped: resume with {manifest['world_size']} ranks, or "
                            "load(strict_world_size=False) to restore only the model and "
                            "optimizer"
                        )
                    entries = self._needed(manifest, rank, per_rank)
                    for name, entry in entries.items():
                        blobs[name] = self._read_verified(candidate, entry)
                except _Incomplete as why:
                    problem = f"{where}: {why}"
                except Exception as e:
                    fatal = e
                verdicts = ranks.all_gather(
                    (problem, None if fatal is None else f"{type(fatal).__name__}: {fatal}"),
                    "the verdicts on a step",
                )
                if fatal is not None:
                    raise fatal
                fatal_elsewhere = [f"rank {r}: {f}" for r, (_, f) in enumerate(verdicts) if f]
                if fatal_elsewhere:
                    raise CheckpointError(
                        f"checkpoint step {candidate} failed on other ranks: "
                        + "; ".join(fatal_elsewhere)
                    )
                problems = sorted({p for p, _ in verdicts if p})
                if not problems:
                    if self._skipped:
                        log.warning(
                            "checkpoint: using step %d, skipping newer: %s",
                            candidate,
                            self._skipped,
                        )
                    return manifest, blobs, entries
                problem = "; ".join(problems)
            log.warning("checkpoint: not using step %d: %s", candidate, problem)
            self._skipped.append(str(problem))
        return None

    def latest_step(self) -> int | None:
        """Newest step whose manifest and files all verify (present, right size and sha256), or
        None. In a distributed run call it on every rank (it is collective, and all ranks get the
        same answer: each checks its own files). Alone, it checks every file of the step."""
        dist = _dist()
        if dist is None:
            found = self._find(None, None, 0, strict_world_size=False)
        else:
            found = self._find(None, dist.get_rank(), dist.get_world_size(), False)
        self._verified = {}
        if found is None:
            return None
        manifest, blobs, entries = found
        step = manifest["step"]
        self._verified = {
            (e["root"], step, e["name"], e["sha256"]): blobs[key] for key, e in entries.items()
        }
        return step

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
        found = self._find(step, rank, world_size, strict_world_size)
        if found is None:
            skipped = "; ".join(self._skipped)
            if step is not None:
                raise CheckpointNotFoundError(
                    f"checkpoint step {step} under {self.uri} cannot be loaded: {skipped}. "
                    "Load another step, or step=None for the newest complete one"
                )
            detail = f" (skipped incomplete steps: {skipped})" if skipped else ""
            raise CheckpointNotFoundError(
                f"no complete checkpoint under {self.uri}{detail}. Check the URI, or start from "
                "scratch: call load() only when latest_step() is not None"
            )
        self._verified = {}
        manifest, blobs, _ = found
        folder = step_dir(manifest["step"])

        def read(name: str) -> Any:
            if name not in blobs:
                return None
            try:
                return _deserialize(blobs.pop(name), map_location, weights_only)
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
        }
