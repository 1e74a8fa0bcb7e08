"""Checkpoints: the same API tests on a local folder and on S3 (moto's server on loopback).

What must hold: a round trip gives back the same bytes; a step without a manifest or with a file
that does not match it is never loaded (the reader falls back or says why); keep_last deletes
old steps only after the new one is committed; big files go up in parts; bad URIs and missing
buckets fail at once with the path in the message; ranks that find different steps broken
still agree on the one they load (2 real processes over gloo).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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


@pytest.fixture
def aws(monkeypatch, moto_url: str) -> str:
    """Dummy credentials, no real AWS reachable: config files and instance metadata off."""
    for name, value in fake_aws_env(moto_url).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    return moto_url


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
    assert manifest["format"] == "cloudtrain.checkpoint" and manifest["version"] == 1
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert sorted(manifest["files"]) == ["model.pt", "optimizer.pt", "rank-00000.pt"]
    for name, entry in manifest["files"].items():
        data = store.get(f"{folder}/{name}")
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


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

    assert ckpt.latest_step() == 2  # sizes match: only the hash can tell
    state = ckpt.load()
    assert state["step"] == 1 and state["comm_state"] == {"seed": 1}
    assert "optimizer.pt does not match its sha256" in caplog.text
    with pytest.raises(CheckpointNotFoundError, match="sha256"):
        ckpt.load(step=2)


def test_truncated_shard_is_skipped(store: Store) -> None:
    ckpt = store.checkpointer()
    _save(ckpt, 1, seed=1)
    _save(ckpt, 2, seed=2)
    key = f"{step_dir(2)}/{rank_file(0)}"
    store.put(key, store.get(key)[:-10])
    assert ckpt.latest_step() == 1
    assert ckpt.load()["step"] == 1


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
    with pytest.raises(ValueError, match="at least 5 MiB"):
        S3Config(multipart_chunksize=1024)
    ckpt = Checkpointer(f"file://{tmp_path}/c")
    _save(ckpt, 1)
    assert (tmp_path / "c" / step_dir(1) / "manifest.json").is_file()


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
    weights = {"w": torch.arange(3 * mib, dtype=torch.float32)}  # 12 MiB: 3 parts
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
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_step_they_load(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _two_rank_worker, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    manifest = json.loads((tmp_path / step_dir(2) / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert sorted(manifest["files"]) == ["model.pt", "rank-00000.pt", "rank-00001.pt"]
