"""Which rank is in which region, and the process groups CloudDDP reduces a bucket over.

Regions come from CompressionConfig.regions: "env" (CLOUDTRAIN_REGION, else the host's region from
`cloudtrain launch`'s CLOUDTRAIN_HOST_REGIONS), "probe", "per-rank", or an explicit name per rank.
Every rank learns every other rank's region with one all_gather; if any rank has none (or with
"probe"), all links are measured (cloudtrain.probe) and ranks are grouped by bandwidth.

Regions are ordered by name; inside a region ranks are ordered by rank, and a rank's position
there is its local index. With S = the size of the smallest region, a bucket is cut into S shards:
the rank of local index j in each region owns shard j and exchanges it (compressed) with the
owners of shard j in the other regions - S parallel flows per region pair, which also sidesteps
the per-flow TCP window cap of long paths. Ranks with local index >= S (in larger regions) own
no shard and receive the results from their region.

Groups (every rank creates every group, in the same order, as torch.distributed requires):
- `control`: all ranks, gloo - the probe, plans, replica checks;
- `dense`: all ranks, the job's backend - the single-region all-reduce;
- `region[r]`: the ranks of region r, the job's backend - dense reduce-scatter / all-gather;
- `cross[j]`: the owners of shard j, one per region, gloo - compressed packets (CPU bytes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .bootstrap import GroupsInMaking, control_group
from .buffers import BROADCAST_BUCKET_BYTES
from .config import CompressionConfig
from .probe import LinkMatrix, cluster_regions, expand, probe, representative_pairs
from .tcp import host_warning

log = logging.getLogger("cloudtrain")

AUTO_REGION = "measured"
REGION_ENV = "CLOUDTRAIN_REGION"
HOST_REGIONS_ENV = "CLOUDTRAIN_HOST_REGIONS"


def region_of_this_host(environ: Mapping[str, str] | None = None) -> str | None:
    """This process's region: CLOUDTRAIN_REGION, else CLOUDTRAIN_HOST_REGIONS looked up by
    HOROVOD_HOSTNAME (this rank's -H address), the host name, or its addresses; else None."""
    env = os.environ if environ is None else environ
    if env.get(REGION_ENV):
        return env[REGION_ENV]
    raw = env.get(HOST_REGIONS_ENV)
    if not raw:
        return None
    try:
        mapping = json.loads(raw)
        if not isinstance(mapping, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise ValueError(
            f"{HOST_REGIONS_ENV} must be a JSON object {{address: region}} ({e}): {raw[:200]!r}"
        ) from e
    if env.get("HOROVOD_HOSTNAME") in mapping:
        return mapping[env["HOROVOD_HOSTNAME"]]
    hostname = socket.gethostname()
    if hostname in mapping:
        return mapping[hostname]
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(hostname, None)}
    except OSError:
        addresses = set()
    for addr in sorted(addresses):
        if addr in mapping:
            return mapping[addr]
    return None


def local_region_name(config: CompressionConfig, rank: int, world_size: int) -> str | None:
    """This rank's region name according to the config, or None if it must be measured."""
    if config.regions == "per-rank":
        return f"rank{rank}"
    if config.regions == "probe":
        return None
    if config.regions == "env":
        return region_of_this_host()
    if len(config.regions) != world_size:
        raise ValueError(
            f"CompressionConfig.regions names {len(config.regions)} regions but the job has "
            f"{world_size} ranks; give one region name per rank"
        )
    return config.regions[rank]


@dataclass
class Topology:
    rank: int
    world_size: int
    rank_regions: tuple[str, ...]
    """Region name of every rank, by rank."""
    regions: tuple[str, ...] = field(init=False)
    """Region names, sorted: a region's index is its position here."""
    members: tuple[tuple[int, ...], ...] = field(init=False)
    """Ranks of each region (by region index), ascending."""
    shards: int = field(init=False)
    groups: dict[str, Any] = field(default_factory=dict, repr=False)
    links: LinkMatrix | None = field(default=None, repr=False)
    """Measured links between all ranks, where they were probed."""
    _making: GroupsInMaking | None = field(default=None, repr=False, compare=False)
    _private_making: dict[tuple[str, ...], GroupsInMaking] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.regions = tuple(sorted(set(self.rank_regions)))
        self.members = tuple(
            tuple(r for r in range(self.world_size) if self.rank_regions[r] == name)
            for name in self.regions
        )
        self.shards = min(len(m) for m in self.members)

    @property
    def region(self) -> int:
        """This rank's region index."""
        return self.regions.index(self.rank_regions[self.rank])

    @property
    def local_index(self) -> int:
        return self.members[self.region].index(self.rank)

    @property
    def shard(self) -> int | None:
        """The shard this rank exchanges across regions, or None if it owns none."""
        return self.local_index if self.local_index < self.shards else None

    @property
    def single_region(self) -> bool:
        return len(self.regions) == 1

    def shard_owners(self, shard: int) -> tuple[int, ...]:
        """The ranks that exchange `shard`, one per region, in region order."""
        return tuple(m[shard] for m in self.members)

    def describe(self) -> str:
        parts = [
            f"{name}: ranks {list(m)}" for name, m in zip(self.regions, self.members, strict=True)
        ]
        return f"{len(self.regions)} region(s), {self.shards} shard(s) per bucket - " + "; ".join(
            parts
        )

    @classmethod
    def discover(
        cls,
        config: CompressionConfig,
        timeout: timedelta,
        wait: bool = True,
        names: Sequence[str | None] | None = None,
    ) -> Topology:
        """All ranks: agree on every rank's region and create the process groups. `wait=False`:
        the gloo groups are still being made on return (their rendezvous is round trips on the
        store; the caller overlaps it with its own work): call wait_groups() before using them.
        `names`: every rank's local_region_name, where the caller has gathered them already
        (CloudDDP, with its model check)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        control = control_group(timeout.total_seconds())
        if names is None:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, local_region_name(config, rank, world), group=control)
            names = gathered
        if len(names) != world:
            raise ValueError(f"names: one region name per rank ({world}), got {len(names)}")
        names = list(names)
        links = None
        if any(name is None for name in names):
            links = probe(control)
            names = [f"{AUTO_REGION}{label}" for label in cluster_regions(links)]
        topo = cls(rank, world, tuple(names), links=links)
        if links is not None:
            topo.check_buffers(
                links, [(i, j) for i in range(world) for j in range(world) if i != j]
            )
        topo.groups["control"] = control
        topo._making = topo._start_groups(timeout)
        if wait:
            topo.wait_groups()
        return topo

    def probe(self, carry: Sequence[Any] = ()) -> LinkMatrix:
        """Measure the links now (all ranks call), and keep the result (`measure`). `carry`
        (where `carried` says so, else ()): tensors whose rank 0 values the probe takes across
        to the other regions' first ranks on its way; broadcast_from_rank0(carry, carried=True)
        then finishes inside the regions."""
        # rank 0's bytes; elsewhere room for them (the other regions' first ranks receive them)
        packed = None
        if carry:
            packed = (
                _pack(carry) if self.rank == 0 else torch.empty(_nbytes(carry), dtype=torch.uint8)
            )
        self.links = self.measure(self.group("control"), "links measured", carry=packed)
        if packed is not None and self.shard == 0 and self.rank != 0:
            _unpack(packed, carry)
        self.check_buffers(self.links, representative_pairs(self.members))
        return self.links

    def check_buffers(self, links: LinkMatrix, measured: Sequence[tuple[int, int]]) -> None:
        """Warn where this host's TCP buffers, not the links, may set what the links this rank
        measured across regions carry (`measured`: the probe's pairs; the others are copies of
        them): every host of its own, whichever of its ranks measured; and where the host
        restarts idle connections from TCP's initial window (tcp.IDLE_WARNING)."""
        across = [(i, j) for i, j in measured if self.rank_regions[i] != self.rank_regions[j]]
        message = host_warning(links, self.rank, across, self.rank_regions.__getitem__)
        if message:
            log.warning(
                "cloudtrain: rank %d (%s): %s", self.rank, self.rank_regions[self.rank], message
            )

    def carried(self, tensors: Sequence[Any]) -> bool:
        """Whether `probe` should take `tensors` across (the same answer on every rank: several
        regions, and no more than CARRY_MAX_BYTES, whose room each rank holds meanwhile)."""
        return not self.single_region and 0 < _nbytes(tensors) <= CARRY_MAX_BYTES

    def measure(self, group: Any, what: str, across: bool = False, **options: Any) -> LinkMatrix:
        """The links measured on `group` (all ranks call; `options` go to probe.probe): with the
        regions known, the links that stand for all (probe.representative_pairs: each way
        between every two regions, and - unless `across` - one inside each region; those that
        share no link at the same time), the rest copied from them. Logged on rank 0 as
        `what`."""
        t0 = time.perf_counter()
        region = [0] * self.world_size
        for r, members in enumerate(self.members):
            for rank in members:
                region[rank] = r
        pairs = [
            (i, j)
            for i, j in representative_pairs(self.members)
            if not across or region[i] != region[j]
        ]
        links = expand(probe(group, pairs=pairs, region=region, **options), self.members)
        if self.rank == 0:
            leaders = [m[0] for m in self.members]
            seen = ", ".join(
                f"{self.regions[a]}->{self.regions[b]} {links.mbit(la, lb):.1f} Mbit/s "
                f"{1000 * links.alpha[la][lb]:.0f} ms"
                for a, la in enumerate(leaders)
                for b, lb in enumerate(leaders)
                if a != b
            )
            names = self.regions
            again = ", ".join(f"{names[region[i]]}->{names[region[j]]}" for i, j in links.again)
            if again:  # (probe.DISAGREE)
                seen += f"; {again} measured again one way at a time (far apart at once)"
            log.warning("cloudtrain: %s in %.1f s: %s", what, time.perf_counter() - t0, seen)
        return links

    def group_ranks(self) -> dict[str, list[int]]:
        """The ranks of each process group CloudDDP uses, by name, in the order they are made:
        "dense" (all), and with several regions "region<i>" (a region's ranks) and "cross<s>"
        (shard s's owner in every region)."""
        out = {"dense": list(range(self.world_size))}
        if self.single_region:
            return out
        for index, ranks in enumerate(self.members):
            out[f"region{index}"] = list(ranks)
        for shard in range(self.shards):
            out[f"cross{shard}"] = list(self.shard_owners(shard))
        return out

    def _start_groups(self, timeout: timedelta) -> GroupsInMaking:
        """Make the groups of `group_ranks`: the region's own collectives on the job's backend
        (new_group, here), those across regions on gloo (made at once, on threads)."""
        backend = dist.get_backend()
        across: dict[str, list[int]] = {}
        for name, ranks in self.group_ranks().items():
            inside = name == "dense" or name.startswith("region")
            if inside and backend != "gloo":
                self.groups[name] = dist.new_group(ranks, timeout=timeout, backend=backend)
            else:
                across[name] = ranks
        return GroupsInMaking(across, timeout)

    def wait_groups(self) -> None:
        """The groups `discover(wait=False)` left in the making, made (all ranks call)."""
        if self._making is not None:
            self.groups.update(self._making.wait())
            self._making = None

    def private(self, names: Sequence[str], timeout: timedelta) -> Topology:
        """A copy with new gloo process groups for `names` ("control" too), made in the same
        order on every rank (all ranks call); other groups are shared. For collectives on a
        background thread, which must never interleave with those on the topology's groups
        (and gloo, also inside a region: NCCL collectives issued from two threads on one device
        can be queued in different orders on different ranks and deadlock). Those that
        start_private began are taken."""
        self.wait_groups()
        making = self._private_making.pop(tuple(names), None)
        if making is None:
            making = self.start_private(names, timeout, keep=False)
        own = dataclasses.replace(self, groups={**self.groups, **making.wait()}, _private_making={})
        return own

    def start_private(
        self, names: Sequence[str], timeout: timedelta, keep: bool = True
    ) -> GroupsInMaking:
        """Begin making the groups of a later private(names) (all ranks call, in the same order),
        so that their rendezvous overlaps other work."""
        ranks = {"control": list(range(self.world_size)), **self.group_ranks()}
        unknown = [name for name in names if name not in ranks]
        if unknown:
            raise ValueError(f"no process group {unknown} in this topology (it has {list(ranks)})")
        making = GroupsInMaking({name: ranks[name] for name in names}, timeout)
        if keep:
            self._private_making[tuple(names)] = making
        return making

    def group(self, name: str) -> Any:
        return self.groups[name]

    def broadcast_from_rank0(self, tensors: Sequence[Any], carried: bool = False) -> None:
        """Rank 0's `tensors` on every rank (all ranks call, several regions), each region's link
        crossed once: to the other regions' first ranks over "cross0" (the shard-0 owners, rank
        0 first) - or, `carried`, already there with the start-up probe (`probe(carry=)`) -
        then from each first rank inside its region. DDP's own start-up broadcast sends rank
        0's copy to every rank, across the WAN once per rank of another region."""
        if not tensors:
            return
        if self.shard == 0 and not carried:
            dist._broadcast_coalesced(
                self.group("cross0"), list(tensors), BROADCAST_BUCKET_BYTES, 0
            )
        if len(self.members[self.region]) > 1:
            region = self.group(f"region{self.region}")
            dist._broadcast_coalesced(region, list(tensors), BROADCAST_BUCKET_BYTES, 0)


CARRY_MAX_BYTES = 64 * 2**20
"""The most start-up state (parameters and buffers) the start-up probe carries across. Its
message takes a fresh connection through TCP slow start - about 8 round trips for 2 MB, which
the probe pays anyway - where the broadcast on its own connections would pay them again (at
180 ms, 1.1-1.5 s for 4.5 MB); beyond this, every rank's packed copy costs more memory than the
round trips are worth."""


def _nbytes(tensors: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _pack(tensors: Sequence[Any]) -> torch.Tensor:
    """The tensors' bytes, one after another, on the host."""
    return torch.cat([t.detach().contiguous().cpu().reshape(-1).view(torch.uint8) for t in tensors])


def _unpack(packed: torch.Tensor, tensors: Sequence[Any]) -> None:
    """`_pack`'s bytes back into the tensors, in place."""
    at = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel() * t.element_size()
            t.copy_(packed[at : at + n].clone().view(t.dtype).view(t.shape))
            at += n
