"""A host's TCP settings for the links between regions: what one connection can carry.

A TCP connection has at most its buffer in flight, so over a long round trip the buffer, not
the link, can set its rate: less than the buffer per round trip (`window_mbit`; part of the
buffer holds the kernel's bookkeeping). Linux's usual ceiling, `net.ipv4.tcp_wmem` 4 MiB, holds
one connection to about 250 Mbit/s at 80 ms and 100 Mbit/s at 180 ms, whatever the link: on the
emulated 1000 Mbit/s link at 80 ms one flow carried 239 Mbit/s with it and 853-892 Mbit/s with
WAN_TCP's buffers (200 Mbit/s at 180 ms: 89 against 162-168), flows of 4-6 s.

WAN_TCP holds buffer ceilings with room for 1 Gbit/s at 180 ms, BBR congestion control (the
default of the kernel docs/measurements.md was measured on; most distributions start with CUBIC,
which halves its window at each loss) and no slow start after idle. The Terraform's hosts get
them at boot (terraform/modules/region/main.tf, `host_tcp`), and so does every rank of the
emulated network (cloudtrain.tools.netem). A host without the buffers is told so at start-up:
`buffer_warning` names the links whose measured rate is what this host's buffers allow, and how
to raise them; one that restarts idle connections from the initial window is told
IDLE_WARNING.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

WAN_TCP = {
    "net.ipv4.tcp_rmem": "4096 131072 67108864",
    "net.ipv4.tcp_wmem": "4096 16384 67108864",
    "net.ipv4.tcp_congestion_control": "bbr",
    "net.ipv4.tcp_slow_start_after_idle": "0",
}
"""sysctl settings for the hosts of a run across regions. The buffers (min, default, max bytes):
64 MiB, room for the bandwidth-delay product of 1 Gbit/s at 180 ms (22.5 MB) with the kernel's
share of it; only the ceilings move, the kernel still sizes each connection's buffers to what it
needs. No slow start after idle: Linux's default (1) sends a connection idle for longer than its
retransmission timeout back to its initial window, and the outer loop's connections across
regions idle for H inner steps between syncs. Under BBR it costs nothing (BBR paces the restart
at its bandwidth estimate), but a host where BBR cannot be loaded stays on its loss-based
default: on the emulated 50 Mbit/s link at 180 ms, 250 KB after 1.5 s idle took 377 ms with it
and 211 without under Reno, 239 either way under BBR."""
BUFFERS = ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")
"""The keys of WAN_TCP that set the buffers."""

NEAR = 0.5
"""A link measured at this share of `window_mbit` or more is taken as held back by the buffers.
A connection they hold back carries 0.5-0.6 of it (the emulated links above), and the start-up
probe, which takes a round trip off each message's time, read more with Linux's usual buffers
(4 MiB send, 6 MiB receive): 0.67-0.86 through 400 Mbit/s at 100 ms, 0.8-1.1 through 1000 Mbit/s
at 180 ms; a 200 Mbit/s link at 80 ms, which they do not hold back, read 0.37-0.44."""


def buffer_ceilings(proc: Path = Path("/proc/sys/net/ipv4")) -> tuple[int, int] | None:
    """This host's TCP (send, receive) buffer ceilings in bytes: the third figures of tcp_wmem
    and tcp_rmem; None where they cannot be read (not Linux)."""
    try:
        send, receive = (
            int((proc / name).read_text().split()[2]) for name in ("tcp_wmem", "tcp_rmem")
        )
    except (OSError, IndexError, ValueError):
        return None
    return send, receive


def restarts_after_idle(proc: Path = Path("/proc/sys/net/ipv4")) -> bool | None:
    """Whether this host's TCP connections pay for an idle spell: it sends them back to their
    initial window (`net.ipv4.tcp_slow_start_after_idle` is not 0) and its congestion control
    is not BBR, which restarts at its bandwidth estimate (WAN_TCP); None where it cannot be read
    (not Linux)."""
    try:
        restarts = (proc / "tcp_slow_start_after_idle").read_text().strip() != "0"
        control = (proc / "tcp_congestion_control").read_text().strip()
    except OSError:
        return None
    return restarts and control != "bbr"


IDLE_WARNING = (
    "this host sends a TCP connection idle for longer than its retransmission timeout back to "
    "its initial window (net.ipv4.tcp_slow_start_after_idle = 1, and a congestion control other "
    "than BBR): an exchange across regions after an idle spell - every sync of the outer loop, "
    "a per-step exchange after a long step - grows its window again over round trips. Set it "
    "on every host: sudo sysctl -w "
    "net.ipv4.tcp_slow_start_after_idle=0, and the same in /etc/sysctl.d/ to keep it (the "
    "Terraform's hosts boot with it)"
)
"""What a rank whose host restarts idle connections says at start-up (restarts_after_idle)."""


def window_mbit(buffer_bytes: int, rtt_s: float) -> float:
    """`buffer_bytes` a round trip of `rtt_s`, in Mbit/s: more than one connection with that
    buffer ever carries."""
    return buffer_bytes * 8 / max(rtt_s, 1e-6) / 1e6


def buffer_warning(
    links: Any,
    me: int,
    measured: Iterable[tuple[int, int]],
    name: Callable[[int], str],
    ceilings: tuple[int, int] | None,
) -> str:
    """A message naming the links rank `me` measured (`measured`: (sender, receiver) pairs;
    `links`: a cloudtrain.probe.LinkMatrix) whose rate is near what this host's buffers allow
    over their round trip - its send ceiling where it sent, its receive ceiling where it
    received (`ceilings`, buffer_ceilings()) - and how to raise them; "" where there is none.
    `name(rank)` names the other end ("to eu", "from eu"; of two pairs so named, the faster)."""
    if ceilings is None:
        return ""
    mine: dict[str, tuple[float, float, int]] = {}
    for i, j in measured:
        if me in (i, j):
            label = f"to {name(j)}" if i == me else f"from {name(i)}"
            if label not in mine or links.mbit(i, j) > mine[label][0]:
                mine[label] = (links.mbit(i, j), links.alpha[i][j], ceilings[i != me])
    held = [
        f"{label} {mbit:.0f} Mbit/s at {1000 * rtt:.0f} ms ({buffer / 2**20:g} MiB a round "
        f"trip: {window_mbit(buffer, rtt):.0f} Mbit/s)"
        for label, (mbit, rtt, buffer) in mine.items()
        if mbit >= NEAR * window_mbit(buffer, rtt)
    ]
    if not held:
        return ""
    settings = " ".join(f"{k}='{WAN_TCP[k]}'" for k in BUFFERS)
    return (
        "this host's TCP buffers (net.ipv4.tcp_wmem for what it sends, tcp_rmem for what it "
        f"receives), not the links, may set what its links carry: {', '.join(held)}. Raise them "
        f"on every host: sudo sysctl -w {settings}, and the same in /etc/sysctl.d/ to keep them "
        "(the Terraform's hosts boot with these)"
    )


def host_warning(
    links: Any, me: int, measured: Iterable[tuple[int, int]], name: Callable[[int], str]
) -> str:
    """What rank `me` says at start-up of its host's TCP settings: buffer_warning with this
    host's ceilings, and IDLE_WARNING where it measured a link (of `measured`, the probe's pairs
    across regions) and the host restarts idle connections; "" where there is nothing to say."""
    pairs = list(measured)
    message = buffer_warning(links, me, pairs, name, buffer_ceilings())
    if any(me in pair for pair in pairs) and restarts_after_idle():
        message = f"{message}; {IDLE_WARNING}" if message else IDLE_WARNING
    return message
