"""Checkpoints: the same API tests on a local folder and on S3 (moto's server on loopback).

What must hold: a round trip gives back the same bytes; a step without a manifest, with a
manifest missing keys, or with a file that does not match it is never loaded nor reported by
latest_step() (the reader falls back or says why); files are zstd frames and old uncompressed
checkpoints still load; keep_last deletes old steps only after the new one is committed; big files
go up in parts; bad URIs and missing buckets fail at once with the path in the message; ranks that
find different steps broken still agree on the one they load; ranks of two regions each write to
their region's bucket and resume from there; ranks that write to inconsistent places fail on every
rank; a rank that never arrives, or a listing that fails on rank 0, is an error on every rank
within the timeout (real processes over gloo).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed import free_port, run_ranks
from support import assert_same, fake_aws_env
from torch import nn

from cloudtrain.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    S3Config,
    rank_file,
    step_dir,
)


class Store:
    """Direct access to what a checkpoint left behind, to inspect it and to break it."""

    def __init__(self, uri: str, s3: S3Config, root: Path | None, bucket: str | None) -> None:
        self.uri, self.s3, self.root, self.bucket = uri, s3, root, bucket
        if bucket is not None:
            import boto3

            self.client = boto3.client("s3", endpoint_url=s3.endpoint_url)

    def checkpointer(self, keep_last: int | None = 3, **kw) -> Checkpointer:
        return Checkpointer(self.uri, keep_last=keep_last, s3=self.s3, **kw)

    def _key(self, key: str) -> str:
        return f"run/{key}"

    def get(self, key: str) -> bytes:
        if self.root is not None:
            return (self.root / key).read_bytes()
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        if self.root is not None:
            (self.root / key).parent.mkdir(parents=True, exist_ok=True)
            (self.root / key).write_bytes(data)
        else:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def delete(self, key: str) -> None:
        if self.root is not None:
            (self.root / key).unlink()
        else:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def files(self) -> list[str]:
        if self.root is not None:
            return sorted(
                str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()
            )
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix="run/"
        )
        return sorted(o["Key"][4:] for page in pages for o in page.get("Contents", []))


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "ckpt"), S3Config(), tmp_path / "ckpt", None)
    url = request.getfixturevalue("aws")
    import boto3

    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
    return Store(f"s3://{bucket}/run", S3Config(endpoint_url=url), None, bucket)


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(ckpt: Checkpointer, step: int, seed: int = 0) -> None:
    model, optimizer = _trained(seed)
    ckpt.save(step, model=model, optimizer=optimizer, comm_state={"seed": seed})


# ------------------------------------------------------------------------------ round trip


def test_round_trip(store: Store) -> None:
    model, optimizer = _trained()
    comm_state = {
        "residuals": {0: torch.randn(7), 1: torch.randn(3, dtype=torch.bfloat16)},
        "controller": {"level": 3, "bandwidth_ewma": 2.5e8, "ladder": ["none", "fp16", "top1%"]},
    }
    extra = {"torch_rng": torch.get_rng_state(), "epoch": 2}
    ckpt = store.checkpointer()
    where = ckpt.save(12, model=model, optimizer=optimizer, comm_state=comm_state, extra=extra)
    assert where.endswith("step-00000012")

    assert ckpt.latest_step() == 12
    state = store.checkpointer().load()
    assert state["step"] == 12 and state["world_size"] == 1
    assert_same(state["model"], model.state_dict(), "model")
    assert_same(state["optimizer"], optimizer.state_dict(), "optimizer")
    assert_same(state["comm_state"], comm_state, "comm_state")
    assert_same(state["extra"], extra, "extra")

    fresh, fresh_opt = _trained(seed=1)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    assert_same(fresh_opt.state_dict(), optimizer.state_dict(), "optimizer after restore")


def test_layout_and_manifest(store: Store) -> None:
    _save(store.checkpointer(), 7)
    folder = step_dir(7)
    assert store.files() == [
        f"{folder}/{n}" for n in ("manifest.json", "model.pt", "optimizer.pt")
    ] + [f"{folder}/{rank_file(0)}"]
    manifest = json.loads(store.get(f"{folder}/manifest.json"))
    assert manifest["format"] == "cloudtrain.checkpoint" and manifest["version"] == 2
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert manifest["ranks"] == [store.uri] and manifest["compression"] == "zstd"
    entries = sorted(manifest["files"], key=lambda e: e["name"])
    assert [e["name"] for e in entries] == ["model.pt", "optimizer.pt", "rank-00000.pt"]
    for entry in entries:
        data = store.get(f"{folder}/{entry['name']}")
        assert data[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame; the hash is over these bytes
        assert entry == {
            "root": store.uri,
            "name": entry["name"],
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }


def test_uncompressed_and_old_checkpoints_load(store: Store) -> None:
    """compression_level=None writes plain torch files; a version-1 checkpoint (uncompressed,
    files as a name -> {size, sha256} map, as cloudtrain wrote them before) still loads."""
    plain = store.checkpointer(compression_level=None)
    _save(plain, 1, seed=1)
    assert store.get(f"{step_dir(1)}/model.pt")[:2] == b"PK"  # torch's zip format
    model, optimizer = _trained(seed=2)
    files = {}
    for name, obj in [
        ("model.pt", model.state_dict()),
        ("optimizer.pt", optimizer.state_dict()),
        (rank_file(0), {"comm_state": {"seed": 2}, "extra": None}),
    ]:
        buf = io.BytesIO()
        torch.save(obj, buf)
        store.put(f"{step_dir(2)}/{name}", buf.getvalue())
        files[name] = {
            "size": len(buf.getvalue()),
            "sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
        }
    v1 = {
        "format": "cloudtrain.checkpoint",
        "version": 1,
        "step": 2,
        "world_size": 1,
        "files": files,
    }
    store.put(f"{step_dir(2)}/manifest.json", json.dumps(v1).encode())
    ckpt = store.checkpointer()
    assert ckpt.latest_step() == 2
    state = ckpt.load()
    assert state["comm_state"] == {"seed": 2}
    assert_same(state["model"], model.state_dict(), "model")
    assert_same(state["optimizer"], optimizer.state_dict(), "optimizer")
    assert ckpt.load(step=1)["comm_state"] == {"seed": 1}
    with pytest.raises(CheckpointError, match="compression_level=0"):
        store.checkpointer(compression_level=0)


@pytest.mark.parametrize(
    "manifest",
    [
        {"format": "cloudtrain.checkpoint", "version": 2, "step": 2},
        {"format": "cloudtrain.checkpoint", "version": 2, "step": 2, "world_size": 1},
        {"format": "cloudtrain.checkpoint", "version": 2, "step": 2, "world_size": 1,
         "ranks": ["x"], "files": [{"name": "model.pt"}]},
        {"format": "cloudtrain.checkpoint", "version": 1, "step": 2, "world_size": 1,
         "files": {"model.pt": 5}},
        {"format": "cloudtrain.checkpoint", "version": 2, "step": 2, "world_size": "one"},
        {"format": "cloudtrain.checkpoint", "version": None, "step": 2},
        ["a", "list"],
        "a string",
    ],
)  # fmt: skip
def test_manifest_missing_keys_is_skipped(store: Store, manifest, caplog) -> None:
    ckpt = store.checkpointer()
    _save(ckpt, 1, seed=1)
    _save(ckpt, 2, seed=2)
    store.put(f"{step_dir(2)}/manifest.json", json.dumps(manifest).encode())
    assert ckpt.latest_step() == 1
    assert ckpt.load()["comm_state"] == {"seed": 1}
    assert "unreadable manifest.json" in caplog.text
    with pytest.raises(CheckpointNotFoundError, match="unreadable manifest.json"):
        ckpt.load(step=2)


def test_resave_same_step(store: Store) -> None:
    ckpt = store.checkpointer()
    _save(ckpt, 3, seed=0)
    _save(ckpt, 3, seed=1)
    assert ckpt.load()["comm_state"] == {"seed": 1}


# ----------------------------------------------------------------- never a half checkpoint


def test_step_without_manifest_is_skipped(store: Store, caplog) -> None:
    ckpt = store.checkpointer()
    _save(ckpt, 1, seed=1)
    _save(ckpt, 2, seed=2)
    store.delete(f"{step_dir(2)}/manifest.json")  # as if preempted between shards and manifest

    assert ckpt.latest_step() == 1
    assert ckpt.load()["comm_state"] == {"seed": 1}
    assert "no manifest.json" in caplog.text
    with pytest.raises(CheckpointNotFoundError, match=r"step-00000002.*no manifest\.json"):
        ckpt.load(step=2)


def test_corrupt_shard_is_never_loaded(store: Store, caplog) -> None:
    ckpt = store.checkpointer()
    _save(ckpt, 1, seed=1)
    _save(ckpt, 2, seed=2)
    key = f"{step_dir(2)}/optimizer.pt"
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    store.put(key, bytes(data))

    assert ckpt.latest_step() == 1  # sizes match: only the hash can tell
    state = ckpt.load()
    assert state["step"] == 1 and state["comm_state"] == {"seed": 1}
    assert "optimizer.pt does not match its sha256" in caplog.text
    with pytest.raises(CheckpointNotFoundError, match="sha256"):
        ckpt.load(step=2)


def test_own_files_are_listed_fetched_and_checked(store: Store, tmp_path) -> None:
    """save(files=) stores a rank's local files as they are; load() lists them and fetch()
    copies one back only if it matches the manifest (ShardedCheckpointer's DCP files)."""
    src = tmp_path / "shard.bin"
    src.write_bytes(os.urandom(70_000))
    ckpt = store.checkpointer()
    ckpt.save(3, comm_state={"a": 1}, files={"region-0-__0_0.distcp": src})
    state = ckpt.load()
    (entry,) = state["files"]
    assert (entry["name"], entry["size"]) == ("region-0-__0_0.distcp", 70_000)
    ckpt.fetch(3, entry, tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    key = f"{step_dir(3)}/region-0-__0_0.distcp"
    data = bytearray(store.get(key))
    data[100] ^= 0xFF
    store.put(key, bytes(data))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        ckpt.fetch(3, entry, tmp_path / "bad.bin")
    assert not (tmp_path / "bad.bin").exists()  # nothing half-checked is left for a reader
    store.delete(key)
    with pytest.raises(CheckpointError, match="is missing"):
        ckpt.fetch(3, entry, tmp_path / "bad.bin")
    for name in ("manifest.json", "model.pt", "rank-00001.pt", "a/b", ".hidden"):
        with pytest.raises(CheckpointError, match="cannot be a file of the step's folder"):
            ckpt.save(4, files={name: src})


def test_truncated_shard_is_skipped(store: Store) -> None:
    ckpt = store.checkpointer()
    _save(ckpt, 1, seed=1)
    _save(ckpt, 2, seed=2)
    key = f"{step_dir(2)}/{rank_file(0)}"
    store.put(key, store.get(key)[:-10])
    assert ckpt.latest_step() == 1
    assert ckpt.load()["step"] == 1


def test_a_moved_or_copied_checkpoint_is_read_where_it_is(tmp_path, monkeypatch) -> None:
    """A checkpoint of one folder reads its files next to its manifest: saved through a relative
    path and loaded from another working directory, moved, or copied (a damaged copy is
    skipped, never made good by the original's files)."""
    import shutil

    monkeypatch.chdir(tmp_path)
    _save(Checkpointer("rel/ckpt"), 3, seed=3)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert Checkpointer(str(tmp_path / "rel/ckpt")).load()["comm_state"] == {"seed": 3}
    shutil.move(tmp_path / "rel/ckpt", tmp_path / "moved")
    assert Checkpointer(str(tmp_path / "moved")).load()["comm_state"] == {"seed": 3}
    shutil.copytree(tmp_path / "moved", tmp_path / "copy")
    shard = tmp_path / "copy" / step_dir(3) / rank_file(0)
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointNotFoundError, match=r"rank-00000\.pt is \d+ bytes"):
        Checkpointer(str(tmp_path / "copy")).load()
    assert Checkpointer(str(tmp_path / "moved")).load()["step"] == 3


def test_nothing_complete_raises_with_the_reasons(store: Store) -> None:
    ckpt = store.checkpointer()
    assert ckpt.latest_step() is None
    with pytest.raises(
        CheckpointNotFoundError, match=r"no complete checkpoint under .*latest_step"
    ):
        ckpt.load()
    _save(ckpt, 5)
    store.delete(f"{step_dir(5)}/manifest.json")
    with pytest.raises(CheckpointNotFoundError, match=r"skipped incomplete steps.*step-00000005"):
        ckpt.load()


# ---------------------------------------------------------------------------- keep_last


def test_keep_last(store: Store) -> None:
    ckpt = store.checkpointer(keep_last=2)
    _save(ckpt, 1)
    _save(ckpt, 2)
    store.delete(f"{step_dir(2)}/manifest.json")  # an unfinished step goes too, once older
    for step in (3, 4, 5):
        _save(ckpt, step)
    assert sorted({k.split("/")[0] for k in store.files()}) == [step_dir(4), step_dir(5)]
    assert ckpt.load()["step"] == 5
    everything = store.checkpointer(keep_last=None)
    _save(everything, 6)
    assert sorted({k.split("/")[0] for k in store.files()}) == [step_dir(s) for s in (4, 5, 6)]


# ------------------------------------------------------------------------- world size


def test_world_size_mismatch(store: Store) -> None:
    ckpt = store.checkpointer()
    _save(ckpt, 1)
    with pytest.raises(CheckpointError, match=r"written by 1 ranks; this run has 2"):
        ckpt.load(rank=1, world_size=2)
    state = ckpt.load(rank=1, world_size=2, strict_world_size=False)
    assert state["model"] is not None and state["comm_state"] is None and state["extra"] is None
    with pytest.raises(CheckpointError, match="needs torch.distributed"):
        ckpt.save(2, model=nn.Linear(2, 2), rank=0, world_size=2)


def test_weights_only_refusal_says_what_to_do(store: Store) -> None:
    ckpt = store.checkpointer()
    ckpt.save(1, extra={"when": timedelta(seconds=3)})  # not a plain tensor/container type
    with pytest.raises(CheckpointError, match=r"weights_only=False"):
        ckpt.load()
    assert ckpt.load(weights_only=False)["extra"] == {"when": timedelta(seconds=3)}


# ------------------------------------------------------------------------------ bad input


def test_bad_uris(tmp_path) -> None:
    with pytest.raises(
        CheckpointError, match=r"unsupported checkpoint URI scheme 'gs' in 'gs://b/p'"
    ):
        Checkpointer("gs://b/p")
    with pytest.raises(CheckpointError, match=r"names no bucket.*s3://BUCKET/PREFIX"):
        Checkpointer("s3:///prefix")
    with pytest.raises(CheckpointError, match="keep_last=0"):
        Checkpointer(str(tmp_path), keep_last=0)
    with pytest.raises(CheckpointError, match="keep_last='3': keep at least 1 step"):
        Checkpointer(str(tmp_path), keep_last="3")  # a TypeError before
    with pytest.raises(CheckpointError, match="step='7' must be an int"):
        Checkpointer(str(tmp_path / "s")).save("7")
    import numpy as np

    numpy_step = Checkpointer(str(tmp_path / "n"), keep_last=np.int64(2))
    numpy_step.save(np.int64(4), comm_state={"seed": 0})  # the manifest's JSON takes it
    assert numpy_step.latest_step() == 4 and numpy_step.keep_last == 2
    with pytest.raises(ValueError, match="at least 5 MiB"):
        S3Config(multipart_chunksize=1024)
    for empty in ("", "  ", None):  # "" wrote into the working directory
        with pytest.raises(CheckpointError, match="give a folder, file:///path, s3://"):
            Checkpointer(empty)
    ckpt = Checkpointer(f"file://{tmp_path}/c")
    _save(ckpt, 1)
    assert (tmp_path / "c" / step_dir(1) / "manifest.json").is_file()
    _save(Checkpointer(tmp_path / "p"), 1)  # a Path, as well as a str
    assert (tmp_path / "p" / step_dir(1) / "manifest.json").is_file()


def test_missing_bucket(aws: str) -> None:
    with pytest.raises(CheckpointError, match=r"bucket 'no-such-bucket' does not exist.*create it"):
        Checkpointer("s3://no-such-bucket/run", s3=S3Config(endpoint_url=aws))


def test_endpoint_from_boto3_environment(aws: str, monkeypatch) -> None:
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", aws)
    boto3.client("s3").create_bucket(Bucket="env-endpoint")
    ckpt = Checkpointer("s3://env-endpoint")  # no prefix: steps at the bucket's top
    _save(ckpt, 1)
    assert ckpt.load()["step"] == 1


# ------------------------------------------------------------------------------ multipart


def test_multipart_upload(aws: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=aws)
    client.create_bucket(Bucket="big")
    mib = 2**20
    s3 = S3Config(endpoint_url=aws, multipart_threshold=5 * mib, multipart_chunksize=5 * mib)
    random = torch.Generator().manual_seed(0)  # incompressible: 12 MiB, as a zstd frame too
    weights = {"w": torch.randint(0, 256, (12 * mib,), dtype=torch.uint8, generator=random)}
    ckpt = Checkpointer("s3://big/run", s3=s3)
    ckpt.save(1, model=weights)
    etag = client.head_object(Bucket="big", Key=f"run/{step_dir(1)}/model.pt")["ETag"]
    assert etag.strip('"').endswith("-3"), f"not a 3-part upload: ETag {etag}"
    assert_same(ckpt.load()["model"], weights)


# ------------------------------------------------------------------- 2 ranks, real gloo


def _two_rank_worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        ckpt = Checkpointer(root)
        for step in (1, 2):
            model = nn.Linear(2, 2)
            ckpt.save(step, model=model, comm_state={"rank": rank, "step": step})
        dist.barrier()
        if rank == 1:  # only rank 1's shard of step 2 breaks: only rank 1 can notice
            path = Path(root, step_dir(2), rank_file(1))
            data = bytearray(path.read_bytes())
            data[-5] ^= 0xFF
            path.write_bytes(bytes(data))
        dist.barrier()
        state = ckpt.load()
        assert state["step"] == 1, f"rank {rank} loaded step {state['step']}"
        assert state["comm_state"] == {"rank": rank, "step": 1}
        # both ranks are past load()'s last collective before either tears gloo down: a rank
        # that left early once made the other abort in teardown ("terminate called without an
        # active exception") after every assertion had passed
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_step_they_load(tmp_path) -> None:
    mp.start_processes(
        _two_rank_worker,
        args=(free_port(), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    manifest = json.loads((tmp_path / step_dir(2) / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert sorted(e["name"] for e in manifest["files"]) == [
        "model.pt",
        "rank-00000.pt",
        "rank-00001.pt",
    ]


# ------------------------------------------------------------ regions, layout, collectives


def _init_ranks() -> None:
    from cloudtrain.bootstrap import init

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    init(backend="gloo")


def _regions_worker(rank: int, world: int, template: str, moto: str, tmp: str) -> dict:
    """Ranks 0, 1 in us-east-1, rank 2 in eu-west-1 (CLOUDTRAIN_REGION)."""
    _init_ranks()
    s3 = S3Config(endpoint_url=moto)
    out: dict = {}
    ckpt = Checkpointer(template, keep_last=1, s3=s3)
    model, optimizer = _trained(seed=5)
    for step in (1, 2):
        ckpt.save(step, model=model, optimizer=optimizer, comm_state={"rank": rank, "step": step})
    out["latest"] = ckpt.latest_step()
    state = ckpt.load()
    out["loaded"] = (state["step"], state["comm_state"], state["path"])
    assert_same(state["model"], model.state_dict(), "model")
    assert_same(state["optimizer"], optimizer.state_dict(), "optimizer")

    def failure(ckpt: Checkpointer, **kw) -> str:
        try:
            ckpt.save(3, model=model, optimizer=optimizer, comm_state={}, **kw)
        except CheckpointError as e:
            return str(e)
        return "saved"

    # rank 1 (us-east-1) points at another bucket than rank 0, same region
    other = "s3://ckpt-elsewhere/run" if rank == 1 else template
    out["split_region"] = failure(Checkpointer(other, s3=s3))
    # local folders that differ from rank to rank: no manifest can describe them
    out["local"] = failure(Checkpointer(f"{tmp}/rank{rank}"))
    # eu-west-1 on a local folder, us-east-1 in S3: rank 0 could never read back that shard
    out["mixed"] = failure(Checkpointer(f"{tmp}/eu" if rank == 2 else template, s3=s3))
    # the first rank of eu-west-1 was not given the model rank 0 writes
    try:
        Checkpointer(template, s3=s3).save(
            3, model=model if rank != 2 else None, optimizer=optimizer
        )
        out["no_model"] = "saved"
    except CheckpointError as e:
        out["no_model"] = str(e)
    return out


def test_two_regions_write_to_their_own_buckets_and_resume(aws: str, tmp_path) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=aws)
    run = uuid.uuid4().hex[:8]
    buckets = {region: f"ckpt-{run}-{region}" for region in ("us-east-1", "eu-west-1")}
    for bucket in [*buckets.values(), "ckpt-elsewhere"]:
        client.create_bucket(Bucket=bucket)
    template = f"s3://ckpt-{run}-{{region}}/run"
    env = fake_aws_env(aws, "S3")
    regions = ["us-east-1", "us-east-1", "eu-west-1"]
    results = run_ranks(
        3,
        _regions_worker,
        template,
        aws,
        str(tmp_path),
        env={r: {**env, "CLOUDTRAIN_REGION": regions[r]} for r in range(3)},
        timeout=180,
    )
    for rank, out in enumerate(results):
        root = f"s3://{buckets[regions[rank]]}/run"
        assert out["latest"] == 2
        assert out["loaded"] == (2, {"rank": rank, "step": 2}, f"{root}/{step_dir(2)}")
        assert "ranks of region 'us-east-1' write to different places" in out["split_region"]
        assert "s3://ckpt-elsewhere/run" in out["split_region"]
        assert "never other hosts' local folders" in out["local"]
        assert "of schemes ['', 's3']" in out["mixed"]
        assert "rank 2 writes the model and optimizer to" in out["no_model"]

    def keys(bucket: str) -> list[str]:
        listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
        return sorted(o["Key"] for o in listed)

    # Each region's bucket holds its ranks' shards, its own model/optimizer copy and a copy of
    # the manifest; keep_last=1 pruned step 1 in both; nothing of step 3 was committed.
    us, eu = (keys(buckets[r]) for r in ("us-east-1", "eu-west-1"))
    folder = f"run/{step_dir(2)}"
    assert [k for k in us if folder in k] == [
        f"{folder}/{n}"
        for n in ("manifest.json", "model.pt", "optimizer.pt", rank_file(0), rank_file(1))
    ]
    assert [k for k in eu if folder in k] == [
        f"{folder}/{n}" for n in ("manifest.json", "model.pt", "optimizer.pt", rank_file(2))
    ]
    assert not [k for k in us + eu if step_dir(1) in k]
    assert not [k for k in us + eu if step_dir(3) in k and k.endswith("manifest.json")]
    manifests = [
        json.loads(client.get_object(Bucket=b, Key=f"{folder}/manifest.json")["Body"].read())
        for b in buckets.values()
    ]
    assert manifests[0] == manifests[1]
    roots = {r: f"s3://{b}/run" for r, b in buckets.items()}
    assert manifests[0]["ranks"] == [roots[r] for r in regions]
    # Any region finds the step alone, from its own bucket, and every file verifies.
    for region in buckets:
        alone = Checkpointer(template, region=region, s3=S3Config(endpoint_url=aws))
        assert alone.latest_step() == 2
        assert alone.load(rank=2, world_size=3)["comm_state"] == {"rank": 2, "step": 2}


def _collectives_worker(rank: int, world: int, moto: str, bucket0: str, bucket1: str) -> dict:
    import time

    _init_ranks()
    s3 = S3Config(endpoint_url=moto)
    out: dict = {}
    ckpt = Checkpointer({"a": f"s3://{bucket0}/run", "b": f"s3://{bucket1}/run"}, s3=s3)
    ckpt.save(1, comm_state={"rank": rank})
    if rank == 0:  # rank 0's store vanishes: only rank 0 lists, and every rank must hear of it
        import boto3

        client = boto3.client("s3", endpoint_url=moto)
        for key in client.list_objects_v2(Bucket=bucket0)["Contents"]:
            client.delete_object(Bucket=bucket0, Key=key["Key"])
        client.delete_bucket(Bucket=bucket0)
    dist.barrier()
    for name, call in (("load", ckpt.load), ("latest", ckpt.latest_step)):
        try:
            call()
            out[name] = "no error"
        except CheckpointError as e:
            out[name] = str(e)
    # A rank that never comes: save() on the others fails after CLOUDTRAIN_TIMEOUT (3 s here).
    t0 = time.monotonic()
    if rank == 0:
        try:
            Checkpointer(str(Path(os.environ["TMP_ROOT"]))).save(2)
            out["timeout"] = "no error"
        except CheckpointError as e:
            out["timeout"] = str(e)
    else:
        time.sleep(8)
    out["seconds"] = time.monotonic() - t0
    return out


def test_listing_error_and_timeout_reach_every_rank(aws: str, tmp_path) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=aws)
    bucket0, bucket1 = (f"ckpt-{uuid.uuid4().hex[:12]}" for _ in range(2))
    for bucket in (bucket0, bucket1):
        client.create_bucket(Bucket=bucket)
    env = {**fake_aws_env(aws, "S3"), "CLOUDTRAIN_TIMEOUT": "3", "TMP_ROOT": str(tmp_path)}
    results = run_ranks(
        2,
        _collectives_worker,
        aws,
        bucket0,
        bucket1,
        env={0: {**env, "CLOUDTRAIN_REGION": "a"}, 1: {**env, "CLOUDTRAIN_REGION": "b"}},
        timeout=120,
    )
    for out in results:
        for name in ("load", "latest"):
            assert f"cannot list the checkpoints on rank 0, under s3://{bucket0}/run" in out[name]
            assert "NoSuchBucket" in out[name]
    assert "did not reach the same call within 3 s (CLOUDTRAIN_TIMEOUT)" in results[0]["timeout"]
    assert 2.5 < results[0]["seconds"] < 7, results[0]["seconds"]


def test_region_templates(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CLOUDTRAIN_REGION", raising=False)
    monkeypatch.delenv("CLOUDTRAIN_HOST_REGIONS", raising=False)
    with pytest.raises(CheckpointError, match=r"depends on the region.*CLOUDTRAIN_REGION"):
        Checkpointer(str(tmp_path / "{region}"))
    assert Checkpointer(str(tmp_path / "{region}"), region="eu-west-1").uri == str(
        tmp_path / "eu-west-1"
    )
    monkeypatch.setenv("CLOUDTRAIN_REGION", "us-east-1")
    assert Checkpointer(str(tmp_path / "ckpt-{region}")).uri == str(tmp_path / "ckpt-us-east-1")
    by_region = {"us-east-1": str(tmp_path / "us"), "eu-west-1": str(tmp_path / "eu")}
    assert Checkpointer(by_region).uri == str(tmp_path / "us")
    with pytest.raises(CheckpointError, match=r"no checkpoint URI for region 'ap-south-1'"):
        Checkpointer(by_region, region="ap-south-1")


def test_load_after_latest_step_reads_nothing_twice(store: Store) -> None:
    """latest_step() verifies every file of the step; the load() that follows takes those same
    verified bytes (keyed by their sha256) instead of downloading them again."""
    ckpt = store.checkpointer()
    _save(ckpt, 1, seed=1)
    _save(ckpt, 2, seed=2)
    assert ckpt.latest_step() == 2
    key = f"{step_dir(2)}/{rank_file(0)}"
    data = bytearray(store.get(key))
    data[-5] ^= 0xFF
    store.put(key, bytes(data))  # changed after the check: this load does not read it again
    assert ckpt.load()["comm_state"] == {"seed": 2}
    assert ckpt.load()["comm_state"] == {"seed": 1}  # nothing cached now: the change is seen


def test_an_old_sharded_checkpoint_is_refused_not_skipped(tmp_path) -> None:
    """A folder of the first ShardedCheckpointer (its own manifest) is an error naming it, never
    "nothing saved" - which would start the run again from step 0."""
    folder = tmp_path / "ckpt" / step_dir(5)
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(
        '{"format": "cloudtrain.sharded-checkpoint/1", "step": 5}'
    )
    with pytest.raises(CheckpointError, match="older ShardedCheckpointer"):
        Checkpointer(str(tmp_path / "ckpt")).latest_step()
