"""The userspace delay line: what holds frames for their one-way delay where the kernel has no
netem qdisc.

A delayed region link is then two TAP devices, `up<g>` on the region bridge and `dn<g>` on the
core bridge, and a relay process (`python -m cloudtrain.tools.netem relay`, one per delayed link,
started in the wan namespace) reads each frame from one TAP, holds it in a queue ordered by due
time and writes it to the other (`DelayLine`); tbf on the TAPs shapes the rate as on veths.

Before the relays start, the emulator measures what one relay can move (frames/s and Mbit/s at
9000-byte frames, CPU per frame; `relay_ceiling`) and refuses a link whose up + down rate needs
more than RELAY_HEADROOM of that: the kernel's bridging and TCP receive work for a frame the
relay writes also runs on the relay's CPU, which the ceiling does not include.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import math
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .host import EmulatorError
from .spec import MTU

RELAY_MODULE = "cloudtrain.tools.netem"
"""What a relay runs as (`python -m`; __main__.py): `relay_processes` finds relays by it."""
RELAY_HEADROOM = 0.5
"""Share of the measured relay ceiling a link's up + down rate may use (see the docstring)."""
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
    cmd = [sys.executable, "-m", RELAY_MODULE, "relay-ceiling",
           "--delay-ms", f"{delay_ms}", "--seconds", f"{seconds}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise EmulatorError(f"measuring the delay line's ceiling failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def describe_ceiling(ceiling: dict[str, float], busiest_mbit: float) -> str:
    """The measured `ceiling` in words, and what share of a core the busiest link's relay needs
    at `busiest_mbit` (its up + down rate)."""
    r = ceiling
    cpu = busiest_mbit * 1e6 / 8 / r["frame_bytes"] * r["us_cpu_per_frame"] / 1e6
    return (
        f"relay ceiling {r['mbit']:.0f} Mbit/s ({r['frames_per_s']:.0f} frames/s "
        f"of {r['frame_bytes']:.0f} B, {r['us_cpu_per_frame']:.1f} us CPU per frame, "
        f"measured at {r['delay_ms']:g} ms delay); the busiest link, {busiest_mbit:g} Mbit/s "
        f"up + down, needs {cpu:.0%} of a core in its relay at full rate"
    )


def check_relay_capacity(ceiling: dict[str, float], region: str, up: float, down: float) -> None:
    """EmulatorError unless region's relay can carry `up` + `down` Mbit/s: RELAY_HEADROOM of the
    measured `ceiling` at most."""
    limit = RELAY_HEADROOM * ceiling["mbit"]
    if up + down > limit:
        raise EmulatorError(
            f"region {region!r}: {up:g} Mbit/s up + {down:g} down through its delay relay is "
            f"more than {limit:.0f} Mbit/s ({RELAY_HEADROOM:.0%} of the "
            f"{ceiling['mbit']:.0f} Mbit/s one relay moved on this machine when the "
            "emulator came up): lower the rate, or ask for no delay on that region's link"
        )


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


def start_relay(
    namespace: str, name: str, link: int, delay_ms: float, log: Path
) -> subprocess.Popen:
    """Start the relay of link `link` of emulator `name` inside `namespace`, its stderr to `log`;
    `wait_ready` waits for it. `ip netns exec` execs the relay: the pid is the relay's."""
    argv = [sys.executable, "-m", RELAY_MODULE, "relay", f"--name={name}", f"--link={link}",
            f"--delay-ms={delay_ms}"]  # fmt: skip
    with log.open("w") as err:
        return subprocess.Popen(
            ["ip", "netns", "exec", namespace, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,  # its owner stops it; a terminal's signals must not
        )


def wait_ready(relay: subprocess.Popen, region: str, log: Path) -> None:
    """Return once `relay` (of region's link) says it is ready; EmulatorError with its log if it
    ends first."""
    assert relay.stdout is not None
    if relay.stdout.readline().strip() != "ready":
        relay.wait(timeout=10)
        raise EmulatorError(
            f"the delay relay of region {region!r} did not start: {log.read_text()[-2000:]}"
        )
    relay.stdout.close()


def relay_main(name: str, link: int, delay_ms: float) -> int:
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
