"""`cloudtrain launch`: run a training command on the cluster's hosts with horovodrun.

    cloudtrain launch -t tf-output.json -- python train.py --epochs 3
    cloudtrain launch --ec2 --cluster demo --regions us-east-1,eu-west-1 -np 8 --dry-run -- ...

runs `horovodrun --gloo -np N -H ip1:slots,ip2:slots,... python train.py ...` with hosts ordered
by region (see cloudtrain.tools.hosts) and N = all their slots unless -np says fewer. horovodrun cannot
give each host its own environment, so the launcher exports CLOUDTRAIN_HOST_REGIONS (JSON,
-H address -> region), and each rank finds its region with
cloudtrain.topology.region_of_this_host(). --dry-run prints the command (with that variable in
front, as a shell would take it) instead of running it.

horovodrun --gloo hands its whole environment to every rank, on the remote command line (visible
in `ps` and logs). So horovodrun gets an allow-list, not the launcher's environment: CLOUDTRAIN_*,
NCCL_*, GLOO_*, HOROVOD_*, TORCH_*, PYTORCH_*, OMP_*, what Python and ssh need (PATH, PYTHONPATH,
LD_LIBRARY_PATH, HOME, USER, LANG, SSH_AUTH_SOCK, ...), and whatever `--env NAME` adds. Secrets are
never forwarded, even when asked: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN and
any name containing SECRET, TOKEN, PASSWORD, PASSWD or CREDENTIAL or ending in _KEY or _KEY_ID.
On the cluster, the hosts' instance role (terraform/) gives each host access to its own
checkpoint bucket; operator credentials would override it. The names forwarded (never values)
are printed on standard error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence

from ..topology import HOST_REGIONS_ENV, REGION_ENV
from .hosts import (
    Host,
    add_source_arguments,
    horovod_hosts_arg,
    host_regions,
    hosts_from_args,
)

FORWARDED_PREFIXES = ("CLOUDTRAIN_", "NCCL_", "GLOO_", "HOROVOD_", "TORCH_", "PYTORCH_", "OMP_")
"""Variables with these prefixes go to the ranks (CLOUDTRAIN_REGION excepted: see rank_environment)."""
FORWARDED_NAMES = frozenset(
    {
        "PATH",
        "PYTHONPATH",
        "PYTHONUNBUFFERED",
        "LD_LIBRARY_PATH",
        "VIRTUAL_ENV",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LC_ALL",
        "TERM",
        "TMPDIR",
        "SSH_AUTH_SOCK",
        "MKL_NUM_THREADS",
    }
)
"""Single variables that go to the ranks: what Python, ssh (horovodrun's remote start) and the
math libraries read."""
_SECRET = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|_KEY$|_KEY_ID$|^AWS_ACCESS_KEY")


def is_secret(name: str) -> bool:
    """Whether `name` looks like a credential; such variables never reach the ranks."""
    return bool(_SECRET.search(name.upper()))


def rank_environment(
    environ: Mapping[str, str], extra: Iterable[str] = ()
) -> tuple[dict[str, str], list[str]]:
    """(the variables horovodrun may hand the ranks, the secret-looking names left out).

    extra: more names to forward (`--env NAME`); ValueError if one is a secret or not set.
    """
    forwarded, withheld = {}, []
    for name, value in environ.items():
        if not (name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES)):
            continue
        if is_secret(name):
            withheld.append(name)
        elif name != REGION_ENV:
            # A region of the launcher's own would override each host's region from
            # CLOUDTRAIN_HOST_REGIONS, so it does not go along.
            forwarded[name] = value
    for name in extra:
        if name == REGION_ENV:
            raise ValueError(
                f"--env {REGION_ENV}: each host's region comes from the cluster's hosts (every "
                "rank would get this one); give the hosts' regions in the cluster file or the "
                "Terraform output instead"
            )
        if is_secret(name):
            raise ValueError(
                f"--env {name}: refusing to forward a variable that looks like a secret (horovodrun "
                "puts every forwarded variable on the ranks' command lines). AWS access on the "
                "cluster comes from the hosts' instance role; give other secrets to the hosts "
                "themselves (e.g. AWS Secrets Manager)"
            )
        if name not in environ:
            raise ValueError(f"--env {name}: {name} is not set in this environment")
        forwarded[name] = environ[name]
    return forwarded, sorted(withheld)


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
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME",
        help="also forward this environment variable to the ranks (repeat); never a secret",
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
        forwarded, withheld = rank_environment(os.environ, args.env)
    except ValueError as e:
        print(f"cloudtrain launch: {e}", file=sys.stderr)
        return 2
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)
    print(
        f"cloudtrain launch: forwarded to the ranks: {' '.join(sorted({*forwarded, *env}))}"
        + (f"; never forwarded (secrets): {' '.join(withheld)}" if withheld else ""),
        file=sys.stderr,
    )
    if args.dry_run:
        print(shown)
        return 0
    print(f"cloudtrain launch: {shown}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(argv, env={**forwarded, **env})
    except FileNotFoundError:
        print(
            f"cloudtrain launch: {args.horovodrun!r} not found: install horovod "
            "(scripts/install-horovod) or pass --horovodrun PATH",
            file=sys.stderr,
        )
        return 127
