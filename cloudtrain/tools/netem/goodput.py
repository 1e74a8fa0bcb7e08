"""The two ends of `Emulator.measure_mbit`: a TCP receiver and a sender, each run inside a rank's
namespace as its own process.

    python -m cloudtrain.tools.netem.goodput receive HOST PORT [SKIP]  # "ready", "BYTES SECONDS"
    python -m cloudtrain.tools.netem.goodput send HOST PORT SECONDS
"""

from __future__ import annotations

import socket
import sys
import time


def receive(host: str, port: int, skip: float = 0.0) -> None:
    """Listen on host:port, say "ready", take one connection to its end and print the bytes
    received and the seconds they took, leaving out the first `skip` seconds (the flow's start)."""
    srv = socket.create_server((host, port))
    srv.settimeout(30)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    n, t0 = 0, None
    while k := conn.recv_into(buf):
        now = time.monotonic()
        if t0 is None:
            t0 = now + skip  # the clock starts at the first byte, and after `skip` from there
        elif now > t0:
            n += k
    print(n, time.monotonic() - t0)


def send(host: str, port: int, seconds: float) -> None:
    """Connect to host:port and send as fast as the link takes for `seconds`."""
    sock = socket.create_connection((host, port))
    chunk = bytes(256 << 10)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock.sendall(chunk)
    sock.close()


if __name__ == "__main__":
    what, host, port, *rest = sys.argv[1:]
    if what == "receive" and len(rest) <= 1:
        receive(host, int(port), *map(float, rest))
    elif what == "send" and len(rest) == 1:
        send(host, int(port), float(rest[0]))
    else:
        sys.exit(__doc__)
