"""`cloudtrain probe`: measure bandwidth and latency between all ranks and print the matrix.

    cloudtrain probe                          # under torchrun / horovodrun: prints the matrix
    cloudtrain probe --netem NAME             # on every rank of a `cloudtrain netem` emulator

With --netem the output also says what the emulator applies (rates, RTT between regions, how),
so the measured latency can be read against the emulated round-trip time. A rank whose host's TCP
buffers may hold its links to the other regions back says so on standard error (cloudtrain.tcp).

The measurement itself is cloudtrain.probe (core); this module is only the command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

from ..probe import cluster_regions, probe
from ..tcp import host_warning


def _run_probe(as_json: bool) -> int:
    from ..bootstrap import init

    try:
        init()
    except (RuntimeError, ValueError, dist.DistNetworkError) as e:  # named by init
        print(f"cloudtrain probe: {e}", file=sys.stderr)
        return 2
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    links = probe(group)
    regions = cluster_regions(links)
    # every rank of its own host: what it sent to and received from the other regions
    me = dist.get_rank()
    across = [(i, j) for i in range(links.world_size) for j in range(links.world_size)
              if regions[i] != regions[j]]  # fmt: skip
    held = host_warning(links, me, across, lambda r: f"rank {r}")
    if held:
        print(f"cloudtrain probe: rank {me}: {held}", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        if as_json:
            print(
                json.dumps(
                    {
                        "alpha_s": links.alpha,
                        "beta_Bps": [
                            [b if math.isfinite(b) else None for b in row] for row in links.beta
                        ],
                        "regions": regions,
                    }
                )
            )
        else:
            print(f"links between {links.world_size} ranks (Mbit/s, latency):")
            print(links.table())
            print(f"regions found by bandwidth: {regions}")
    dist.destroy_process_group()
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--netem", metavar="NAME", help="run one rank in each namespace of this emulator"
    )


def run(args: argparse.Namespace) -> int:
    if not args.netem:
        return _run_probe(args.json)
    from .netem import Emulator, EmulatorError

    if os.geteuid() != 0:
        print(
            "cloudtrain probe --netem runs a rank in each of the emulator's network namespaces, "
            "which needs root: run it with sudo",
            file=sys.stderr,
        )
        return 2
    try:
        wan = Emulator.attach(args.netem)
    except (EmulatorError, ValueError) as e:
        print(f"cloudtrain probe: {e}", file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", "cloudtrain.tools.probe"] + (["--json"] if args.json else [])
    env = {"WORLD_SIZE": str(wan.world_size), "MASTER_PORT": "29517"}
    procs = [
        wan.popen(r, argv, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
        for r in range(wan.world_size)
    ]
    try:
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:  # a rank stuck past the timeout (or an interrupt): none is left behind
            if p.poll() is None:
                p.kill()
                p.wait()
    code = max(p.returncode for p in procs)
    # What was emulated beside what was measured: the fitted latency should match the RTT.
    emulated = {
        "name": wan.name,
        "emulation": wan.emulation,
        "note": wan.emulation_note,
        "rtt_ms": [
            [wan.rtt_ms(i, j) for j in range(wan.world_size)] for i in range(wan.world_size)
        ],
    }
    if args.json and code == 0:
        report = json.loads(outputs[0].strip().splitlines()[-1])
        print(json.dumps({**report, "emulated": emulated}))
    else:
        print(f"emulator {wan.name}: {wan.emulation} ({wan.emulation_note})")
        print(outputs[0], end="")
    return code


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="cloudtrain probe")
    configure(parser)
    sys.exit(_run_probe(parser.parse_args().json))
