"""Local WAN emulator: a multi-region cluster on one Linux machine (needs root).

What it builds. Every rank gets its own network namespace `ct-<name>-r<rank>` whose only
interface, `eth0`, has the address 10.77.<g>.<i+1>/16 (region index g, i-th rank of that region;
ranks are numbered region by region in the order given). All switching happens in one private
namespace `ct-<name>-wan`:

    rank ns        ct-<name>-wan                                          rank ns
    eth0 ── r0 ─┐                                                  ┌─ r2 ── eth0
    eth0 ── r1 ─┴ br0 ── up0 ═tbf═ dn0 ── core ── dn1 ═tbf═ up1 ── br1 ─┬─ r3 ── eth0
                 (us: unshaped)    (shaped at us rate)  (shaped at eu rate)   (eu: unshaped)

A region is a bridge (`br<g>`); ranks of a region talk through it unshaped (12-18 Gbit/s
here). Each region bridge joins the `core` bridge through one veth pair `up<g>`/`dn<g>` whose two
ends both carry a `tbf` egress qdisc at that region's rate: `up<g>` shapes what leaves the region,
`dn<g>` what enters it. So traffic between regions crosses two shaped links, the sender's uplink
and the receiver's downlink, and gets min(rate of sender region, rate of receiver region): a
sender in a 50 Mbit/s region is limited by its own uplink even if the peer has 1 Gbit/s. With
three or more regions this models per-region WAN capacity (all flows into a region share its
downlink), not per-pair links. Uplink and downlink may differ (`down_mbit`, `--down-mbit`): a
region with a slow uplink and a fast downlink sends slowly but receives fast, so two regions can
have different rates each way. Everything is one L2 subnet, so no routing, no forwarding sysctl
and nothing in the root namespace: no interface, address or route of the host is touched.

Delay. Latency needs the `netem` qdisc, which many kernels (this one included) lack. When a
round-trip time is asked for, `up()` probes for netem inside the private namespace; if present,
each uplink gets `netem delay RTT/2` as root qdisc with the tbf below it (so one way crosses one
delay), and `emulation` says "rate and delay"; otherwise only rates are applied and `emulation`
says "rate only" — always read it before quoting results as latency-emulated.

tbf parameters (`tbf_params`): the rate is the Ethernet-frame rate (tbf counts the 14-byte L2
header, so TCP goodput is about 95% of it: ~96 Mbit/s across a 100 Mbit/s link). The bucket
holds max(64 KiB, 1 ms of traffic): veth hands tbf 64 KiB GSO super-packets, and a smaller bucket
would make tbf split every one of them. The queue holds burst + max(20 ms, RTT) of traffic —
about one bandwidth-delay product, as a WAN router buffer does — so one TCP flow keeps the link
full instead of losing throughput to tail drops, while queueing delay stays bounded.

Cleanup. Before creating anything, `up()` writes /run/cloudtrain-netem/<name>.json listing what it
will create; every namespace also matches `ct-<name>-(wan|r<N>)`, so `teardown(name)` and
`teardown(None)` (all emulators) find leftovers even when the state file is lost. Deleting the
namespaces deletes every interface in them; processes still inside are killed first (they were
started in our namespaces). The context manager, atexit and SIGTERM/SIGHUP clean up; after a
SIGKILL run `cloudtrain netem down --name NAME` (or `--all`).

Processes. `popen(rank, argv)` runs argv under `ip netns exec` and sets GLOO_SOCKET_IFNAME,
NCCL_SOCKET_IFNAME, TP_SOCKET_IFNAME and HOROVOD_GLOO_IFACE to eth0 (gloo otherwise resolves the
hostname, which names no address inside a namespace), MASTER_ADDR to rank 0's address and
CLOUDTRAIN_REGION to the rank's region, unless `env` sets them. Loopback is up in every rank
namespace, and every rank reaches every other rank's address.

    with Emulator(regions={"us": 2, "eu": 2}, mbit={"us": 1000, "eu": 50}, name="demo") as wan:
        p = wan.popen(0, [sys.executable, "train.py"], env={"RANK": "0", "WORLD_SIZE": "4"})
        wan.set_rate("eu", 20)       # bandwidth drops mid-run
        wan.counters()               # {"us": {"tx_bytes": ..., "rx_bytes": ...}, "eu": {...}}

    cloudtrain netem up --regions us:2,eu:2 --profile us-eu --name demo
    cloudtrain netem exec 0 --name demo -- python -c 'print(1)'
    cloudtrain netem rate --region eu --mbit 50 --name demo
    cloudtrain netem status --name demo [--json]
    cloudtrain netem down --name demo        # or: down --all
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "ct-"
"""Every namespace this module creates starts with this; `teardown` relies on it."""
STATE_DIR = Path("/run/cloudtrain-netem")
DEFAULT_NAME = "local"
SUBNET = "10.77.0.0/16"
RANK_IFNAME = "eth0"
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_REGION_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
_NS_RE = re.compile(r"ct-[a-z0-9][a-z0-9-]*-(?:wan|r\d+)")
RATE_ONLY = "rate only"
RATE_AND_DELAY = "rate and delay"


class EmulatorError(RuntimeError):
    """The emulator cannot be built, found or changed; the message says what to do."""


# ---------------------------------------------------------------------------------------------
# Link profiles (DESIGN.md, "Measuring on one machine")


@dataclass(frozen=True)
class LinkProfile:
    """A named inter-region link: single-flow rate and round-trip time."""

    mbit: float = 100.0
    """Rate in Mbit/s."""
    rtt_ms: float = 0.0
    """Round-trip time in ms; emulated only where the kernel has netem."""

    def __post_init__(self) -> None:
        if not (self.mbit > 0 and math.isfinite(self.mbit)):
            raise ValueError(f"rate must be a positive number of Mbit/s, got {self.mbit}")
        if not (self.rtt_ms >= 0 and math.isfinite(self.rtt_ms)):
            raise ValueError(f"rtt_ms must be >= 0, got {self.rtt_ms}")


PROFILES: dict[str, LinkProfile] = {
    "intra-zone": LinkProfile(5000, 0.2),
    "us-eu": LinkProfile(210, 103),
    "us-asia": LinkProfile(135, 157),
    "eu-asia": LinkProfile(76, 253),
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
    """`100` -> every region 100 Mbit/s; `us=1000,eu=50` -> per region (all must be given)."""
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
    rtt_ms: float = 0.0
    """Round-trip time between regions; applied only where the kernel has netem."""
    name: str = DEFAULT_NAME
    """Names the namespaces (ct-<name>-wan, ct-<name>-r<rank>) and the state file."""
    down_mbit: dict[str, float] | None = None
    """Rate of each region's WAN downlink where it differs from the uplink (asymmetric links)."""

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"bad name {self.name!r}: use 1-32 of a-z, 0-9, '-'")
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
        for region, rate in [*self.mbit.items(), *(self.down_mbit or {}).items()]:
            LinkProfile(rate, self.rtt_ms)  # validates both, with its messages
            if rate > 100_000:
                raise ValueError(f"region {region!r}: {rate} Mbit/s is beyond what tbf can shape")

    def down(self, region: str) -> float:
        """The region's downlink rate."""
        return (self.down_mbit or self.mbit)[region]


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


_AVAILABLE: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """(True, "") when this process can build an emulator, else (False, why). Cached."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _probe_available()
    return _AVAILABLE


def _probe_available() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, "the WAN emulator needs Linux network namespaces"
    if os.geteuid() != 0:
        return False, "the WAN emulator needs root (network namespaces, tc); run as root"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return False, f"`{tool}` not found: install iproute2"
    probe = f"{PREFIX}probe-{os.getpid()}-wan"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _batch("tc", probe, ["qdisc add dev p0 root tbf rate 1mbit burst 16kb limit 32kb"])
        _run(["ip", "-n", probe, "link", "add", "b0", "type", "bridge"])
    except (EmulatorError, OSError, subprocess.SubprocessError) as e:
        return False, f"network namespaces with veth, bridge and tbf are unusable here: {e}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
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
# Tear down (also without state)


def _state_path(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def leftovers(name: str | None = None) -> list[str]:
    """Namespaces of emulator `name` (every emulator when None) that exist now."""
    pattern = _NS_RE if name is None else re.compile(rf"{PREFIX}{re.escape(name)}-(wan|r\d+)")
    return [ns for ns in _namespaces() if pattern.fullmatch(ns)]


def _kill_inside(namespaces: Sequence[str]) -> None:
    pids = set()
    for ns in namespaces:
        out = _run(["ip", "netns", "pids", ns], check=False)
        pids.update(int(p) for p in out.split() if p.isdigit())
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
    """Remove emulator `name` (every emulator when None): its processes, namespaces, state file.

    Works from the state file and from the namespace names, so it also cleans up after a
    crash. Returns what was removed; removing nothing is not an error."""
    names = [name] if name is not None else sorted(p.stem for p in STATE_DIR.glob("*.json"))
    namespaces = set(leftovers(name))
    existing = set(_namespaces())
    for n in names:
        with contextlib.suppress(OSError, ValueError, KeyError):
            state = json.loads(_state_path(n).read_text())
            namespaces.update(ns for ns in state["namespaces"] if ns in existing)
    ordered = sorted(namespaces, key=lambda ns: ns.endswith("-wan"))  # ranks first, wan last
    _kill_inside(ordered)
    removed = []
    for ns in ordered:
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    for n in names:
        for path in [_state_path(n), *STATE_DIR.glob(f"{n}.tmp*")]:
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
        rtt_ms: float = 0.0,
        name: str = DEFAULT_NAME,
        down_mbit: float | Mapping[str, float] | None = None,
    ) -> None:
        def per_region(rate: float | Mapping[str, float]) -> dict[str, float]:
            rates = dict.fromkeys(regions, rate) if isinstance(rate, (int, float)) else rate
            return {r: float(v) for r, v in rates.items()}

        down = None if down_mbit is None else per_region(down_mbit)
        self.spec = WanSpec(dict(regions), per_region(mbit), rtt_ms, name, down)
        self.emulation: str | None = None
        """"rate only" or "rate and delay" once up; see `emulation_note` for why."""
        self.emulation_note = ""
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
            "version": 1,
            "name": self.name,
            "regions": list(self.spec.regions.items()),
            "mbit": self.spec.mbit,
            "down_mbit": self.spec.down_mbit,
            "rtt_ms": self.spec.rtt_ms,
            "emulation": self.emulation,
            "note": self.emulation_note,
            "namespaces": [self.wan_namespace, *map(self.namespace, range(self.world_size))],
            "addresses": [self.address(k) for k in range(self.world_size)],
            "pid": os.getpid(),
            "created": time.time(),
        }
        tmp = _state_path(self.name).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(_state_path(self.name))

    def _build(self) -> None:
        wan = self.wan_namespace
        no_ipv6 = {  # no router solicitations / DAD chatter crossing the shaped links
            "net.ipv6.conf.all.disable_ipv6": "1",
            "net.ipv6.conf.default.disable_ipv6": "1",
        }
        for ns in [wan, *map(self.namespace, range(self.world_size))]:
            _run(["ip", "netns", "add", ns])
            _sysctl(ns, no_ipv6)
        delay = self.spec.rtt_ms > 0 and _has_netem(wan)
        if self.spec.rtt_ms <= 0:
            self.emulation, self.emulation_note = RATE_ONLY, "no delay asked for"
        elif delay:
            self.emulation = RATE_AND_DELAY
            self.emulation_note = f"{self.spec.rtt_ms:g} ms RTT via netem"
        else:
            self.emulation = RATE_ONLY
            self.emulation_note = (
                f"kernel has no netem qdisc: {self.spec.rtt_ms:g} ms RTT is NOT emulated"
            )

        bridge = "type bridge stp_state 0 forward_delay 0"
        ip = ["link set lo up", f"link add core {bridge}", "link set core up"]
        tc = []
        for g, region in enumerate(self.spec.regions):
            ip += [
                f"link add br{g} {bridge}",
                f"link add up{g} type veth peer name dn{g}",
                f"link set up{g} master br{g}",
                f"link set dn{g} master core",
                f"link set br{g} up",
                f"link set up{g} up",
                f"link set dn{g} up",
            ]
            tc += self._qdisc_lines(g, self.spec.mbit[region], self.spec.down(region), delay)
        for rank in range(self.world_size):
            g = self._region_index(self.region(rank))
            ip += [
                f"link add r{rank} type veth peer name {RANK_IFNAME} netns {self.namespace(rank)}",
                f"link set r{rank} master br{g}",
                f"link set r{rank} up",
            ]
        _batch("ip", wan, ip)
        _batch("tc", wan, tc)
        for rank in range(self.world_size):
            _batch(
                "ip",
                self.namespace(rank),
                [
                    "link set lo up",
                    f"addr add {self.address(rank)}/16 dev {RANK_IFNAME}",
                    f"link set {RANK_IFNAME} up",
                ],
            )

    def _qdisc_lines(self, g: int, up: float, down: float, delay: bool) -> list[str]:
        """tc lines adding the qdiscs that shape region g: egress of up<g> is the region's uplink
        (towards the core), egress of dn<g> its downlink."""
        lines = []
        for dev, mbit in ((f"up{g}", up), (f"dn{g}", down)):
            p = tbf_params(mbit, self.spec.rtt_ms if delay else 0.0)
            tbf = f"tbf rate {p['rate']}bit burst {p['burst']} limit {p['limit']}"
            if delay and dev.startswith("up"):
                # netem first (root) and the shaper below it: the netem-wiki recipe. Its packet
                # limit must not drop before tbf does: room for twice the frames of one delay
                # plus a full tbf queue at this rate.
                one_way = self.spec.rtt_ms / 2
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
        delay = self.emulation == RATE_AND_DELAY
        # Delete and add, in one batch, rather than `tc qdisc change`: on this kernel a tbf
        # changed under a full queue was seen to stop dequeuing for good (packets sat in its
        # backlog, TCP backed off to a 60 s stall). A fresh qdisc drops what was queued, and TCP
        # retransmits it within one RTO.
        reset = [f"qdisc del dev {dev}{g} root" for dev in ("up", "dn")]
        lines = reset + self._qdisc_lines(g, float(mbit), down, delay)
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
            lines.append(
                f"  {region:<10} {self._rates(region):>13} Mbit/s  ranks {ranks[0]}-{ranks[-1]}"
                f"  {self.address(ranks[0])}..{self.address(ranks[-1])}"
                f"  WAN tx {c.get('tx_bytes', 0):,} B  rx {c.get('rx_bytes', 0):,} B"
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
    p.add_argument("--rtt-ms", type=float, help="round-trip time (needs kernel netem)")
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
    which.add_argument("--all", action="store_true", help="every emulator (ct-*-wan, ct-*-r<N>)")

    p = add("exec", "run a command inside a rank's namespace")
    p.add_argument("rank", type=int)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")

    p = add("measure", "TCP goodput between two ranks")
    p.add_argument("src", type=int)
    p.add_argument("dst", type=int)
    p.add_argument("--seconds", type=float, default=1.0)


def run(args: argparse.Namespace) -> int:
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
            rtt = profile.rtt_ms
        else:
            mbit, rtt = parse_mbit(args.mbit, list(regions)), 0.0
        rtt = args.rtt_ms if args.rtt_ms is not None else rtt
        down = parse_mbit(args.down_mbit, list(regions)) if args.down_mbit else None
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
    names = [args.name] if args.name else sorted(p.stem for p in STATE_DIR.glob("*.json"))
    report = []
    for name in names:
        wan = Emulator.attach(name)
        report.append(
            {
                "name": name,
                "emulation": wan.emulation,
                "note": wan.emulation_note,
                "rtt_ms": wan.spec.rtt_ms,
                "regions": {
                    r: {
                        "ranks": wan.ranks(r),
                        "addresses": [wan.address(k) for k in wan.ranks(r)],
                        "mbit": wan.spec.mbit[r],
                        "down_mbit": wan.spec.down(r),
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
