"""Collectives with deadlines (cloudtrain.collectives) on real processes over gloo: packets in
region order, arrival times, issue-now-wait-later, receives posted an exchange ahead, and errors
that name the stage, the peers and where - within the timeout - instead of a hang; the
point-to-point reduce-scatter inside a region."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
from distributed import run_ranks


def _exchanges(rank, world):
    import torch.distributed as dist

    import cloudtrain
    from cloudtrain.collectives import ReceivesAhead, exchange_sized

    cloudtrain.init(timeout_s=30)
    group = dist.new_group([0, 1, 2], backend="gloo")
    peers = (2, 0, 1)  # region order is not rank order
    me = peers.index(rank)
    sizes = [3, 7, 11]
    wire = torch.full((sizes[me],), 10 + rank, dtype=torch.uint8)
    timings: dict[int, float] = {}
    pending = exchange_sized(wire, sizes, peers, me, group, timedelta(seconds=30), "", timings)
    sized = pending.wait()
    # two streams posted ahead, interleaved, three exchanges each: every packet reaches its own
    receives = ReceivesAhead.of(group)
    streams = [receives.stream(b, 16) for b in (0, 1)]
    ahead = []
    for step in range(3):
        for b, stream in enumerate(streams):
            wire = torch.full((sizes[me],), 100 * b + 10 * step + rank, dtype=torch.uint8)
            got = exchange_sized(
                wire, sizes, peers, me, group, timedelta(seconds=30), stream=stream
            ).wait()
            ahead.append([t.tolist() for t in got])
    held = sorted(b.numel() for b in receives.buffers())  # the next exchange's, posted
    return [t.tolist() for t in sized], sorted(timings), ahead, held


def _reduce_scatter(rank, world, dtype):
    import torch.distributed as dist

    import cloudtrain
    from cloudtrain.collectives import reduce_scatter_direct

    cloudtrain.init(timeout_s=30)
    members = (1, 2, 3)  # a region of three; rank 0 is elsewhere
    group = dist.new_group(list(members), backend="gloo")
    if rank not in members:
        return None
    buf = torch.randn(3 * 1001, generator=torch.Generator().manual_seed(rank)).to(dtype)
    out = torch.empty(1001, dtype=dtype)
    reduce_scatter_direct(out, buf, members, members.index(rank), group, timedelta(seconds=30))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_scatter_direct_sums_each_slice_in_member_order(dtype):
    results = run_ranks(4, _reduce_scatter, dtype)
    bufs = [
        torch.randn(3 * 1001, generator=torch.Generator().manual_seed(r)).to(dtype)
        for r in (1, 2, 3)
    ]
    for j, out in enumerate(results[1:]):
        expected = bufs[0][j * 1001 : (j + 1) * 1001].clone()
        for b in bufs[1:]:
            expected += b[j * 1001 : (j + 1) * 1001]
        assert out.dtype == dtype and torch.equal(out, expected), j  # bit for bit, that order
    assert results[0] is None


def test_exchanges_give_every_region_its_packet_in_region_order():
    for rank, (sized, timed, ahead, held) in enumerate(run_ranks(3, _exchanges)):
        assert sized == [[12] * 3, [10] * 7, [11] * 11]
        me = (2, 0, 1).index(rank)
        assert timed == sorted(i for i in range(3) if i != me)  # every other sender timed
        expected = [
            [[100 * b + 10 * step + r] * n for r, n in zip((2, 0, 1), (3, 7, 11), strict=True)]
            for step in range(3)
            for b in range(2)
        ]
        assert ahead == expected
        assert held == [16] * 4  # a receive per stream and peer, its stream's size, posted ahead


def _send_before_the_receiver_arrives(rank, world, posted_ahead):
    import threading

    import torch.distributed as dist

    import cloudtrain
    from cloudtrain.collectives import ReceivesAhead, exchange_sized

    cloudtrain.init(timeout_s=30)
    group = dist.new_group([0, 1], backend="gloo")
    stream = ReceivesAhead.of(group).stream(0, 8) if posted_ahead else None
    store = dist.distributed_c10d._get_default_store()
    wire = torch.full((8,), rank, dtype=torch.uint8)
    timeout = timedelta(seconds=30)
    exchange_sized(wire, [8, 8], (0, 1), rank, group, timeout, stream=stream).wait()
    if rank == 1:  # says when its second packet has left (gloo's send is complete)
        pending = exchange_sized(wire, [8, 8], (0, 1), 1, group, timeout, stream=stream)
        send = pending.works.pop(0)  # waited for here alone: gloo counts each wait's completion

        def left() -> None:
            send.wait(timeout)
            store.set("sent", "1")

        waiter = threading.Thread(target=left)
        waiter.start()
        pending.wait()
        waiter.join()
        return None
    try:  # rank 0 reaches its second exchange only after 3 s without word that the packet left
        store.wait(["sent"], timedelta(seconds=3))
        early = True
    except RuntimeError:
        early = False
    exchange_sized(wire, [8, 8], (0, 1), 0, group, timeout, stream=stream).wait()
    return early


@pytest.mark.parametrize("posted_ahead", [True, False])
def test_a_packet_leaves_before_its_receiver_reaches_the_exchange_only_posted_ahead(
    posted_ahead,
):
    # gloo holds a send until the receive is posted: posted at the stream's last exchange, the
    # second packet leaves while its receiver is still elsewhere; posted as the exchange starts
    # (without `ahead`), it waits
    assert run_ranks(2, _send_before_the_receiver_arrives, posted_ahead)[0] is posted_ahead


def _too_large_for_the_stream(rank, world):
    import torch.distributed as dist

    import cloudtrain
    from cloudtrain.collectives import CommError, ReceivesAhead, exchange_sized

    cloudtrain.init(timeout_s=30)
    group = dist.new_group([0, 1], backend="gloo")
    stream = ReceivesAhead.of(group).stream(0, 8)
    wire = torch.zeros(9, dtype=torch.uint8)
    try:
        exchange_sized(wire, [9, 9], (0, 1), rank, group, timedelta(seconds=5), stream=stream)
    except CommError as e:
        return str(e)
    return None


def test_a_packet_larger_than_its_streams_receives_is_refused_on_every_owner():
    for text in run_ranks(2, _too_large_for_the_stream):
        assert "exceed the 8 bytes their stream's receives were posted for" in text


def _peer_dies(rank, world):
    import torch.distributed as dist

    import cloudtrain
    from cloudtrain.collectives import CommError, ReceivesAhead, exchange_sized

    cloudtrain.init(timeout_s=6)
    group = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=6))
    stream = ReceivesAhead.of(group).stream(0, 4)
    wire = torch.zeros(4, dtype=torch.uint8)
    timeout = timedelta(seconds=6)
    exchange_sized(wire, [4, 4], (0, 1), rank, group, timeout, stream=stream).wait()  # both alive
    if rank == 1:
        os._exit(1)
    t0 = time.monotonic()
    try:
        where = " at step 3, bucket 0"
        pending = exchange_sized(wire, [4, 4], (0, 1), 0, group, timeout, where, stream=stream)
        pending.wait()
    except CommError as e:
        return str(e), time.monotonic() - t0
    return None, 0.0


def test_a_dead_peer_is_a_comm_error_naming_stage_peers_and_where():
    text, seconds = run_ranks(2, _peer_dies, timeout=60, allow_failures=True)[0]
    assert text is not None, "rank 0 must raise"
    assert "cross-region exchange (point-to-point)" in text and "ranks [0, 1]" in text
    assert "at step 3, bucket 0" in text and "A peer may have died" in text
    assert seconds < 6 + 5


def _sized(rank, world, nbytes, shorter):
    import torch.distributed as dist

    import cloudtrain
    from cloudtrain.collectives import CommError, exchange_sized

    cloudtrain.init(timeout_s=30)
    group = dist.new_group([0, 1], backend="gloo")
    wire = torch.full((nbytes,), rank + 1, dtype=torch.uint8)
    try:
        pending = exchange_sized(
            wire, [8, 8], (0, 1), rank, group, timedelta(seconds=5), shorter=shorter
        )
    except CommError as e:
        return str(e)
    return [w[:nbytes].tolist() for w in pending.wait()]


@pytest.mark.parametrize(
    "nbytes,shorter,message",
    [
        (9, False, "own packet is 9 bytes, the plan says 8"),
        (7, False, "own packet is 7 bytes, the plan says 8"),  # only zstd packets may be shorter
        (9, True, "own packet is 9 bytes, the plan says at most 8"),
    ],
)
def test_own_packet_of_another_size_than_the_plan_is_refused_before_sending(
    nbytes, shorter, message
):
    for text in run_ranks(2, _sized, nbytes, shorter):
        assert isinstance(text, str) and message in text


def test_a_zstd_packet_shorter_than_its_plan_arrives_in_its_plans_buffer():
    # each rank sends 7 bytes where the plan allows 8: gloo fills the first 7 of the buffer
    for received in run_ranks(2, _sized, 7, True):
        assert received == [[1] * 7, [2] * 7]
