"""Local WAN emulator: a multi-region cluster on one Linux machine (needs root).

What it builds. Every rank gets its own network namespace `ct-<name>-r<rank>` whose only
interface, `eth0`, has the address 10.77.<g>.<i+1>/16 (region index g, i-th rank of that region;
ranks are numbered region by region in the order given). All switching happens in one private
namespace `ct-<name>-wan`:

    rank ns        ct-<name>-wan                                          rank ns
    eth0 ── r0 ─┐                                                  ┌─ r2 ── eth0
    eth0 ── r1 ─┴ br0 ── up0 ═tbf═ dn0 ── core ── dn1 ═tbf═ up1 ── br1 ─┬─ r3 ── eth0
                 (us: unshaped)    (shaped at us rate)  (shaped at eu rate)   (eu: unshaped)

A region is a bridge (`br<g>`); ranks of a region talk through it unshaped. Each region bridge
joins the `core` bridge through one link `up<g>`/`dn<g>` whose two ends both carry a `tbf`
egress qdisc at that region's rate: `up<g>` shapes what leaves the region, `dn<g>` what enters
it. So traffic between regions crosses two shaped links, the sender's uplink and the receiver's
downlink, and gets min(rate of sender region, rate of receiver region). With three or more
regions this models per-region WAN capacity (all flows into a region share its downlink), not
per-pair links. Uplink and downlink may differ (`down_mbit`, `--down-mbit`). Everything is one L2
subnet with a 9000-byte MTU (jumbo frames on every veth, bridge and TAP), so no routing, no
forwarding sysctl and nothing in the root namespace: no interface, address or route of the host
is touched.

Delay. A region link holds every frame for its one-way delay, both directions. Region g has an
RTT share s_g (`rtt_ms`: one number for every region, or one per region); its link delays each
frame s_g/4 each way, so a frame from region a to region b waits s_a/4 + s_b/4 and the round trip
between a and b is (s_a + s_b) / 2 — with one number R, every pair of regions has RTT R. (Three
regions with RTTs 80/180/230 ms for us-eu/us-asia/eu-asia are shares 30/130/330.) Ranks of one
region see no added delay. How the delay is applied, in order of preference:

- `netem` where the kernel has it: the link is a veth pair, each end `netem delay s_g/4` as root
  qdisc with the tbf below it. `emulation` says "rate + delay (netem)".
- otherwise a userspace delay line: the link is two TAP devices, `up<g>` on the region bridge and
  `dn<g>` on the core bridge, and a relay process (`python -m cloudtrain.tools.netem relay`, one
  per delayed link, started in the wan namespace) reads each frame from one TAP, holds it in a
  queue ordered by due time and writes it to the other; tbf on the TAPs shapes the rate as on
  veths. `emulation` says "rate + delay (userspace delay line)". Before the relays start, `up()`
  measures what one relay can move (frames/s and Mbit/s at 9000-byte frames, CPU per frame; see
  `relay_ceiling`), reports it in `relay_note`, and refuses a link whose up + down rate needs
  more than RELAY_HEADROOM of that: the kernel's bridging and TCP receive work for a frame the
  relay writes also runs on the relay's CPU, which the ceiling does not include.
- neither (no netem, no /dev/net/tun): `emulation` says "rate only" and the note says the delay
  is NOT emulated — always read it before quoting results as latency-emulated.

tbf parameters (`tbf_params`): the rate is the Ethernet-frame rate (tbf counts the 14-byte L2
header, so TCP goodput is about 99% of it at a 9000-byte MTU). The bucket holds max(64 KiB, 1 ms
of traffic): veth hands tbf 64 KiB GSO super-packets, and a smaller bucket would make tbf split
every one of them. The queue holds burst + max(20 ms, RTT) of traffic — about one
bandwidth-delay product, as a WAN router buffer does — so one TCP flow keeps the link full
instead of losing throughput to tail drops, while queueing delay stays bounded.

Cleanup. Before creating anything, `up()` writes /run/cloudtrain-netem/<name>.json listing what it
will create (namespaces, later the relays' pids). Every namespace it creates is named
`ct-<name>-(wan|r<N>)` and carries a marker (the alias `cloudtrain-netem:<name>` on its loopback),
so `teardown(name)` and `teardown(None)` (every emulator) find leftovers even when the state file
is lost, and never touch a namespace this module did not create, whatever its name. Relays are
found by their command line (which names their emulator; the state file records their pids too)
and killed first, with every other process started in our namespaces: a process left inside
would keep a deleted namespace alive. Deleting the namespaces deletes every interface in them. The
context manager, atexit and SIGTERM/SIGHUP clean up; after a SIGKILL run
`cloudtrain netem down --name NAME` (or `--all`).

Processes. `popen(rank, argv)` runs argv under `ip netns exec` and sets GLOO_SOCKET_IFNAME,
NCCL_SOCKET_IFNAME, TP_SOCKET_IFNAME and HOROVOD_GLOO_IFACE to eth0 (gloo otherwise resolves the
hostname, which names no address inside a namespace), MASTER_ADDR to rank 0's address and
CLOUDTRAIN_REGION to the rank's region, unless `env` sets them. Loopback is up in every rank
namespace, and every rank reaches every other rank's address.

    with Emulator(regions={"us": 2, "eu": 2}, mbit=100, rtt_ms=80, name="demo") as wan:
        p = wan.popen(0, [sys.executable, "train.py"], env={"RANK": "0", "WORLD_SIZE": "4"})
        wan.set_rate("eu", 20)       # bandwidth drops mid-run
        wan.counters()               # {"us": {"tx_bytes": ..., "rx_bytes": ...}, "eu": {...}}

    cloudtrain netem up --regions us:2,eu:2 --profile us-eu --name demo   # 210 Mbit/s, 80 ms
    cloudtrain netem up --regions us:2,eu:2 --mbit 100 --rtt-ms 80 --name demo
    cloudtrain netem exec 0 --name demo -- python -c 'print(1)'
    cloudtrain netem rate --region eu --mbit 50 --name demo
    cloudtrain netem status --name demo [--json]
    cloudtrain netem down --name demo        # or: down --all
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import fcntl
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "ct-"
"""Every namespace this module creates starts with this (and carries MARKER)."""
MARKER = "cloudtrain-netem"
"""Alias set on the loopback of every namespace we create, followed by ':<name>'."""
STATE_DIR = Path("/run/cloudtrain-netem")
DEFAULT_NAME = "local"
SUBNET = "10.77.0.0/16"
RANK_IFNAME = "eth0"
MTU = 9000
"""Jumbo frames inside the emulated network: the delay line handles 6x fewer frames than at 1500."""
RELAY_HEADROOM = 0.5
"""Share of the measured relay ceiling a link's up + down rate may use (see the docstring)."""
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_REGION_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
_NS_RE = re.compile(r"ct-([a-z0-9][a-z0-9-]*)-(?:wan|r\d+)")
RATE_ONLY = "rate only"
DELAY_NETEM = "rate + delay (netem)"
DELAY_LINE = "rate + delay (userspace delay line)"


class EmulatorError(RuntimeError):
    """The emulator cannot be built, found or changed; the message says what to do."""


def check_name(name: str) -> str:
    """`name` if it is a valid emulator name, else ValueError: it names namespaces and the state
    file, so it must be a plain name (no path separators, no '..')."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"bad emulator name {name!r}: use 1-32 characters of a-z, 0-9 and '-', starting with "
            "a letter or digit (it names network namespaces and a file in /run/cloudtrain-netem)"
        )
    return name


# ---------------------------------------------------------------------------------------------
# Link profiles (docs/design.md, "Emulating a WAN on one machine")


@dataclass(frozen=True)
class LinkProfile:
    """A named inter-region link: single-flow rate and round-trip time."""

    mbit: float = 100.0
    """Rate in Mbit/s."""
    rtt_ms: float = 0.0
    """Round-trip time in ms between the two regions."""

    def __post_init__(self) -> None:
        _check_rate(self.mbit)
        _check_rtt(self.rtt_ms)


def _check_rate(mbit: float) -> None:
    if isinstance(mbit, bool) or not (isinstance(mbit, (int, float)) and 0 < mbit < math.inf):
        raise ValueError(f"rate must be a positive number of Mbit/s, got {mbit!r}")


def _check_rtt(rtt_ms: float) -> None:
    if isinstance(rtt_ms, bool) or not (isinstance(rtt_ms, (int, float)) and 0 <= rtt_ms <= 10_000):
        raise ValueError(f"rtt_ms must be a number of milliseconds in 0..10000, got {rtt_ms!r}")


PROFILES: dict[str, LinkProfile] = {
    # Published inter-region figures: single-flow rate (window x RTT bound) and RTT.
    "intra-zone": LinkProfile(5000, 0.2),
    "us-us": LinkProfile(250, 65),
    "us-eu": LinkProfile(210, 80),
    "us-asia": LinkProfile(135, 180),
    "eu-asia": LinkProfile(76, 230),
    "eu-australia": LinkProfile(70, 272),
    "500mbit": LinkProfile(500, 0),
}


def link_profile(name: str) -> LinkProfile:
    """A profile from PROFILES, or `<N>mbit` / `<N>gbit` (rate only, no delay)."""
    if name in PROFILES:
        return PROFILES[name]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(mbit|gbit)", name.strip().lower())
    if m:
        return LinkProfile(float(m[1]) * (1000 if m[2] == "gbit" else 1), 0.0)
    known = ", ".join(PROFILES)
    raise ValueError(f"unknown link profile {name!r}: use one of {known}, or <N>mbit / <N>gbit")


def parse_regions(text: str) -> dict[str, int]:
    """`us:2,eu:2` -> {"us": 2, "eu": 2} (order kept: it numbers the ranks)."""
    regions: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        region, sep, count = part.partition(":")
        if not sep or not count.strip().isdigit():
            raise ValueError(f"bad region {part!r}: write REGION:RANKS, e.g. us:2,eu:2")
        if region in regions:
            raise ValueError(f"region {region!r} is given twice in {text!r}")
        regions[region.strip()] = int(count)
    if not regions:
        raise ValueError("no regions given: write e.g. us:2,eu:2")
    return regions


def parse_mbit(text: str, regions: Sequence[str]) -> dict[str, float]:
    """`100` -> every region 100; `us=1000,eu=50` -> per region (all must be given). Also for
    per-region RTT shares (`--rtt-ms us=30,eu=130`)."""
    if "=" not in text:
        return dict.fromkeys(regions, float(text))
    rates = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        region, _, value = part.partition("=")
        rates[region.strip()] = float(value)
    return rates


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class WanSpec:
    """What to emulate: ranks per region, each region's WAN rate, the inter-region RTT."""

    regions: dict[str, int] = field(default_factory=lambda: {"a": 1, "b": 1})
    """Ranks per region in rank order: {"us": 2, "eu": 2} puts ranks 0-1 in us, 2-3 in eu."""
    mbit: dict[str, float] = field(default_factory=lambda: {"a": 100.0, "b": 100.0})
    """Rate of each region's WAN uplink (and downlink, unless down_mbit says otherwise), Mbit/s."""
    rtt_ms: float | dict[str, float] = 0.0
    """RTT between any two regions, or each region's RTT share (pair RTT = mean of the shares)."""
    name: str = DEFAULT_NAME
    """Names the namespaces (ct-<name>-wan, ct-<name>-r<rank>) and the state file."""
    down_mbit: dict[str, float] | None = None
    """Rate of each region's WAN downlink where it differs from the uplink (asymmetric links)."""

    def __post_init__(self) -> None:
        check_name(self.name)
        if not self.regions or len(self.regions) > 250:
            raise ValueError("give between 1 and 250 regions, e.g. {'us': 2, 'eu': 2}")
        for region, n in self.regions.items():
            if not _REGION_RE.fullmatch(region):
                raise ValueError(f"bad region name {region!r}: use letters, digits, '_', '-'")
            if not (isinstance(n, int) and 1 <= n <= 250):
                raise ValueError(f"region {region!r}: ranks must be an int in 1..250, got {n!r}")
        if set(self.mbit) != set(self.regions):
            raise ValueError(
                f"rates given for {sorted(self.mbit)} but regions are {sorted(self.regions)}: "
                "give one rate, or one per region (us=1000,eu=50)"
            )
        if self.down_mbit is not None and set(self.down_mbit) != set(self.regions):
            raise ValueError(
                f"downlink rates given for {sorted(self.down_mbit)} but regions are "
                f"{sorted(self.regions)}: give one per region"
            )
        if isinstance(self.rtt_ms, Mapping):
            if set(self.rtt_ms) != set(self.regions):
                raise ValueError(
                    f"RTT shares given for {sorted(self.rtt_ms)} but regions are "
                    f"{sorted(self.regions)}: give one RTT, or one share per region (us=30,eu=130)"
                )
            for share in self.rtt_ms.values():
                _check_rtt(share)
        else:
            _check_rtt(self.rtt_ms)
        for region, rate in [*self.mbit.items(), *(self.down_mbit or {}).items()]:
            _check_rate(rate)
            if rate > 100_000:
                raise ValueError(f"region {region!r}: {rate} Mbit/s is beyond what tbf can shape")

    def down(self, region: str) -> float:
        """The region's downlink rate."""
        return (self.down_mbit or self.mbit)[region]

    def share(self, region: str) -> float:
        """Region's RTT share in ms (the RTT itself when one number is given for all)."""
        return float(self.rtt_ms[region] if isinstance(self.rtt_ms, Mapping) else self.rtt_ms)

    def link_delay_ms(self, region: str) -> float:
        """One-way delay the region's link adds, each direction: a quarter of its share."""
        return self.share(region) / 4

    def pair_rtt_ms(self, a: str, b: str) -> float:
        """Round-trip time between a rank of region a and one of region b."""
        return 0.0 if a == b else (self.share(a) + self.share(b)) / 2

    @property
    def max_rtt_ms(self) -> float:
        return max((self.share(r) for r in self.regions), default=0.0)


def tbf_params(mbit: float, rtt_ms: float = 0.0) -> dict[str, int]:
    """tbf rate (bit/s), burst and limit (bytes) for one shaped link; see the module docstring."""
    rate = int(mbit * 1e6)
    burst = max(64 * 1024, rate // 8 // 1000)
    limit = burst + int(rate / 8 * max(0.020, rtt_ms / 1000))
    return {"rate": rate, "burst": burst, "limit": limit}


# ---------------------------------------------------------------------------------------------
# Running ip/tc


def _run(argv: Sequence[str], *, input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        raise EmulatorError(f"`{' '.join(argv)}` failed: {msg}")
    return proc.stdout


def _batch(tool: str, ns: str | None, lines: Sequence[str]) -> None:
    """Run many `ip`/`tc` commands in one process (`-batch -`), inside netns `ns`."""
    if lines:
        _run([tool, *(["-n", ns] if ns else []), "-batch", "-"], input="\n".join(lines) + "\n")


def _sysctl(ns: str, settings: Mapping[str, str]) -> None:
    # /proc/sys/net is per namespace: this changes only `ns`, never the host.
    if shutil.which("sysctl"):
        args = [f"{k}={v}" for k, v in settings.items()]
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *args], check=False)


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _marker_of(ns: str) -> str | None:
    """The emulator name recorded in namespace ns's marker, or None (not one of ours)."""
    out = _run(["ip", "-n", ns, "-j", "link", "show", "lo"], check=False)
    with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
        alias = json.loads(out)[0].get("ifalias", "")
        tag, sep, name = alias.partition(":")
        if tag == MARKER and sep:
            return name
    return None


_AVAILABLE: tuple[bool, str] | None = None
_HAS_TUN: bool | None = None


def available() -> tuple[bool, str]:
    """(True, "") when this process can build an emulator, else (False, what the machine lacks:
    root, `ip`/`tc`, network namespaces with veth and bridges, the tbf qdisc). Cached.

    Only a missing capability reads as unavailable: any other failure raises EmulatorError, so a
    bug in the emulator never turns into "unavailable" (and into skipped tests)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _probe_available()
    return _AVAILABLE


def delay_line_available() -> bool:
    """Whether TAP devices can be made here (/dev/net/tun): the userspace delay line needs them."""
    if _HAS_TUN is None:
        available()
    return bool(_HAS_TUN)


def _probe_available() -> tuple[bool, str]:
    global _HAS_TUN
    if not sys.platform.startswith("linux"):
        return False, "the WAN emulator needs Linux network namespaces"
    if os.geteuid() != 0:
        return False, "the WAN emulator needs root (network namespaces, tc); run as root"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return False, f"`{tool}` not found: install iproute2"
    probe = f"{PREFIX}probe-{os.getpid()}-{threading.get_ident() % 10000}"
    steps = [
        ("network namespaces", ["ip", "netns", "add", probe]),
        ("veth pairs", ["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"]),
        ("bridges", ["ip", "-n", probe, "link", "add", "b0", "type", "bridge"]),
        ("the tbf qdisc", ["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf",
                           "rate", "1mbit", "burst", "16kb", "limit", "32kb"]),
    ]  # fmt: skip
    try:
        for what, argv in steps:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if proc.returncode != 0:
                return False, f"this kernel offers no {what} to root: {proc.stderr.strip()}"
        tap = ["ip", "-n", probe, "tuntap", "add", "dev", "t0", "mode", "tap"]
        _HAS_TUN = subprocess.run(tap, capture_output=True, timeout=60).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=60)
    return True, ""


def _has_netem(ns: str) -> bool:
    """Whether the kernel has the netem qdisc, tried on a throwaway veth pair inside `ns`."""
    _run(["ip", "-n", ns, "link", "add", "nprobe0", "type", "veth", "peer", "name", "nprobe1"])
    try:
        cmd = ["tc", "-n", ns, "qdisc", "add", "dev", "nprobe0", "root", "netem", "delay", "1ms"]
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    finally:
        _run(["ip", "-n", ns, "link", "del", "nprobe0"], check=False)


# ---------------------------------------------------------------------------------------------
# The userspace delay line


_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_MAX_HELD = 256 << 20
"""Bytes one direction of a relay may hold; tbf in front keeps it far below (rate x delay)."""


def _open_tap(ifname: str) -> int:
    """A file descriptor attached to the existing TAP device `ifname` (in this namespace)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", ifname.encode(), _IFF_TAP | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class DelayLine:
    """Moves frames from each path's source fd to its sink fd, each held `delay_s` after it was
    read. The delay is the same for every frame of a path, so a FIFO per path is already ordered
    by due time. Frames beyond _MAX_HELD bytes per path are dropped, as a full router queue does."""

    def __init__(self, paths: Sequence[tuple[int, int]], delay_s: float) -> None:
        self.paths = list(paths)
        self.delay_s = delay_s
        self.moved = 0
        self._queues: list[collections.deque[tuple[float, bytes]]] = [
            collections.deque() for _ in self.paths
        ]
        self._held = [0] * len(self.paths)
        self._poll = select.epoll()
        self._index = {}
        for k, (src, _) in enumerate(self.paths):
            os.set_blocking(src, False)
            self._poll.register(src, select.EPOLLIN)
            self._index[src] = k

    def run(self, until: float = math.inf) -> None:
        """Relay until time.monotonic() reaches `until` (forever by default). Returns early when
        a source fd reports an error or end of file (its device was deleted)."""
        while True:
            now = time.monotonic()
            due = until
            for k, queue in enumerate(self._queues):
                sink = self.paths[k][1]
                while queue and queue[0][0] <= now:
                    frame = queue.popleft()[1]
                    self._held[k] -= len(frame)
                    with contextlib.suppress(BlockingIOError):  # a full sink drops, as a NIC does
                        os.write(sink, frame)
                    self.moved += 1
                if queue:
                    due = min(due, queue[0][0])
            if now >= until:
                return
            # epoll waits whole milliseconds (rounded up): wait the part below one in sleep,
            # whose timer is finer, so short delays are not stretched by up to 1 ms per hop.
            wait = -1.0 if due == math.inf else math.floor(max(0.0, due - now) * 1000) / 1000
            events = self._poll.poll(wait)
            if not events and due != math.inf and (rest := due - time.monotonic()) > 0:
                time.sleep(rest)
            now = time.monotonic()
            for fd, _ in events:
                k = self._index[fd]
                for _ in range(64):  # then write what is due, even under a flood
                    try:
                        frame = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    except OSError:
                        return
                    if not frame:
                        return
                    if self._held[k] + len(frame) <= _MAX_HELD:
                        self._queues[k].append((now + self.delay_s, frame))
                        self._held[k] += len(frame)


def relay_ceiling(delay_ms: float, seconds: float = 0.3) -> dict[str, float]:
    """What one relay process moves at most on this machine, measured now with `delay_ms`:
    frames/s and Mbit/s of MTU-sized frames, and its CPU per frame. Runs the relay's own loop
    (DelayLine) in a fresh process between two socket pairs fed as fast as they take frames;
    frames per CPU-second of the relay is the ceiling (one core fully used)."""
    cmd = [sys.executable, "-m", "cloudtrain.tools.netem", "relay-ceiling",
           "--delay-ms", f"{delay_ms}", "--seconds", f"{seconds}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise EmulatorError(f"measuring the delay line's ceiling failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def _measure_ceiling(delay_ms: float, seconds: float) -> dict[str, float]:
    """The measurement behind relay_ceiling; runs in its own process (it forks)."""
    frame_bytes = MTU + 14
    feed_w, feed_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sink_w, sink_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    children = []
    for role in ("feed", "sink"):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            with contextlib.suppress(OSError):
                if role == "feed":
                    frame = bytes(frame_bytes)
                    while True:
                        feed_w.send(frame)
                else:
                    while sink_r.recv(65536):
                        pass
            os._exit(0)
        children.append(pid)
    line = DelayLine([(feed_r.fileno(), sink_w.fileno())], delay_ms / 1000)
    line.run(time.monotonic() + delay_ms / 1000 + 0.05)  # the queue fills, frames start leaving
    moved, cpu, wall = line.moved, time.process_time(), time.monotonic()
    line.run(wall + seconds)
    moved, cpu, wall = line.moved - moved, time.process_time() - cpu, time.monotonic() - wall
    for s in (feed_w, feed_r, sink_w, sink_r):
        s.close()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    fps = moved / max(cpu, 1e-6)
    return {
        "frames_per_s": fps,
        "mbit": fps * frame_bytes * 8 / 1e6,
        "us_cpu_per_frame": 1e6 / fps,
        "measured_frames_per_s": moved / wall,
        "cpu_share": cpu / wall,
        "frame_bytes": frame_bytes,
        "delay_ms": delay_ms,
    }


def _relay_main(name: str, link: int, delay_ms: float) -> int:
    """A relay process: joins TAPs up<link> and dn<link> (run inside the emulator's wan
    namespace), says "ready", relays until killed or its devices go."""
    up, dn = _open_tap(f"up{link}"), _open_tap(f"dn{link}")
    line = DelayLine([(up, dn), (dn, up)], delay_ms / 1000)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner tears down; a terminal's ^C must not
    with contextlib.suppress(OSError):
        # A network is not slowed by the ranks' compute: on a busy machine the relay must not
        # queue behind them, or every frame would wait a scheduler slice on top of its delay.
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the owner may exit and close the pipe: nothing more goes there
    line.run()
    print(f"relay {name}/{link}: a device went away, exiting", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# Tear down (also without state)


def _state_path(name: str) -> Path:
    return STATE_DIR / f"{check_name(name)}.json"


def _state_names() -> list[str]:
    return sorted(p.stem for p in STATE_DIR.glob("*.json") if _NAME_RE.fullmatch(p.stem))


def _read_state(name: str) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        state = json.loads(_state_path(name).read_text())
        if isinstance(state, dict):
            return state
    return {}


def leftovers(name: str | None = None) -> list[str]:
    """Namespaces of emulator `name` (every emulator when None) that exist now: named like ours
    and carrying our marker, so a namespace someone else made is never listed."""
    if name is not None:
        check_name(name)
    found = []
    for ns in _namespaces():
        m = _NS_RE.fullmatch(ns)
        if m and (name is None or m[1] == name) and _marker_of(ns) == m[1]:
            found.append(ns)
    return found


def relay_processes(name: str | None = None) -> list[int]:
    """Pids of the live relay processes of emulator `name` (of every emulator when None), found
    by their command line in /proc: also those whose namespace or state file is already gone
    (a relay still running keeps its namespace alive, out of `ip netns list`'s sight)."""
    want = None if name is None else f"--name={check_name(name)}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or _zombie(int(proc.name)):
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"cloudtrain.tools.netem" in argv and b"relay" in argv:
                names = [a for a in argv if a.startswith(b"--name=")]
                if names and (want is None or names[0] == want):
                    pids.append(int(proc.name))
    return pids


def _kill(pids: set[int]) -> None:
    pids.discard(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = set()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                alive.add(pid)
        if not alive:
            return
        deadline = time.monotonic() + 1.0
        while alive and time.monotonic() < deadline:
            time.sleep(0.02)
            alive = {p for p in alive if Path(f"/proc/{p}").exists() and not _zombie(p)}
        pids = alive


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def teardown(name: str | None = None) -> list[str]:
    """Remove emulator `name` (every emulator when None): its relays and other processes, its
    namespaces, its state file.

    Works from the state file and from the namespaces' names and markers, so it also cleans up
    after a crash; a namespace without our marker is never touched. Returns what was removed;
    removing nothing is not an error."""
    names = [check_name(name)] if name is not None else _state_names()
    namespaces = set(leftovers(name))
    for n in names:
        recorded = set(_read_state(n).get("namespaces") or []) & set(_namespaces())
        namespaces.update(ns for ns in recorded if _marker_of(ns) == n)
    # Relays by name only for emulators seen here (state file or marked namespace): `--all`
    # must not reach an emulator that is none of this view's business.
    seen = set(names) | {m[1] for ns in namespaces if (m := _NS_RE.fullmatch(ns))}
    pids = {pid for n in seen for pid in relay_processes(n)}
    ordered = sorted(namespaces, key=lambda ns: ns.endswith("-wan"))  # ranks first, wan last
    for ns in ordered:
        out = _run(["ip", "netns", "pids", ns], check=False)
        pids.update(int(p) for p in out.split() if p.isdigit())
    # Relays first: a process inside a namespace keeps it alive after `ip netns del`.
    _kill(pids)
    removed = []
    for ns in ordered:
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    for n in names:
        extra = [*STATE_DIR.glob(f"{n}.tmp*"), *STATE_DIR.glob(f"{n}.relay-*.log")]
        for path in [_state_path(n), *extra]:
            if path.exists():
                path.unlink(missing_ok=True)
                removed.append(str(path))
    return removed


# ---------------------------------------------------------------------------------------------
# The emulator


class Emulator:
    """One emulated multi-region cluster. Use as a context manager, or up()/down()."""

    def __init__(
        self,
        regions: Mapping[str, int],
        mbit: float | Mapping[str, float],
        rtt_ms: float | Mapping[str, float] = 0.0,
        name: str = DEFAULT_NAME,
        down_mbit: float | Mapping[str, float] | None = None,
    ) -> None:
        def per_region(rate: float | Mapping[str, float]) -> dict[str, float]:
            rates = dict.fromkeys(regions, rate) if isinstance(rate, (int, float)) else rate
            return {r: float(v) for r, v in rates.items()}

        down = None if down_mbit is None else per_region(down_mbit)
        rtt = float(rtt_ms) if isinstance(rtt_ms, (int, float)) else per_region(rtt_ms)
        self.spec = WanSpec(dict(regions), per_region(mbit), rtt, name, down)
        self.emulation: str | None = None
        """RATE_ONLY, DELAY_NETEM or DELAY_LINE once up; see `emulation_note` for details."""
        self.emulation_note = ""
        self.relay: dict[str, float] | None = None
        """The delay line's measured ceiling (relay_ceiling), when it is in use."""
        self.relays: dict[str, int] = {}
        """Pid of the relay process of each delayed region link."""
        self._relay_procs: list[subprocess.Popen] = []
        self._rank_region = [(r, i) for r, n in self.spec.regions.items() for i in range(n)]
        self._owned = False
        self._old_handlers: dict[int, object] = {}

    # -- names and addresses ----------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def world_size(self) -> int:
        return len(self._rank_region)

    @property
    def wan_namespace(self) -> str:
        return f"{PREFIX}{self.name}-wan"

    def namespace(self, rank: int) -> str:
        """The network namespace rank `rank` runs in."""
        self._check_rank(rank)
        return f"{PREFIX}{self.name}-r{rank}"

    def region(self, rank: int) -> str:
        self._check_rank(rank)
        return self._rank_region[rank][0]

    def ranks(self, region: str) -> list[int]:
        return [k for k, (r, _) in enumerate(self._rank_region) if r == region]

    def address(self, rank: int) -> str:
        """IPv4 address of rank's eth0 (rank 0's is the MASTER_ADDR)."""
        self._check_rank(rank)
        region, i = self._rank_region[rank]
        return f"10.77.{self._region_index(region)}.{i + 1}"

    @property
    def mbit(self) -> dict[str, float]:
        return dict(self.spec.mbit)

    def rtt_ms(self, a: int, b: int) -> float:
        """The emulated round-trip time between ranks a and b (0 within a region), when the
        emulation includes delay; the RTT asked for otherwise (see `emulation`)."""
        return self.spec.pair_rtt_ms(self.region(a), self.region(b))

    def _region_index(self, region: str) -> int:
        if region not in self.spec.regions:
            raise KeyError(f"no region {region!r}; regions are {list(self.spec.regions)}")
        return list(self.spec.regions).index(region)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range: world size is {self.world_size}")

    # -- lifecycle ----------------------------------------------------------------------------

    def up(self, *, persist: bool = False) -> Emulator:
        """Build it. Unless `persist`, it is torn down at exit and on SIGTERM/SIGHUP too."""
        ok, why = available()
        if not ok:
            raise EmulatorError(why)
        taken = EmulatorError(
            f"an emulator named {self.name!r} exists already: "
            f"run `cloudtrain netem down --name {self.name}` or pick another name"
        )
        if leftovers(self.name):
            raise taken
        STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:  # claims the name: of two processes racing for it, one gets an error
            _state_path(self.name).open("x").close()
        except FileExistsError:
            raise taken from None
        self._owned = not persist
        if self._owned:
            atexit.register(self.down)
            self._install_signal_handlers()
        try:
            self._write_state()  # first: a crash from here on leaves a record
            self._build()
            self._write_state()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove everything up() made (idempotent)."""
        teardown(self.name)
        for proc in self._relay_procs:  # killed by teardown; reap them so none lingers as a zombie
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._relay_procs.clear()
        if self._owned:
            self._owned = False
            atexit.unregister(self.down)
            self._restore_signal_handlers()

    def __enter__(self) -> Emulator:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @classmethod
    def attach(cls, name: str = DEFAULT_NAME) -> Emulator:
        """The emulator `name` that is up now (made by another process, e.g. the CLI)."""
        try:
            state = json.loads(_state_path(name).read_text())
        except FileNotFoundError:
            raise EmulatorError(
                f"no emulator named {name!r} is up: start one with `cloudtrain netem up`"
            ) from None
        wan = cls(
            dict(state["regions"]),
            state["mbit"],
            state["rtt_ms"],
            state["name"],
            state.get("down_mbit"),
        )
        wan.emulation, wan.emulation_note = state.get("emulation"), state.get("note", "")
        wan.relay, wan.relays = state.get("relay"), state.get("relays") or {}
        return wan

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum: int, frame: object) -> None:
            # Unwinds `with` blocks (which call down) and runs atexit; exit status as if killed.
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._old_handlers[sig] = signal.signal(sig, on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._old_handlers.clear()

    def _write_state(self) -> None:
        state = {
            "version": 2,
            "name": self.name,
            "regions": list(self.spec.regions.items()),
            "mbit": self.spec.mbit,
            "down_mbit": self.spec.down_mbit,
            "rtt_ms": self.spec.rtt_ms,
            "emulation": self.emulation,
            "note": self.emulation_note,
            "relay": self.relay,
            "relays": self.relays,
            "namespaces": [self.wan_namespace, *map(self.namespace, range(self.world_size))],
            "addresses": [self.address(k) for k in range(self.world_size)],
            "pid": os.getpid(),
            "created": time.time(),
        }
        tmp = _state_path(self.name).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(_state_path(self.name))

    def _delayed(self) -> list[str]:
        return [r for r in self.spec.regions if self.spec.link_delay_ms(r) > 0]

    def _choose_emulation(self) -> None:
        rtt = self._rtt_text()
        if not self._delayed():
            self.emulation, self.emulation_note = RATE_ONLY, "no delay asked for"
        elif _has_netem(self.wan_namespace):
            self.emulation, self.emulation_note = DELAY_NETEM, f"{rtt} via netem"
        elif delay_line_available():
            self.relay = relay_ceiling(max(map(self.spec.link_delay_ms, self._delayed())))
            for region in self._delayed():
                self._check_relay_capacity(region, self.spec.mbit[region], self.spec.down(region))
            r = self.relay
            busiest = max(self.spec.mbit[g] + self.spec.down(g) for g in self._delayed())
            cpu = busiest * 1e6 / 8 / r["frame_bytes"] * r["us_cpu_per_frame"] / 1e6
            self.emulation = DELAY_LINE
            self.emulation_note = (
                f"{rtt}; relay ceiling {r['mbit']:.0f} Mbit/s ({r['frames_per_s']:.0f} frames/s "
                f"of {r['frame_bytes']:.0f} B, {r['us_cpu_per_frame']:.1f} us CPU per frame, "
                f"measured at {r['delay_ms']:g} ms delay); the busiest link, {busiest:g} Mbit/s "
                f"up + down, needs {cpu:.0%} of a core in its relay at full rate"
            )
        else:
            self.emulation = RATE_ONLY
            self.emulation_note = (
                f"kernel has no netem qdisc and no /dev/net/tun: {rtt} is NOT emulated"
            )

    def _rtt_text(self) -> str:
        shares = {self.spec.share(r) for r in self.spec.regions}
        if len(shares) == 1:
            return f"{shares.pop():g} ms RTT between regions"
        regions = list(self.spec.regions)
        pairs = [(a, b) for i, a in enumerate(regions) for b in regions[i + 1 :]]
        return "RTT " + ", ".join(f"{a}-{b} {self.spec.pair_rtt_ms(a, b):g} ms" for a, b in pairs)

    def _check_relay_capacity(self, region: str, up: float, down: float) -> None:
        if self.relay is None or self.spec.link_delay_ms(region) <= 0:
            return
        limit = RELAY_HEADROOM * self.relay["mbit"]
        if up + down > limit:
            raise EmulatorError(
                f"region {region!r}: {up:g} Mbit/s up + {down:g} down through its delay relay is "
                f"more than {limit:.0f} Mbit/s ({RELAY_HEADROOM:.0%} of the "
                f"{self.relay['mbit']:.0f} Mbit/s one relay moved on this machine when the "
                "emulator came up): lower the rate, or ask for no delay on that region's link"
            )

    def _build(self) -> None:
        wan = self.wan_namespace
        no_ipv6 = {  # no router solicitations / DAD chatter crossing the shaped links
            "net.ipv6.conf.all.disable_ipv6": "1",
            "net.ipv6.conf.default.disable_ipv6": "1",
        }
        for ns in [wan, *map(self.namespace, range(self.world_size))]:
            _run(["ip", "netns", "add", ns])
            _batch("ip", ns, [f"link set lo alias {MARKER}:{self.name}", "link set lo up"])
            _sysctl(ns, no_ipv6)
        self._choose_emulation()
        line = self.emulation == DELAY_LINE

        bridge = f"mtu {MTU} type bridge stp_state 0 forward_delay 0"
        ip = [f"link add core {bridge}", "link set core up"]
        tc = []
        for g, region in enumerate(self.spec.regions):
            if line and self.spec.link_delay_ms(region) > 0:
                link = [f"tuntap add dev up{g} mode tap", f"tuntap add dev dn{g} mode tap"]
                link += [f"link set up{g} mtu {MTU}", f"link set dn{g} mtu {MTU}"]
            else:
                link = [f"link add up{g} mtu {MTU} type veth peer name dn{g} mtu {MTU}"]
            ip += [
                f"link add br{g} {bridge}",
                *link,
                f"link set up{g} master br{g}",
                f"link set dn{g} master core",
                f"link set br{g} up",
                f"link set up{g} up",
                f"link set dn{g} up",
            ]
            tc += self._qdisc_lines(g, self.spec.mbit[region], self.spec.down(region))
        for rank in range(self.world_size):
            g = self._region_index(self.region(rank))
            ip += [
                f"link add r{rank} mtu {MTU} type veth peer name {RANK_IFNAME} mtu {MTU} "
                f"netns {self.namespace(rank)}",
                f"link set r{rank} master br{g}",
                f"link set r{rank} up",
            ]
        _batch("ip", wan, ip)
        if line:
            self._start_relays()
        _batch("tc", wan, tc)
        for rank in range(self.world_size):
            _batch(
                "ip",
                self.namespace(rank),
                [
                    f"addr add {self.address(rank)}/16 dev {RANK_IFNAME}",
                    f"link set {RANK_IFNAME} up",
                ],
            )

    def _start_relays(self) -> None:
        for g, region in enumerate(self.spec.regions):
            delay = self.spec.link_delay_ms(region)
            if delay <= 0:
                continue
            log = STATE_DIR / f"{self.name}.relay-{g}.log"
            argv = [sys.executable, "-m", "cloudtrain.tools.netem", "relay", f"--name={self.name}",
                    f"--link={g}", f"--delay-ms={delay}"]  # fmt: skip
            with log.open("w") as err:
                proc = subprocess.Popen(
                    ["ip", "netns", "exec", self.wan_namespace, *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    start_new_session=True,  # its owner stops it; a terminal's signals must not
                )
            self._relay_procs.append(proc)
            self.relays[region] = proc.pid  # `ip netns exec` execs the relay: same pid
            self._write_state()
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                proc.wait(timeout=10)
                raise EmulatorError(
                    f"the delay relay of region {region!r} did not start: {log.read_text()[-2000:]}"
                )
            proc.stdout.close()

    def _qdisc_lines(self, g: int, up: float, down: float) -> list[str]:
        """tc lines adding the qdiscs that shape region g: egress of up<g> is the region's uplink
        (towards the core), egress of dn<g> its downlink."""
        region = list(self.spec.regions)[g]
        one_way = self.spec.link_delay_ms(region)
        netem = self.emulation == DELAY_NETEM and one_way > 0
        lines = []
        for dev, mbit in ((f"up{g}", up), (f"dn{g}", down)):
            p = tbf_params(mbit, self.spec.max_rtt_ms if self.emulation != RATE_ONLY else 0.0)
            tbf = f"tbf rate {p['rate']}bit burst {p['burst']} limit {p['limit']}"
            if netem:
                # netem first (root) and the shaper below it: the netem-wiki recipe. Its packet
                # limit must not drop before tbf does: room for twice the frames of one delay
                # plus a full tbf queue at this rate.
                pkts = max(1000, int(2 * (p["rate"] / 8 * one_way / 1000 + p["limit"]) / 1500))
                lines.append(
                    f"qdisc add dev {dev} root handle 1: netem delay {one_way}ms limit {pkts}"
                )
                lines.append(f"qdisc add dev {dev} parent 1:1 handle 10: {tbf}")
            else:
                lines.append(f"qdisc add dev {dev} root handle 10: {tbf}")
        return lines

    # -- live control -------------------------------------------------------------------------

    def set_rate(self, region: str, mbit: float, down_mbit: float | None = None) -> None:
        """Change region's uplink rate now, and its downlink to down_mbit (default: the same);
        existing flows feel it at once."""
        g = self._region_index(region)
        down = float(mbit if down_mbit is None else down_mbit)
        rates = {**self.spec.mbit, region: float(mbit)}
        downs = None
        if self.spec.down_mbit is not None or down != float(mbit):
            downs = {r: self.spec.down(r) for r in self.spec.regions} | {region: down}
        spec = WanSpec(dict(self.spec.regions), rates, self.spec.rtt_ms, self.name, downs)
        if self.emulation == DELAY_LINE:
            self._check_relay_capacity(region, float(mbit), down)
        # Delete and add, in one batch, rather than `tc qdisc change`: on this kernel a tbf
        # changed under a full queue was seen to stop dequeuing for good (packets sat in its
        # backlog, TCP backed off to a 60 s stall). A fresh qdisc drops what was queued, and TCP
        # retransmits it within one RTO.
        reset = [f"qdisc del dev {dev}{g} root" for dev in ("up", "dn")]
        lines = reset + self._qdisc_lines(g, float(mbit), down)
        _batch("tc", self.wan_namespace, lines)
        self.spec = spec
        self._write_state()

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes/packets that left (tx) and entered (rx) each region over its shaped WAN link.

        Read from the kernel's counters of `up<g>` (L2 frames, headers included): the truth,
        whatever the framework reports."""
        out = _run(["ip", "-n", self.wan_namespace, "-s", "-j", "link", "show"])
        links = {link["ifname"]: link["stats64"] for link in json.loads(out)}
        result = {}
        for g, region in enumerate(self.spec.regions):
            s = links[f"up{g}"]
            result[region] = {
                "tx_bytes": s["tx"]["bytes"],
                "rx_bytes": s["rx"]["bytes"],
                "tx_packets": s["tx"]["packets"],
                "rx_packets": s["rx"]["packets"],
            }
        return result

    def env(self, rank: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment popen gives rank: os.environ, our defaults, then `env`."""
        return {
            **os.environ,
            "GLOO_SOCKET_IFNAME": RANK_IFNAME,
            "NCCL_SOCKET_IFNAME": RANK_IFNAME,
            "TP_SOCKET_IFNAME": RANK_IFNAME,
            "HOROVOD_GLOO_IFACE": RANK_IFNAME,
            "MASTER_ADDR": self.address(0),
            "CLOUDTRAIN_REGION": self.region(rank),
            **(env or {}),
        }

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """argv prefixed so that it runs inside rank's namespace."""
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    def popen(
        self, rank: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start argv inside rank's namespace (see `env` for the environment it gets)."""
        return subprocess.Popen(self.command(rank, argv), env=self.env(rank, env), **kwargs)

    def measure_mbit(self, src: int, dst: int, seconds: float = 1.0, port: int = 5201) -> float:
        """TCP goodput from rank src to rank dst over `seconds`, Mbit/s, measured at dst."""
        recv = self.popen(
            dst,
            [sys.executable, "-c", _RECEIVER, self.address(dst), str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs = [recv]
        try:
            assert recv.stdout is not None
            if recv.stdout.readline().strip() != "ready":
                raise EmulatorError(f"receiver in rank {dst} did not start")
            args = [self.address(dst), str(port), str(seconds)]
            procs.append(self.popen(src, [sys.executable, "-c", _SENDER, *args]))
            out, _ = recv.communicate(timeout=seconds + 60)
            nbytes, elapsed = out.split()
            return int(nbytes) * 8 / float(elapsed) / 1e6
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()

    def _rates(self, region: str) -> str:
        up, down = self.spec.mbit[region], self.spec.down(region)
        return f"{up:g}" if up == down else f"{up:g} up/{down:g} dn"

    def describe(self) -> str:
        lines = [
            f"{self.name}: {self.world_size} ranks in {len(self.spec.regions)} regions, "
            f"{self.emulation} ({self.emulation_note}); wan namespace {self.wan_namespace}"
        ]
        try:
            counters = self.counters()
        except EmulatorError:
            counters = {}
        for region in self.spec.regions:
            ranks = self.ranks(region)
            c = counters.get(region, {})
            delay = self.spec.link_delay_ms(region)
            lines.append(
                f"  {region:<10} {self._rates(region):>13} Mbit/s  {delay:g} ms each way"
                f"  ranks {ranks[0]}-{ranks[-1]}"
                f"  {self.address(ranks[0])}..{self.address(ranks[-1])}"
                f"  WAN tx {c.get('tx_bytes', 0):,} B  rx {c.get('rx_bytes', 0):,} B"
                + (f"  relay pid {self.relays[region]}" if region in self.relays else "")
            )
        return "\n".join(lines)


_RECEIVER = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
srv.settimeout(30)
print("ready", flush=True)
conn, _ = srv.accept()
buf = bytearray(1 << 20)
n, t0 = 0, None
while k := conn.recv_into(buf):
    if t0 is None:
        t0 = time.monotonic()  # clock starts at the first byte; those bytes are not counted
    else:
        n += k
print(n, time.monotonic() - t0)
"""

_SENDER = """
import socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk = bytes(256 << 10)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    sock.sendall(chunk)
sock.close()
"""


# ---------------------------------------------------------------------------------------------
# CLI: cloudtrain netem up|down|rate|status|exec|measure


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
    how.add_argument("--profile", help=f"link profile: {', '.join(PROFILES)}, or <N>mbit")
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
        print(f"cloudtrain netem: {e}", file=sys.stderr)
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
    report = []
    for name in names:
        wan = Emulator.attach(name)
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
                "counters": wan.counters(),
            }
        )
        if not args.json:
            print(wan.describe())
    orphans = sorted(set(leftovers(args.name)) - {ns for r in report for ns in r["namespaces"]})
    if args.json:
        print(json.dumps({"emulators": report, "orphan_namespaces": orphans}, indent=1))
    elif orphans:
        print("namespaces without state (remove with `down --all`): " + ", ".join(orphans))
    elif not report:
        print("no emulator is up")
    return 0


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


def _main(argv: Sequence[str] | None = None) -> int:
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
        return _relay_main(check_name(args.name), args.link, args.delay_ms)
    print(json.dumps(_measure_ceiling(args.delay_ms, args.seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
