"""The `cloudtrain` command line.

Each subcommand lives in its own module, which defines `configure(parser)` (add its arguments)
and `run(args) -> int` (exit status). COMMANDS maps the name to that module; it is imported only
when the subcommand is used, so `cloudtrain --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (module, one-line help)
    "hosts": (
        "cloudtrain.tools.hosts",
        "cluster hosts as a horovodrun -H string and each one's region",
    ),
    "launch": (
        "cloudtrain.tools.launch",
        "run a training command on the cluster with horovodrun --gloo",
    ),
    "netem": (
        "cloudtrain.tools.netem",
        "local WAN emulator: a namespace per rank, tbf-shaped regions",
    ),
    "probe": ("cloudtrain.tools.probe", "measure bandwidth and latency between all ranks"),
    "lighthouse": (
        "cloudtrain.tools.lighthouse",
        "torchft's Lighthouse: who is present in an elastic run",
    ),
    "chaos": (
        "cloudtrain.tools.chaos",
        "regions killed, restarted and leaving on the emulated WAN: an elastic run measured",
    ),
    "plan": (
        "cloudtrain.tools.plan",
        "step time, traffic, dollars and memory of each mode, before provisioning",
    ),
    "memory": (
        "cloudtrain.tools.memory",
        "per-rank memory of CloudDDP and cloudtrain.fully_shard side by side",
    ),
    "bench": (
        "cloudtrain.tools.bench",
        "DDP, fp16, PowerSGD and CloudDDP side by side over an emulated WAN",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cloudtrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"cloudtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).configure(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
