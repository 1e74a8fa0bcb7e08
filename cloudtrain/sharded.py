"""Models that do not fit one GPU: FSDP2 shards them inside each region, cloudtrain carries the
shards across regions.

    import cloudtrain
    from cloudtrain import fully_shard       # was: from torch.distributed.fsdp import fully_shard

    cloudtrain.init()
    for block in model.layers:
        fully_shard(block, mp_policy=mp)      # FSDP2's own arguments, on cloudtrain's mesh
    fully_shard(model, mp_policy=mp)          # config="auto" by default: cloudtrain's presets
    opt = torch.optim.AdamW(model.parameters())   # built after sharding, as FSDP2 wants
    ...                                       # train as with FSDP2
    comm = cloudtrain.ShardedComm.of(model)   # stats(), comm_state_dict(), close(), ...

`device_mesh()` is a 2-D DeviceMesh ("replicate", "shard") built from the regions (the same
CompressionConfig.regions as CloudDDP's): row r holds region r's ranks, so a region's ranks form
the "shard" dimension and the regions the "replicate" dimension. `fully_shard` calls torch's on
the "shard" dimension - plain FSDP inside each region: the parameters, gradients and optimizer
state of a rank are 1/k of the model's for k ranks per region - and registers the unit (the
parameters of that call: one FSDP param group) with the run's `ShardedComm`, which does what
FSDP's HSDP does with a dense all-reduce across the replicate dimension, per unit:

    FSDP: reduce-scatter in the region     -> p.grad = this rank's shard of the region's mean
    next unit's reduction (or the end of backward): the unit's shard is final (`Unit.flat_grad`)
    CrossRegion.issue(flat / R, ...)       -> error feedback + the plan's codec + zstd, and the
                                              swap with the owners of the same shard in the
                                              other regions, issued on the communication thread
    end of backward: CrossRegion.collect   -> every packet checked, decoded, summed in region
                                              order (the same bits on every owner of the shard)
    p.grad = the sum                       -> stays sharded: nothing is gathered

The swaps of all units are in flight together and overlap the rest of backward, so a step waits
for about half a round trip (receives posted ahead), not one per unit. A unit's shard is
exchanged once per gradient sync, after the last backward that reduced it: with accumulation (`set_requires_gradient_sync(False)`,
or `set_requires_all_reduce(False)`, on the micro-steps) what crosses is the accumulated gradient
FSDP left in p.grad - never one micro-batch's reduction alone, which is all a hook on FSDP's
reduction sees (the trap of gating such a hook to the last micro-batch). The plan - codec per
region, zstd, staleness - is the config's or the controller's ("auto", cloudtrain.controller),
fixed at a step's first exchange; with staleness s > 0 the sums wait in cloudtrain.pipeline and
step t applies step t - s's. With an outer loop (config.outer, e.g. "diloco"), nothing crosses
per step: `OuterLoop(sharded=True)` exchanges each rank's shard of the pseudo-gradients every H
steps and keeps the outer copy of its own shard only.

Checks, on every rank before the first step: a mesh that is not the regions' (`fully_shard`);
parameters of several dtypes in one unit (`fully_shard`); units sharded differently across
regions, or left to torch's own fully_shard (at the first forward, `ShardedComm.set_up`); an
optimizer built before sharding (at its first step: it would update tensors the model no
longer holds).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from .compress import ErrorFeedback
from .config import AUTO, CompressionConfig
from .datapath import CrossRegion
from .ddp import WRAPPED, check_agreement
from .guard import QualityProbe
from .hook import CommThread, FailureRelay, first_plan, verify_replicas
from .outer import OuterLoop, check_optimizer
from .pipeline import Pipeline
from .plan import Codecs, Plan
from .shard_exchange import UnitExchange
from .shard_units import (
    Unit,
    check_mesh,
    check_uniform,
    check_units,
    reference,
    topology_and_mesh,
)
from .stats import CommStats, Observer

log = logging.getLogger("cloudtrain")

SHARDED_STATE_FORMAT = "cloudtrain.sharded/1"


# -- the run ---------------------------------------------------------------------------------------
_LIVE: weakref.WeakSet[ShardedComm] = weakref.WeakSet()
_BY_MODULE: weakref.WeakKeyDictionary[nn.Module, ShardedComm] = weakref.WeakKeyDictionary()
_OPEN: list[ShardedComm] = []
"""The comm new fully_shard calls join (until it is set up: then a new model starts a new one)."""
_REPLACED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
"""Parameters fully_shard replaced by their shards, by id: an optimizer holding one was built
before sharding."""
_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_HOOKED: list[Any] = []


class ShardedComm(UnitExchange):
    """The cross-region side of a model sharded with cloudtrain.fully_shard (module docstring):
    one per model, made by its first fully_shard call. `ShardedComm.of(model)` finds it."""

    def __init__(self, config: CompressionConfig, given: bool = True) -> None:
        self.config = config
        self.given = given
        """Whether a fully_shard call gave the config (else "auto", until a later call's)."""
        self.topo, self.mesh = topology_and_mesh(config)
        self.units: list[Unit] = []
        self.modules: list[nn.Module] = []
        """Every module fully_shard sharded for this model, in call order."""
        self.codecs = Codecs(config)
        self.ready = False
        self.root: nn.Module | None = None
        self.names: dict[int, str] = {}
        self.controller: Any = None
        self.device = torch.device("cpu")
        self.path: CrossRegion | None = None
        self.pipeline = Pipeline()
        self.plan: Plan | None = None
        self.step = 0
        self.outer: OuterLoop | None = None
        self._relay = FailureRelay()
        self._thread: CommThread | None = None
        # this backward: the unit FSDP reduced last (final once the next one reduces), units
        # reduced since their last sync, swaps issued
        self._reducing: Unit | None = None
        self._owed: set[int] = set()
        self._issued: list[tuple[Unit, torch.futures.Future]] = []
        self._queued = False
        _LIVE.add(self)

    def check_adoptable(self, config: CompressionConfig) -> None:
        """A later fully_shard call's config (the root's, say), where the earlier calls gave
        none, applies to the whole model (`adopt`) if it names the same regions and timeout,
        which made the mesh the earlier calls sharded over; else this raises. A model whose
        mesh is not the config's cannot go on: the next fully_shard call starts another."""
        if self.given:
            raise ValueError(
                f"cloudtrain.fully_shard: config {config.codec!r} differs from the one an earlier "
                f"fully_shard call of this model gave ({self.config.codec!r}); give the config "
                "once (or the same one every time)"
            )
        mesh_of = (repr(config.regions), config.timeout_s)
        if self.ready or mesh_of != (repr(self.config.regions), self.config.timeout_s):
            if _OPEN and _OPEN[0] is self:
                _OPEN.clear()
            raise ValueError(
                f"cloudtrain.fully_shard: config (regions={config.regions!r}, timeout_s="
                f"{config.timeout_s}) is given after this model's first fully_shard call, which "
                "made its mesh from the default config's regions and timeout"
                + (" and ran a forward" if self.ready else "")
                + "; give config= to the first call (the first block's), or to every call"
            )

    def adopt(self, config: CompressionConfig) -> None:
        """The whole model's config from now on (check_adoptable said it may be)."""
        self.config, self.codecs, self.given = config, Codecs(config), True

    @classmethod
    def of(cls, module: nn.Module) -> ShardedComm:
        """The ShardedComm of a module cloudtrain.fully_shard sharded (the root, or any unit)."""
        comm = _BY_MODULE.get(module)
        if comm is None:
            raise ValueError(
                f"{type(module).__name__} was not sharded by cloudtrain.fully_shard, so it has no "
                "ShardedComm: shard it with `from cloudtrain import fully_shard`"
            )
        return comm

    @property
    def compression_config(self) -> CompressionConfig:
        return self.config

    @property
    def regions(self) -> int:
        return len(self.topo.regions)

    @property
    def crosses(self) -> bool:
        """Gradient shards cross regions every step (several regions, no outer loop)."""
        return self.regions > 1 and self.config.outer is None

    @property
    def error(self) -> BaseException | None:
        return self._relay.error

    # -- building --------------------------------------------------------------------------------
    def add(self, module: nn.Module) -> None:
        """Register the FSDP module `module` (sharded just now): each of its param groups is a
        unit, whose reductions FSDP reports to `_reduced`."""
        groups = list(module._get_fsdp_state()._fsdp_param_groups)
        if len(groups) > 1:
            raise ValueError(
                "cloudtrain.fully_shard: a shard_placement_fn that puts parameters on meshes of "
                "their own is not supported (one FSDP module, several param groups)"
            )
        for group in groups:
            unit = Unit(len(self.units), module, group)
            self.units.append(unit)
            module.set_all_reduce_hook(lambda _output, unit=unit: self._reduced(unit))
        module.register_forward_pre_hook(self._pre_forward)
        self.modules.append(module)
        _BY_MODULE[module] = self

    def joins(self, module: nn.Module) -> bool:
        """Whether a fully_shard call on `module` belongs to this model: until a call shards a
        module around all the other units so far (the root), every call does; after it, only a
        call on a module around that root. (A model of one unit is closed by its first forward:
        shard the next model after it, or give it blocks.)"""
        inside = {id(m) for m in module.modules()}
        roots = [m for m in self.modules if len(self.modules) > 1 and self._around_all(m)]
        return not roots or id(roots[-1]) in inside

    def _around_all(self, module: nn.Module) -> bool:
        inside = {id(sub) for sub in module.modules()}
        return all(id(m) in inside for m in self.modules)

    def set_up(self) -> None:
        """Once, at the first forward (FSDP's own lazy init has run) or the first call that needs
        it; all ranks. Checks what every rank must agree on, then makes the data path and, with
        "auto", the controller."""
        if self.ready:
            return
        if _OPEN and _OPEN[0] is self:
            _OPEN.clear()  # a fully_shard call from now on starts another model
        self.ready = True
        root = self._outermost()
        self.root = root
        self.names = {id(p): name for name, p in root.named_parameters()}
        try:
            try:
                check_units(root, self.modules)
                problem = None
            except ValueError as e:
                problem = e
            check_agreement(root, self.config, problem)
            check_uniform(self.units, self.names, self.topo)
        except Exception:
            self.ready = False
            raise
        config, topo = self.config, self.topo
        if config.codec == AUTO and self.crosses:
            from .controller import Controller

            if topo.links is None:
                topo.probe()
            self.controller = Controller(
                config, topo, self.codecs, self.shard_numels(), self._device()
            )
        guarded = self.controller is not None and self.controller.guard is not None
        ef = ErrorFeedback(config.residual_torch_dtype) if config.error_feedback else None
        self.path = CrossRegion(
            config, topo, self.codecs, ef, CommStats(),
            Observer() if self.controller is not None else None,
            QualityProbe(config.controller.quality_sample) if guarded else None,
        )  # fmt: skip
        self.path.stats.buckets = len(self.units)
        self.plan = first_plan(config, topo, self.codecs, self.controller)
        self.device = self._device()
        self._thread = CommThread(lambda job: [(job, job.work())], self._relay, self.device)
        log.info(
            "cloudtrain: sharded %d unit(s) over %s; config %s",
            len(self.units),
            topo.describe(),
            config.codec if config.outer is None else "outer loop",
        )

    def _outermost(self) -> nn.Module:
        """The unit whose module holds every other unit's: the root (FSDP's root is the module
        first called, which in a model sharded bottom-up is this one)."""
        for module in reversed(self.modules):
            if self._around_all(module):
                return module
        raise ValueError(
            "cloudtrain.fully_shard: no unit holds all the others; shard the model's root too "
            "(fully_shard(model) after its blocks), as FSDP2 expects. With two models, shard "
            "one's blocks and root before the other's: a model sharded in one call (no blocks) "
            "is closed by its first forward, and until then the next call joins it"
        )

    def _device(self) -> torch.device:
        """Where the gradient shards live (the host with CPU offload)."""
        for unit in self.units:
            for p in unit.params:
                return p.to_local().device
        return torch.device("cpu")

    def shard_numels(self) -> list[int]:
        """Elements of this rank's shard of every unit."""
        return [u.numel() for u in self.units]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner optimizer of an outer loop (config.outer): found by itself at its first
        step(); call this where the comm state must load before that (all ranks)."""
        if self.config.outer is None or self.outer is not None:
            return
        self.set_up()
        params = [p for u in self.units for p in u.params]
        check_optimizer(optimizer, params)
        self.outer = OuterLoop(
            self.config, self.topo, params, optimizer, self.path.stats, lambda: self.step,
            sharded=True,
        )  # fmt: skip

    # -- checks, state, end ----------------------------------------------------------------------
    def verify_replicas(self) -> None:
        """Raise ReplicaMismatch unless every shard is bit-identical in every region (all ranks
        call)."""
        self.set_up()
        params = [p for _, p in self.root.named_parameters()]
        names = [name for name, _ in self.root.named_parameters()]
        tensors = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        verify_replicas(
            tensors,
            names,
            self.topo,
            self.step,
            self.config.timeout_s,
            lambda rank: reference(self.topo, rank),
        )

    def stats(self) -> CommStats:
        """A copy of this rank's counters (cloudtrain.stats), with "auto" also what the
        controller believes and decided (as CloudDDP.stats())."""
        self.set_up()
        stats = self.path.stats.copy()
        if self.controller is not None:
            stats.controller = self.controller.snapshot()
        return stats

    def comm_state_dict(self) -> dict[str, Any]:
        """This rank's communication state: residuals, step, controller, the pipeline's sums in
        flight (finished first: a collective, every rank calls it at the same step), counters;
        with an outer loop its outer copy, momentum, residuals and fragments in flight, of this
        rank's shard."""
        self.set_up()
        if self.config.outer is not None and self.outer is None:
            raise ValueError(
                "ShardedComm.comm_state_dict(): the outer loop has no optimizer yet; call "
                "attach(optimizer) first (or save after the first optimizer step)"
            )
        self._finish_flights()
        return {
            "format": SHARDED_STATE_FORMAT,
            "config": self.config.fingerprint(),
            "rank": self.topo.rank,
            "regions": list(self.topo.rank_regions),
            "units": self.shard_numels(),
            "step": self.step,
            **self.path.state_dict(),
            "controller": None if self.controller is None else self.controller.state_dict(),
            "pipeline": self.pipeline.state_dict(),
            "outer": None if self.outer is None else self.outer.state_dict(),
        }

    def load_comm_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `comm_state_dict()` of this rank of the saved run (after the model and
        optimizer are loaded; with an outer loop, attach(optimizer) first or let the loader do
        it). A state of another cluster or mesh shape is refused: its shards had other owners."""
        self.set_up()
        if not isinstance(state, dict) or state.get("format") != SHARDED_STATE_FORMAT:
            raise ValueError(
                "sharded comm state: expected a dict from ShardedComm.comm_state_dict() of this "
                "cloudtrain release (CloudDDP's comm state does not load into a sharded model)"
            )
        if state["config"] != self.config.fingerprint():
            raise ValueError(
                "sharded comm state was saved with a different CompressionConfig; resume with "
                "the same config"
            )
        if (
            list(state["regions"]) != list(self.topo.rank_regions)
            or state["rank"] != self.topo.rank
        ):
            raise ValueError(
                f"sharded comm state of rank {state['rank']} of regions {state['regions']} "
                f"loaded on rank {self.topo.rank} of {list(self.topo.rank_regions)}: each rank "
                "loads its own, saved on the same mesh (after resharding, load the model and "
                "optimizer only)"
            )
        if list(state["units"]) != self.shard_numels():
            raise ValueError(
                f"sharded comm state holds units of {state['units']} elements, this model "
                f"{self.shard_numels()}: resume with the same model and fully_shard calls"
            )
        self.step = int(state["step"])
        self.path.load_state_dict(state)
        self.pipeline.load_state_dict(state.get("pipeline", []), self.device)
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
            self.plan = self.controller.plan()
        if self.config.outer is not None:
            if self.outer is None:
                raise ValueError(
                    "sharded comm state with an outer loop: call attach(optimizer) before "
                    "load_comm_state_dict(), so that the outer loop knows its inner optimizer"
                )
            self.outer.load_state_dict(state["outer"])

    def finish_outer(self) -> None:
        """With an outer loop: merge what is in flight and sync every fragment (all ranks), so
        that every region holds the same shards."""
        if self.outer is not None:
            self.outer.sync_all()

    def _finish_flights(self) -> None:
        """The pipeline's exchanges in flight finished now (all ranks, the same step), on the
        communication thread's CUDA stream where it has one (CommThread.here)."""
        finish = lambda: self.pipeline.finish_all(self.path.collect)  # noqa: E731
        if self._thread is None:
            finish()
        else:
            self._thread.here(finish)

    def settle(self) -> None:
        """Let cloudtrain's collectives in flight finish (the pipeline's, the controller's, the
        outer loop's) - every rank, the same step, before destroy_process_group()."""
        if self.path is not None:
            self._finish_flights()
        if self.controller is not None:
            self.controller.settle()
        if self.outer is not None:
            self.outer.settle()

    def close(self) -> None:
        """settle(), then stop the threads; call on every rank before destroy_process_group()."""
        self.settle()
        if self._thread is not None:
            self._thread.close()
        if self.controller is not None:
            self.controller.close()
        if self.outer is not None:
            self.outer.close()


# -- the optimizer: built after sharding, found at its first step ---------------------------------
def _check_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A global step pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook), once per
    optimizer: one that holds a parameter fully_shard replaced was built before sharding; one
    that holds a sharded model's parameters is that model's outer loop's inner optimizer."""
    if optimizer in _CHECKED:
        return
    held = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [p for p in held if _REPLACED.get(id(p)) is p]
    if stale:
        raise ValueError(
            f"this optimizer was built before cloudtrain.fully_shard: it holds {len(stale)} "
            "parameter(s) the model no longer has (fully_shard replaced them by their shards), so "
            "its step would train nothing. Build the optimizer after sharding, on "
            "model.parameters()"
        )
    ids = {id(p) for p in held}
    for comm in list(_LIVE):
        waiting = comm.config.outer is not None and comm.outer is None
        if waiting and any(id(p) in ids for u in comm.units for p in u.params):
            comm.attach(optimizer)
    _CHECKED.add(optimizer)


def _install_optimizer_check() -> None:
    with _HOOK_LOCK:
        if not _HOOKED:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _HOOKED.append(register_optimizer_step_pre_hook(_check_optimizer_step))


# -- the call --------------------------------------------------------------------------------------
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    config: CompressionConfig | str | None = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """torch.distributed.fsdp.fully_shard over the regions' mesh, with the unit's gradients
    crossing regions through cloudtrain (module docstring). Call it as torch's, bottom-up, per
    block and at the root; every FSDP argument (reshard_after_forward, mp_policy, offload_policy,
    ignored_params, ...) is passed on. mesh: leave it out, or cloudtrain.device_mesh() - torch's
    fully_shard gets its "shard" dimension, a region. config: a CompressionConfig, a preset name
    or a codec spec ("auto" by default), the same for every call of one model. Returns the module,
    now an FSDPModule."""
    if isinstance(module, FSDPModule):
        raise ValueError(
            f"cloudtrain.fully_shard: this {type(module).__name__} is sharded already; shard each "
            "module once (its blocks, then the root)"
        )
    if any(module is m for wrapped in list(WRAPPED) for m in wrapped.modules()):
        raise ValueError(
            "cloudtrain.fully_shard: this module is inside a CloudDDP, whose hook would never "
            "run once FSDP2 has sharded its parameters; use cloudtrain.fully_shard alone, with "
            "no CloudDDP around the model (docs/sharding.md)"
        )
    config = None if config is None else CompressionConfig.resolve(config)
    if config is not None and config.elastic is not None:
        raise ValueError(
            "cloudtrain.fully_shard: elastic regions (config.elastic) work with CloudDDP's outer "
            "loop only; a sharded run keeps a fixed set of regions - leave elastic unset"
        )
    if config is not None and config.outer is not None and config.outer.work == "time":
        raise ValueError(
            "outer.work='time' with cloudtrain.fully_shard is not supported yet (it needs the "
            "samples each rank trains on); use work='steps', or CloudDDP"
        )
    if config is not None and config.global_batch is not None:
        raise ValueError(
            "cloudtrain.fully_shard: batch shares (config.global_batch) work with CloudDDP only; "
            "inside a region FSDP's ranks compute one batch each - leave global_batch unset"
        )
    comm = _OPEN[0] if _OPEN else None
    if comm is not None and not comm.joins(module):
        comm = None  # another model: sharded after this one's root, and not around it
    adopting = comm is not None and config is not None and config != comm.config
    if adopting:
        comm.check_adoptable(config)
    fresh = comm is None
    if comm is None:
        comm = ShardedComm(config or CompressionConfig.resolve(AUTO), given=config is not None)
    check_mesh(mesh, comm.mesh)
    if "process_group" in fsdp_kwargs or "dp_mesh_dims" in fsdp_kwargs:
        raise ValueError(
            "cloudtrain.fully_shard makes its own mesh from the regions; do not pass "
            f"{sorted(set(fsdp_kwargs) & {'process_group', 'dp_mesh_dims'})}"
        )
    ignored = fsdp_kwargs.get("ignored_params") or set()
    new = [
        (name, p)
        for name, p in module.named_parameters()
        if not isinstance(p, DTensor) and p.requires_grad and p not in ignored
    ]
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for _, p in new})
    if len(dtypes) > 1:
        by_dtype = {d: next(n for n, p in new if str(p.dtype).endswith(d)) for d in dtypes}
        raise ValueError(
            f"cloudtrain.fully_shard: the parameters of this unit have several dtypes ({by_dtype}; "
            "e.g. parameter: dtype); FSDP reduces a unit's gradients as one tensor of one dtype. "
            "Give them one dtype (model.to(torch.float32); MixedPrecisionPolicy for bf16 "
            "compute), or shard the parameters of each dtype in a fully_shard call of their own"
        )
    for _, p in new:
        _REPLACED[id(p)] = p
    torch_fully_shard(module, mesh=comm.mesh["shard"], **fsdp_kwargs)
    if adopting:  # after every check: a call refused changes nothing
        comm.adopt(config)
    comm.add(module)
    if fresh:  # the model's later fully_shard calls join it
        _OPEN[:] = [comm]
    _install_optimizer_check()
    return module
