"""CloudDDP: DistributedDataParallel whose gradients cross regions compressed.

    import cloudtrain
    cloudtrain.init()                                   # horovodrun, torchrun, or one process
    model = cloudtrain.CloudDDP(model, "topk-1pct")     # or "auto", "cocktail", a CompressionConfig

CloudDDP is DDP with cloudtrain's communication hook (cloudtrain.hook) registered on it: DDP still
builds the buckets and applies the results; the hook reduces each bucket densely inside a region
and compressed across regions (cloudtrain.datapath), with the plan of what to send fixed by the
config or chosen per link by the controller (cloudtrain.controller). docs/design.md walks one
bucket through these modules.

Before the first step all ranks compare model and config and fail naming the difference, and
rank 0's parameters and buffers reach every rank (DDP's init_sync), across each region's link
once (Topology.broadcast_from_rank0).
"""

import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .bootstrap import init, start_control_group
from .buffers import RegionBuffers
from .config import AUTO, CompressionConfig
from .hook import CommState, compressed_hook, wants_controller
from .outer import OuterLoop, fixed_schedule, own_group_names
from .stats import CommStats
from .topology import Topology, local_region_name

log = logging.getLogger("cloudtrain")


class ConfigMismatch(RuntimeError):
    """Ranks disagree on the model or the compression config."""


def _model_description(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [
        (name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
    ]


WRAPPED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Every CloudDDP made: cloudtrain.fully_shard refuses a module inside one."""


def _check_dense(module: torch.nn.Module) -> None:
    """CloudDDP compresses dense buckets of whole parameters: a module sharded with FSDP2, or
    one that makes sparse gradients, is refused now, naming what to do, not inside torch."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(sub, FSDPModule) for sub in module.modules()):
        raise ValueError(
            "CloudDDP: the model is sharded with FSDP2 (fully_shard); CloudDDP replicates whole "
            "parameters. Shard it with cloudtrain.fully_shard alone (no CloudDDP around it): its "
            "shards' gradients cross regions compressed (docs/sharding.md)"
        )
    for prefix, sub in module.named_modules():
        if isinstance(sub, torch.nn.Embedding | torch.nn.EmbeddingBag) and sub.sparse:
            name = f"{prefix}.weight" if prefix else "weight"
            raise ValueError(
                f"CloudDDP: parameter {name!r} gets sparse gradients ({type(sub).__name__} with "
                "sparse=True); CloudDDP reduces dense gradients - make it sparse=False"
            )


def _identity(module: torch.nn.Module, config: CompressionConfig) -> dict[str, Any]:
    """What every rank (and, in an elastic run, every region) must run alike."""
    from . import __version__

    return {
        "version": __version__,
        "config": config.fingerprint(),
        "model": _model_description(module),
        # rank 0's cross at start-up (Topology.broadcast_from_rank0): every rank must hold alike
        "buffers": [(name, tuple(b.shape), str(b.dtype)) for name, b in module.named_buffers()],
    }


def check_agreement(
    module: torch.nn.Module, config: CompressionConfig, problem: ValueError | None = None
) -> list[str | None]:
    """All ranks compare model and config before the first step; a difference raises, named.
    Returns every rank's region name as it knows it (topology.local_region_name): gathered in
    the same collective, so that Topology.discover needs no gathering of its own. `problem`:
    what a check of this rank's alone found, raised on every rank (else only this one would
    raise, and the others would meet a closed connection in their next collective)."""
    world = dist.get_world_size()
    mine = (
        _identity(module, config),
        local_region_name(config, dist.get_rank(), world),
        None if problem is None else str(problem),
    )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if problem is not None:
        raise problem
    for rank, (_, _, found) in enumerate(gathered):
        if found is not None:
            raise ValueError(f"on rank {rank}: {found}")
    everyone = [identity for identity, _, _ in gathered]
    ref = everyone[0]
    for rank, other in enumerate(everyone):
        if other == ref:
            continue
        if other["version"] != ref["version"]:
            raise ConfigMismatch(
                f"rank {rank} runs cloudtrain {other['version']}, rank 0 runs {ref['version']}"
            )
        if other["config"] != ref["config"]:
            raise ConfigMismatch(
                f"rank {rank}'s CompressionConfig differs from rank 0's (fingerprint {other['config']} vs "
                f"{ref['config']}); every rank must pass the same config to CloudDDP (or cloudtrain.fully_shard)"
            )
        a, b = ref["model"], other["model"]
        if len(a) != len(b):
            raise ConfigMismatch(
                f"rank {rank}'s model has {len(b)} parameters, rank 0's has {len(a)}"
            )
        for pa, pb in zip(a, b, strict=True):
            if pa != pb:
                raise ConfigMismatch(
                    f"rank {rank}'s model differs from rank 0's: parameter {pb[0]!r} is {pb[1:]} "
                    f"(shape, dtype, requires_grad) on rank {rank} and {pa[0]!r} {pa[1:]} on rank 0"
                )
        if other["buffers"] != ref["buffers"]:
            which = _first_difference(ref["buffers"], other["buffers"])
            raise ConfigMismatch(
                f"rank {rank}'s model's buffers differ from rank 0's: {which} (name, shape, "
                "dtype); every rank starts from rank 0's buffers, so they must match"
            )
    return [name for _, name, _ in gathered]


def _first_difference(ref: list[Any], other: list[Any]) -> str:
    """The first entry where two ranks' (name, shape, dtype) lists differ, in words."""
    for a, b in zip(ref, other, strict=False):
        if a != b:
            return f"{b} against {a} on rank 0"
    return f"{len(other)} buffers against {len(ref)} on rank 0"


def _region_group(topo: Topology) -> Any:
    """This rank's region's group; with one region (e.g. one region of an elastic run) every rank
    is in it: the group of all. None for a region of one rank."""
    if len(topo.members[topo.region]) == 1:
        return None
    if topo.single_region:
        return topo.groups.get("dense")
    return topo.groups.get(f"region{topo.region}")


def batch_of(inputs: tuple, kwargs: dict[str, Any]) -> int:
    """A forward's samples: the leading dimension of its first tensor argument (1 if none)."""
    for value in (*inputs, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() else 1
    return 1


def _start_up(config: CompressionConfig, topo: Topology) -> bool:
    """Begin making the groups the controller or the outer loop will have of their own; whether
    the links are probed at start-up (for the controller, or the outer loop's choice of H and
    codec). Making a group across the WAN is round trips; they overlap what comes before."""
    if wants_controller(config, topo):
        topo.start_private(("control",), config.timeout)
        return True
    if config.outer is not None and not topo.single_region:
        topo.start_private(own_group_names(topo), config.timeout)
        return fixed_schedule(config.outer, topo) is None
    return False


class CloudDDP(DistributedDataParallel):
    """DistributedDataParallel that compresses gradients between regions (module docstring).

    config: a CompressionConfig, a preset name ("auto", "none", "fp16", "topk-1pct", "cocktail",
    "diloco", ...) or a codec spec ("topk:0.01"). optimizer: the inner optimizer, built on
    module.parameters() before wrapping - required with an outer loop (config.outer, e.g.
    "diloco"; cloudtrain.outer) and in an elastic run (config.elastic), accepted and unused
    otherwise. Other keyword arguments go to
    DistributedDataParallel.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        config: CompressionConfig | str = AUTO,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        config = CompressionConfig.resolve(config)
        if config.outer is not None and optimizer is None:
            raise ValueError(
                "CloudDDP: an outer loop (config.outer, e.g. 'diloco') needs the inner optimizer: "
                "CloudDDP(model, config, optimizer=opt), with opt built on model.parameters() "
                "before wrapping"
            )
        if config.elastic is not None and optimizer is None:
            raise ValueError(
                "CloudDDP: an elastic run (config.elastic) needs the optimizer - a step whose "
                "exchange failed is dropped, and a joining region receives its state: "
                "CloudDDP(model, config, optimizer=opt), with opt built on model.parameters() "
                "before wrapping"
            )
        init(timeout_s=config.timeout_s)
        if "process_group" in ddp_kwargs:
            raise ValueError("CloudDDP makes its own process groups; do not pass process_group")
        start_control_group(config.timeout_s)  # its rendezvous overlaps the checks
        try:
            _check_dense(module)
            problem = None
        except ValueError as e:  # raised on every rank (check_agreement), not on this one alone
            problem = e
        names = check_agreement(module, config, problem)
        # the groups' rendezvous (store round trips across the WAN) overlaps DDP's construction
        # and the links' probe
        topo = Topology.discover(config, config.timeout, wait=False, names=names)
        probe = _start_up(config, topo)
        init_sync = ddp_kwargs.pop("init_sync", True)
        # across regions rank 0's parameters and buffers cross each link once, not once a rank
        super().__init__(module, init_sync=init_sync and topo.single_region, **ddp_kwargs)
        start_state = self._start_state(ddp_kwargs) if init_sync and not topo.single_region else []
        carried = False
        if probe and topo.links is None:
            # on the control group, made before the others; rank 0's start-up state goes across
            # with it, on the connections it takes out of TCP slow start
            carried = topo.carried(start_state)
            topo.probe(carry=start_state if carried else ())
        topo.wait_groups()
        topo.broadcast_from_rank0(start_state, carried=carried)
        by_time = config.outer is not None and config.outer.work == "time"
        if by_time and not topo.single_region:
            # regions step apart: DDP's own collectives (its bucket rebuild at the second
            # forward, find_unused_parameters' map of used parameters) stay inside the region,
            # or a region would wait in one while another waits in a sync (its parameters were
            # broadcast across all ranks above, so every region starts from rank 0's)
            self._update_process_group(topo.group(f"region{topo.region}"))
        params = list(self.module.parameters())
        names = [name for name, _ in self.module.named_parameters()]
        outer = config.outer is not None
        self.comm = CommState(config, topo, params, names)
        super().register_comm_hook(self.comm, compressed_hook)
        if ddp_kwargs.get("find_unused_parameters"):  # see BucketLayouts.track_unused
            self.comm.layouts.track_unused(self.reducer._get_local_used_map, topo.rank == 0)
        comm = self.comm
        self.outer: OuterLoop | None = None
        if outer:
            self.outer = OuterLoop(
                config, topo, params, optimizer, comm.stats, lambda: comm.step,
                samples=lambda: comm.samples,
            )  # fmt: skip
        self.region_buffers = None
        """Outer-loop mode: the module's buffers, broadcast inside the region only and
        reconciled across regions at syncs (cloudtrain.buffers); None otherwise."""
        if outer and getattr(self, "forward_sync_buffers", self.broadcast_buffers):
            self.forward_sync_buffers = self.broadcast_buffers = False  # (torch >= 2.13; older)
            self.region_buffers = RegionBuffers.of(self.module, _region_group(topo))
            self.outer.buffers = self.region_buffers
        self.elastic = None
        if config.elastic is not None:  # this launch is one region of the run; it joins now
            self.elastic = self._elastic_region(config, topo, optimizer)
            self.elastic.join()
        if topo.single_region and config.global_batch is not None:
            log.warning(
                "cloudtrain: all ranks are in one region, where no controller runs: the global "
                "batch is shared equally (set CLOUDTRAIN_REGION per host for shares by throughput)"
            )
        if topo.single_region and not config.lossless and config.codec != AUTO:
            log.info(
                "cloudtrain: all ranks are in one region, so gradients are all-reduced without lossy "
                "compression; set CLOUDTRAIN_REGION per host (or regions='per-rank') to compress"
            )
        log.info("cloudtrain: %s; config %s", topo.describe(), config.codec)
        WRAPPED.add(self)  # made: fully_shard refuses its modules from now on

    def _elastic_region(
        self, config: CompressionConfig, topo: Topology, optimizer: torch.optim.Optimizer
    ) -> Any:
        """This launch's part in an elastic run (cloudtrain.elastic): the outer loop's syncs,
        or, per step, the hook's exchanges (a failed one dropped between the optimizer's step
        hooks)."""
        from .elastic import ElasticRegion, ElasticSteps, identity_of
        from .outer import check_optimizer
        from .transfer import OuterReplica, StepReplica

        comm, identity = self.comm, identity_of(_identity(self.module, config))
        if self.outer is not None:

            def set_step(step: int) -> None:
                comm.step = step

            replica = OuterReplica(self.outer, self.module, set_step)
            self.outer.elastic = region = ElasticRegion(config, topo, replica, identity)
            return region
        check_optimizer(optimizer, list(self.module.parameters()))
        comm.tolerate_failures()
        steps = ElasticSteps(config, topo, StepReplica(comm, self.module, optimizer), identity)
        steps.buffers = RegionBuffers.of(self.module, _region_group(topo))
        optimizer.register_step_pre_hook(lambda *_: steps.before_step())
        optimizer.register_step_post_hook(lambda *_: steps.after_step())
        return steps

    def _start_state(self, ddp_kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """What DDP's start-up sync (init_sync) makes rank 0's on every rank, here in
        cloudtrain's groups (Topology.broadcast_from_rank0): the parameters, and the buffers
        unless the deprecated broadcast_buffers=False left them out (the model's shapes were
        compared by check_agreement)."""
        ignore = self.parameters_to_ignore
        states = [t for name, t in self.module.named_parameters() if name not in ignore]
        legacy = ddp_kwargs.get("broadcast_buffers")
        if ddp_kwargs.get("forward_sync_buffers") is not None or legacy is None or legacy:
            states += [t for name, t in self.module.named_buffers() if name not in ignore]
        return [t.detach() for t in states]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            if self.outer is not None:  # first: a sync it runs counts the samples before this one
                self.outer.catch_up()  # where AMP skipped this region's last step (OuterLoop)
                if self.region_buffers is not None:  # DDP's broadcast, inside the region
                    self.region_buffers.in_region()
            samples = batch_of(inputs, kwargs)
            if self.require_backward_grad_sync:  # not under no_sync: the step's last forward
                self.comm.check_share(samples)
            self.comm.count_samples(samples)
        return super().forward(*inputs, **kwargs)

    def batch_size(self) -> int:
        """With CompressionConfig(global_batch=N): this rank's share of the global batch at the
        step now computed - draw that many samples for it (or use cloudtrain.ShareSampler)."""
        return self.comm.batch_size()

    @property
    def samples_seen(self) -> int:
        """Samples this rank trained on: the leading dimension of the first tensor argument of
        every training forward (1 for a forward without one), since the run started."""
        return self.comm.samples

    @property
    def samples_done(self) -> int:
        """The run's samples over all regions, updated only at the outer loop's round boundaries
        (cloudtrain.rounds), so that `while model.samples_done < total:` stops every region
        after the same round. With OuterConfig(work="time") it is exact and the same on every
        rank (regions run different numbers of inner steps: count samples, not steps, and let
        learning-rate schedules follow it); otherwise it is this rank's samples x the world
        size (per step without an outer loop), exact where every rank's batches are alike. Not
        kept in an elastic run: use steps_done there."""
        if self.outer is None:
            if self.comm.shares is not None:  # every step trains on the whole global batch
                return self.comm.step * self.comm.shares.global_batch
            return self.comm.samples * self.comm.topo.world_size
        return self.outer.samples_done

    @property
    def steps_done(self) -> int:
        """Gradient syncs done (the hook's step count). In an elastic run a region that joined
        or took the state of the run counts from the run's step: train while it is below the
        run's total."""
        return self.comm.step

    @property
    def compression_config(self) -> CompressionConfig:
        return self.comm.config

    @property
    def topology(self) -> Topology:
        return self.comm.topo

    def comm_state_dict(self) -> dict[str, Any]:
        """This rank's communication state: error-feedback residuals, step, controller; with an
        outer loop also its outer copy, momentum, residuals and fragments in flight."""
        state = self.comm.state_dict()
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_comm_state_dict(self, state: dict[str, Any]) -> None:
        self.comm.load_state_dict(state)
        if self.outer is not None:
            if not isinstance(state.get("outer"), dict):
                raise ValueError(
                    "comm state has no outer-loop state: it was saved without an outer loop; "
                    "resume with the config it was saved with"
                )
            self.outer.load_state_dict(state["outer"])

    def finish_outer(self) -> None:
        """With an outer loop: merge what is in flight and sync every fragment, so that all
        replicas hold the same parameters (all ranks call; e.g. before the final evaluation)."""
        if self.outer is not None:
            self.outer.sync_all()

    def close(self) -> None:
        """Let cloudtrain's collectives in flight finish: the pipeline's exchanges, the
        controller's decision on its way and the outer loop's exchanges (every rank has started
        them, so they complete within the timeout). Call it on every rank, at the same step,
        before `dist.destroy_process_group()`: destroying the groups under a collective in flight
        can abort the process. Nothing is lost, and training may go on after it."""
        self.comm.settle()
        if self.outer is not None:
            self.outer.settle()
        if self.elastic is not None:
            self.elastic.close()

    def verify_replicas(self) -> None:
        """Check now that all replicas' parameters agree bit for bit (all ranks must call it;
        per step in an elastic run: all ranks of the regions present)."""
        if self.outer is None and self.elastic is not None:
            self.elastic.verify()
            return
        self.comm.verify_replicas()

    def stats(self) -> CommStats:
        """A copy of this rank's counters: steps, buckets, bytes sent to other regions on every
        path, seconds per stage (cloudtrain.stats); with "auto" also what the controller believes
        and decided (`CommStats.controller`: link estimates, plan, the quality guard)."""
        stats = self.comm.stats.copy()
        if self.comm.controller is not None:
            stats.controller = self.comm.controller.snapshot()
        if self.elastic is not None:
            stats.elastic = self.elastic.snapshot()
        return stats

    def register_comm_hook(self, state: object, hook: Any) -> None:
        raise RuntimeError(
            "CloudDDP registers its own communication hook (that is what CloudDDP is); a second "
            "one cannot be added. Use torch's DistributedDataParallel for a hook of your own"
        )

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        self.register_comm_hook(None, comm_hook_type)

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Any:
        if not divide_by_initial_world_size:
            raise ValueError(
                "CloudDDP: join(divide_by_initial_world_size=False) is not supported - a comm hook "
                "is not told how many ranks still train, so CloudDDP always divides by the world "
                "size (the default, divide_by_initial_world_size=True)"
            )
        if self.comm.config.verify_every:
            raise ValueError(
                "CloudDDP: join() leaves the ranks that ran out of inputs with their old parameters "
                "(DDP's design), so replicas differ by intent and verify_every would report them; "
                "use CompressionConfig(verify_every=0) with join(), or even out the inputs"
            )
        return super().join(divide_by_initial_world_size, enable, throw_on_early_termination)

    def _match_all_reduce_for_bwd_pass(self) -> None:
        # join(): ranks out of inputs shadow every bucket with zeros through the hook and wait on
        # its futures; a failure there is re-raised as the hook's own exception, not a
        # RuntimeError wrapping its message
        try:
            super()._match_all_reduce_for_bwd_pass()
        except Exception:
            if self.comm.error is not None:
                raise self.comm.error from None
            raise

    def __del__(self) -> None:
        comm = self.__dict__.get("comm")
        if comm is not None:
            comm.close()
        outer = self.__dict__.get("outer")
        if outer is not None:
            outer.close()
