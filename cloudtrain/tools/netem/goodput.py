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
    received and the seconds they took, leaving out the first `skip` seconds (the flow's start).

    The clock starts at a read, `skip` or more after the first byte, that emptied the socket
    (it returned less than asked): the bytes that read and the reads before it took arrived
    before the clock, counted they would be a backlog read at once (a busy reader's socket holds
    megabytes)."""
    srv = socket.create_server((host, port))
    srv.settimeout(30)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    n, first, t0 = 0, None, None
    while k := conn.recv_into(buf):
        now = time.monotonic()
        if t0 is not None:
            n += k
            continue
        first = now if first is None else first
        if now >= first + skip and k < len(buf):
            t0 = now
    if t0 is None:
        print("the flow ended before its clock started")
    else:
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
