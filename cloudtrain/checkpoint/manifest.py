"""The on-disk format of a checkpoint: folder and file names, manifest.json, and how state becomes
the bytes of a file.

    <root>/step-00001234/model.pt        model.state_dict()
                         optimizer.pt    optimizer.state_dict()
                         rank-00000.pt   {"comm_state": ..., "extra": ...} of rank 0
                         manifest.json   written last: the commit marker

manifest.json (version 2) is {"format": FORMAT, "version": 2, "step", "world_size", "ranks": the
root each rank's shard lives under, "files": [{"root", "name", "size", "sha256"}, ...],
"compression", "created_unix", "torch_version"}. Version 1 (one store: "files" a map name ->
{size, sha256}, no "ranks") still loads: `parse_manifest` gives both versions one shape.

A file is torch.save's bytes, as a zstd frame unless written with compression_level=None; the
size and sha256 are over the stored bytes, so a reader checks a file before it decompresses it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .errors import CheckpointError, IncompleteStep

FORMAT = "cloudtrain.checkpoint"
FORMAT_VERSION = 2
"""2: files may live in several stores (a root per file and per rank); files may be zstd frames."""
DEFAULT_ZSTD_LEVEL = 3
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MANIFEST = "manifest.json"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir(step: int) -> str:
    """Name of the folder that holds `step` (`step-00001234`)."""
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    """Name of the file that holds the per-rank state of `rank`."""
    return f"rank-{rank:05d}.pt"


def steps_in(folders: Iterable[str]) -> list[int]:
    """The steps whose folders are among `folders` (a store's list_dirs(); others are ignored)."""
    return [int(m.group(1)) for d in folders if (m := _STEP_DIR.match(d))]


# ------------------------------------------------------------------------------ manifest


def build_manifest(
    step: int,
    world_size: int,
    ranks: list[str],
    files: list[dict[str, Any]],
    compression_level: int | None,
) -> bytes:
    """manifest.json for `step`: `ranks` the root of each rank's shard, `files` the entries
    {root, name, size, sha256} of every file the ranks wrote."""
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "ranks": ranks,
        "files": files,
        "compression": None if compression_level is None else "zstd",
        "created_unix": time.time(),
        "torch_version": torch.__version__,
    }
    return json.dumps(manifest, indent=1).encode()


def parse_manifest(raw: bytes, step: int, where: str, root: str) -> dict[str, Any]:
    """The manifest in one shape for every version: step, world_size, version, files (a list of
    {root, name, size, sha256}), ranks (root of each rank's shard). `root` is the store it was
    read from: version 1 names no roots, its files are all there. Raises IncompleteStep for
    anything unreadable or missing; CheckpointError for a version newer than this code."""
    try:
        manifest = json.loads(raw)
        if manifest.get("format") == "cloudtrain.sharded-checkpoint/1":
            raise CheckpointError(
                f"{where} was written by an older ShardedCheckpointer (its own local layout), "
                "which this cloudtrain does not read: resume with the release that wrote it, "
                "or start the run afresh in another folder"
            )
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
        raise IncompleteStep(f"unreadable manifest.json ({type(e).__name__}: {e})") from None
    # Roots the manifest leaves implicit (version 1) are the store it was read from. So are
    # those of a checkpoint whose files all went to one store, read from another place (moved,
    # copied, or saved through a relative path from another working directory): its files are
    # where its manifest is, never in the folder it was first written to.
    saved = {e["root"] for e in files} | {r for r in ranks if r}
    moved = len(saved) == 1 and root not in saved
    for e in files:
        e["root"] = root if moved or not e["root"] else e["root"]
    return {"step": step, "world_size": world_size, "version": version, "files": files,
            "ranks": [root if moved or not r else r for r in ranks]}  # fmt: skip


def files_to_read(
    manifest: dict[str, Any], rank: int | None, per_rank: bool, own_root: str
) -> dict[str, dict[str, Any]]:
    """The entries (by name) of the files `rank` reads: its shard if `per_rank`, and the model
    and optimizer from its own store (`own_root`) where that holds a copy, else from the first
    store that does. rank None: every file of the step, keyed root/name."""
    files = manifest["files"]
    if rank is None:
        return {f"{e['root']}/{e['name']}": e for e in files}
    needed = {}
    if per_rank:
        name, root = rank_file(rank), manifest["ranks"][rank]
        match = [e for e in files if e["name"] == name and e["root"] == root]
        if not match:
            raise IncompleteStep(f"the manifest lists no {name} under {root}")
        needed[name] = match[0]
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        copies = [e for e in files if e["name"] == name]
        own = [e for e in copies if e["root"] == own_root]
        if own or copies:
            needed[name] = (own or copies)[0]
    return needed


# ------------------------------------------------------------------------- file contents


def state_of(obj: Any, what: str) -> Mapping[str, Any]:
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


def serialize(obj: Any, level: int | None) -> bytes:
    """The stored bytes of `obj`: torch.save's, as a zstd frame of `level` (None: plain)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    if level is None:
        return data
    return _zstd().ZstdCompressor(level=level).compress(data)


def deserialize(data: bytes, map_location: Any, weights_only: bool) -> Any:
    """The object of stored bytes, compressed or not (a zstd frame starts with its magic)."""
    if data[:4] == _ZSTD_MAGIC:
        # Trusted size: these bytes already matched the manifest's sha256.
        data = _zstd().ZstdDecompressor().decompressobj().decompress(data)
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in chunks (a shard of a big model does not fit memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()
