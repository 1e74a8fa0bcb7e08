"""Where checkpoint files live: a local folder or an S3 prefix, behind one small interface.

A store maps keys such as "step-00000012/model.pt" to bytes: put, get (KeyError when absent),
put_file and get_file (the same from and to a local file, streamed: for files too big to hold in
memory), list_dirs, list_files (name -> size), delete, delete_dir, where (the URI of a key, for
messages), and is_transient (whether an error is worth a retry). Writes of one key are atomic: a
reader sees the whole old object, the whole new one, or nothing.

    store = open_store("s3://ct-demo-us-east-1-ckpt/run1", S3Config())
    store.put("step-00000012/manifest.json", data)

A root is a path, file:///path or s3://bucket/prefix. `resolve_root` turns what a user passes
(a root, a template with "{region}", or a map {region: root}) into this rank's root. S3 goes
through boto3 (the `cloud` extra): multipart transfers for big files (TransferConfig), botocore's
retry with backoff for every request, and `with_retries` on top for the manifest, the one object
whose loss would cost a whole checkpoint.
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from ..topology import region_of_this_host
from .errors import CheckpointError

log = logging.getLogger(__name__)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_T = TypeVar("_T")
_CHUNK = 8 << 20


def uri_scheme(uri: str) -> str:
    """The scheme of a root URI, lower-case ("s3", "file"); "" for a plain path."""
    match = _SCHEME.match(uri)
    return match.group(1).lower() if match else ""


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


class LocalStore:
    """A folder on this host; each write goes to a temporary file that is renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def where(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def put(self, key: str, data: bytes) -> None:
        self._write(key, lambda f: f.write(data))

    def put_file(self, key: str, source: str | os.PathLike) -> None:
        def copy(f: Any) -> None:
            with open(source, "rb") as src:
                shutil.copyfileobj(src, f, _CHUNK)

        self._write(key, copy)

    def _write(self, key: str, fill: Callable[[Any], Any]) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            fill(f)
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

    def get_file(self, key: str, dest: str | os.PathLike) -> None:
        try:
            shutil.copyfile(self.root / key, dest)
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


class S3Store:
    """A prefix in an S3 bucket; the bucket is checked when the store is made."""

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

    def put_file(self, key: str, source: str | os.PathLike) -> None:
        self.client.upload_file(
            os.fspath(source), self.bucket, self._key(key), Config=self.transfer
        )

    def get(self, key: str) -> bytes:
        buf = io.BytesIO()
        self._download(key, lambda k: self.client.download_fileobj(
            self.bucket, k, buf, Config=self.transfer))  # fmt: skip
        return buf.getvalue()

    def get_file(self, key: str, dest: str | os.PathLike) -> None:
        self._download(key, lambda k: self.client.download_file(
            self.bucket, k, os.fspath(dest), Config=self.transfer))  # fmt: skip

    def _download(self, key: str, fetch: Callable[[str], None]) -> None:
        from botocore.exceptions import ClientError

        try:
            fetch(self._key(key))
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) in ("404", "NoSuchKey"):
                raise KeyError(key) from None
            raise

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


Store = LocalStore | S3Store


def open_store(uri: str, s3: S3Config) -> Store:
    """The store of a root URI; CheckpointError for an unknown scheme or a missing bucket."""
    scheme = uri_scheme(uri)
    if scheme == "":
        return LocalStore(Path(uri).expanduser())
    if scheme == "file":
        path = urlparse(uri).path
        if not path:
            raise CheckpointError(f"checkpoint URI {uri!r} has no path: use file:///abs/path")
        return LocalStore(Path(path))
    if scheme == "s3":
        parsed = urlparse(uri)
        if not parsed.netloc:
            raise CheckpointError(f"checkpoint URI {uri!r} names no bucket: use s3://BUCKET/PREFIX")
        return S3Store(uri, parsed.netloc, parsed.path.strip("/"), s3)
    raise CheckpointError(
        f"unsupported checkpoint URI scheme {scheme!r} in {uri!r}: use a local path, "
        "file:///path or s3://bucket/prefix"
    )


def resolve_root(
    uri: str | os.PathLike | Mapping[str, str], region: str | None
) -> tuple[str | None, str]:
    """(this rank's region, None where unknown, and this rank's root URI) for a root, a template
    with "{region}" or a map {region: root}; region None: region_of_this_host()."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, (str, Mapping)) or (isinstance(uri, str) and not uri.strip()):
        raise CheckpointError(
            f"checkpoint URI {uri!r}: give a folder, file:///path, s3://bucket/prefix, a "
            "template with {region}, or a map {region: URI}"
        )
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


def with_retries(store: Store, s3: S3Config, fn: Callable[[], _T], what: str) -> _T:
    """fn(), tried again with backoff after the store's transient errors (S3 only: a local
    folder's errors are not worth a retry)."""
    attempts = s3.manifest_attempts if isinstance(store, S3Store) else 1
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if attempt + 1 == attempts or not store.is_transient(e):
                raise
            delay = s3.retry_base_delay_s * 2**attempt
            log.warning("checkpoint: %s failed (%s); retrying in %.1fs", what, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
