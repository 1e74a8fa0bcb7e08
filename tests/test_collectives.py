"""Collectives with deadlines (cloudtrain.collectives) on real processes over gloo: packets in
region order from both exchanges, arrival times, issue-now-wait-later, and errors that name the
stage, the peers and where - within the timeout - instead of a hang; the point-to-point
reduce-scatter inside a region."""

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
    from cloudtrain.collectives import exchange_fixed, exchange_sized

    cloudtrain.init(timeout_s=30)
    group = dist.new_group([0, 1, 2], backend="gloo")
    peers = (2, 0, 1)  # region order is not rank order
    me = peers.index(rank)
    fixed_wire = torch.full((5,), rank, dtype=torch.uint8)
    fixed = exchange_fixed(fixed_wire, peers, group, timedelta(seconds=30)).wait()
    sizes = [3, 7, 11]
    wire = torch.full((sizes[me],), 10 + rank, dtype=torch.uint8)
    timings: dict[int, float] = {}
    pending = exchange_sized(wire, sizes, peers, me, group, timedelta(seconds=30), "", timings)
    sized = pending.wait()
    return [t.tolist() for t in fixed], [t.tolist() for t in sized], sorted(timings)


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


def test_both_exchanges_give_every_region_its_packet_in_region_order():
    for rank, (fixed, sized, timed) in enumerate(run_ranks(3, _exchanges)):
        assert fixed == [[2] * 5, [0] * 5, [1] * 5]
        assert sized == [[12] * 3, [10] * 7, [11] * 11]
        me = (2, 0, 1).index(rank)
        assert timed == sorted(i for i in range(3) if i != me)  # every other sender timed


def _peer_dies(rank, world):
    import torch.distributed as dist

    import cloudtrain
    from cloudtrain.collectives import CommError, exchange_fixed

    cloudtrain.init(timeout_s=6)
    group = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=6))
    wire = torch.zeros(4, dtype=torch.uint8)
    exchange_fixed(wire, (0, 1), group, timedelta(seconds=6)).wait()  # both alive once
    if rank == 1:
        os._exit(1)
    t0 = time.monotonic()
    try:
        pending = exchange_fixed(wire, (0, 1), group, timedelta(seconds=6), " at step 3, bucket 0")
        pending.wait()
    except CommError as e:
        return str(e), time.monotonic() - t0
    return None, 0.0


def test_a_dead_peer_is_a_comm_error_naming_stage_peers_and_where():
    text, seconds = run_ranks(2, _peer_dies, timeout=60, allow_failures=True)[0]
    assert text is not None, "rank 0 must raise"
    assert "cross-region exchange (all_gather)" in text and "ranks [0, 1]" in text
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
