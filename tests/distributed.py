"""Run a function on N real processes joined by torch.distributed over gloo on loopback.

    results = run_ranks(2, worker, arg1, arg2, env={0: {...}, 1: {...}}, timeout=120)

`worker(rank, world_size, *args)` runs in a fresh (spawned) process with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, so `cloudtrain.init()` joins the group; its return value comes
back. An exception in any rank fails the call with that rank's traceback, and so does a rank that
dies without a word or does not finish within `timeout` seconds (every process is killed, none
left). With allow_failures, failed ranks give a RankFailed in their place instead.

And a script on the ranks of the emulated WAN (cloudtrain.tools.netem: each rank in its region's
network namespace; root only), run_over_wan's being 2 regions of 2:

    reports = run_over_wan("zs", SCRIPT, 29532, mbit=20)   # each rank's last stdout line, as JSON
    procs = spawn_in_regions(wan, SCRIPT, port, stdin=subprocess.PIPE)   # on an Emulator of yours
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cloudtrain.tools.netem import Emulator


class RankFailed(AssertionError):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"rank {rank} failed:\n{text}")
        self.rank = rank
        self.text = text


def free_port() -> int:
    """A TCP port nothing listens on now, outside the ephemeral range (chaos.free_ports)."""
    from cloudtrain.tools.chaos import free_ports

    return free_ports(1)[0]


def _child(fn, rank, world, port, env, args, results) -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)  # a native crash prints every thread's stack
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    )
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        out = fn(rank, world, *args)
        # as bytes: a tensor sent as is travels as a file descriptor, which is gone once this
        # process exits - possibly before the parent has read it
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        # the result is written out before the group goes: once this rank's sockets close, the
        # others fail, and a failure here must reach run_ranks before theirs
        results.close()
        results.join_thread()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


OTHERS_S = 10.0
"""After a rank fails, how long run_ranks waits for the others' outcomes: the rank whose
failure comes first is often one that lost its peer ("Connection reset by peer"), and the
cause is another rank's error or death."""


def _exit(p: Any) -> str:
    code = p.exitcode
    if code is not None and code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _drain(results: Any, out: dict[int, Any]) -> None:
    """The results already in the queue, into `out` (a rank that finished is not "no
    result")."""
    while True:
        try:
            rank, ok, value = results.get_nowait()
        except queue.Empty:
            return
        out.setdefault(rank, _load(value) if ok else RankFailed(rank, value))


def _with_others(first: RankFailed, out: dict[int, Any], procs: list[Any]) -> RankFailed:
    """`first`'s failure, with every other rank's outcome: its error's last lines, how its
    process ended, or that it is still running."""
    lines = []
    killed = [r for r, p in enumerate(procs) if r != first.rank and (p.exitcode or 0) < 0]
    if killed:  # the others' errors (a connection reset) follow from it
        lines.append(
            f"(rank {killed[0]} died of a signal: the errors above follow from it; a crash's "
            "stack is in the captured stderr)"
        )
    for r, p in enumerate(procs):
        if r == first.rank:
            continue
        got = out.get(r)
        if isinstance(got, RankFailed):
            tail = "\n    ".join(got.text.strip().splitlines()[-3:])
            lines.append(f"rank {r} failed too:\n    {tail}")
        elif r in out:
            lines.append(f"rank {r} finished")
        elif p.exitcode is not None:
            lines.append(f"rank {r} exited with {_exit(p)} and no result")
        else:
            lines.append(f"rank {r} still running")
    return RankFailed(first.rank, first.text + "\nthe other ranks:\n" + "\n".join(lines))


def _load(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def run_ranks(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    env: dict[int, dict[str, str]] | None = None,
    timeout: float = 120.0,
    allow_failures: bool = False,
) -> list[Any]:
    """Results by rank (see module docstring)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world, port, (env or {}).get(r, {}), args, results),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    failed: RankFailed | None = None
    try:
        while len(out) < world:
            if failed is not None and time.monotonic() > deadline:
                _drain(results, out)
                raise _with_others(failed, out, procs)
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):  # a rank that died without a word
                    if r not in out and p.exitcode is not None and results.empty():
                        out[r] = RankFailed(r, f"process exited with {_exit(p)} and no result")
                        if failed is None and not allow_failures:
                            failed, deadline = out[r], time.monotonic() + OTHERS_S
                if failed is None and time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(out))
                    raise AssertionError(
                        f"ranks {missing} did not finish within {timeout}s"
                    ) from None
                continue
            out[rank] = _load(value) if ok else RankFailed(rank, value)
            if not ok and failed is None and not allow_failures:
                failed, deadline = out[rank], time.monotonic() + OTHERS_S
        if failed is not None:
            raise _with_others(failed, out, procs)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world)]


# -- scripts over the emulated WAN -----------------------------------------------------------------


def spawn_in_regions(wan: Emulator, script: str, port: int, **popen) -> list[subprocess.Popen]:
    """Every rank of the emulator running `script`, each in its region's namespace, stdout
    piped."""
    env = {"WORLD_SIZE": str(wan.world_size), "MASTER_PORT": str(port)}
    return [
        wan.popen(
            r,
            [sys.executable, "-c", script],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
            **popen,
        )
        for r in range(wan.world_size)
    ]


def run_over_wan(prefix: str, script: str, port: int, mbit: float, rtt_ms: float = 0) -> list:
    """The 4 ranks of `script` over an emulated WAN (2 regions x 2): every rank must exit with
    0 (a rank aborted in teardown is a failure too); each rank's last stdout line, as JSON."""
    from cloudtrain.tools.netem import Emulator, teardown

    name = f"{prefix}{os.getpid() % 10000}-{uuid.uuid4().hex[:4]}"
    try:
        with Emulator({"us": 2, "eu": 2}, mbit, rtt_ms=rtt_ms, name=name) as wan:
            procs = spawn_in_regions(wan, script, port, stderr=subprocess.PIPE)
            outs = [p.communicate(timeout=240) for p in procs]
            assert [p.returncode for p in procs] == [0, 0, 0, 0], [
                o[0][-2000:] + o[1][-2000:] for o in outs
            ]
    finally:
        teardown(name)
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
