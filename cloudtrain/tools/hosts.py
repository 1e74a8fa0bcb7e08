"""`cloudtrain hosts`: the cluster's hosts as a horovodrun `-H` string, with each host's region.

Hosts come from the Terraform in terraform/ or from EC2 itself:

    terraform -chdir=terraform output -json | cloudtrain hosts -t -
    cloudtrain hosts --ec2 --cluster demo --regions us-east-1,eu-west-1 [--json]

Terraform's `hosts` output is a list of {name, region, private_ip, public_ip, slots, instance_id}.
EC2 discovery lists running instances tagged `cloudtrain:cluster` = NAME in each region; the
region is the `cloudtrain:region` tag (else the region searched), slots the `cloudtrain:slots`
tag (else --default-slots). Hosts are ordered by region, then name, so ranks of a region are
contiguous and the order is the same on every call.

Regions reach the ranks through CLOUDTRAIN_HOST_REGIONS, a JSON map from the address of each host
in `-H` to its region, exported by `cloudtrain launch` (horovodrun --gloo passes the launcher's
environment to every rank, and sets HOROVOD_HOSTNAME to the rank's `-H` address). Each rank
resolves its own with `region_of_this_host()`; a CLOUDTRAIN_REGION set on the host wins.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..topology import REGION_ENV

CLUSTER_TAG = "cloudtrain:cluster"
REGION_TAG = "cloudtrain:region"
SLOTS_TAG = "cloudtrain:slots"

# What horovodrun's -H "addr:slots,addr:slots" and the ranks' command lines can carry unquoted:
# an IPv4 address or a DNS name. A comma would add a host, a colon change the slots, a space or a
# shell metacharacter split or extend the remote command.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")


def check_address(address: str, host: str = "") -> str:
    """`address` if it is an IPv4 address or a DNS host name; else ValueError naming the host."""
    if isinstance(address, str):
        try:
            ipaddress.IPv4Address(address)
            return address
        except ValueError:
            pass
        if _HOSTNAME.match(address) and not address.replace(".", "").isdigit():
            return address
    who = f"host {host!r}: " if host else ""
    raise ValueError(
        f"{who}address {address!r} is not an IPv4 address or a DNS host name (a comma, colon, "
        "space or shell character would change horovodrun's -H list or the remote command): "
        "fix the Terraform output or the EC2 data it came from"
    )


@dataclass(frozen=True)
class Host:
    """One machine of the cluster."""

    name: str
    """Terraform's name for it, or the EC2 Name tag (else the instance id)."""
    region: str
    """Cloud region, e.g. us-east-1: ranks of one region share fast links."""
    private_ip: str | None
    """Address inside the peered VPCs: what the ranks use by default."""
    public_ip: str | None
    """Public address, if it has one."""
    slots: int
    """Processes (usually GPUs) to run on it."""
    instance_id: str | None = None
    """EC2 instance id, if known."""

    def __post_init__(self) -> None:
        if not self.name or not self.region:
            raise ValueError(f"host {self}: name and region must not be empty")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"host {self.name!r}: slots={self.slots!r} must be an integer >= 1")
        for addr in (self.private_ip, self.public_ip):
            if addr is not None:
                check_address(addr, self.name)

    def address(self, kind: str = "private") -> str:
        """The address of `kind` ("private" or "public"); raises if the host has none."""
        if kind not in ("private", "public"):
            raise ValueError(f"address kind {kind!r}: use 'private' or 'public'")
        addr = self.private_ip if kind == "private" else self.public_ip
        if not addr:
            raise ValueError(f"host {self.name!r} ({self.region}) has no {kind} IP address")
        return addr


def _natural(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def sort_hosts(hosts: Iterable[Host]) -> list[Host]:
    """Hosts by region, then name (node-2 before node-10)."""
    return sorted(hosts, key=lambda h: (h.region, _natural(h.name), h.name))


# ----------------------------------------------------------------------------- sources


def hosts_from_terraform_output(output: Any) -> list[Host]:
    """Hosts from parsed `terraform output -json` (or `terraform output -json hosts`)."""
    value = output
    if isinstance(output, Mapping):
        if "hosts" not in output:
            raise ValueError(
                f"terraform output has no 'hosts' output (outputs: {sorted(output)}): run it in "
                "the folder of the cloudtrain Terraform, which outputs one"
            )
        value = output["hosts"]
        if isinstance(value, Mapping) and "value" in value:
            value = value["value"]
    if not isinstance(value, list) or not value:
        raise ValueError("terraform output 'hosts' must be a non-empty list of host objects")
    hosts = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise ValueError(f"terraform output hosts[{i}] is {type(item).__name__}, not an object")
        missing = [k for k in ("name", "region", "private_ip", "slots") if k not in item]
        missing += [k for k in ("name", "region", "slots") if k in item and item[k] is None]
        if missing:
            raise ValueError(f"terraform output hosts[{i}] lacks {', '.join(missing)}")
        hosts.append(
            Host(
                name=str(item["name"]),
                region=str(item["region"]),
                private_ip=item.get("private_ip") or None,
                public_ip=item.get("public_ip") or None,
                slots=item["slots"],
                instance_id=item.get("instance_id") or None,
            )
        )
    return sort_hosts(hosts)


def load_terraform_output(path: str) -> list[Host]:
    """Hosts from a file holding `terraform output -json`; "-" reads standard input."""
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path) as f:
                text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read terraform output {path!r}: {e.strerror}") from e
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(
            f"terraform output {path!r} is not JSON ({e}): make it with `terraform output -json`"
        ) from e
    return hosts_from_terraform_output(data)


def hosts_from_ec2(cluster: str, regions: Iterable[str], *, default_slots: int = 1) -> list[Host]:
    """Running EC2 instances tagged cloudtrain:cluster=`cluster`, in each of `regions`."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError as e:
        raise ValueError("EC2 discovery needs boto3: pip install 'cloudtrain[cloud]'") from e
    hosts = []
    for region in regions:
        ec2 = boto3.session.Session().client(
            "ec2", region_name=region, config=Config(retries={"mode": "standard"})
        )
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[
                {"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]},
                {"Name": "instance-state-name", "Values": ["running"]},
            ]
        )
        try:
            pages = list(pages)
        except (BotoCoreError, ClientError) as e:
            raise ValueError(
                f"EC2 discovery in region {region!r} failed: {e}; check the region's name and "
                "AWS credentials (aws configure, AWS_PROFILE, or the instance's role)"
            ) from None
        for page in pages:
            for reservation in page["Reservations"]:
                for inst in reservation["Instances"]:
                    tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                    slots = tags.get(SLOTS_TAG)
                    try:
                        slots = default_slots if slots is None else int(slots)
                    except ValueError:
                        raise ValueError(
                            f"instance {inst['InstanceId']} ({region}) has tag {SLOTS_TAG}="
                            f"{slots!r}: it must be an integer"
                        ) from None
                    hosts.append(
                        Host(
                            name=tags.get("Name") or inst["InstanceId"],
                            region=tags.get(REGION_TAG) or region,
                            private_ip=inst.get("PrivateIpAddress"),
                            public_ip=inst.get("PublicIpAddress"),
                            slots=slots,
                            instance_id=inst["InstanceId"],
                        )
                    )
    if not hosts:
        raise ValueError(
            f"no running EC2 instance tagged {CLUSTER_TAG}={cluster} in {', '.join(regions)}"
        )
    return sort_hosts(hosts)


# ------------------------------------------------------------------------- what to print


def horovod_hosts_arg(hosts: Iterable[Host], address: str = "private") -> str:
    """horovodrun's -H value: "ip1:slots,ip2:slots" in the given order."""
    return ",".join(f"{h.address(address)}:{h.slots}" for h in hosts)


def host_regions(hosts: Iterable[Host], address: str = "private") -> dict[str, str]:
    """{address used in -H: region}: the value of CLOUDTRAIN_HOST_REGIONS."""
    regions: dict[str, str] = {}
    for h in hosts:
        addr = h.address(address)
        if addr in regions:
            raise ValueError(f"two hosts have the address {addr}: each host must be listed once")
        regions[addr] = h.region
    return regions


# ------------------------------------------------------------------------------------ CLI


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the hosts come from; shared by `cloudtrain hosts` and `cloudtrain launch`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "-t",
        "--terraform-output",
        metavar="FILE",
        help="file with `terraform output -json` ('-' = standard input)",
    )
    src.add_argument("--ec2", action="store_true", help="discover running EC2 instances by tag")
    parser.add_argument("--cluster", help=f"with --ec2: value of the {CLUSTER_TAG} tag")
    parser.add_argument("--regions", help="with --ec2: comma-separated regions to search")
    parser.add_argument(
        "--default-slots",
        type=int,
        default=1,
        metavar="N",
        help=f"with --ec2: slots of an instance without a {SLOTS_TAG} tag (default 1)",
    )
    parser.add_argument(
        "--address",
        choices=("private", "public"),
        default="private",
        help="which IP goes into -H (default private: the regions' VPCs are peered)",
    )


def hosts_from_args(args: argparse.Namespace) -> list[Host]:
    if args.terraform_output:
        return load_terraform_output(args.terraform_output)
    regions = [r.strip() for r in (args.regions or "").split(",") if r.strip()]
    if not args.cluster or not regions:
        raise ValueError("--ec2 needs --cluster NAME and --regions REGION[,REGION...]")
    if args.default_slots < 1:
        raise ValueError(f"--default-slots {args.default_slots} must be at least 1")
    return hosts_from_ec2(args.cluster, regions, default_slots=args.default_slots)


def configure(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON for machines")


def run(args: argparse.Namespace) -> int:
    try:
        hosts = hosts_from_args(args)
        hosts_arg = horovod_hosts_arg(hosts, args.address)
        regions = host_regions(hosts, args.address)
    except ValueError as e:
        print(f"cloudtrain hosts: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {
            "hosts_arg": hosts_arg,
            "np": sum(h.slots for h in hosts),
            "host_regions": regions,
            "hosts": [asdict(h) for h in hosts],
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(hosts_arg)
    for h in hosts:
        print(f"{h.address(args.address)}\t{REGION_ENV}={h.region}\tslots={h.slots}\t{h.name}")
    return 0
