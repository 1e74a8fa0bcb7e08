"""`Emulator`: one emulated multi-region cluster on this machine, built, changed and removed.

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

Delay. A region link holds every frame for its one-way delay (a quarter of the region's RTT
share, spec.py), both directions. How the delay is applied, in order of preference:

- `netem` where the kernel has it: the link is a veth pair, each end `netem delay s_g/4` as root
  qdisc with the tbf below it. `emulation` says "rate + delay (netem)".
- otherwise a userspace delay line (delayline.py): the link is two TAP devices and a relay
  process between them; tbf on the TAPs shapes the rate as on veths. `emulation` says
  "rate + delay (userspace delay line)"; `relay` holds one relay's ceiling measured before the
  relays start, `emulation_note` reports it, and a link whose up + down rate needs more than
  RELAY_HEADROOM of it is refused.
- neither (no netem, no /dev/net/tun): `emulation` says "rate only" and the note says the delay
  is NOT emulated — always read it before quoting results as latency-emulated.

Processes. `popen(rank, argv)` runs argv under `ip netns exec` and sets GLOO_SOCKET_IFNAME,
NCCL_SOCKET_IFNAME, TP_SOCKET_IFNAME and HOROVOD_GLOO_IFACE to eth0 (gloo otherwise resolves the
hostname, which names no address inside a namespace), MASTER_ADDR to rank 0's address and
CLOUDTRAIN_REGION to the rank's region, unless `env` sets them. Loopback is up in every rank
namespace, and every rank reaches every other rank's address.

Cleanup (cleanup.py): the context manager, atexit and SIGTERM/SIGHUP tear it down; after a
SIGKILL run `cloudtrain netem down --name NAME` (or `--all`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .cleanup import STATE_DIR, _state_path, leftovers, teardown
from .delayline import RELAY_HEADROOM, relay_ceiling
from .host import EmulatorError, _batch, _has_netem, _run, _sysctl, available, delay_line_available
from .spec import (
    DEFAULT_NAME,
    DELAY_LINE,
    DELAY_NETEM,
    MARKER,
    MTU,
    PREFIX,
    RANK_IFNAME,
    RATE_ONLY,
    WanSpec,
    tbf_params,
)

GOODPUT = f"{__package__}.goodput"
"""The module measure_mbit runs at both ends (by name: importing it here would run it twice)."""


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
            [sys.executable, "-m", GOODPUT, "receive", self.address(dst), str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs = [recv]
        try:
            assert recv.stdout is not None
            if recv.stdout.readline().strip() != "ready":
                raise EmulatorError(f"receiver in rank {dst} did not start")
            args = [self.address(dst), str(port), str(seconds)]
            procs.append(self.popen(src, [sys.executable, "-m", GOODPUT, "send", *args]))
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
