"""The pieces of cloudtrain.sharded that know FSDP2 and the mesh: the 2-D mesh of the regions
("replicate", "shard": a row per region), a unit (the parameters of one fully_shard call, one
FSDP param group) as cloudtrain exchanges it, and the checks every rank runs before the first
step (units left to torch's own fully_shard; units sharded differently across regions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from .bootstrap import init
from .config import CompressionConfig
from .topology import Topology

MESH_DIMS = ("replicate", "shard")


# -- the mesh ------------------------------------------------------------------------------------
_MESHES: dict[tuple[Any, ...], tuple[Topology, DeviceMesh]] = {}
"""(regions, timeout, default group) -> the topology and mesh made for them."""


def topology_and_mesh(config: CompressionConfig) -> tuple[Topology, DeviceMesh]:
    """The regions (Topology.discover, all ranks) and the mesh of regions x ranks in a region,
    made once per process for each regions setting."""
    init(timeout_s=config.timeout_s)
    key = (repr(config.regions), config.timeout_s, id(dist.group.WORLD))
    if key not in _MESHES:
        topo = Topology.discover(config, config.timeout)
        sizes = {len(m) for m in topo.members}
        if len(sizes) != 1:
            counts = ", ".join(
                f"{name} {len(m)}" for name, m in zip(topo.regions, topo.members, strict=True)
            )
            raise ValueError(
                f"cloudtrain.fully_shard: the regions have different numbers of ranks ({counts}); "
                "sharding inside regions needs a mesh of regions x ranks, the same number of ranks "
                "in every region: launch as many ranks in each, or use CloudDDP"
            )
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = DeviceMesh(device, torch.tensor(topo.members), mesh_dim_names=MESH_DIMS)
        _MESHES[key] = (topo, mesh)
    return _MESHES[key]


def device_mesh(config: CompressionConfig | str | None = None) -> DeviceMesh:
    """The 2-D mesh ("replicate", "shard") of the regions: row r is region r's ranks (regions in
    name order, ranks ascending). All ranks call (the first call per regions setting discovers
    the regions and makes the process groups). config: whose `regions` to use (default "env")."""
    return topology_and_mesh(CompressionConfig.resolve(config))[1]


def check_mesh(mesh: Any, ours: DeviceMesh) -> None:
    if mesh is None or mesh is ours:
        return
    names = getattr(mesh, "mesh_dim_names", None)
    ranks = mesh.mesh.tolist() if isinstance(mesh, DeviceMesh) else None
    if names != MESH_DIMS or ranks != ours.mesh.tolist():
        raise ValueError(
            f"cloudtrain.fully_shard: mesh={mesh!r} (ranks {ranks}, dims {names}) is not the mesh "
            f"of the regions, {ours.mesh.tolist()} with dims {MESH_DIMS} (a row per region): "
            "leave mesh out, or pass mesh=cloudtrain.device_mesh(config) with the config given "
            "to fully_shard (its regions make the mesh)"
        )


# -- one unit: the parameters of one fully_shard call --------------------------------------------
@dataclass
class Unit:
    """One FSDP param group as cloudtrain exchanges it: its trainable parameters' local shards
    laid end to end (in FSDP's order)."""

    index: int
    module: nn.Module
    group: Any
    """torch's FSDPParamGroup: its flags say whether this backward syncs."""

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's trainable sharded (DTensor) parameters, as FSDP holds them now (a load with
        assign=True replaces them)."""
        return [fp.sharded_param for fp in self.group.fsdp_params if fp.sharded_param.requires_grad]

    @property
    def syncs(self) -> bool:
        """FSDP reduces this unit's gradients across data-parallel ranks in this backward."""
        return bool(self.group.reduce_grads and self.group.all_reduce_grads)

    @property
    def offload(self) -> bool:
        return any(fp.offload_to_cpu for fp in self.group.fsdp_params)

    def numel(self) -> int:
        return sum(p.to_local().numel() for p in self.params)

    def flat_grad(self, scale: float) -> torch.Tensor:
        """(numel,) this rank's shard of the unit's gradient times `scale`, a copy (zeros where a
        parameter has none)."""
        pieces = []
        for p in self.params:
            local = p.to_local()
            grad = p.grad.to_local() if p.grad is not None else local.new_zeros(local.shape)
            pieces.append(grad.reshape(-1))
        if not pieces:
            return torch.zeros(0)
        return torch.cat(pieces).mul_(scale)

    def write_grad(self, flat: torch.Tensor) -> None:
        """The unit's gradient shards become `flat`'s values (a parameter without a gradient gets
        one only where they are not all zero: HSDP leaves it None, a region that used it does
        not)."""
        at = 0
        for p in self.params:
            local = p.to_local()
            piece = flat[at : at + local.numel()].view(local.shape)
            at += local.numel()
            if p.grad is None:
                if not bool(piece.any()):
                    continue
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_local()
            grad.copy_(piece.to(device=grad.device, dtype=grad.dtype))


# -- checks before the first step --------------------------------------------------------------
def check_units(root: nn.Module, modules: list[nn.Module]) -> None:
    """Every FSDP module under the root must be one of ours (`modules`): torch's own fully_shard
    would leave its gradients inside the region."""
    mine = {id(m) for m in modules}
    for name, sub in root.named_modules():
        if isinstance(sub, FSDPModule) and id(sub) not in mine:
            groups = sub._get_fsdp_state()._fsdp_param_groups
            if groups:
                raise ValueError(
                    f"cloudtrain: module {name or '(root)'!r} was sharded by torch's "
                    "fully_shard, not cloudtrain's: its gradients would never leave the "
                    "region. Shard every unit with `from cloudtrain import fully_shard`"
                )


def check_uniform(units: list[Unit], names: dict[int, str], topo: Topology) -> None:
    """The owners of a shard in every region hold the same parameters in the same shapes,
    unit by unit (else their packets would not match): gathered, compared, raised on every
    rank alike."""
    mine = [
        [(names.get(id(p), "?"), tuple(p.to_local().shape), str(p.dtype)) for p in u.params]
        for u in units
    ]
    everyone: list[Any] = [None] * topo.world_size
    dist.all_gather_object(everyone, mine, group=topo.group("control"))
    for rank, layout in enumerate(everyone):
        ref = reference(topo, rank)
        if layout == everyone[ref]:
            continue
        where = _first_difference(layout, everyone[ref])
        raise ValueError(
            f"cloudtrain.fully_shard: rank {rank} (region "
            f"{topo.rank_regions[rank]}) shards the model differently from rank {ref} "
            f"(region {topo.rank_regions[ref]}), which holds the same shard: {where}. Every "
            "region must shard the same model with the same units: the same fully_shard "
            "calls, in the same order, with the same shard_placement_fn"
        )


def _first_difference(a: list[Any], b: list[Any]) -> str:
    if len(a) != len(b):
        return f"{len(a)} units against {len(b)}"
    for i, (ua, ub) in enumerate(zip(a, b, strict=True)):
        if ua != ub:
            return f"unit {i} holds {ua} against {ub}"
    return "?"


def reference(topo: Topology, rank: int) -> int:
    """The rank of the first region that holds the same shard as `rank`."""
    members = topo.members
    region = next(r for r, m in enumerate(members) if rank in m)
    return members[0][members[region].index(rank)]
