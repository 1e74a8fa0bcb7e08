"""Spot interruption watcher, rank agreement, and preempt -> checkpoint -> resume end to end.

A fake EC2 instance-metadata server (IMDSv2: token PUT, then spot/instance-action GET with the
token; 404 until the test switches it to a notice) runs on loopback. The end-to-end test runs
tests/data/spot_train.py as 2 real processes over gloo, one per region, checkpointing to the
per-region buckets that terraform/modules/plan names (planned by real Terraform, created on moto's
S3 server) through the checkpoint URI template it outputs.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from distributed import free_port
from support import assert_same, fake_aws_env, plan_module_outputs

from cloudtrain.checkpoint import Checkpointer
from cloudtrain.spot import (
    IMDS_ENDPOINT_ENV,
    InstanceMetadata,
    PreemptionGuard,
    SpotNotice,
    SpotWatcher,
)

TRAIN_SCRIPT = Path(__file__).parent / "data" / "spot_train.py"
NOTICE = {"action": "terminate", "time": "2026-11-29T23:30:00Z"}


class FakeIMDS(http.server.ThreadingHTTPServer):
    """The two IMDSv2 calls the watcher makes, with a switchable spot notice."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _IMDSHandler)
        self.notice: dict | str | None = None  # a dict is sent as JSON, a str as it is
        self.tokens: set[str] = set()
        self.gets = 0
        self.puts = 0
        self.thread = threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _IMDSHandler(http.server.BaseHTTPRequestHandler):
    server: FakeIMDS

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        if self.path != "/latest/api/token" or not ttl or not 1 <= int(ttl) <= 21600:
            return self._reply(400)
        self.server.puts += 1
        token = uuid.uuid4().hex
        self.server.tokens.add(token)
        self._reply(200, token.encode())

    def do_GET(self) -> None:
        self.server.gets += 1
        if self.headers.get("X-aws-ec2-metadata-token") not in self.server.tokens:
            return self._reply(401)
        if self.path != "/latest/meta-data/spot/instance-action" or self.server.notice is None:
            return self._reply(404)
        notice = self.server.notice
        self._reply(200, (notice if isinstance(notice, str) else json.dumps(notice)).encode())


@contextlib.contextmanager
def _serve_imds() -> Iterator[FakeIMDS]:
    server = FakeIMDS()
    server.thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def imds() -> Iterator[FakeIMDS]:
    with _serve_imds() as server:
        yield server


@pytest.fixture
def other_imds() -> Iterator[FakeIMDS]:
    """The metadata service of a second instance."""
    with _serve_imds() as server:
        yield server


def _dead_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"  # a port nothing listens on once closed


def _wait_for(cond, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(0.005)
    return time.monotonic() - t0


# --------------------------------------------------------------------------- watcher


def test_no_notice_is_404_and_training_goes_on(imds: FakeIMDS) -> None:
    with SpotWatcher(imds.url, interval_s=0.02) as watcher:
        _wait_for(lambda: imds.gets >= 3, 5)
        assert not watcher.noticed and watcher.errors == 0
    assert imds.puts == 1  # one token serves every poll


def test_notice_seen_within_poll_period(imds: FakeIMDS, monkeypatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", _dead_endpoint())  # link-local IMDS must bypass proxies
    monkeypatch.setenv("http_proxy", _dead_endpoint())
    interval = 0.3
    seen: list[SpotNotice] = []
    with SpotWatcher(imds.url, interval_s=interval, on_notice=seen.append) as watcher:
        _wait_for(lambda: imds.gets >= 1, 5)
        imds.notice = NOTICE
        took = _wait_for(lambda: watcher.noticed, 5)
    assert took <= interval + 0.2
    assert watcher.notice == SpotNotice(action="terminate", time="2026-11-29T23:30:00Z")
    assert seen == [watcher.notice]
    assert watcher.errors == 0


def test_dead_endpoint_logs_once_and_never_raises(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="cloudtrain.spot")
    with SpotWatcher(_dead_endpoint(), interval_s=0.01, timeout_s=0.5) as watcher:
        _wait_for(lambda: watcher.errors >= 3, 10)
        assert watcher._thread is not None and watcher._thread.is_alive()
    assert not watcher.noticed
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot read instance metadata" in warnings[0].getMessage()
    assert PreemptionGuard(watcher).should_stop() is False


def test_endpoint_from_environment(imds: FakeIMDS, monkeypatch) -> None:
    monkeypatch.setenv(IMDS_ENDPOINT_ENV, imds.url + "/")
    client = InstanceMetadata()
    assert client.endpoint == imds.url
    assert client.get("spot/instance-action") is None
    imds.notice = NOTICE
    assert json.loads(client.get("spot/instance-action")) == NOTICE


def test_expired_token_is_renewed(imds: FakeIMDS) -> None:
    client = InstanceMetadata(imds.url)
    assert client.get("spot/instance-action") is None
    imds.tokens.clear()  # the server forgets it: the next GET gets 401
    imds.notice = NOTICE
    assert json.loads(client.get("spot/instance-action")) == NOTICE
    assert imds.puts == 2


def test_garbled_notice_still_counts(imds: FakeIMDS) -> None:
    imds.notice = "<html>not json</html>"
    assert SpotWatcher(imds.url).poll() == SpotNotice(action="unknown", time="")


def test_notice_time() -> None:
    soon = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
    left = SpotNotice("terminate", soon).seconds_left()
    assert left is not None and 100 < left <= 121
    assert SpotNotice("terminate", "").seconds_left() is None


def test_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        SpotWatcher("http://127.0.0.1:1", interval_s=0)
    with pytest.raises(ValueError, match="check_every"):
        PreemptionGuard(None, check_every=0)


def test_guard_without_distributed_is_local(imds: FakeIMDS) -> None:
    watcher = SpotWatcher(imds.url)
    guard = PreemptionGuard(watcher, check_every=2)
    assert [guard.should_stop() for _ in range(2)] == [False, False]
    imds.notice = NOTICE
    watcher.poll()
    assert guard.should_stop() is False  # the 3rd call is not a check point
    assert guard.should_stop() is True
    assert guard.should_stop() is True  # and it stays stopped
    other = PreemptionGuard(None)
    other.request_stop()
    assert other.should_stop() is True


# ----------------------------------------------------------- preempt, checkpoint, resume


def _launch(
    world: int, args: list[str], env: dict[str, str], per_rank: list[dict[str, str]] | None = None
) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = {
            **os.environ,
            **env,
            **(per_rank[rank] if per_rank else {}),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(TRAIN_SCRIPT), *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen], timeout_s: float = 120) -> list[str]:
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out}"
    return outputs


def test_preempted_run_resumes_bit_identical(
    tmp_path, monkeypatch, imds: FakeIMDS, other_imds: FakeIMDS, moto_url: str
) -> None:
    """2 ranks on two "instances" in two regions, each with its own metadata service and its own
    region's checkpoint bucket (the plan module's layout); 10 steps, checkpoint every 3. Run A goes
    straight through. In run B only rank 1's instance gets a notice, after step 4: both ranks must
    stop after step 4 (rank 0 never saw a notice itself), commit that step - each rank's shard in
    its region's bucket, the manifest in both - and exit 0. Run C restarts from it and finishes.
    A's and C's final model, Adam state, per-rank comm state and RNG must be equal bit for bit."""
    import boto3

    env = fake_aws_env(moto_url, "S3")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    one_host = {"instance_count": 1, "instance_type": "g5.xlarge", "slots": 1}
    layout = plan_module_outputs(
        tmp_path / "terraform",
        {
            "cluster_name": "ct-spot",
            "operator_cidrs": ["203.0.113.7/32"],
            "checkpoint_bucket_suffix": uuid.uuid4().hex[:12],
            "regions": {"us-east-1": one_host, "eu-west-1": one_host},
        },
    )
    buckets = layout["checkpoint_buckets"]
    for bucket in buckets.values():
        boto3.client("s3").create_bucket(Bucket=bucket)
    uri = layout["checkpoint_uri"] + "/run"
    regions = [host["region"] for host in layout["hosts"]]  # rank r runs on host r
    assert regions == ["eu-west-1", "us-east-1"]
    instances = [
        {IMDS_ENDPOINT_ENV: other_imds.url, "CLOUDTRAIN_REGION": regions[0]},
        {IMDS_ENDPOINT_ENV: imds.url, "CLOUDTRAIN_REGION": regions[1]},
    ]
    common = ["--steps", "10", "--save-every", "3", "--poll", "0.1"]

    # Run A alongside run B: the step B stops at does not depend on timing (see --hold-at).
    # Its metadata endpoint is dead: a watcher that cannot reach IMDS must not disturb training.
    dead = [{**instance, IMDS_ENDPOINT_ENV: _dead_endpoint()} for instance in instances]
    reference = _launch(2, [*common, "--out", str(tmp_path / "a")], env, dead)
    # Rank 1 holds after step 4 until its own watcher sees the notice, which the test switches
    # on only then: so the step to stop at is known, and no earlier step can see the notice.
    hold = ["--hold-at", "4", "--hold-rank", "1"]
    procs = _launch(
        2, [*common, "--out", str(tmp_path / "b"), "--checkpoint", uri, *hold], env, instances
    )
    seen = []
    for line in procs[1].stdout:
        seen.append(line)
        if line.strip() == "rank 1: step 4":
            imds.notice = NOTICE
            break
    outputs = _finish(procs)
    outputs[1] = "".join(seen) + outputs[1]
    _finish(reference)
    assert "rank 0: preempted after step 4 (own notice: False)" in outputs[0], outputs[0]
    assert "rank 1: preempted after step 4 (own notice: True)" in outputs[1], outputs[1]
    assert not (tmp_path / "b").exists()
    for region in regions:  # either region finds the step in its own bucket
        assert Checkpointer(uri, region=region).latest_step() == 4
    checkpointer = Checkpointer(uri, region=regions[0])
    saved = [checkpointer.load(rank=r, world_size=2) for r in range(2)]
    assert [(s["step"], s["world_size"]) for s in saved] == [(4, 2), (4, 2)]

    def keys(region: str, step: int) -> list[str]:
        listed = boto3.client("s3").list_objects_v2(
            Bucket=buckets[region], Prefix=f"run/step-{step:08d}/"
        )
        return sorted(o["Key"].rsplit("/", 1)[1] for o in listed.get("Contents", []))

    for rank, region in enumerate(regions):  # each rank's shard only in its region's bucket
        assert keys(region, 4) == [
            "manifest.json",
            "model.pt",
            "optimizer.pt",
            f"rank-{rank:05d}.pt",
        ]
    with pytest.raises(AssertionError):  # each rank got its own shard back
        assert_same(saved[0]["comm_state"], saved[1]["comm_state"])

    imds.notice = None
    outputs = _finish(
        _launch(2, [*common, "--out", str(tmp_path / "c"), "--checkpoint", uri], env, instances)
    )
    for rank in range(2):
        assert f"rank {rank}: resumed from step 4" in outputs[rank], outputs[rank]
        assert f"rank {rank}: finished 10 steps" in outputs[rank]
    assert checkpointer.latest_step() == 9
    for bucket in buckets.values():
        listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="run/", Delimiter="/")
        assert [p["Prefix"] for p in listed["CommonPrefixes"]] == [
            "run/step-00000006/",
            "run/step-00000009/",
        ]  # keep_last=2, in each region

    finals = {}
    for rank in range(2):
        a = torch.load(tmp_path / "a" / f"rank-{rank}.pt", weights_only=True)
        c = torch.load(tmp_path / "c" / f"rank-{rank}.pt", weights_only=True)
        assert_same(a, c, f"rank {rank}")
        finals[rank] = a
    # CloudDDP's error-feedback residuals were saved, restored and continued exactly.
    residuals = finals[0]["comm_state"]["residuals"]["residuals"]  # ErrorFeedback.state_dict
    assert residuals and all(float(r.abs().sum()) > 0 for r in residuals.values())
    assert finals[0]["comm_state"]["step"] == 10
    # Replicas agree, while the per-rank state really is per rank.
    assert_same(finals[0]["model"], finals[1]["model"], "replicas")
    with pytest.raises(AssertionError):
        assert_same(finals[0]["comm_state"], finals[1]["comm_state"])


def _guard_worker(rank: int, world: int) -> dict:
    from cloudtrain.bootstrap import init

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    init(backend="gloo")
    guard = PreemptionGuard(None)
    if rank == 1:
        guard.request_stop()
    agreed = guard.should_stop()  # both ranks: rank 1's request reaches rank 0
    t0 = time.monotonic()
    error = None
    if rank == 0:  # rank 1 never votes again: rank 0 hears of it after CLOUDTRAIN_TIMEOUT
        try:
            PreemptionGuard(None).should_stop()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    else:
        time.sleep(8)
    return {"agreed": agreed, "error": error, "seconds": time.monotonic() - t0}


def test_guard_votes_in_cloudtrains_group_with_its_timeout() -> None:
    from distributed import run_ranks

    results = run_ranks(2, _guard_worker, env={r: {"CLOUDTRAIN_TIMEOUT": "3"} for r in range(2)})
    assert [r["agreed"] for r in results] == [True, True]
    assert results[0]["error"] is not None and 2.5 < results[0]["seconds"] < 7, results[0]


def test_bad_timeout_names_the_variable(monkeypatch) -> None:
    from cloudtrain.bootstrap import timeout_seconds

    for bad in ("abc", "inf", "-1", "0", "nan"):
        monkeypatch.setenv("CLOUDTRAIN_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"CLOUDTRAIN_TIMEOUT='{bad}'"):
            timeout_seconds()
    monkeypatch.setenv("CLOUDTRAIN_TIMEOUT", " 12.5 ")
    assert timeout_seconds() == 12.5
    with pytest.raises(ValueError, match="timeout_s=True"):
        timeout_seconds(True)
