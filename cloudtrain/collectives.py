"""How packets and shards move: collectives with a deadline and errors that name who and where.

Every collective CloudDDP issues goes through `run_and_wait`, which waits at most the configured timeout
and turns any failure - a peer that died (connection reset), one that stalled (timeout), a size
mismatch - into a CommError naming the stage, the peers and the step, instead of a hang or a
bare gloo message.

An exchange can be issued now and waited for later (`Pending`), so a pipelined step can overlap
a cross-region round trip with the next steps' compute. Compressed packets cross regions with
`exchange_sized`: each owner of a shard sends its packet point-to-point to every other owner and
receives theirs with the sizes the plan announced (for a zstd sender, the most it may send: its
packet is cut to the size its header states). wait() gives the packets in region order, the
sender's own included, so every owner of a shard decodes and sums the same bytes in the same
order.

gloo holds a send until its receiver has posted the receive and said so over the wire, so two
owners that reach an exchange together each wait half a round trip for the other's notice before
their packet leaves: a round trip and the transfer. A packet stream's receives are therefore
posted an exchange ahead (`ReceivesAhead`): each exchange takes the receive posted at the
stream's last one and posts the next behind it, so by the next exchange the notice has crossed
and a packet leaves as soon as it is sent - half a round trip and the transfer. On the emulated
100 Mbit/s, 80 ms link (2 regions x 1 rank, 280 KB packets): 111-127 ms an exchange with the
receive posted as it starts, 42-56 ms with it posted ahead.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

# torch >= 2.12 renamed the tensor-in/tensor-out collectives; older releases have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the stage and the peers."""


class Pending:
    """Collectives issued and not yet waited for: `wait()` waits at most the timeout and turns
    any failure into a CommError naming the stage, the peers and where, then returns `result()`."""

    __slots__ = ("_done", "_result", "_waiters", "peers", "stage", "timeout", "where", "works")

    def __init__(
        self,
        stage: str,
        peers: Sequence[int],
        timeout: timedelta,
        works: Sequence[Any],
        result: Callable[[], Any] = lambda: None,
        where: str = "",
        waiters: Sequence[threading.Thread] = (),
    ) -> None:
        self.stage, self.peers, self.timeout, self.where = stage, list(peers), timeout, where
        self.works = list(works)
        self._result = result
        self._waiters = list(waiters)
        self._done = False

    def wait(self) -> Any:
        if not self._done:
            t0 = time.monotonic()
            try:
                for work in self.works:
                    work.wait(self.timeout)
                for waiter in self._waiters:
                    waiter.join()
            except Exception as e:
                raise self.error(e, time.monotonic() - t0) from e
            self._done = True
        return self._result()

    def error(self, e: BaseException, waited: float) -> CommError:
        return CommError(
            collective_failure(
                self.stage,
                self.peers,
                dist.get_rank(),
                self.where,
                waited,
                e,
                timeout_s=self.timeout.total_seconds(),
            )
        )


def collective_failure(
    stage: str,
    ranks: Sequence[int],
    rank: int,
    where: str,
    seconds: float,
    cause: BaseException,
    *,
    timeout_s: float,
    knob: str = "CompressionConfig.timeout_s",
    hint: str = "",
) -> str:
    """The text of a failed collective, one for every caller. It names the stage, its ranks,
    this rank, `where` (such as " at step 3, bucket 0", or ""), the seconds waited, the first line
    of the cause, and the timeout with the setting that changes it (`knob`). `hint`, a sentence
    on what the caller must do, goes last."""
    text = str(cause).strip()
    first_line = text.splitlines()[0] if text else type(cause).__name__
    return (
        f"cloudtrain: {stage} with ranks {list(ranks)} failed on rank {rank}{where} after "
        f"{seconds:.1f}s: {first_line}. A peer may have died or stalled, or did not reach the "
        f"same call within {timeout_s:g} s ({knob}).{f' {hint}' if hint else ''}"
    )


def all_reduce_async(
    buf: torch.Tensor, ranks: Sequence[int], group: Any, where: str, timeout_s: float
) -> torch.futures.Future:
    """`buf` summed over `ranks` in place (over one rank: at once), as a future; its failure is
    a CommError naming the all-reduce, the ranks and `where` (collective_failure). Other errors
    raised by what the caller chains on it pass as they are."""
    if len(ranks) == 1:
        work: torch.futures.Future = torch.futures.Future()
        work.set_result([buf])
    else:
        work = dist.all_reduce(buf, group=group, async_op=True).get_future()
    t0 = time.perf_counter()

    def summed(fut: torch.futures.Future) -> torch.Tensor:
        try:
            return fut.value()[0]
        except Exception as e:
            seconds, rank = time.perf_counter() - t0, dist.get_rank()
            text = collective_failure(
                "all-reduce", ranks, rank, where, seconds, e, timeout_s=timeout_s
            )
            raise CommError(text) from None

    return work.then(summed)


def issue(
    stage: str,
    peers: Sequence[int],
    timeout: timedelta,
    start: Callable[[], Any],
    where: str = "",
    result: Callable[[], Any] = lambda: None,
) -> Pending:
    """Run `start()` (which issues async collectives and returns one Work or a list)."""
    pending = Pending(stage, peers, timeout, (), result, where)
    try:
        works = start()
    except Exception as e:
        raise pending.error(e, 0.0) from e
    pending.works = list(works) if isinstance(works, list) else [works]
    return pending


def run_and_wait(
    stage: str, peers: Sequence[int], timeout: timedelta, start: Callable[[], Any], where: str = ""
) -> None:
    """Run `start()` (which issues async collectives and returns one Work or a list) and wait."""
    issue(stage, peers, timeout, start, where).wait()


def reduce_scatter_direct(
    out: torch.Tensor,
    buf: torch.Tensor,
    members: Sequence[int],
    me: int,
    group: Any,
    timeout: timedelta,
    where: str = "",
) -> None:
    """Reduce-scatter point-to-point: member j gets slice j of every member's `buf` (contiguous,
    len(members) * out.numel() elements) and sums them, in member order, into `out`. The same
    bytes move as in a ring; gloo's own reduce_scatter takes about twice as long (2 ranks,
    4.5 MB on loopback: 8.1 ms against 3.6)."""
    m = out.numel()
    mine = [buf[j * m : (j + 1) * m] if j == me else buf.new_empty(m) for j in range(len(members))]

    def start() -> list[Any]:
        works = []
        for j, peer in enumerate(members):
            if j != me:
                works.append(dist.isend(buf[j * m : (j + 1) * m], dst=peer, group=group))
                works.append(dist.irecv(mine[j], src=peer, group=group))
        return works

    run_and_wait("intra-region reduce-scatter (point-to-point)", members, timeout, start, where)
    out.copy_(mine[0])
    for piece in mine[1:]:
        out.add_(piece)


STREAM_TAGS = 1 << 30
"""Packet streams' tags count from here (`ReceivesAhead.stream`): apart from the default tag 0
and the state transfer's (cloudtrain.transfer), and within gloo's 31 bits."""


class ReceivesAhead:
    """The receives a rank has posted ahead on one group (`of`): per (peer, tag), the receive
    its next exchange takes (module docstring); the group's packet streams' tags; and every rung
    the group's packets were sent at (what the data path sizes its receives for).

    gloo matches a peer's messages of one tag to the receives posted for them in the order both
    were made, so each stream's exchanges must come in the same order on every owner, as the
    data path's do, and a stream's tag is its number in the order streams were first used - the
    same on every owner, and no two streams share one. One per group, whoever issues its
    exchanges: a data path made again for the same group goes on with its streams (a receive
    dropped while posted would still take the next packet meant for its stream). So a group an
    exchange failed on is never used again (cloudtrain.elastic): a step dropped on one side
    would leave its streams a packet apart. For the same reason they are kept while the group
    lives, past the model that posted them: models made one after another on one process's
    groups go on with its streams, where receives dropped while posted would take the next
    model's packets. Receives still posted when the group is destroyed go with it: nothing waits
    for them, and destroying a group with receives posted neither hangs nor fails."""

    __slots__ = ("_posted", "_tags", "rungs")
    _of: ClassVar[weakref.WeakKeyDictionary[Any, ReceivesAhead]] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._posted: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}
        self._tags: dict[Any, int] = {}
        self.rungs: set[Any] = set()

    @classmethod
    def of(cls, group: Any) -> ReceivesAhead:
        receives = cls._of.get(group)
        if receives is None:
            receives = cls._of[group] = cls()
        return receives

    def stream(self, key: Any, nbytes: int) -> PacketStream:
        """The packet stream named by `key` whose packets have at most `nbytes` bytes: a stream
        whose packets may grow is another stream, so no message meets a receive posted smaller
        than itself."""
        tag = self._tags.setdefault((key, nbytes), STREAM_TAGS + len(self._tags))
        return PacketStream(self, tag, nbytes)

    def buffers(self) -> list[torch.Tensor]:
        """The buffers of the receives posted ahead: memory the group's streams hold between
        exchanges (cloudtrain.tools.memory counts it as cloudtrain's state)."""
        return [buffer for buffer, _ in self._posted.values()]

    def take(self, group: Any, peer: int, tag: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        """The receive (buffer of `nbytes`, work) for `peer`'s next packet of stream `tag` on
        `group`: the one posted at the stream's last exchange, or one posted now; the next is
        posted behind it."""
        held = self._posted.pop((peer, tag), None)
        if held is None:
            held = _post(group, peer, tag, nbytes)
        self._posted[(peer, tag)] = _post(group, peer, tag, nbytes)
        return held


def _post(group: Any, peer: int, tag: int, nbytes: int) -> tuple[torch.Tensor, Any]:
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    return buffer, dist.irecv(buffer, src=peer, group=group, tag=tag)


@dataclass(frozen=True)
class PacketStream:
    """One exchange's packet stream (`ReceivesAhead.stream`): the group's receives, the
    stream's tag and the most bytes one of its packets can have (what its receives are posted
    for)."""

    receives: ReceivesAhead
    tag: int
    nbytes: int


def exchange_sized(
    wire: torch.Tensor,
    sizes: Sequence[int],
    peers: Sequence[int],
    me: int,
    group: Any,
    timeout: timedelta,
    where: str = "",
    timings: dict[int, float] | None = None,
    *,
    shorter: bool = False,
    stream: PacketStream | None = None,
) -> Pending:
    """Owners send packets of different sizes, known to all from the plan: point-to-point.
    `wait()` returns the packets in `peers` order (this rank's own included). A zstd sender's
    size is the most it may send (`shorter`: this rank's packet may be smaller): its packet is
    received into a buffer of `sizes[i]` bytes and must be cut to its own length by whoever reads
    it (`compress.cut`; gloo takes a message shorter than the buffer posted for it, never longer).
    With `stream`, the packets travel as that stream's, into the receives posted at its last
    exchange (module docstring), and the next are posted; without (tests: the exchange gloo
    makes by itself), the receives are posted now.

    With `timings`, records for every peer the seconds from the start until its packet was in
    (the controller's check for packets that slowed: cloudtrain.estimates).
    """
    if wire.numel() > sizes[me] or (wire.numel() < sizes[me] and not shorter):
        allowed = f"at most {sizes[me]}" if shorter else f"{sizes[me]}"
        raise CommError(
            f"cloudtrain: own packet is {wire.numel()} bytes, the plan says {allowed}{where}"
        )
    if stream is not None and max(sizes) > stream.nbytes:  # alike on every owner: all raise
        raise CommError(
            f"cloudtrain: the plan's packets of {list(sizes)} bytes{where} exceed the "
            f"{stream.nbytes} bytes their stream's receives were posted for"
        )
    received = [wire if i == me else torch.empty(0, dtype=torch.uint8) for i in range(len(sizes))]
    stage = "cross-region exchange (point-to-point)"

    def start() -> list[Any]:
        works = []
        for i, peer in enumerate(peers):
            if i == me:
                continue
            if stream is None:
                tag, (buffer, receive) = 0, _post(group, peer, 0, sizes[i])
            else:
                tag = stream.tag
                buffer, receive = stream.receives.take(group, peer, tag, stream.nbytes)
            received[i] = buffer[: sizes[i]]
            works.append(dist.isend(wire, dst=peer, group=group, tag=tag))
            works.append(receive)
        return works

    pending = issue(stage, peers, timeout, start, where, lambda: received)
    if timings is None:
        return pending
    # gloo completes a receive only inside wait(): one thread per peer waits and stamps it
    t0 = time.monotonic()
    errors: list[BaseException] = []

    def wait_for(i: int, work: Any) -> None:
        try:
            work.wait(timeout)
            timings[i] = time.monotonic() - t0
        except BaseException as e:
            errors.append(e)

    receives = pending.works[1::2]  # (send, receive) per peer, in peer order
    others = [i for i in range(len(peers)) if i != me]
    waiters = [
        threading.Thread(target=wait_for, args=(i, w), daemon=True)
        for i, w in zip(others, receives, strict=True)
    ]
    for waiter in waiters:
        waiter.start()

    def received_or_raise() -> list[torch.Tensor]:
        if errors:
            raise pending.error(errors[0], time.monotonic() - t0) from errors[0]
        return received

    return Pending(stage, peers, timeout, pending.works[0::2], received_or_raise, where, waiters)
