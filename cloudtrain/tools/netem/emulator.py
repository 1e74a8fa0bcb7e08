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

Hosts. Every rank namespace gets the TCP settings the Terraform's hosts boot with
(cloudtrain.tcp.WAN_TCP: buffer ceilings under which one connection is held back by the link,
not by its window, and BBR).

Processes. `popen(rank, argv)` runs argv under `ip netns exec` and sets GLOO_SOCKET_IFNAME,
NCCL_SOCKET_IFNAME, TP_SOCKET_IFNAME and HOROVOD_GLOO_IFACE to eth0 (gloo otherwise resolves the
hostname, which names no address inside a namespace), MASTER_ADDR to rank 0's address and
CLOUDTRAIN_REGION to the rank's region, unless `env` sets them. Loopback is up in every rank
namespace, and every rank reaches every other rank's address.

Cleanup (cleanup.py): the context manager, atexit and SIGTERM/SIGHUP tear it down; after a
SIGKILL run `cloudtrain netem down --name NAME` (or `--all`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ...tcp import WAN_TCP
from .cleanup import (
    TeardownAtExit,
    _state_path,
    add_namespace,
    claim_state,
    leftovers,
    relay_log,
    teardown,
    write_state,
)
from .delayline import (
    check_relay_capacity,
    describe_ceiling,
    relay_ceiling,
    start_relay,
    wait_ready,
)
from .host import (
    EmulatorError,
    _batch,
    _has_netem,
    _run,
    _sysctl,
    available,
    delay_line_available,
)
from .spec import (
    DEFAULT_NAME,
    DELAY_LINE,
    DELAY_NETEM,
    MTU,
    RANK_IFNAME,
    RATE_ONLY,
    WanSpec,
    rank_namespace,
    tbf_params,
    wan_namespace,
)

GOODPUT = f"{__package__}.goodput"
"""The module measure_mbit runs at both ends (by name: importing it here would run it twice)."""


TCP_NOTE = "; TCP settings the ranks lack"
"""Where the emulation's note says the ranks' namespaces miss TCP settings (Emulator._build)."""


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
        self.spec = WanSpec.of(regions, mbit, rtt_ms, name, down_mbit)
        self.emulation: str | None = None
        """RATE_ONLY, DELAY_NETEM or DELAY_LINE once up; see `emulation_note` for details."""
        self.emulation_note = ""
        self.relay: dict[str, float] | None = None
        """The delay line's measured ceiling (relay_ceiling), when it is in use."""
        self.relays: dict[str, int] = {}
        """Pid of the relay process of each delayed region link."""
        self._relay_procs: list[subprocess.Popen] = []
        self._rank_region = [(r, i) for r, n in self.spec.regions.items() for i in range(n)]
        self._exit_guard: TeardownAtExit | None = None
        """Tears this emulator down at exit and on SIGTERM/SIGHUP, while it is up and owned."""

    # -- names and addresses ----------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def world_size(self) -> int:
        return len(self._rank_region)

    @property
    def wan_namespace(self) -> str:
        return wan_namespace(self.name)

    def namespace(self, rank: int) -> str:
        """The network namespace rank `rank` runs in."""
        self._check_rank(rank)
        return rank_namespace(self.name, rank)

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
        if leftovers(self.name) or not claim_state(self.name):
            raise EmulatorError(
                f"an emulator named {self.name!r} exists already: "
                f"run `cloudtrain netem down --name {self.name}` or pick another name"
            )
        if not persist:
            self._exit_guard = TeardownAtExit(self.down)
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
        if self._exit_guard is not None:
            guard, self._exit_guard = self._exit_guard, None
            guard.release()

    def __enter__(self) -> Emulator:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @classmethod
    def attach(cls, name: str = DEFAULT_NAME) -> Emulator:
        """The emulator `name` that is up now (made by another process, e.g. the CLI)."""
        try:
            return cls._attach(name)
        except (KeyError, TypeError) as e:  # a state file of another form
            raise EmulatorError(
                f"emulator {name!r}: its state file {_state_path(name)} is not of this "
                f"release's form ({type(e).__name__}: {e}); `cloudtrain netem down --name "
                f"{name}` removes what is left of it"
            ) from None

    @classmethod
    def _attach(cls, name: str) -> Emulator:
        try:
            state = json.loads(_state_path(name).read_text())
        except FileNotFoundError:
            raise EmulatorError(
                f"no emulator named {name!r} is up: start one with `cloudtrain netem up`"
            ) from None
        except (OSError, ValueError) as e:  # e.g. an empty file a crash left
            raise EmulatorError(
                f"emulator {name!r}: its state file {_state_path(name)} is unreadable ({e}); "
                f"`cloudtrain netem down --name {name}` removes what is left of it"
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
        write_state(self.name, state)

    def _choose_emulation(self) -> None:
        delayed, rtt = self.spec.delayed_regions(), self.spec.describe_rtt()
        if not delayed:
            self.emulation, self.emulation_note = RATE_ONLY, "no delay asked for"
        elif _has_netem(self.wan_namespace):
            self.emulation, self.emulation_note = DELAY_NETEM, f"{rtt} via netem"
        elif delay_line_available():
            self.relay = relay_ceiling(max(map(self.spec.link_delay_ms, delayed)))
            for region in delayed:
                self._check_relay_capacity(region, self.spec.mbit[region], self.spec.down(region))
            self.emulation = DELAY_LINE
            self.emulation_note = self._relay_note()
        else:
            self.emulation = RATE_ONLY
            self.emulation_note = (
                f"kernel has no netem qdisc and no /dev/net/tun: {rtt} is NOT emulated"
            )

    def _relay_note(self) -> str:
        """The delay line's note: the RTT, and its ceiling beside the busiest delayed link."""
        delayed = self.spec.delayed_regions()
        busiest = max(self.spec.mbit[g] + self.spec.down(g) for g in delayed)
        return f"{self.spec.describe_rtt()}; {describe_ceiling(self.relay, busiest)}"

    def _check_relay_capacity(self, region: str, up: float, down: float) -> None:
        if self.relay is not None and self.spec.link_delay_ms(region) > 0:
            check_relay_capacity(self.relay, region, up, down)

    def _build(self) -> None:
        wan = self.wan_namespace
        for ns in [wan, *map(self.namespace, range(self.world_size))]:
            add_namespace(ns, self.name)
        self._choose_emulation()
        _batch("ip", wan, _wiring_lines(self.spec, delay_line=self.emulation == DELAY_LINE))
        if self.emulation == DELAY_LINE:
            self._start_relays()
        regions = range(len(self.spec.regions))
        _batch(
            "tc", wan, [ln for g in regions for ln in _qdisc_lines(self.spec, self.emulation, g)]
        )
        missed: set[str] = set()
        for rank in range(self.world_size):
            address = [f"addr add {self.address(rank)}/16 dev {RANK_IFNAME}"]
            _batch("ip", self.namespace(rank), [*address, f"link set {RANK_IFNAME} up"])
            missed.update(_sysctl(self.namespace(rank), WAN_TCP))  # as the Terraform's hosts boot
        if missed:  # the emulator still works; its links may read slower than asked
            self.emulation_note += (
                f"{TCP_NOTE} ({'; '.join(sorted(missed))}): a connection "
                "may be held back by its own window or congestion control, not by the link"
            )

    def _start_relays(self) -> None:
        for g, region in enumerate(self.spec.regions):
            delay = self.spec.link_delay_ms(region)
            if delay <= 0:
                continue
            log = relay_log(self.name, g)
            proc = start_relay(self.wan_namespace, self.name, g, delay, log)
            self._relay_procs.append(proc)
            self.relays[region] = proc.pid
            self._write_state()  # before waiting: a crash from here on leaves its pid on record
            wait_ready(proc, region, log)

    # -- live control -------------------------------------------------------------------------

    def set_rate(self, region: str, mbit: float, down_mbit: float | None = None) -> None:
        """Change region's uplink rate now, and its downlink to down_mbit (default: the same);
        existing flows feel it at once."""
        g = self._region_index(region)
        spec = self.spec.with_rate(region, mbit, down_mbit)
        if self.emulation == DELAY_LINE:
            self._check_relay_capacity(region, spec.mbit[region], spec.down(region))
        # Delete and add, in one batch, rather than `tc qdisc change`: on this kernel a tbf
        # changed under a full queue was seen to stop dequeuing for good (packets sat in its
        # backlog, TCP backed off to a 60 s stall). A fresh qdisc drops what was queued, and TCP
        # retransmits it within one RTO.
        reset = [f"qdisc del dev {dev}{g} root" for dev in ("up", "dn")]
        _batch("tc", self.wan_namespace, reset + _qdisc_lines(spec, self.emulation, g))
        self.spec = spec
        if self.emulation == DELAY_LINE and self.relay is not None:
            # the busiest link may have changed; what follows it (the TCP settings) stays
            _, sep, tcp = self.emulation_note.partition(TCP_NOTE)
            self.emulation_note = self._relay_note() + sep + tcp
        self._write_state()

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes/packets that left (tx) and entered (rx) each region over its shaped WAN link.

        Read from the kernel's counters of `up<g>` (L2 frames, headers included): the truth,
        whatever the framework reports."""
        out = _run(["ip", "-n", self.wan_namespace, "-s", "-j", "link", "show"])
        links = {link["ifname"]: link["stats64"] for link in json.loads(out)}
        return {r: _traffic(links[f"up{g}"]) for g, r in enumerate(self.spec.regions)}

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

    def measure_mbit(
        self, src: int, dst: int, seconds: float = 1.0, port: int = 5201, skip_s: float = 0.0
    ) -> float:
        """TCP goodput from rank src to rank dst over `seconds`, Mbit/s, measured at dst (the
        first `skip_s` of them left out)."""
        return self.measure_flows([(src, dst)], seconds, port, skip_s)[0]

    def measure_flows(
        self,
        pairs: Sequence[tuple[int, int]],
        seconds: float = 1.0,
        port: int = 5201,
        skip_s: float = 0.0,
    ) -> list[float]:
        """TCP goodput of one flow per (src, dst) pair, all at once for `seconds`, Mbit/s each,
        measured at each dst from its first byte, or `skip_s` after it (a flow's start left out;
        less than `seconds`). Pair k listens on port + k. The senders start one after another, a
        process launch apart (tens of ms against flows of seconds)."""
        if not 0 <= skip_s < seconds:
            raise ValueError(f"skip_s={skip_s}: leave out less than the flow's {seconds} s")
        procs: list[subprocess.Popen] = []
        try:
            receivers = []
            for k, (_, dst) in enumerate(pairs):
                argv = [sys.executable, "-m", GOODPUT, "receive", self.address(dst), str(port + k),
                        str(skip_s)]  # fmt: skip
                receivers.append(self.popen(dst, argv, stdout=subprocess.PIPE, text=True))
                procs.append(receivers[-1])
            for recv, (_, dst) in zip(receivers, pairs, strict=True):
                assert recv.stdout is not None
                if recv.stdout.readline().strip() != "ready":
                    raise EmulatorError(f"receiver in rank {dst} did not start")
            for k, (src, dst) in enumerate(pairs):
                args = [self.address(dst), str(port + k), str(seconds)]
                procs.append(self.popen(src, [sys.executable, "-m", GOODPUT, "send", *args]))
            rates = []
            for recv, (src, dst) in zip(receivers, pairs, strict=True):
                out, _ = recv.communicate(timeout=seconds + 60)
                try:
                    nbytes, elapsed = out.split()
                    rates.append(int(nbytes) * 8 / float(elapsed) / 1e6)
                except ValueError:
                    raise EmulatorError(
                        f"the flow from rank {src} to rank {dst} carried nothing (receiver said "
                        f"{out.strip()!r}, exit code {recv.returncode})"
                    ) from None
            return rates
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()

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
                f"  {region:<10} {self.spec.describe_rates(region):>13} Mbit/s  {delay:g} ms each way"
                f"  ranks {ranks[0]}-{ranks[-1]}"
                f"  {self.address(ranks[0])}..{self.address(ranks[-1])}"
                f"  WAN tx {c.get('tx_bytes', 0):,} B  rx {c.get('rx_bytes', 0):,} B"
                + (f"  relay pid {self.relays[region]}" if region in self.relays else "")
            )
        return "\n".join(lines)


def _traffic(stats64: Mapping[str, Any]) -> dict[str, int]:
    """What `counters` reports of one link, from its `stats64` in `ip -s -j link show`."""
    return {
        "tx_bytes": stats64["tx"]["bytes"],
        "rx_bytes": stats64["rx"]["bytes"],
        "tx_packets": stats64["tx"]["packets"],
        "rx_packets": stats64["rx"]["packets"],
    }


def _wiring_lines(spec: WanSpec, *, delay_line: bool) -> list[str]:
    """ip lines, run in the wan namespace, that make the topology of the module docstring: the
    core bridge, each region's bridge and its link up<g>/dn<g> to the core (two TAPs for the
    relay where `delay_line` delays it, else a veth pair), and each rank's veth into its own
    namespace (`eth0` there), all with jumbo frames."""
    bridge = f"mtu {MTU} type bridge stp_state 0 forward_delay 0"
    lines = [f"link add core {bridge}", "link set core up"]
    for g, region in enumerate(spec.regions):
        if delay_line and spec.link_delay_ms(region) > 0:
            link = [f"tuntap add dev up{g} mode tap", f"tuntap add dev dn{g} mode tap"]
            link += [f"link set up{g} mtu {MTU}", f"link set dn{g} mtu {MTU}"]
        else:
            link = [f"link add up{g} mtu {MTU} type veth peer name dn{g} mtu {MTU}"]
        lines += [
            f"link add br{g} {bridge}",
            *link,
            f"link set up{g} master br{g}",
            f"link set dn{g} master core",
            f"link set br{g} up",
            f"link set up{g} up",
            f"link set dn{g} up",
        ]
    region_of_rank = [g for g, n in enumerate(spec.regions.values()) for _ in range(n)]
    for rank, g in enumerate(region_of_rank):
        lines += [
            f"link add r{rank} mtu {MTU} type veth peer name {RANK_IFNAME} mtu {MTU} "
            f"netns {rank_namespace(spec.name, rank)}",
            f"link set r{rank} master br{g}",
            f"link set r{rank} up",
        ]
    return lines


def _qdisc_lines(spec: WanSpec, emulation: str | None, g: int) -> list[str]:
    """tc lines adding the qdiscs that shape region g at spec's rates: egress of up<g> is the
    region's uplink (towards the core), egress of dn<g> its downlink; under DELAY_NETEM a netem
    qdisc above each tbf adds the link's delay."""
    region = list(spec.regions)[g]
    one_way = spec.link_delay_ms(region)
    netem = emulation == DELAY_NETEM and one_way > 0
    lines = []
    for dev, mbit in ((f"up{g}", spec.mbit[region]), (f"dn{g}", spec.down(region))):
        p = tbf_params(mbit, spec.max_rtt_ms if emulation != RATE_ONLY else 0.0)
        tbf = f"tbf rate {p['rate']}bit burst {p['burst']} limit {p['limit']}"
        if netem:
            # netem first (root) and the shaper below it: the netem-wiki recipe. Its packet
            # limit must not drop before tbf does: room for twice the frames of one delay
            # plus a full tbf queue at this rate.
            pkts = max(1000, int(2 * (p["rate"] / 8 * one_way / 1000 + p["limit"]) / 1500))
            lines.append(f"qdisc add dev {dev} root handle 1: netem delay {one_way}ms limit {pkts}")
            lines.append(f"qdisc add dev {dev} parent 1:1 handle 10: {tbf}")
        else:
            lines.append(f"qdisc add dev {dev} root handle 10: {tbf}")
    return lines
