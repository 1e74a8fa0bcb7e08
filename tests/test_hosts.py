"""`cloudtrain hosts` and `cloudtrain launch`: from Terraform's output or EC2 tags to horovodrun.

Sources: a recorded `terraform output -json` (tests/data/terraform-output.json, the shape the
Terraform in terraform/ emits) and EC2 instances in two regions on moto's server (loopback).
The last test runs a real `horovodrun --gloo` on 127.0.0.1 through `cloudtrain launch` and checks
that every rank finds its region.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import skip_or_fail

from cloudtrain.cli import main
from cloudtrain.tools.hosts import (
    Host,
    horovod_hosts_arg,
    hosts_from_terraform_output,
    sort_hosts,
)
from cloudtrain.topology import region_of_this_host

TF_OUTPUT = Path(__file__).parent / "data" / "terraform-output.json"
H_ARG = "10.1.0.23:4,10.1.0.57:4,10.0.0.12:8,10.0.0.44:8"
REGIONS = {
    "10.1.0.23": "eu-west-1",
    "10.1.0.57": "eu-west-1",
    "10.0.0.12": "us-east-1",
    "10.0.0.44": "us-east-1",
}


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- terraform


def test_terraform_output_to_hosts_arg(capsys) -> None:
    rc, out, _ = _cli(capsys, "hosts", "-t", str(TF_OUTPUT))
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == H_ARG
    assert lines[1].split("\t") == [
        "10.1.0.23",
        "CLOUDTRAIN_REGION=eu-west-1",
        "slots=4",
        "ct-demo-eu-west-1-0",
    ]
    assert [line.split("\t")[1] for line in lines[1:]] == [
        f"CLOUDTRAIN_REGION={r}" for r in REGIONS.values()
    ]
    # The Terraform computes the same -H string itself.
    assert json.loads(TF_OUTPUT.read_text())["horovod_hosts"]["value"] == H_ARG


def test_terraform_output_json_from_stdin(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(TF_OUTPUT.read_text()))
    rc, out, _ = _cli(capsys, "hosts", "--terraform-output", "-", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["hosts_arg"] == H_ARG and doc["np"] == 24 and doc["host_regions"] == REGIONS
    assert doc["hosts"][1] == {
        "name": "ct-demo-eu-west-1-1",
        "region": "eu-west-1",
        "private_ip": "10.1.0.57",
        "public_ip": None,  # Terraform writes "" for none
        "slots": 4,
        "instance_id": "i-0a4c1f9e2b7d35e02",
    }


def test_public_addresses(capsys) -> None:
    rc, _, err = _cli(capsys, "hosts", "-t", str(TF_OUTPUT), "--address", "public")
    assert rc == 2 and "host 'ct-demo-eu-west-1-1' (eu-west-1) has no public IP address" in err


def test_order_is_region_then_name() -> None:
    hosts = [
        Host(f"n-{i}", region, f"10.0.{j}.{i}", None, 1)
        for j, region in enumerate(["us-west-2", "ap-south-1"])
        for i in (10, 2, 1)
    ]
    names = [(h.region, h.name) for h in sort_hosts(reversed(hosts))]
    assert names == [
        ("ap-south-1", "n-1"),
        ("ap-south-1", "n-2"),
        ("ap-south-1", "n-10"),
        ("us-west-2", "n-1"),
        ("us-west-2", "n-2"),
        ("us-west-2", "n-10"),
    ]
    # Terraform's own order does not matter: a shuffled list gives the same -H.
    value = json.loads(TF_OUTPUT.read_text())["hosts"]["value"]
    assert horovod_hosts_arg(hosts_from_terraform_output(value[::-1])) == H_ARG


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "is not JSON"),
        ('{"cluster_cidrs": {"value": {}}}', "has no 'hosts' output"),
        ('{"hosts": {"value": []}}', "non-empty list"),
        ('{"hosts": {"value": [{"name": "a", "region": "r", "slots": 1}]}}', "lacks private_ip"),
        (
            '{"hosts": [{"name": "a", "region": null, "private_ip": "10.0.0.1", "slots": 1}]}',
            "lacks region",
        ),
        (
            '{"hosts": {"value": [{"name": "a", "region": "r", "private_ip": "1.2.3.4", "slots": 0}]}}',
            "slots=0 must be an integer >= 1",
        ),
        (
            '{"hosts": {"value": [{"name": "a", "region": "r", "private_ip": "", "slots": 1}]}}',
            "has no private IP address",  # `terraform output` before the instances exist
        ),
        (
            '{"hosts": {"value": ['
            '{"name": "a", "region": "r", "private_ip": "1.2.3.4", "slots": 1},'
            '{"name": "b", "region": "r", "private_ip": "1.2.3.4", "slots": 1}]}}',
            "two hosts have the address 1.2.3.4",
        ),
        *[
            (
                '{"hosts": {"value": [{"name": "evil", "region": "r", "private_ip": '
                + json.dumps(addr)
                + ', "slots": 1}]}}',
                f"host 'evil': address {addr!r} is not an IPv4 address or a DNS host name",
            )
            for addr in (
                "10.0.0.1,10.0.0.2",
                "10.0.0.1:8",
                "10.0.0.1 x",
                "h;rm -rf ~",
                "$(id)",
                "1.2.3.999",
            )
        ],
    ],
)
def test_bad_terraform_output(tmp_path, capsys, content: str, message: str) -> None:
    path = tmp_path / "out.json"
    path.write_text(content)
    rc, out, err = _cli(capsys, "hosts", "-t", str(path))
    assert rc == 2 and out == ""
    assert message in err and err.startswith("cloudtrain hosts: ")


def test_missing_file(capsys, tmp_path) -> None:
    rc, _, err = _cli(capsys, "hosts", "-t", str(tmp_path / "nope.json"))
    assert rc == 2 and "cannot read terraform output" in err and "nope.json" in err


# ----------------------------------------------------------------------------------- EC2


@pytest.fixture
def ec2_cluster(aws: str) -> Iterator[dict[str, str]]:
    """Cluster "demo" in us-east-1 (8 slots) and eu-west-1 (no slots tag), {name: instance id};
    plus an untagged instance, one of another cluster and a stopped one, all to be left out."""
    import boto3

    def run(ec2, **tags: str) -> str:
        spec = [
            {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
        ]
        out = ec2.run_instances(
            ImageId="ami-12c6146b", MinCount=1, MaxCount=1, TagSpecifications=spec if tags else []
        )
        return out["Instances"][0]["InstanceId"]

    ids = {}
    for region, slots in (("us-east-1", {"cloudtrain:slots": "8"}), ("eu-west-1", {})):
        ec2 = boto3.client("ec2", region_name=region)
        for i in (1, 0):
            name = f"demo-{region}-{i}"
            ids[name] = run(
                ec2,
                Name=name,
                **{"cloudtrain:cluster": "demo", "cloudtrain:region": region},
                **slots,
            )
        run(ec2)
        run(ec2, **{"cloudtrain:cluster": "other"})
        ec2.stop_instances(InstanceIds=[run(ec2, **{"cloudtrain:cluster": "demo"})])
    yield ids
    for region in ("us-east-1", "eu-west-1"):
        ec2 = boto3.client("ec2", region_name=region)
        reservations = ec2.describe_instances()["Reservations"]
        ec2.terminate_instances(
            InstanceIds=[i["InstanceId"] for r in reservations for i in r["Instances"]]
        )


def test_ec2_discovery(capsys, ec2_cluster) -> None:
    rc, out, err = _cli(
        capsys,
        "hosts",
        "--ec2",
        "--cluster",
        "demo",
        "--regions",
        "us-east-1,eu-west-1",
        "--default-slots",
        "2",
        "--json",
    )
    assert rc == 0, err
    doc = json.loads(out)
    got = [(h["region"], h["name"], h["slots"], h["instance_id"]) for h in doc["hosts"]]
    assert got == [
        ("eu-west-1", "demo-eu-west-1-0", 2, ec2_cluster["demo-eu-west-1-0"]),
        ("eu-west-1", "demo-eu-west-1-1", 2, ec2_cluster["demo-eu-west-1-1"]),
        ("us-east-1", "demo-us-east-1-0", 8, ec2_cluster["demo-us-east-1-0"]),
        ("us-east-1", "demo-us-east-1-1", 8, ec2_cluster["demo-us-east-1-1"]),
    ]
    ips = [h["private_ip"] for h in doc["hosts"]]
    assert doc["hosts_arg"] == ",".join(
        f"{ip}:{s}" for ip, s in zip(ips, (2, 2, 8, 8), strict=True)
    )
    assert doc["host_regions"] == dict(zip(ips, [g[0] for g in got], strict=True))


def test_ec2_errors(capsys, aws: str) -> None:
    rc, _, err = _cli(capsys, "hosts", "--ec2", "--cluster", "demo")
    assert rc == 2 and "--ec2 needs --cluster NAME and --regions" in err
    rc, _, err = _cli(capsys, "hosts", "--ec2", "--cluster", "nobody", "--regions", "us-east-1")
    assert (
        rc == 2 and "no running EC2 instance tagged cloudtrain:cluster=nobody in us-east-1" in err
    )


# -------------------------------------------------------------------------------- launch


def test_launch_dry_run(capsys) -> None:
    rc, out, _ = _cli(
        capsys,
        "launch",
        "-t",
        str(TF_OUTPUT),
        "--dry-run",
        "--",
        "python",
        "train.py",
        "--lr",
        "0.1",
        "--name",
        "a b",
    )
    assert rc == 0
    regions = json.dumps(REGIONS, separators=(",", ":"))
    assert out.strip() == (
        f"CLOUDTRAIN_HOST_REGIONS='{regions}' horovodrun --gloo -np 24 -H {H_ARG} python train.py --lr 0.1 --name 'a b'"
    )


def test_launch_options(capsys) -> None:
    rc, out, _ = _cli(
        capsys,
        "launch",
        "-t",
        str(TF_OUTPUT),
        "-np",
        "6",
        "--horovodrun-arg=--start-timeout=120",
        "--dry-run",
        "python",
        "train.py",
    )
    assert rc == 0
    assert (
        out.split("' ", 1)[1].strip()
        == f"horovodrun --gloo -np 6 -H {H_ARG} --start-timeout=120 python train.py"
    )
    rc, _, err = _cli(
        capsys, "launch", "-t", str(TF_OUTPUT), "-np", "25", "--dry-run", "--", "python", "t.py"
    )
    assert rc == 2 and "-np 25: the hosts have 24 slots" in err
    rc, _, err = _cli(capsys, "launch", "-t", str(TF_OUTPUT), "--dry-run", "--")
    assert rc == 2 and "no training command" in err
    rc, _, err = _cli(
        capsys,
        "launch",
        "-t",
        str(TF_OUTPUT),
        "--horovodrun",
        "/nonexistent/horovodrun",
        "--",
        "true",
    )
    assert rc == 127 and "not found" in err


SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAOPERATOR",
    "AWS_SECRET_ACCESS_KEY": "operator-secret-value",
    "AWS_SESSION_TOKEN": "operator-session-token",
    "CLOUDTRAIN_API_TOKEN": "ct-token-value",
    "DB_PASSWORD": "db-password-value",
    "GITHUB_KEY": "gh-key-value",
}


def test_launch_forwards_an_allow_list_and_never_secrets(capsys, monkeypatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("MY_DATA_DIR", "/data")
    rc, out, err = _cli(
        capsys,
        "launch",
        "-t",
        str(TF_OUTPUT),
        "--env",
        "MY_DATA_DIR",
        "--dry-run",
        "python",
        "t.py",
    )
    assert rc == 0
    for value in SECRETS.values():
        assert value not in out and value not in err
    forwarded = err.split("forwarded to the ranks: ")[1].split(";")[0].split()
    assert {"NCCL_DEBUG", "MY_DATA_DIR", "PATH", "CLOUDTRAIN_HOST_REGIONS"} <= set(forwarded)
    assert not set(forwarded) & ({*SECRETS, "UNRELATED_SETTING"})
    assert "never forwarded (secrets): " + " ".join(sorted(["CLOUDTRAIN_API_TOKEN"])) in err
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "DB_PASSWORD"):
        rc, _, err = _cli(capsys, "launch", "-t", str(TF_OUTPUT), "--env", name, "--dry-run", "x")
        assert rc == 2 and f"--env {name}: refusing to forward" in err
    rc, _, err = _cli(
        capsys, "launch", "-t", str(TF_OUTPUT), "--env", "NOT_SET_X", "--dry-run", "x"
    )
    assert rc == 2 and "NOT_SET_X is not set" in err
    monkeypatch.setenv("CLOUDTRAIN_REGION", "us")  # it would give every rank the launcher's
    rc, _, err = _cli(
        capsys, "launch", "-t", str(TF_OUTPUT), "--env", "CLOUDTRAIN_REGION", "--dry-run", "x"
    )
    assert rc == 2 and "--env CLOUDTRAIN_REGION: each host's region comes from" in err


# ------------------------------------------------------------------------------- regions


def test_region_of_this_host(monkeypatch) -> None:
    import socket

    mapping = json.dumps({"10.0.0.12": "us-east-1", socket.gethostname(): "eu-west-1"})
    assert region_of_this_host({}) is None
    assert (
        region_of_this_host({"CLOUDTRAIN_REGION": "ap-south-1", "CLOUDTRAIN_HOST_REGIONS": mapping})
        == "ap-south-1"
    )
    env = {"CLOUDTRAIN_HOST_REGIONS": mapping, "HOROVOD_HOSTNAME": "10.0.0.12"}
    assert region_of_this_host(env) == "us-east-1"
    assert region_of_this_host({"CLOUDTRAIN_HOST_REGIONS": mapping}) == "eu-west-1"  # by host name
    assert (
        region_of_this_host(
            {"CLOUDTRAIN_HOST_REGIONS": '{"192.0.2.1": "x"}', "HOROVOD_HOSTNAME": "h"}
        )
        is None
    )
    with pytest.raises(ValueError, match="CLOUDTRAIN_HOST_REGIONS must be a JSON object"):
        region_of_this_host({"CLOUDTRAIN_HOST_REGIONS": "us-east-1"})
    monkeypatch.setenv("CLOUDTRAIN_REGION", "sa-east-1")
    assert region_of_this_host() == "sa-east-1"


RANK_PROBE = """
import json, os
from cloudtrain.topology import region_of_this_host
secrets = json.loads(os.environ["PROBE_SECRETS"]) if "PROBE_SECRETS" in os.environ else None
lines, pid = [], os.getpid()
while pid > 1:  # this rank's command line and its launchers' (what `ps` shows)
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        lines.append(f.read().replace(b"\\0", b" ").decode(errors="replace"))
    with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
leaked = sorted(
    n for n in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "DB_PASSWORD")
    if n in os.environ
)
in_cmdline = [v for v in ("operator-secret-value", "operator-session-token") if any(v in c for c in lines)]
print("rank", os.environ["HOROVOD_RANK"], "region", region_of_this_host(),
      "leaked", leaked, "cmdline", in_cmdline, "data", os.environ.get("MY_DATA_DIR"), flush=True)
"""


def test_launch_runs_horovodrun_and_ranks_find_their_region(tmp_path) -> None:
    """A real horovodrun (installed by `make install`) on 127.0.0.1: every rank finds its
    region, gets what --env asked for, and none of the launcher's credentials - neither in its
    environment nor on any command line above it."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "horovodrun").exists():
        skip_or_fail("horovod", "horovodrun is missing: `make install` builds it")
    tf = {
        "hosts": {
            "value": [
                {
                    "name": "local-0",
                    "region": "loopback-1",
                    "private_ip": "127.0.0.1",
                    "public_ip": "",
                    "slots": 2,
                    "instance_id": "",
                }
            ]
        }
    }
    (tmp_path / "tf.json").write_text(json.dumps(tf))
    (tmp_path / "probe.py").write_text(RANK_PROBE)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **SECRETS}
    env["MY_DATA_DIR"] = "/data"
    env.pop("CLOUDTRAIN_REGION", None)
    result = subprocess.run(
        [
            str(bin_dir / "cloudtrain"),
            "launch",
            "-t",
            str(tmp_path / "tf.json"),
            "--env",
            "MY_DATA_DIR",
            "--horovodrun-arg=--network-interface=lo",
            "--",
            sys.executable,
            str(tmp_path / "probe.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert f"rank {rank} region loopback-1 leaked [] cmdline [] data /data" in result.stdout, (
            result.stdout
        )
    for value in SECRETS.values():
        assert value not in result.stdout + result.stderr
