"""Bandwidth prober: measure every link between ranks, and find regions from the measurements.

Each ordered pair (i -> j), alone or beside pairs that share no link with it (`rounds`): i sends
a warm-up transfer, then messages of growing size (from what the warm-up showed, at least
64 KiB, then sized from the rate the last one read: GROWTH) until one's transfer - its time
less the fastest ping - takes at least `max_seconds` and twice the round trip, or the size
reaches `max_bytes`: that size is repeated, or, where it read under 0.75x of a smaller one's
rate (SLOW_READING), twice that size instead, within `max_bytes`. j answers each message with a
one-byte ack, i times them, and each announcement of a size: a one-byte ping (a size's repeats
go under one announcement).
(Sizes that only show the round trip cannot show bandwidth: across 80 ms, a few hundred KB take
the round trip and a jitter's worth more, whatever the link's rate.) alpha (seconds, about one
round trip) is the fastest ping, beta (bytes per second) the best rate of the repeated sizes, per
direction (`fit_measured`). Where the two directions between two regions, measured at once,
read more than DISAGREE apart, the slower is measured again alone, and the faster too where the
slower alone still reads apart from it (`disagreeing`). Every rank gets the whole matrix;
`pairs` measures only some (the others are copied from a measured pair of the same regions:
`expand`).

    cloudtrain probe                          # the command (cloudtrain.tools.probe)

`cluster_regions` groups ranks whose links are much faster among themselves than to the others
(the largest gap in log-bandwidth, at least `min_ratio`), for ranks launched without
CLOUDTRAIN_REGION. The passive estimates during training live in cloudtrain.controller.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

START_BYTES = 64 * 1024
WARMUP_BYTES = 2 * 1024 * 1024
SLOW_READING = 0.75
"""A message that shows bandwidth read at under this share of the rate a smaller one read at
(whose time the round trip weighs on more, so it should read slower, not faster; for the first
size, the warm-up's, slow start and all) lost its transfer to recovering losses: `_measure`
times a message twice its size instead of repeating it. The smaller one is the last whose
transfer took at least the round trip (the warm-up where none did), both as the probe's fastest
ping leaves them: one the round trip dominates reads a rate a ping queued behind other traffic
can inflate (on the emulated 50 Mbit/s link at 180 ms, a 1.35 MB message read 2.5x the link,
and the next, true, rate read "slow"). On the emulated 50 Mbit/s link at 80 ms, one start-up
probe in three read 0.62x of one TCP flow at 1.2 MB, all three repeats alike, where
the half size had read 1.1x and 1.8 MB messages read 1.08x; at 200 Mbit/s, one in five read
0.70x at 4 MB, under the warm-up's rate. With the second message, 15 probes at 50 and
200 Mbit/s, 80 and 180 ms read 0.90-1.15x of the flow, against 0.62-1.15x before."""
GROWTH = 1.25
"""The next message carries what the last one's rate would carry in GROWTH x the target time
(at least twice the last size, at most 8x): the rate a short message reads is low (its round trip
and slow start weigh on it), so sizes reach one that shows bandwidth in a step or two, where
doubling took four or five (at 200 Mbit/s and 180 ms: 700 KB, 1.4, 2.8, 5.6, 11.2 MB, about
2.5 s of a pair's 8.3 s)."""
MIN_TRANSFER_S = 0.1
"""The shortest transfer that shows a shaped link's rate. A message that starts with a full
window overruns the shaper's queue, and recovering its losses takes much of a short transfer:
on the emulated 50 Mbit/s link, 0.05 s transfers read 0.4-1.1x of one TCP flow's rate, 0.1 s
ones 0.8-1.05x (the best of three), 0.25 s ones 1.0-1.03x."""
DISAGREE = 1.25
"""Two directions between the same two regions, measured at once, that read more than this
ratio apart: the slower is measured again alone, and the faster too where the slower alone still
reads apart from it (`disagreeing`). Each direction's acknowledgements - TCP's and the probe's
own - cross the other direction's link, and where its queue holds the other direction's probe
they wait behind it, which the sender's clock counts as transfer. On the emulated 100 Mbit/s
link at 80 ms, 24 start-up probes with both directions at once read eu->us at 40-79 % of the
link in nine, us->eu at 69-80 % in two; one way at a time, 11 read both at 91-100 % but one
eu->us at 77 %. On the hetero link (us 1000 Mbit/s, eu 50 up), us->eu read 562 at once. A
direction measured again costs a pair's time (1.5 s at 80 ms), so only where the two disagree,
by a misreading or by links that do differ."""


@dataclass(frozen=True)
class LinkMatrix:
    """alpha[i][j] seconds and beta[i][j] bytes/second of the link from rank i to rank j."""

    alpha: tuple[tuple[float, ...], ...]
    beta: tuple[tuple[float, ...], ...]
    sent: int = 0
    """Bytes this rank sent measuring them (what the measurement cost it)."""
    again: tuple[tuple[int, int], ...] = ()
    """The pairs measured again one way at a time (DISAGREE), each as (sender, receiver)."""

    @property
    def world_size(self) -> int:
        return len(self.beta)

    def mbit(self, i: int, j: int) -> float:
        return 8 * self.beta[i][j] / 1e6

    def table(self) -> str:
        n = self.world_size
        head = "from\\to " + " ".join(f"{j:>14}" for j in range(n))
        rows = [head]
        for i in range(n):
            cells = [
                f"{'-':>14}"
                if i == j
                else f"{self.mbit(i, j):8.1f}Mb {1000 * self.alpha[i][j]:4.1f}ms"
                for j in range(n)
            ]
            rows.append(f"{i:>7} " + " ".join(cells))
        return "\n".join(rows)


def fit_link(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) from (bytes, seconds) samples: t = alpha + bytes / beta.

    Delays only ever add (a busy peer, a scheduler), so each size counts with its fastest time;
    the slope is fitted to those by least squares, and the latency is the lowest intercept any
    of them leaves under that slope (one delayed size must not raise it).
    """
    if not samples:
        raise ValueError("fit_link needs at least one (bytes, seconds) sample")
    fastest: dict[int, float] = {}
    for b, t in samples:
        fastest[b] = min(t, fastest.get(b, math.inf))
    points = sorted(fastest.items())
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / var if var > 0 else 0.0
    if slope <= 0:  # no size dependence visible: bandwidth from the largest transfer alone
        b, t = points[-1]
        return points[0][1], b / max(t, 1e-9)
    alpha = max(0.0, min(t - slope * b for b, t in points))
    return alpha, 1.0 / slope


def fit_measured(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(alpha, beta) from a pair's samples (`_measure`): the latency is the fastest one-byte
    ping, the bandwidth the best rate of the sizes that show it - those timed more than once
    (`_measure` repeats the size it stopped at, or twice it instead where that read slow), each
    by its fastest time less that latency (the largest size alone where none was repeated);
    without pings, the least-squares fit of every size (fit_link)."""
    pings = [t for b, t in samples if b == 1]
    if not pings:
        return fit_link(samples)
    alpha = min(pings)
    fastest: dict[int, float] = {}
    count: dict[int, int] = {}
    for b, t in samples:
        if b > 1:
            fastest[b] = min(t, fastest.get(b, math.inf))
            count[b] = count.get(b, 0) + 1
    if not fastest:
        raise ValueError("fit_measured needs at least one message larger than a ping")
    shown = [b for b in fastest if count[b] > 1] or [max(fastest)]
    return alpha, max(b / max(fastest[b] - alpha, 1e-9) for b in shown)


def _timed(
    size: int,
    count: int,
    payload: torch.Tensor,
    header: torch.Tensor,
    ack: torch.Tensor,
    dst: int,
    group: Any,
) -> list[tuple[int, float]]:
    """`count` timed messages of `size` bytes to dst, each until its ack is back, after one
    announcement: its round trip - a one-byte ping: dst's receive for it is posted since its
    last ack - and then each message's (size, seconds). dst posts its receive for the next
    message before it acks the one before, so a repeat goes out without an announcement round
    trip of its own."""
    header[0], header[1] = size, count
    t0 = time.perf_counter()
    dist.send(header, group=group, group_dst=dst)
    dist.recv(ack, group=group, group_src=dst)  # dst's receive is posted
    samples = [(1, time.perf_counter() - t0)]
    for _ in range(count):
        t1 = time.perf_counter()
        dist.send(payload[:size], group=group, group_dst=dst)
        dist.recv(ack, group=group, group_src=dst)  # received (and the next one's posted)
        samples.append((size, time.perf_counter() - t1))
    return samples


def _rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank in `group` and its size (None: the world). Asked of the group itself:
    an elastic run's cross-region groups (cloudtrain.elastic.cross_group) are not subgroups of
    the process's world, whose rank numbers they do not share."""
    if group is None:
        return dist.get_rank(), dist.get_world_size()
    return group.rank(), group.size()


def _reference(before: list[tuple[int, float]], rtt: float) -> float:
    """SLOW_READING's reference rate, bytes/s: of the messages before the one that shows
    bandwidth - (bytes, seconds), the warm-up first - the last whose transfer (its time less
    `rtt`, the probe's fastest ping) took at least the round trip; the warm-up's where none
    did."""
    for size, seconds in reversed(before[1:]):
        if seconds - rtt >= rtt:
            return size / (seconds - rtt)
    size, seconds = before[0]
    return size / max(seconds - rtt, 1e-9)


def _measure(
    src: int, dst: int, group: Any, max_seconds: float, max_bytes: int, repeats: int, start: int
) -> list[tuple[int, float]]:
    """src sends growing messages to dst and times each until dst's ack is back (ranks in
    `group`).

    Gloo sends a message only once the receiver has posted its receive (the receiver announces
    it over the wire), so the size goes ahead untimed and dst answers "ready" once its receive
    is posted: the timed part is then payload out and ack back, one round trip plus the
    transfer; the announcement's own round trip is a ping. A warm-up transfer takes TCP out of
    slow start, and its rate sizes the first timed message (at least `start` bytes). Sizes grow
    (GROWTH) until the transfer, not the round trip, dominates: at least max_seconds and twice
    the round trip; that size is repeated, or twice it instead (within max_bytes) where it read
    under SLOW_READING of a smaller one's rate (`_reference`). A size's repeats go under one
    announcement: dst posts the next receive before it acks the last."""
    me = _rank_and_size(group)[0]
    if me == src:
        return _send_sizes(dst, group, max_seconds, max_bytes, repeats, start)
    if me == dst:
        _answer_sizes(src, group, max_bytes, _most_announced(repeats))
    return []


def _most_announced(repeats: int) -> int:
    """How many messages one announcement may carry: a size's repeats, or two of twice a size
    that read slow (the sender's bound and the receiver's check)."""
    return max(repeats, 2)


def _send_sizes(
    dst: int, group: Any, max_seconds: float, max_bytes: int, repeats: int, start: int
) -> list[tuple[int, float]]:
    """_measure's sender: the warm-up, the growing sizes, the repeats, then the end."""
    header = torch.zeros(2, dtype=torch.int64)  # a message's size, and how many times it goes
    ack = torch.zeros(1, dtype=torch.uint8)
    samples: list[tuple[int, float]] = []
    payload = torch.zeros(max_bytes, dtype=torch.uint8)
    args = (payload, header, ack, dst, group)
    # A connection that has carried little is still in TCP slow start, and across a long
    # round trip that would make every small message look slower: a warm-up transfer first,
    # not a sample, whose rate (a floor: slow start is in it) sizes the first timed message.
    # Every size's announcement is a one-byte ping: they time the round trip alone (a
    # fresh connection's first messages can be slow: the fastest counts). Pings of their
    # own would cost two round trips each and time nothing more.
    announced, (warm, took) = _timed(min(WARMUP_BYTES, max_bytes), 1, *args)
    samples.append(announced)
    rtt = announced[1]
    rate = warm / max(took - rtt, 1e-9)  # the last size's (first, the warm-up's), bytes/s
    before = [(warm, took)]  # (bytes, seconds) of the warm-up and the sizes leading up
    target = max(max_seconds, 2 * rtt)
    size = int(min(max(start, rate * target), max_bytes))
    while True:
        samples.extend(_timed(size, 1, *args))
        rtt = min(rtt, samples[-2][1])
        # the target from the fastest ping: the first waits for dst to reach the probe
        # (0.35 s on 180 ms links), and a target from it asked for transfers twice too long
        target = max(max_seconds, 2 * rtt)
        transfer = samples[-1][1] - rtt
        if transfer >= target or size * 2 > max_bytes:
            break
        rate = size / max(transfer, 1e-9)
        before.append(samples[-1])
        # at least twice the size, and what the rate it read would carry in GROWTH x the
        # target (a rate read from a short message is low: its round trip and slow start
        # weigh on it), within 8x
        size = int(min(max(2 * size, min(8 * size, GROWTH * rate * target)), max_bytes))
    slow = size / max(transfer, 1e-9) < SLOW_READING * _reference(before, rtt)
    if slow and size * 2 <= max_bytes:
        # slower than a size before it (or the warm-up, slow start and all) was: a message
        # that overran the shaper's queue and spent its time recovering losses, which its
        # repeats do alike. Twice that size instead, repeated (fit_measured: the best of the
        # sizes repeated counts)
        samples.extend(_timed(size * 2, _most_announced(repeats), *args))
    elif repeats > 1:  # the size that shows bandwidth, again: its fastest counts
        samples.extend(_timed(size, repeats - 1, *args))
    header.zero_()  # the end
    dist.send(header, group=group, group_dst=dst)
    return samples


def _answer_sizes(src: int, group: Any, max_bytes: int, most: int) -> None:
    """_measure's receiver: each announcement checked (a size of 1 to `max_bytes`, 1 to `most`
    messages of it) before a receive is posted, each message acked, until the end."""
    header = torch.zeros(2, dtype=torch.int64)
    ack = torch.zeros(1, dtype=torch.uint8)
    buf = torch.empty(max_bytes, dtype=torch.uint8)
    while True:
        dist.recv(header, group=group, group_src=src)
        size, count = int(header[0]), int(header[1])
        if size == 0:
            break
        if not (0 < size <= max_bytes and 0 < count <= most):
            raise RuntimeError(
                f"cloudtrain probe: rank {src} announced {count} message(s) of {size} bytes "
                f"where 1 to {most} of 1 to {max_bytes} bytes were expected; every rank must "
                "run the same cloudtrain with the same probe options"
            )
        work = dist.irecv(buf[:size], group=group, group_src=src)
        dist.send(ack, group=group, group_dst=src)  # posted
        for left in range(count - 1, -1, -1):
            work.wait()
            if left:  # the next one's receive is posted before this one's ack leaves
                work = dist.irecv(buf[:size], group=group, group_src=src)
            dist.send(ack, group=group, group_dst=src)


def probe(
    group: Any = None,
    *,
    max_seconds: float = MIN_TRANSFER_S,
    max_bytes: int = 32 * 1024 * 1024,
    repeats: int = 2,
    start_bytes: int = START_BYTES,
    pairs: Sequence[tuple[int, int]] | None = None,
    region: Sequence[int] | None = None,
    carry: torch.Tensor | None = None,
) -> LinkMatrix:
    """All ranks of `group` (a gloo group; default: the world) call this; all get the matrix,
    indexed by rank within the group. `pairs`: the (i, j) to measure (default: all); the others
    are left as zeros for `expand` to fill. `region`: each rank's region, where known: pairs
    that share no link are then measured at the same time (`rounds`), and two directions that
    read far apart so measured again alone (`disagreeing`). `carry` (with `region`; uint8, the
    same size on every rank): once all is measured, rank 0's goes to the receivers of its pairs
    to other regions, whose `carry` becomes it - rank 0's start-up state crosses on connections
    the probe has taken out of TCP slow start, where a broadcast of its own would go through
    slow start again (cloudtrain.topology.Topology.broadcast_from_rank0)."""
    me, world = _rank_and_size(group)
    ranks = list(range(world))
    if pairs is None:
        pairs = [(i, j) for i in ranks for j in ranks if i != j]
    if carry is not None and (region is None or carry.dtype != torch.uint8):
        raise ValueError("probe: carry needs the ranks' regions and a uint8 tensor")
    measure = (group, max_seconds, max_bytes, repeats, start_bytes)
    batches = rounds(list(dict.fromkeys(pairs)), region)  # (each pair once)
    sent, seen = _measure_rounds(batches, me, world, measure)
    again: list[tuple[int, int]] = []
    split = (
        [] if region is None else disagreeing(batches, region, [[b for _, b in r] for r in seen])
    )
    for slow, fast in split:  # one way at a time: each ends in a gathering before the next
        for i, j in (slow, fast):
            more, alone = _measure_rounds([[(i, j)]], me, world, measure)
            sent, seen[i][j] = sent + more, alone[i][j]
            again.append((i, j))
            if not _apart(seen[slow[0]][slow[1]][1], seen[fast[0]][fast[1]][1]):
                break  # the slower one alone reads as the other did: the other stands
    alpha = tuple(tuple(seen[i][j][0] for j in ranks) for i in ranks)
    beta = tuple(tuple(seen[i][j][1] for j in ranks) for i in ranks)
    if carry is not None:  # after every pair: no measurement shares its link with it
        to = sorted({j for i, j in pairs if i == 0 and region[j] != region[0]})  # type: ignore[index]
        if me == 0:
            works = [dist.isend(carry, group=group, group_dst=j) for j in to]
            for work in works:
                work.wait()
            sent += len(to) * carry.numel()
        elif me in to:
            dist.recv(carry, group=group, group_src=0)
    return LinkMatrix(alpha, beta, sent, tuple(again))


def _measure_rounds(
    batches: list[list[tuple[int, int]]], me: int, world: int, measure: tuple
) -> tuple[int, list[list[tuple[float, float]]]]:
    """This rank's pairs of `batches` measured (`measure`: _measure's group and options), then
    every rank's (alpha, beta) gathered: (the bytes this rank sent, the matrix; a pair not
    measured reads (0, inf)). Each rank goes through its own pairs in batch order: pairs of
    different batches that share no rank may run at once."""
    group, _, max_bytes, *_ = measure
    mine = torch.full((world, 2), math.nan, dtype=torch.float64)  # this rank's row: (alpha, beta)
    sent = 0
    for i, j in (pair for batch in batches for pair in batch):
        if me not in (i, j):  # measured by others, alone or beside this rank's pair
            continue
        samples = _measure(i, j, *measure)
        if me == i:
            mine[j] = torch.tensor(fit_measured(samples), dtype=torch.float64)
            sent += min(WARMUP_BYTES, max_bytes) + sum(b for b, _ in samples)
    # one collective (an object gather is two, each a round trip or more across the WAN)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    nan = math.isnan
    return sent, [[(a, b) if not nan(a) else (0.0, math.inf) for a, b in r.tolist()] for r in rows]


def _apart(a: float, b: float) -> bool:
    """Two rates (bytes/s) more than DISAGREE apart."""
    return max(a, b) > DISAGREE * min(a, b)


def disagreeing(
    batches: Sequence[Sequence[tuple[int, int]]],
    region: Sequence[int],
    beta: Sequence[Sequence[float]],
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The directions to measure again one way at a time (pure: every rank computes the same
    from the gathered matrix): two pairs of one batch of `rounds` - measured at once - that go
    opposite ways between two regions and read more than DISAGREE apart (`beta`: bytes/s by
    sender and receiver), as (the slower pair, the faster), in batch order. `probe` measures
    the slower alone first, and the faster too only where the slower still reads apart from
    it: a direction whose acknowledgements waited reads slow (at 100 Mbit/s and 80 ms), but
    where the links differ it is the faster one's acknowledgements that wait, on the slower
    link (on the hetero link, us->eu read 562 of 1000 Mbit/s beside eu's 50). A faster reading
    kept is at least 1 / DISAGREE of the slower one's alone. Only opposite pairs are compared:
    a pair beside another out of its receiving region (A->B beside B->C, which `rounds` does
    not put together for `representative_pairs`) is not."""
    out: list[tuple[tuple[int, int], tuple[int, int]]] = []
    for batch in batches:
        across = [(i, j) for i, j in batch if region[i] != region[j]]
        for n, (i, j) in enumerate(across):
            for k, m in across[n + 1 :]:
                back = (region[k], region[m]) == (region[j], region[i])
                if back and _apart(beta[i][j], beta[k][m]):
                    slow, fast = sorted([(i, j), (k, m)], key=lambda p: beta[p[0]][p[1]])
                    out.append((slow, fast))
    return out


def rounds(
    pairs: Sequence[tuple[int, int]], region: Sequence[int] | None = None
) -> list[list[tuple[int, int]]]:
    """The pairs in rounds whose pairs are measured at the same time, in order (each pair in the
    first round that has room). Without `region` (a region per rank) every pair is a round of
    its own: two flows could share a bottleneck no one knows. With it, the pairs of a round share
    no rank, no sending region's uplink, no receiving region's downlink and no region inside
    (their acknowledgements may still wait behind each other: `disagreeing`): each rank goes
    through its own pairs in round order, so none waits for another's partner.
    Every rank computes the same rounds."""
    if region is None:
        return [[pair] for pair in pairs]

    def uses(i: int, j: int) -> set[tuple[str, int]]:
        r, q = region[i], region[j]
        links = {("in", r)} if r == q else {("up", r), ("down", q)}
        return links | {("rank", i), ("rank", j)}

    out: list[list[tuple[int, int]]] = []
    busy: list[set[tuple[str, int]]] = []
    for i, j in pairs:
        need = uses(i, j)
        k = next((k for k, b in enumerate(busy) if not need & b), len(out))
        if k == len(out):
            out.append([])
            busy.append(set())
        out[k].append((i, j))
        busy[k] |= need
    return out


def _region_pair(a: Sequence[int], b: Sequence[int]) -> tuple[int, int]:
    """The ranks that stand for the link from region a to region b (ranks ascending in each):
    the first ranks from the region of the lower first rank, the last ranks the other way, so
    that both directions can be measured at once, and rank 0's links out of its region start
    at rank 0 (what `probe`'s carry needs)."""
    return (a[0], b[0]) if a[0] < b[0] else (a[-1], b[-1])


def representative_pairs(members: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """With regions known, the links that stand for all: between every two regions both ways
    (`_region_pair`), and inside each region of several ranks its first to its second and back."""
    out = [
        _region_pair(members[r], members[q])
        for r in range(len(members))
        for q in range(len(members))
        if r != q
    ]
    return (
        out
        + [(m[0], m[1]) for m in members if len(m) > 1]
        + [(m[1], m[0]) for m in members if len(m) > 1]
    )


def expand(links: LinkMatrix, members: Sequence[Sequence[int]]) -> LinkMatrix:
    """A matrix measured on `representative_pairs` for every pair: a link between two regions
    is the link measured between them that way, one inside a region its first to its second
    rank's."""
    region = {rank: r for r, m in enumerate(members) for rank in m}

    def source(i: int, j: int) -> tuple[int, int]:
        r, q = region[i], region[j]
        if r != q:
            return _region_pair(members[r], members[q])
        return (members[r][0], members[r][1])

    n = links.world_size
    pick = {(i, j): source(i, j) for i in range(n) for j in range(n) if i != j}
    alpha = tuple(
        tuple(0.0 if i == j else links.alpha[pick[i, j][0]][pick[i, j][1]] for j in range(n))
        for i in range(n)
    )
    beta = tuple(
        tuple(math.inf if i == j else links.beta[pick[i, j][0]][pick[i, j][1]] for j in range(n))
        for i in range(n)
    )
    return LinkMatrix(alpha, beta, links.sent, links.again)


def cluster_regions(links: LinkMatrix, min_ratio: float = 4.0) -> list[int]:
    """A region index per rank: ranks joined by links on the fast side of the largest gap in
    log-bandwidth (if that gap is at least min_ratio) share a region. Regions are numbered by
    their lowest rank."""
    n = links.world_size
    pair = {
        (i, j): min(links.beta[i][j], links.beta[j][i]) for i in range(n) for j in range(i + 1, n)
    }
    if not pair:
        return [0] * n
    values = sorted(pair.values())
    gaps = [(values[k + 1] / values[k], k) for k in range(len(values) - 1) if values[k] > 0]
    ratio, k = max(gaps, default=(1.0, 0))
    if ratio < min_ratio:
        return [0] * n
    threshold = math.sqrt(values[k] * values[k + 1])
    parent = list(range(n))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for (i, j), b in pair.items():
        if b >= threshold:
            parent[root(j)] = root(i)
    labels: dict[int, int] = {}
    return [labels.setdefault(root(r), len(labels)) for r in range(n)]
