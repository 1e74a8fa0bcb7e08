"""A host's TCP settings for the links between regions: what one connection can carry.

A TCP connection has at most its buffer in flight, so over a long round trip the buffer, not
the link, can set its rate: less than the buffer per round trip (`window_mbit`; part of the
buffer holds the kernel's bookkeeping). Linux's usual ceiling, `net.ipv4.tcp_wmem` 4 MiB, holds
one connection to about 250 Mbit/s at 80 ms and 100 Mbit/s at 180 ms, whatever the link: on the
emulated 1000 Mbit/s link at 80 ms one flow carried 239 Mbit/s with it and 853-892 Mbit/s with
WAN_TCP's buffers (200 Mbit/s at 180 ms: 89 against 162-168), flows of 4-6 s.

WAN_TCP holds buffer ceilings that fit the links cloudtrain is for (up to 1 Gbit/s at 180 ms and
more) and BBR congestion control (which every measurement in docs/measurements.md ran with; most
distributions start with CUBIC, which halves its window at each loss). The Terraform's hosts get
them at boot (terraform/modules/region/main.tf, `host_tcp`), and so does every rank of the
emulated network (cloudtrain.tools.netem). A host without the buffers is told so at start-up:
`window_limited` names the links whose measured rate is what this host's buffers allow, and how
to raise them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

WAN_TCP = {
    "net.ipv4.tcp_rmem": "4096 131072 67108864",
    "net.ipv4.tcp_wmem": "4096 16384 67108864",
    "net.ipv4.tcp_congestion_control": "bbr",
}
"""sysctl settings for the hosts of a run across regions. The buffers (min, default, max bytes):
64 MiB, room for the bandwidth-delay product of 1 Gbit/s at 180 ms (22.5 MB) with the kernel's
share of it; only the ceilings move, the kernel still sizes each connection's buffers to what it
needs."""
BUFFERS = ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")
"""The keys of WAN_TCP that set the buffers."""

NEAR = 0.5
"""A link measured at this share of `window_mbit` or more is taken as held back by the buffers.
A connection they hold back carries 0.5-0.6 of it (the emulated links above), and the probe, which
takes a round trip off each message's time, reads up to 0.86 of it (400 Mbit/s at 100 ms with
4 MiB: 286 Mbit/s); a 200 Mbit/s link at 80 ms, which 4 MiB does not hold back, reads 0.44-0.48."""


def buffer_ceiling(proc: Path = Path("/proc/sys/net/ipv4")) -> int | None:
    """The smaller of this host's TCP send and receive buffer ceilings (the third figure of
    tcp_wmem and tcp_rmem), in bytes; None where they cannot be read (not Linux)."""
    try:
        return min(int((proc / name).read_text().split()[2]) for name in ("tcp_wmem", "tcp_rmem"))
    except (OSError, IndexError, ValueError):
        return None


def window_mbit(buffer_bytes: int, rtt_s: float) -> float:
    """`buffer_bytes` a round trip of `rtt_s`, in Mbit/s: more than one connection with that
    buffer ever carries."""
    return buffer_bytes * 8 / max(rtt_s, 1e-6) / 1e6


def window_limited(links: Mapping[str, tuple[float, float]], buffer_bytes: int | None) -> str:
    """A message that names the links this host's buffers may hold back and how to raise
    them; "" where they hold back none. `links`: region -> (measured Mbit/s of one connection
    to it, round trip seconds)."""
    if buffer_bytes is None:
        return ""
    held = {
        region: (mbit, rtt, window_mbit(buffer_bytes, rtt))
        for region, (mbit, rtt) in links.items()
        if mbit >= NEAR * window_mbit(buffer_bytes, rtt)
    }
    if not held:
        return ""
    seen = ", ".join(
        f"to {region} {mbit:.0f} Mbit/s at {1000 * rtt:.0f} ms (the buffer a round trip: "
        f"{cap:.0f} Mbit/s)"
        for region, (mbit, rtt, cap) in sorted(held.items())
    )
    settings = " ".join(f"{k}='{WAN_TCP[k]}'" for k in BUFFERS)
    return (
        f"this host's TCP buffers (at most {buffer_bytes / 2**20:.0f} MiB: net.ipv4.tcp_wmem, "
        f"tcp_rmem), not the links, may set what its links carry: {seen}. Raise them on every "
        f"host: sysctl -w {settings} (the Terraform's hosts boot with these)"
    )
