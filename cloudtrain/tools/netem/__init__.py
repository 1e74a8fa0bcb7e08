"""Local WAN emulator: a multi-region cluster on one Linux machine (needs root).

Every rank runs in its own network namespace; the ranks of a region share a bridge, and each
region reaches the others through one link shaped with tbf at the region's rate and delayed by
its share of the RTT (netem, or a userspace delay line where the kernel has no netem). Nothing
of the host's own network is touched, and everything is removed again, also after a crash.

    with Emulator(regions={"us": 2, "eu": 2}, mbit=100, rtt_ms=80, name="demo") as wan:
        p = wan.popen(0, [sys.executable, "train.py"], env={"RANK": "0", "WORLD_SIZE": "4"})
        wan.set_rate("eu", 20)       # bandwidth drops mid-run
        wan.counters()               # {"us": {"tx_bytes": ..., "rx_bytes": ...}, "eu": {...}}

    cloudtrain netem up --regions us:2,eu:2 --profile us-eu --name demo   # 210 Mbit/s, 80 ms
    cloudtrain netem down --name demo        # or: down --all

Where each part lives:

- spec.py: what to emulate — names, link profiles, `WanSpec`, the RTT shares, tbf's parameters;
- host.py: running ip/tc, and what this machine offers (`available`, netem, TAP devices);
- emulator.py: `Emulator`, the topology it builds and how delay is applied;
- delayline.py: the userspace delay line (`DelayLine`, the relay process, `relay_ceiling`);
- cleanup.py: the state file, finding leftovers and relays, `teardown`;
- cli.py: `cloudtrain netem up|down|rate|status|exec|measure`;
- goodput.py, __main__.py: the processes the emulator starts (measure_mbit's two ends, relays).
"""

from .cleanup import STATE_DIR, leftovers, relay_processes, teardown
from .cli import configure, run
from .delayline import RELAY_HEADROOM, DelayLine, relay_ceiling
from .emulator import Emulator
from .host import EmulatorError, available, delay_line_available
from .spec import (
    DEFAULT_NAME,
    DELAY_LINE,
    DELAY_NETEM,
    MARKER,
    MTU,
    PREFIX,
    PROFILES,
    RANK_IFNAME,
    RATE_ONLY,
    SUBNET,
    LinkProfile,
    WanSpec,
    check_name,
    link_profile,
    parse_mbit,
    parse_regions,
    tbf_params,
)

__all__ = [
    "DEFAULT_NAME",
    "DELAY_LINE",
    "DELAY_NETEM",
    "MARKER",
    "MTU",
    "PREFIX",
    "PROFILES",
    "RANK_IFNAME",
    "RATE_ONLY",
    "RELAY_HEADROOM",
    "STATE_DIR",
    "SUBNET",
    "DelayLine",
    "Emulator",
    "EmulatorError",
    "LinkProfile",
    "WanSpec",
    "available",
    "check_name",
    "configure",
    "delay_line_available",
    "leftovers",
    "link_profile",
    "parse_mbit",
    "parse_regions",
    "relay_ceiling",
    "relay_processes",
    "run",
    "tbf_params",
    "teardown",
]
