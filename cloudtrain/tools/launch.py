"""`cloudtrain launch`: run a training command on the cluster's hosts with horovodrun.

    cloudtrain launch -t tf-output.json -- python train.py --epochs 3
    cloudtrain launch --ec2 --cluster demo --regions us-east-1,eu-west-1 -np 8 --dry-run -- ...

runs `horovodrun --gloo -np N -H ip1:slots,ip2:slots,... python train.py ...` with hosts ordered
by region (see cloudtrain.tools.hosts) and N = all their slots unless -np says fewer. horovodrun cannot
give each host its own environment, so the launcher exports CLOUDTRAIN_HOST_REGIONS (JSON,
-H address -> region); horovodrun --gloo hands the launcher's environment to every rank, and each
rank finds its region with cloudtrain.topology.region_of_this_host(). --dry-run prints the command
(with that variable in front, as a shell would take it) instead of running it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

from ..topology import HOST_REGIONS_ENV, REGION_ENV
from .hosts import (
    Host,
    add_source_arguments,
    horovod_hosts_arg,
    host_regions,
    hosts_from_args,
)


def horovodrun_command(
    hosts: Sequence[Host],
    command: Sequence[str],
    *,
    np: int | None = None,
    address: str = "private",
    horovodrun: str = "horovodrun",
    extra_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment variables to add) that run `command` on `hosts`."""
    if not command:
        raise ValueError("no training command: give it after --, e.g. -- python train.py")
    slots = sum(h.slots for h in hosts)
    np = slots if np is None else np
    if not 1 <= np <= slots:
        raise ValueError(f"-np {np}: the hosts have {slots} slots; use 1..{slots}")
    argv = [horovodrun, "--gloo", "-np", str(np), "-H", horovod_hosts_arg(hosts, address)]
    argv += [*extra_args, *command]
    env = {HOST_REGIONS_ENV: json.dumps(host_regions(hosts, address), separators=(",", ":"))}
    return argv, env


def configure(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("-np", type=int, help="number of processes (default: all slots)")
    parser.add_argument("--horovodrun", default="horovodrun", help="horovodrun executable")
    parser.add_argument(
        "--horovodrun-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for horovodrun, e.g. --horovodrun-arg=--start-timeout=120 (repeat)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument(
        "train_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the training command, after --",
    )


def run(args: argparse.Namespace) -> int:
    command = list(args.train_command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        hosts = hosts_from_args(args)
        argv, env = horovodrun_command(
            hosts,
            command,
            np=args.np,
            address=args.address,
            horovodrun=args.horovodrun,
            extra_args=args.horovodrun_arg,
        )
    except ValueError as e:
        print(f"cloudtrain launch: {e}", file=sys.stderr)
        return 2
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)
    if args.dry_run:
        print(shown)
        return 0
    print(f"cloudtrain launch: {shown}", file=sys.stderr, flush=True)
    try:
        # horovodrun hands this environment to every rank: a region of the launcher's own would
        # override each host's region from CLOUDTRAIN_HOST_REGIONS, so it does not go along
        inherited = {k: v for k, v in os.environ.items() if k != REGION_ENV}
        return subprocess.call(argv, env={**inherited, **env})
    except FileNotFoundError:
        print(
            f"cloudtrain launch: {args.horovodrun!r} not found: install horovod "
            "(scripts/install-horovod) or pass --horovodrun PATH",
            file=sys.stderr,
        )
        return 127
