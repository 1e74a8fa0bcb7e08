"""`cloudtrain lighthouse`: run torchft's Lighthouse, the membership service of an elastic run.

    cloudtrain lighthouse --bind 0.0.0.0:29510 --min-regions 2
    # then on every rank of every region: TORCHFT_LIGHTHOUSE=http://<this host>:29510

One Lighthouse per run (it is a single point of failure: run it where it outlives the regions,
e.g. on a small on-demand instance). It forms a quorum from the regions that ask for one at a
sync once at least --min-regions have asked and they are a majority of those heartbeating; a
region is gone when its heartbeats stop for --heartbeat-timeout-s (docs/elastic.md). It prints
its address, then serves until stopped (SIGTERM / Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="0.0.0.0:29510", help="address:port to listen on")
    parser.add_argument(
        "--min-regions", type=int, default=1, help="fewest regions that make a quorum"
    )
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=3.0,
        help="a region that sent no heartbeat for this long is gone (its survivors' stall)",
    )
    parser.add_argument(
        "--join-timeout-s",
        type=float,
        default=60.0,
        help="how long a quorum waits for regions that heartbeat but have not asked yet",
    )
    parser.add_argument("--quorum-tick-ms", type=int, default=20, help="how often it decides")


def serve(
    bind: str, min_regions: int, heartbeat_timeout_s: float, join_timeout_s: float, tick_ms: int
):
    """A running torchft LighthouseServer (call .address(), .shutdown())."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=min_regions,
        join_timeout_ms=int(1000 * join_timeout_s),
        quorum_tick_ms=tick_ms,
        heartbeat_timeout_ms=int(1000 * heartbeat_timeout_s),
    )


MIN_HEARTBEAT_TIMEOUT_S = 0.2
"""Two of the regions' default heartbeats (ElasticConfig.heartbeat_s, 0.1 s): a timeout under
this takes live regions as lost between beats, and each then forms a run of its own."""


def run(args: argparse.Namespace) -> int:
    if args.min_regions < 1 or args.join_timeout_s <= 0:
        print("cloudtrain lighthouse: --min-regions >= 1 and a positive --join-timeout-s",
              file=sys.stderr)  # fmt: skip
        return 2
    if not args.heartbeat_timeout_s >= MIN_HEARTBEAT_TIMEOUT_S:
        print(
            f"cloudtrain lighthouse: --heartbeat-timeout-s {args.heartbeat_timeout_s} is below "
            f"{MIN_HEARTBEAT_TIMEOUT_S} s: regions heartbeat every elastic.heartbeat_s (0.1 s "
            "by default), and a region missed for a timeout is taken as lost; give several "
            "beats' time (the default is 3 s)",
            file=sys.stderr,
        )
        return 2
    try:
        server = serve(
            args.bind, args.min_regions, args.heartbeat_timeout_s, args.join_timeout_s,
            args.quorum_tick_ms,
        )  # fmt: skip
    except RuntimeError as e:  # the server's own: a taken port, an address that is not one
        print(
            f"cloudtrain lighthouse: cannot serve on --bind {args.bind} ({e}); give HOST:PORT of "
            "a free port, e.g. 0.0.0.0:29510",
            file=sys.stderr,
        )
        return 2
    print(f"lighthouse {server.address()} min_regions={args.min_regions}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="cloudtrain lighthouse")
    configure(parser)
    sys.exit(run(parser.parse_args()))
