"""What to emulate: the emulator's names, the link profiles, `WanSpec`, and the tbf arithmetic.

Pure: nothing here touches the machine. `WanSpec` is the validated description an `Emulator` is
built from (ranks per region, each region's rates, the RTT shares); `parse_regions`/`parse_mbit`
read the command line's forms of it, `link_profile` the named links of docs/design.md.

Delay. Region g has an RTT share s_g (`rtt_ms`: one number for every region, or one per region);
its link delays each frame s_g/4 each way, so a frame from region a to region b waits
s_a/4 + s_b/4 and the round trip between a and b is (s_a + s_b) / 2 — with one number R, every
pair of regions has RTT R. (Three regions with RTTs 80/180/230 ms for us-eu/us-asia/eu-asia are
shares 30/130/330.) Ranks of one region see no added delay.

tbf parameters (`tbf_params`): the rate is the Ethernet-frame rate (tbf counts the 14-byte L2
header, so TCP goodput is about 99% of it at a 9000-byte MTU). The bucket holds max(64 KiB, 1 ms
of traffic): veth hands tbf 64 KiB GSO super-packets, and a smaller bucket would make tbf split
every one of them. The queue holds burst + max(20 ms, RTT) of traffic — about one
bandwidth-delay product, as a WAN router buffer does — so one TCP flow keeps the link full
instead of losing throughput to tail drops, while queueing delay stays bounded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PREFIX = "ct-"
"""Every namespace the emulator creates starts with this (and carries MARKER)."""
MARKER = "cloudtrain-netem"
"""Alias set on the loopback of every namespace we create, followed by ':<name>'."""
DEFAULT_NAME = "local"
SUBNET = "10.77.0.0/16"
RANK_IFNAME = "eth0"
MTU = 9000
"""Jumbo frames inside the emulated network: the delay line handles 6x fewer frames than at 1500."""
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_REGION_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
_NS_RE = re.compile(r"ct-([a-z0-9][a-z0-9-]*)-(?:wan|r\d+)")
RATE_ONLY = "rate only"
DELAY_NETEM = "rate + delay (netem)"
DELAY_LINE = "rate + delay (userspace delay line)"


def wan_namespace(name: str) -> str:
    """The namespace of emulator `name` that holds every bridge and shaped link."""
    return f"{PREFIX}{name}-wan"


def rank_namespace(name: str, rank: int) -> str:
    """The namespace rank `rank` of emulator `name` runs in."""
    return f"{PREFIX}{name}-r{rank}"


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
        region = region.strip()
        if not sep or not count.strip().isdigit():
            raise ValueError(f"bad region {part!r}: write REGION:RANKS, e.g. us:2,eu:2")
        if region in regions:
            raise ValueError(f"region {region!r} is given twice in {text!r}")
        regions[region] = int(count)
    if not regions:
        raise ValueError("no regions given: write e.g. us:2,eu:2")
    return regions


def parse_mbit(text: str, regions: Sequence[str]) -> dict[str, float]:
    """`100` -> every region 100; `us=1000,eu=50` -> per region (all must be given). Also for
    per-region RTT shares (`--rtt-ms us=30,eu=130`)."""
    if "=" not in text:
        return dict.fromkeys(regions, _number(text, text))
    rates = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        region, _, value = part.partition("=")
        rates[region.strip()] = _number(value, text)
    return rates


def _number(value: str, text: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(
            f"{text!r}: {value.strip()!r} is not a number; give one for every region (100) or "
            "one per region (us=1000,eu=50), without units"
        ) from None


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

    @classmethod
    def of(
        cls,
        regions: Mapping[str, int],
        mbit: float | Mapping[str, float],
        rtt_ms: float | Mapping[str, float] = 0.0,
        name: str = DEFAULT_NAME,
        down_mbit: float | Mapping[str, float] | None = None,
    ) -> WanSpec:
        """The spec of the arguments `Emulator` takes: each rate and the RTT either one number for
        every region or one per region."""

        def per_region(rate: float | Mapping[str, float]) -> dict[str, float]:
            rates = dict.fromkeys(regions, rate) if isinstance(rate, (int, float)) else rate
            return {r: float(v) for r, v in rates.items()}

        down = None if down_mbit is None else per_region(down_mbit)
        rtt = float(rtt_ms) if isinstance(rtt_ms, (int, float)) else per_region(rtt_ms)
        return cls(dict(regions), per_region(mbit), rtt, name, down)

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

    def delayed_regions(self) -> list[str]:
        """The regions whose link adds delay (a share above 0)."""
        return [r for r in self.regions if self.link_delay_ms(r) > 0]

    def describe_rtt(self) -> str:
        """The RTTs between regions in words: one figure when every pair has the same."""
        shares = {self.share(r) for r in self.regions}
        if len(shares) == 1:
            return f"{shares.pop():g} ms RTT between regions"
        regions = list(self.regions)
        pairs = [(a, b) for i, a in enumerate(regions) for b in regions[i + 1 :]]
        return "RTT " + ", ".join(f"{a}-{b} {self.pair_rtt_ms(a, b):g} ms" for a, b in pairs)

    def describe_rates(self, region: str) -> str:
        """Region's rates in Mbit/s in words: one figure when uplink and downlink are the same."""
        up, down = self.mbit[region], self.down(region)
        return f"{up:g}" if up == down else f"{up:g} up/{down:g} dn"

    def with_rate(self, region: str, mbit: float, down_mbit: float | None = None) -> WanSpec:
        """This spec with region's uplink at `mbit` and its downlink at `down_mbit` (default: the
        same); down_mbit stays None while every region's links are symmetric."""
        down = float(mbit if down_mbit is None else down_mbit)
        rates = {**self.mbit, region: float(mbit)}
        downs = None
        if self.down_mbit is not None or down != float(mbit):
            downs = {r: self.down(r) for r in self.regions} | {region: down}
        return WanSpec(dict(self.regions), rates, self.rtt_ms, self.name, downs)


def tbf_params(mbit: float, rtt_ms: float = 0.0) -> dict[str, int]:
    """tbf rate (bit/s), burst and limit (bytes) for one shaped link; see the module docstring."""
    rate = int(mbit * 1e6)
    burst = max(64 * 1024, rate // 8 // 1000)
    limit = burst + int(rate / 8 * max(0.020, rtt_ms / 1000))
    return {"rate": rate, "burst": burst, "limit": limit}
