"""`cloudtrain netem up|down|rate|status|exec|measure`, and the command line of the delay line's
own processes (`python -m cloudtrain.tools.netem relay|relay-ceiling`, see __main__.py).

    cloudtrain netem up --regions us:2,eu:2 --profile us-eu --name demo   # 210 Mbit/s, 80 ms
    cloudtrain netem up --regions us:2,eu:2 --mbit 100 --rtt-ms 80 --name demo
    cloudtrain netem exec 0 --name demo -- python -c 'print(1)'
    cloudtrain netem rate --region eu --mbit 50 --name demo
    cloudtrain netem status --name demo [--json]
    cloudtrain netem down --name demo        # or: down --all

`configure(parser)` and `run(args)` are what cloudtrain/cli.py calls for the `netem` subcommand.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence

from .cleanup import _state_names, leftovers, teardown
from .delayline import _measure_ceiling, relay_main
from .emulator import Emulator
from .host import EmulatorError, available
from .spec import DEFAULT_NAME, PROFILES, check_name, link_profile, parse_mbit, parse_regions


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="netem_command", metavar="ACTION", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name not in ("down", "status"):
            p.add_argument("--name", default=DEFAULT_NAME, help="emulator (default: %(default)s)")
        return p

    p = add("up", "build an emulated cluster (stays up until `down`)")
    p.add_argument("--regions", required=True, help="ranks per region in rank order: us:2,eu:2")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--profile", help=f"link profile: {', '.join(PROFILES)}, or <N>mbit / <N>gbit")
    how.add_argument("--mbit", help="rate for all regions (100) or per region (us=1000,eu=50)")
    p.add_argument(
        "--rtt-ms",
        help="RTT between regions, ms (overrides the profile's), or a share per region: "
        "us=30,eu=130 (pair RTT = mean of the two shares)",
    )
    p.add_argument("--down-mbit", help="downlink rates where they differ: us=1000,eu=1000")

    p = add("rate", "change one region's WAN rate live")
    p.add_argument("--region", required=True)
    p.add_argument("--mbit", required=True, type=float)
    p.add_argument("--down-mbit", type=float, help="downlink rate (default: the same as --mbit)")

    p = add("status", "topology, rates, emulation kind, bytes per WAN link")
    p.add_argument("--name", help="one emulator (default: every one)")
    p.add_argument("--json", action="store_true", help="machine-readable")

    p = sub.add_parser("down", help="remove an emulator, also after a crash")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--name", default=DEFAULT_NAME, help="emulator name (default: %(default)s)")
    which.add_argument(
        "--all", action="store_true", help="every emulator this tool made (never other namespaces)"
    )

    p = add("exec", "run a command inside a rank's namespace")
    p.add_argument("rank", type=int)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")

    p = add("measure", "TCP goodput between two ranks")
    p.add_argument("src", type=int)
    p.add_argument("dst", type=int)
    p.add_argument("--seconds", type=float, default=1.0)


def run(args: argparse.Namespace) -> int:
    try:  # a bad name is refused before anything else is looked at
        if getattr(args, "name", None) is not None:
            check_name(args.name)
    except ValueError as e:
        print(f"cloudtrain netem: {e}", file=sys.stderr)
        return 2
    ok, why = available()
    if not ok:
        print(f"cloudtrain netem: {why}", file=sys.stderr)
        return 1
    try:
        return _run_command(args)
    except (EmulatorError, ValueError, KeyError, IndexError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str quotes
        print(f"cloudtrain netem: {why}", file=sys.stderr)
        return 1


def _run_command(args: argparse.Namespace) -> int:
    action = args.netem_command
    if action == "up":
        regions = parse_regions(args.regions)
        if args.profile:
            profile = link_profile(args.profile)
            mbit: dict[str, float] = dict.fromkeys(regions, profile.mbit)
            rtt: float | dict[str, float] = profile.rtt_ms
        else:
            mbit, rtt = parse_mbit(args.mbit, list(regions)), 0.0
        if args.rtt_ms is not None:
            rtt = parse_mbit(args.rtt_ms, list(regions))
            rtt = rtt if "=" in args.rtt_ms else next(iter(rtt.values()))
        down = parse_mbit(args.down_mbit, list(regions)) if args.down_mbit else None
        check_name(args.name)
        wan = Emulator(regions, mbit, rtt, args.name, down).up(persist=True)
        print(wan.describe())
        return 0
    if action == "down":
        removed = teardown(None if args.all else args.name)
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    if action == "status":
        return _status(args)
    if action == "exec":
        args.name, args.cmd = _exec_split(args.cmd, args.name)
    wan = Emulator.attach(args.name)
    if action == "rate":
        wan.set_rate(args.region, args.mbit, args.down_mbit)
        print(wan.describe())
    elif action == "exec":
        rank, cmd = args.rank, args.cmd
        return subprocess.run(wan.command(rank, cmd), env=wan.env(rank)).returncode
    elif action == "measure":
        rate = wan.measure_mbit(args.src, args.dst, args.seconds)
        print(f"rank {args.src} -> rank {args.dst}: {rate:.1f} Mbit/s")
    return 0


def _status(args: argparse.Namespace) -> int:
    names = [args.name] if args.name else _state_names()
    report, broken = [], []
    for name in names:
        # an emulator whose state or namespaces are gone is named, and the others listed
        try:
            wan = Emulator.attach(name)  # its errors say how to clean up
        except EmulatorError as e:
            broken.append(name)
            print(f"cloudtrain netem: {e}", file=sys.stderr)
            continue
        try:
            counters = wan.counters()
        except EmulatorError as e:  # its namespaces are gone
            broken.append(name)
            down = f"`cloudtrain netem down --name {name}` cleans it up"
            print(f"cloudtrain netem: {e} ({down})", file=sys.stderr)
            continue
        report.append(
            {
                "name": name,
                "emulation": wan.emulation,
                "note": wan.emulation_note,
                "rtt_ms": wan.spec.rtt_ms,
                "relay": wan.relay,
                "relays": wan.relays,
                "regions": {
                    r: {
                        "ranks": wan.ranks(r),
                        "addresses": [wan.address(k) for k in wan.ranks(r)],
                        "mbit": wan.spec.mbit[r],
                        "down_mbit": wan.spec.down(r),
                        "delay_ms_each_way": wan.spec.link_delay_ms(r),
                    }
                    for r in wan.spec.regions
                },
                "namespaces": [wan.wan_namespace, *map(wan.namespace, range(wan.world_size))],
                "counters": counters,
            }
        )
        if not args.json:
            print(wan.describe())
    orphans = sorted(set(leftovers(args.name)) - {ns for r in report for ns in r["namespaces"]})
    if args.json:
        print(json.dumps({"emulators": report, "orphan_namespaces": orphans}, indent=1))
    elif orphans:
        print("namespaces without state (remove with `down --all`): " + ", ".join(orphans))
    elif not report and not broken:
        print("no emulator is up")
    return 1 if broken else 0


def _exec_split(cmd: list[str], name: str) -> tuple[str, list[str]]:
    """(name, command) of `exec RANK [--name NAME] [--] CMD...`: REMAINDER keeps the options
    given after RANK, so they are parsed here."""
    head, tail = [], cmd
    if tail[:1] == ["--name"]:
        head, tail = tail[:2], tail[2:]
    elif tail[:1] and tail[0].startswith("--name="):
        head, tail = tail[:1], tail[1:]
    if tail[:1] == ["--"]:
        tail = tail[1:]
    opts = argparse.ArgumentParser(prog="cloudtrain netem exec RANK")
    opts.add_argument("--name", default=name)
    if not tail:
        raise ValueError("give a command: cloudtrain netem exec RANK [--name NAME] -- CMD ...")
    return opts.parse_args(head).name, tail


def child_main(argv: Sequence[str] | None = None) -> int:
    """`python -m cloudtrain.tools.netem relay|relay-ceiling ...`: the delay line's processes
    (started by the emulator, not by hand)."""
    parser = argparse.ArgumentParser(prog="python -m cloudtrain.tools.netem")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("relay", help="relay frames between TAPs up<LINK> and dn<LINK>")
    p.add_argument("--name", required=True)
    p.add_argument("--link", type=int, required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    p = sub.add_parser("relay-ceiling", help="measure what one relay moves (JSON)")
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--seconds", type=float, default=0.3)
    args = parser.parse_args(argv)
    if args.what == "relay":
        return relay_main(check_name(args.name), args.link, args.delay_ms)
    print(json.dumps(_measure_ceiling(args.delay_ms, args.seconds)))
    return 0
