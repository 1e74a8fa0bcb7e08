"""How packets and shards move: collectives with a deadline and errors that name who and where.

Every collective CloudDDP issues goes through `finish`, which waits at most the configured timeout
and turns any failure - a peer that died (connection reset), one that stalled (timeout), a size
mismatch - into a CommError naming the stage, the peers and the step, instead of a hang or a
bare gloo message.

Compressed packets cross regions in one of two ways:
- `exchange_fixed`: every sender's packet has the same size (known from the plan), so one
  all_gather moves them all;
- `exchange_sized`: senders use different levels, so each sends its packet point-to-point to every
  other owner of the shard, and receives theirs with the sizes the plan announced.
Both return the packets in region order, the sender's own included, so every owner of a shard
decodes and sums the same bytes in the same order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.12 renamed the tensor-in/tensor-out collectives; older releases have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the stage and the peers."""


def finish(
    stage: str, peers: Sequence[int], timeout: timedelta, start: Callable[[], Any], where: str = ""
) -> None:
    """Run `start()` (which issues async collectives and returns one Work or a list) and wait."""
    t0 = time.monotonic()
    try:
        works = start()
        for work in works if isinstance(works, list) else [works]:
            work.wait(timeout)
    except Exception as e:
        waited = time.monotonic() - t0
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CommError(
            f"cloudtrain: {stage} with ranks {list(peers)} failed on rank {dist.get_rank()}{where} after "
            f"{waited:.1f}s: {cause}. A peer may have died or stalled (timeout {timeout.total_seconds():g}s, "
            "CompressionConfig.timeout_s)."
        ) from e


def exchange_fixed(
    wire: torch.Tensor, peers: Sequence[int], group: Any, timeout: timedelta, where: str = ""
) -> list[torch.Tensor]:
    """All owners send equal-size packets: one all_gather. Returns packets in `peers` order."""
    out = torch.empty(len(peers) * wire.numel(), dtype=torch.uint8)
    finish(
        "cross-region exchange (all_gather)",
        peers,
        timeout,
        lambda: all_gather_single(out, wire, group=group, async_op=True),
        where,
    )
    rows = out.view(len(peers), wire.numel())
    by_group_rank = sorted(peers)  # a group's ranks are ordered by global rank
    return [rows[by_group_rank.index(p)] for p in peers]


def exchange_sized(
    wire: torch.Tensor,
    sizes: Sequence[int],
    peers: Sequence[int],
    me: int,
    group: Any,
    timeout: timedelta,
    where: str = "",
    timings: dict[int, float] | None = None,
) -> list[torch.Tensor]:
    """Owners send packets of different sizes, known to all from the plan: point-to-point.

    With `timings`, records for every peer the seconds from the start until its packet was in
    (the controller's passive bandwidth estimate).
    """
    if wire.numel() != sizes[me]:
        raise CommError(
            f"cloudtrain: own packet is {wire.numel()} bytes, the plan announced {sizes[me]}{where}"
        )
    received = [
        wire if i == me else torch.empty(size, dtype=torch.uint8) for i, size in enumerate(sizes)
    ]
    sends: list[Any] = []
    recvs: dict[int, Any] = {}

    def start() -> list[Any]:
        for i, peer in enumerate(peers):
            if i != me:
                sends.append(dist.isend(wire, dst=peer, group=group))
                recvs[i] = dist.irecv(received[i], src=peer, group=group)
        return sends + list(recvs.values())

    def start_and_time_arrivals() -> list[Any]:
        # gloo completes a receive only inside wait(): one thread per peer waits and stamps it
        t0 = time.monotonic()
        start()
        errors: list[BaseException] = []

        def wait_for(i: int, work: Any) -> None:
            try:
                work.wait(timeout)
                timings[i] = time.monotonic() - t0
            except BaseException as e:
                errors.append(e)

        waiters = [
            threading.Thread(target=wait_for, args=item, daemon=True) for item in recvs.items()
        ]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join()
        if errors:
            raise errors[0]
        return sends

    stage = "cross-region exchange (point-to-point)"
    finish(stage, peers, timeout, start if timings is None else start_and_time_arrivals, where)
    return received
