"""Topology: regions, shards and their owners (pure), and the groups on real processes."""

from __future__ import annotations

import pytest
from distributed import run_ranks

from cloudtrain import CompressionConfig
from cloudtrain.topology import Topology, local_region_name


def test_regions_sorted_members_and_shards() -> None:
    topo = Topology(rank=3, world_size=5, rank_regions=("us", "eu", "us", "eu", "us"))
    assert topo.regions == ("eu", "us")
    assert topo.members == ((1, 3), (0, 2, 4))
    assert topo.shards == 2  # the smallest region's size
    assert (topo.region, topo.local_index, topo.shard) == (0, 1, 1)
    assert topo.shard_owners(0) == (1, 0)
    assert topo.shard_owners(1) == (3, 2)
    extra = Topology(rank=4, world_size=5, rank_regions=topo.rank_regions)
    assert extra.shard is None  # a larger region's extra rank owns no shard
    assert not topo.single_region
    assert "2 region(s), 2 shard(s)" in topo.describe()


def test_single_region() -> None:
    topo = Topology(rank=0, world_size=2, rank_regions=("a", "a"))
    assert topo.single_region and topo.shards == 2


def test_local_region_name_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert local_region_name(CompressionConfig(regions="per-rank"), 2, 4) == "rank2"
    assert local_region_name(CompressionConfig(regions="probe"), 2, 4) is None
    assert local_region_name(CompressionConfig(regions="a,a,b,b"), 2, 4) == "b"
    monkeypatch.setenv("CLOUDTRAIN_REGION", "eu-west-1")
    assert local_region_name(CompressionConfig(regions="env"), 0, 4) == "eu-west-1"
    with pytest.raises(ValueError, match="one region name per rank"):
        local_region_name(CompressionConfig(regions="a,b"), 0, 4)


def _discover(rank: int, world: int, regions: str, gathered: bool) -> tuple:
    import torch

    import cloudtrain
    from cloudtrain.ddp import check_agreement
    from cloudtrain.topology import Topology

    cloudtrain.init()
    config = CompressionConfig(regions=regions, timeout_s=30)
    # CloudDDP's way: the names come with the model check's gathering, on the default group
    names = check_agreement(torch.nn.Linear(2, 2), config) if gathered else None
    topo = Topology.discover(config, config.timeout, names=names)
    # no rank leaves (closing its connections) while another is still connecting its groups:
    # gloo reports that as "Connection closed by peer" on the rank still connecting
    torch.distributed.barrier(group=topo.groups["control"])
    return topo.rank_regions, topo.region, topo.shard, sorted(topo.groups)


@pytest.mark.parametrize("gathered", [False, True])
def test_discover_agrees_on_every_rank_and_makes_the_groups(gathered: bool) -> None:
    results = run_ranks(3, _discover, "b,a,b", gathered)
    for rank, (regions, region, shard, groups) in enumerate(results):
        assert regions == ("b", "a", "b")
        assert region == (0 if rank == 1 else 1)
        assert shard == (None if rank == 2 else 0)
        assert groups == ["control", "cross0", "dense", "region0", "region1"]


def _start(rank: int, world: int, regions: str, ddp_kwargs: dict, codec: str) -> tuple:
    import torch

    import cloudtrain

    cloudtrain.init()
    torch.manual_seed(rank)  # every rank starts from its own weights and statistics
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.Linear(16, 3, dtype=torch.bfloat16),
    )
    model[1].running_mean.fill_(float(rank))
    model[1].num_batches_tracked.fill_(rank)  # an int64 buffer
    config = CompressionConfig(codec=codec, regions=regions, timeout_s=30)
    ddp = cloudtrain.CloudDDP(model, config, **ddp_kwargs)
    bn = ddp.module[1]
    return (
        [p.float().tolist() for p in ddp.module.parameters()],
        bn.running_mean.tolist(),
        int(bn.num_batches_tracked),
    )


@pytest.mark.parametrize("ddp_kwargs", [{}, {"broadcast_buffers": False}])
@pytest.mark.parametrize("codec", ["none", "auto"])
def test_every_rank_starts_from_rank_0s_model_sent_across_regions_once(ddp_kwargs, codec) -> None:
    """DDP's start-up sync through cloudtrain's groups (Topology.broadcast_from_rank0): rank 0's
    parameters and buffers (float32, bfloat16, int64) reach the other region's first rank (rank
    1, alone in region a) - over cross0, or with "auto" behind the start-up probe's messages on
    the link it measures (Topology.probe's carry) - and its own region's rank 2 inside region
    b; the deprecated broadcast_buffers=False leaves buffers out, as DDP does."""
    results = run_ranks(3, _start, "b,a,b", ddp_kwargs, codec)
    params = [p for p, _, _ in results]
    assert params[1] == params[0] and params[2] == params[0]
    means = [m for _, m, _ in results]
    counts = [n for _, _, n in results]
    if ddp_kwargs:
        assert [m[0] for m in means] == [0.0, 1.0, 2.0] and counts == [0, 1, 2]
    else:
        assert means == [[0.0] * 16] * 3 and counts == [0] * 3


def _groups_at_once(rank: int, world: int) -> tuple:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import cloudtrain
    from cloudtrain.bootstrap import GroupsInMaking

    cloudtrain.init()
    making = GroupsInMaking({"all": [0, 1, 2], "pair": [2, 0], "one": [1]}, timedelta(seconds=30))
    groups = making.wait()
    assert making.wait() is groups  # waited for once
    seen = {}
    for name, group in groups.items():
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            seen[name] = None
            continue
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        # registered as new_group registers: its backend, this rank's number in it (ascending)
        seen[name] = (dist.get_backend(group), dist.get_rank(group), t.item())
    src = dist.get_global_rank(groups["pair"], 1) if rank != 1 else None
    dist.destroy_process_group()  # takes the registered groups with it
    return seen, src


def test_groups_made_at_once_are_registered_like_new_groups() -> None:
    """GroupsInMaking: each group on a thread with its own client of the store; wait() registers
    them in torch.distributed's world - get_backend, get_rank(group) numbered in ascending order
    of the ranks, as new_group numbers them; a rank outside a group gets NON_GROUP_MEMBER."""
    results = run_ranks(3, _groups_at_once)
    assert results[0] == ({"all": ("gloo", 0, 6.0), "pair": ("gloo", 0, 4.0), "one": None}, 2)
    assert results[1] == ({"all": ("gloo", 1, 6.0), "pair": None, "one": ("gloo", 0, 2.0)}, None)
    assert results[2] == ({"all": ("gloo", 2, 6.0), "pair": ("gloo", 1, 4.0), "one": None}, 2)


def _group_missing_a_rank(rank: int, world: int) -> str:
    from datetime import timedelta

    import cloudtrain
    from cloudtrain.bootstrap import GroupsInMaking

    cloudtrain.init()
    # rank 1 never starts the group: rank 0 waits out the timeout and says which group
    if rank == 1:
        return "absent"
    try:
        GroupsInMaking({"both": [0, 1]}, timedelta(seconds=2)).wait()
    except RuntimeError as e:
        return str(e)
    return "made"


def test_a_group_whose_rank_never_comes_fails_naming_it() -> None:
    message = run_ranks(2, _group_missing_a_rank)[0]
    assert "making the gloo process group 'both' of ranks [0, 1] failed" in message
