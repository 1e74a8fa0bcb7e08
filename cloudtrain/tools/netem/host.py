"""The machine the emulator runs on: running `ip`/`tc`, and what the kernel offers.

`available()` says whether this process can build an emulator at all (root, iproute2, network
namespaces with veth, bridges and tbf); `delay_line_available()` whether TAP devices exist for
the userspace delay line; `_has_netem(ns)` whether the kernel has the netem qdisc. `_run` and
`_batch` run ip/tc and turn a failure into `EmulatorError` with the tool's own message;
`_sysctl` changes a setting inside one namespace, never the host's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from .spec import PREFIX


class EmulatorError(RuntimeError):
    """The emulator cannot be built, found or changed; the message says what to do."""


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


def _sysctl(ns: str, settings: Mapping[str, str]) -> list[str]:
    """Set `settings` inside netns `ns` (/proc/sys/net is per namespace: never the host's), as
    far as its kernel takes them; the keys that do not read back as asked ("key: why")."""
    if not shutil.which("sysctl"):
        return [f"{key}: no `sysctl` here (install procps)" for key in settings]
    args = [f"{k}={v}" for k, v in settings.items()]
    _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *args], check=False)
    lines = _run(["ip", "netns", "exec", ns, "sysctl", *settings], check=False).splitlines()
    seen = dict(line.partition(" = ")[::2] for line in lines)  # "key = value" per line
    return [
        f"{key}: asked {value!r}, has {seen.get(key, 'nothing')!r}"
        for key, value in settings.items()
        if seen.get(key, "").split() != value.split()
    ]


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
