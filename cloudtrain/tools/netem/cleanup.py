"""Finding and removing what an emulator made, also after a crash: its state file, namespaces
and processes.

Before creating anything, `Emulator.up()` writes /run/cloudtrain-netem/<name>.json listing what it
will create (namespaces, later the relays' pids). Every namespace it creates is named
`ct-<name>-(wan|r<N>)` and carries a marker (the alias `cloudtrain-netem:<name>` on its loopback),
so `teardown(name)` and `teardown(None)` (every emulator) find leftovers even when the state file
is lost, and never touch a namespace this package did not create, whatever its name. Relays are
found by their command line (which names their emulator; the state file records their pids too)
and killed first, with every other process started in our namespaces: a process left inside
would keep a deleted namespace alive. Deleting the namespaces deletes every interface in them.

The write side lives here too: `add_namespace` sets the marker that `leftovers` reads,
`claim_state`/`write_state` the file `teardown` reads, `relay_log` names the logs it removes.
`TeardownAtExit` tears an emulator down at exit and on SIGTERM/SIGHUP; after a SIGKILL run
`cloudtrain netem down --name NAME` (or `--all`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .delayline import RELAY_MODULE
from .host import _batch, _run, _sysctl
from .spec import _NAME_RE, _NS_RE, MARKER, check_name

STATE_DIR = Path("/run/cloudtrain-netem")
_NO_IPV6 = {  # no router solicitations / DAD chatter crossing the shaped links
    "net.ipv6.conf.all.disable_ipv6": "1",
    "net.ipv6.conf.default.disable_ipv6": "1",
}


def add_namespace(ns: str, name: str) -> None:
    """Create namespace `ns` for emulator `name`, carrying the marker `_marker_of` reads, with
    its loopback up and IPv6 off."""
    _run(["ip", "netns", "add", ns])
    _batch("ip", ns, [f"link set lo alias {MARKER}:{name}", "link set lo up"])
    _sysctl(ns, _NO_IPV6)


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


def _state_path(name: str) -> Path:
    return STATE_DIR / f"{check_name(name)}.json"


def _state_names() -> list[str]:
    return sorted(p.stem for p in STATE_DIR.glob("*.json") if _NAME_RE.fullmatch(p.stem))


def relay_log(name: str, link: int | str) -> Path:
    """Where the relay of emulator name's link `link` writes its stderr (`*`: a glob of all)."""
    return STATE_DIR / f"{name}.relay-{link}.log"


def claim_state(name: str) -> bool:
    """Create emulator name's state file, empty, unless it exists: of two processes racing for
    the name, one gets False."""
    STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        _state_path(name).open("x").close()
    except FileExistsError:
        return False
    return True


def write_state(name: str, state: Mapping[str, Any]) -> None:
    """Replace emulator name's state file with `state`, at once (a reader never sees half)."""
    tmp = _state_path(name).with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(_state_path(name))


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
            if RELAY_MODULE.encode() in argv and b"relay" in argv:
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
        extra = [*STATE_DIR.glob(f"{n}.tmp*"), *STATE_DIR.glob(relay_log(n, "*").name)]
        for path in [_state_path(n), *extra]:
            if path.exists():
                path.unlink(missing_ok=True)
                removed.append(str(path))
    return removed


class TeardownAtExit:
    """Calls `down` at interpreter exit and on SIGTERM/SIGHUP until `release()`: an emulator
    owned by a process goes with it (after a SIGKILL, `teardown` finds what is left)."""

    def __init__(self, down: Callable[[], None]) -> None:
        self.down = down
        self._old_handlers: dict[int, Any] = {}
        atexit.register(down)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._old_handlers[sig] = signal.signal(sig, _exit_on_signal)

    def release(self) -> None:
        atexit.unregister(self.down)
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._old_handlers.clear()


def _exit_on_signal(signum: int, frame: object) -> None:
    # Unwinds `with` blocks (which call down) and runs atexit; exit status as if killed.
    raise SystemExit(128 + signum)
