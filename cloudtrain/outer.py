"""The outer loop (DiLoCo, Streaming DiLoCo): parameters cross regions every H steps, not gradients.

    model = CloudDDP(model, "diloco", optimizer=opt)    # opt built on model.parameters() first

Inner steps are DDP inside each region only (the hook's region_only path); the inner optimizer
and its state stay local. `OuterLoop` runs after every inner `optimizer.step()` (a step post-hook)
and, for each fragment of the parameters whose sync step it is (fragment f of F syncs at the
steps t > 0 with (t - f*H//F) % H == 0; t counts gradient syncs, so a step AMP skipped in one
region does not put the regions' schedules apart):

    delta = outer_copy - local                        # the region's pseudo-gradient: the same
                                                      #   bits on each of the region's ranks
    mine = delta[shard]                               # each of the region's k ranks owns 1/k
    summed = CrossRegion.exchange(mine, ...)          # compressed with error feedback, swapped
                                                      #   with that shard's owners elsewhere,
                                                      #   checked and summed in region order
    gather_in_region(...)                             # every rank: the whole summed delta
    outer_copy -= outer_lr * nesterov(summed / R)     # outer SGD, the same math on every rank
    local = outer_copy                                # or, with overlap, see below

so the outer copy is bit-identical on every rank after each outer step, and with overlap 0 the
fragment's parameters too. Overlap (tau > 0): the exchange runs on a background thread, on
process groups of its own (so it never interleaves with the hook's collectives), and its result
is merged tau inner steps later as `local = outer_copy_new + (local_now - local_at_send)`: the
region's tau newer steps are kept, not thrown away (Streaming DiLoCo's mixing with alpha = 0
drops them; any alpha > 0 keeps stale parameters as well). With tau = 0 it is DiLoCo exactly.
The outer copy stays bit-identical everywhere; regions' parameters differ by their last tau steps
until the next sync (`sync_all()` syncs everything and makes all replicas equal).

`choose_schedule` is the choice of H and of each region's codec from the measured link and step
time (a pure function): the exchange must hide in the tau steps it overlaps, or, without
overlap, stall at most `STALL_SHARE` of the compute between two syncs.

With OuterConfig(work="time") each region runs its own H_r steps in a round of H x the slowest
region's step time, and the pseudo-gradients are weighted by the regions' samples
(cloudtrain.rounds).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import CommError, run_and_wait
from .compress import ErrorFeedback
from .compress.ladders import OUTER_LADDER
from .config import AUTO, CompressionConfig, OuterConfig
from .costs import LinkEstimate
from .datapath import CrossRegion, Shard, pad_to_shards
from .estimates import region_links
from .outer_state import _FragmentSync, load_region, region_state
from .plan import Codecs, Plan, Rung, ceil_div
from .rounds import Rounds, region_totals, round_steps, sample_weights
from .stats import CommStats
from .topology import Topology

log = logging.getLogger("cloudtrain")

OUTER_STATE_FORMAT = 2
"""2: with the round (cloudtrain.rounds); 1 (without) still loads, its samples_done from 0."""

SYNC_CHOICES = (5, 10, 20, 50, 100, 200, 500, 1000)
"""Values of H that sync_every="auto" picks from, smallest (best quality) first."""

STALL_SHARE = 0.1
"""Without overlap: the share of the compute between two syncs an exchange may stall."""

DECIDE_AFTER = 5
"""With "auto": inner steps timed before H and the codecs are chosen (none syncs before)."""

ELASTIC_STEP_TIMES = 1000
"""In an elastic run: the inner steps whose median times its plans (cloudtrain.replan)."""


@dataclass(frozen=True)
class Schedule:
    sync_every: int
    rungs: tuple[Rung, ...]
    """Codec of each sender region's pseudo-gradient packets (by region index)."""
    exchange_s: float
    """Predicted seconds of one fragment's exchange on the slowest link."""
    fits: bool
    """False: nothing fits the budget; the most compression at the largest H was taken."""
    regions: tuple[str, ...] = ()
    """In an elastic run, the regions it was planned for, whose codecs `rungs` are (by name:
    `rungs_of`); () where the regions are fixed, or before an elastic run's first plan."""
    start: int = 0
    """The step its rounds count from: 0, or the sync at which an elastic run planned it."""

    @property
    def provisional(self) -> bool:
        """An elastic "auto" run's schedule before its first plan: fragment 0 syncs once, at
        step `sync_every`, and plans there (cloudtrain.replan)."""
        return not self.rungs

    def rungs_of(self, regions: Sequence[str], fallback: Rung) -> tuple[Rung, ...]:
        """The codec of each of `regions`' packets: one codec for all where the regions are
        fixed; in an elastic run each region's by name, and `fallback` for a region it was not
        planned for (one that joined since: until the next plan, at fragment 0's sync)."""
        if not self.regions:
            return (self.rungs[0] if self.rungs else fallback,) * len(regions)
        by_name = dict(zip(self.regions, self.rungs, strict=True))
        return tuple(by_name.get(name, fallback) for name in regions)

    def describe(self, step_s: float, links: Sequence[LinkEstimate]) -> str:
        fits = "fits" if self.fits else "does not fit: most compression"
        seen = [(f"{8 * lk.bandwidth / 1e6:.1f} Mbit/s", f"{1000 * lk.rtt:.0f} ms") for lk in links]
        return (
            f"H={self.sync_every}, codecs {list(self.rungs)}, exchange {self.exchange_s:.3f}s per "
            f"fragment ({fits}), step {step_s:.3f}s, links {seen}"
        )

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Schedule:
        rungs = tuple((n, tuple(lv) if isinstance(lv, list) else lv) for n, lv in state["rungs"])
        regions = tuple(state.get("regions", ()))  # (states saved before elastic plans: none)
        return cls(
            state["sync_every"], rungs, state["exchange_s"], state["fits"], regions,
            int(state.get("start", 0)),
        )  # fmt: skip


def outer_zstd(config: CompressionConfig) -> bool:
    """Whether the outer loop's packets go through zstd: unless the config says no
    (`CompressionConfig.zstd=False`). Once per H steps, behind the inner steps, its CPU is small
    and the bytes it saves are what the outer loop is for."""
    return config.zstd is not False


def fragment_exchange_seconds(link: LinkEstimate, nbytes: float, receivers: int) -> float:
    """One fragment's exchange on a sender's link: half a round trip (its receives were posted
    at the last sync: cloudtrain.collectives.ReceivesAhead) plus its packet to every other
    region (the per-step exchange's model is cloudtrain.costs.exchange_seconds)."""
    return link.rtt / 2 + receivers * nbytes / link.bandwidth


@dataclass(frozen=True)
class SyncSetting:
    """What choosing the outer loop's schedule needs: the model, its shard owners per region,
    each region's link (by region index, as a shard owner sees it), an inner step's seconds,
    the fragments that sync in turn, and the steps an exchange may overlap (0: it stalls)."""

    numel: int
    links: Sequence[LinkEstimate]
    shards: int
    step_s: float
    fragments: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", tuple(self.links))
        if self.numel < 1 or not self.links or self.shards < 1 or self.fragments < 1:
            raise ValueError("SyncSetting: numel, links, shards and fragments must be positive")
        if self.overlap < 0:
            raise ValueError(f"SyncSetting: overlap={self.overlap} must be 0 or more steps")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"SyncSetting: step_s={self.step_s!r} must be a positive time")

    @property
    def shard_numel(self) -> int:
        """Elements of one shard of the largest fragment."""
        return ceil_div(ceil_div(self.numel, self.fragments), self.shards)

    def budget(self, sync_every: int) -> float:
        """Seconds one fragment's exchange may take at H = `sync_every`: with overlap, the tau
        steps it hides behind, and the link must carry the F fragments' exchanges within H
        steps; without, STALL_SHARE of the H/F steps between two syncs of any fragment."""
        per_fragment = self.step_s * sync_every / self.fragments
        if self.overlap:
            return min(self.overlap * self.step_s, per_fragment)
        return STALL_SHARE * per_fragment

    def candidates(self, sync_every: int | str) -> list[int]:
        """The H to try, smallest first: the one configured, or SYNC_CHOICES for "auto"; each
        more than the overlap and at least one step a fragment."""
        hs = [sync_every] if sync_every != AUTO else list(SYNC_CHOICES)
        fit = [h for h in hs if h > self.overlap and h >= self.fragments]
        return fit or [max(self.overlap + 1, self.fragments)]


def choose_schedule(
    s: SyncSetting,
    wire_nbytes: Callable[[Rung, int], int],
    sync_every: int | str = AUTO,
    ladder: Sequence[Rung] = OUTER_LADDER,
) -> Schedule:
    """H and each region's codec for the outer exchange (module docstring): the smallest H, then
    per region the least compression, such that every region's exchange of one fragment fits
    its budget (SyncSetting.budget). When none fits: the largest H, and per region the least
    compression whose exchange is within one budget of the fastest rung's (compression that
    does not save time only costs accuracy)."""
    receivers = len(s.links) - 1
    times = [
        [fragment_exchange_seconds(link, wire_nbytes(rung, s.shard_numel), receivers)
         for rung in ladder]
        for link in s.links
    ]  # fmt: skip
    candidates = s.candidates(sync_every)
    for h in candidates:
        budget = s.budget(h)
        picks = [next((i for i, t in enumerate(ts) if t <= budget), None) for ts in times]
        if None not in picks:
            worst = max(ts[i] for ts, i in zip(times, picks, strict=True))
            return Schedule(h, tuple(ladder[i] for i in picks), worst, True)
    # Nothing fits (the round trip alone may not): the largest H, and per region the least
    # compression within one budget of the fastest rung - more would cost accuracy, not time.
    h = candidates[-1]
    # with overlap, the tau steps it hides behind, not capped by the link's share of H here
    budget = s.overlap * s.step_s if s.overlap else s.budget(h)
    picks = [next(i for i, t in enumerate(ts) if t <= min(ts) + budget) for ts in times]
    worst = max(ts[i] for ts, i in zip(times, picks, strict=True))
    return Schedule(h, tuple(ladder[i] for i in picks), worst, False)


class Fragments:
    """The trainable parameters laid end to end and cut into `count` fragments of about equal
    size: each fragment's pieces (parameter index, start in it, length), read and written as one
    float32 vector."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        count: int,
        view: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`view(p)`: the tensor of `p` that is read and written (default `p` itself; for a sharded
        parameter, its local shard - looked up at every use, as FSDP may replace it)."""
        self.params, self.count = list(params), count
        self._view = view or (lambda p: p)
        self.numel = sum(self._view(p).numel() for p in self.params)
        bounds = [f * self.numel // count for f in range(count + 1)]
        self.pieces = [self._pieces(bounds[f], bounds[f + 1]) for f in range(count)]

    def _pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(parameter index, start in it, length) covering elements [lo, hi)."""
        out, offset = [], 0
        for i, p in enumerate(self.params):
            numel = self._view(p).numel()
            start, end = max(lo, offset), min(hi, offset + numel)
            if start < end:
                out.append((i, start - offset, end - start))
            offset += numel
        return out

    def local(self, f: int) -> torch.Tensor:
        """Fragment f of the local parameters, float32."""
        views = [self._view(self.params[i]).detach() for i, _, _ in self.pieces[f]]
        return torch.cat(
            [
                v.reshape(-1)[s : s + n].float()
                for v, (_, s, n) in zip(views, self.pieces[f], strict=True)
            ]
        )

    def write(self, f: int, values: torch.Tensor) -> None:
        at = 0
        for i, s, n in self.pieces[f]:
            self._view(self.params[i]).detach().view(-1)[s : s + n].copy_(values[at : at + n])
            at += n


def outer_step(
    outer: OuterConfig, copy: torch.Tensor, momentum: torch.Tensor | None, mean: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The outer SGD step (momentum, Nesterov) of one fragment's outer copy by the regions' mean
    pseudo-gradient: (new copy, new momentum), both in outer.dtype; the arithmetic in float32."""
    update = mean
    if outer.outer_momentum > 0:
        buf = (
            mean.clone()
            if momentum is None
            else momentum.float().mul_(outer.outer_momentum).add_(mean)
        )
        momentum = buf.to(outer.torch_dtype)
        buf = momentum.float()
        update = mean.add(buf, alpha=outer.outer_momentum) if outer.nesterov else buf
    return copy.float().sub_(update, alpha=outer.outer_lr).to(outer.torch_dtype), momentum


def _local_shard(p: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's local shard."""
    return p.to_local()


def _check_fragments(numel: int, fragments: int, cut: int) -> None:
    if numel < fragments * cut:
        raise ValueError(
            f"outer.fragments={fragments}: the model's {numel} parameters cannot be cut into "
            f"{fragments} fragments of {cut} shard(s) each; use fewer"
        )


def own_group_names(topo: Topology) -> list[str]:
    """The groups the outer loop's exchange has of its own (Topology.private): it may run on a
    background thread while the hook reduces gradients."""
    return [n for n in topo.group_ranks() if n.startswith(("region", "cross"))]


def fixed_schedule(outer: OuterConfig, topo: Topology) -> Schedule | None:
    """The schedule when there is nothing to choose (H and the codec given, or one region);
    None: it is chosen after DECIDE_AFTER steps."""
    if outer.sync_every == AUTO or (outer.codec == AUTO and not topo.single_region):
        return None
    rung = ("none", None) if outer.codec == AUTO else (outer.codec, outer.level)
    return Schedule(outer.sync_every, (rung,) * len(topo.regions), 0.0, True)


def check_optimizer(optimizer: Any, params: Sequence[torch.Tensor]) -> None:
    """The inner optimizer must be a torch optimizer holding every trainable parameter."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer={optimizer!r}: the outer loop (and an elastic run) needs the "
            "(inner) torch.optim.Optimizer, built on module.parameters() before wrapping"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [i for i, p in enumerate(params) if id(p) not in held]
    if missing:
        raise ValueError(
            f"optimizer= does not hold {len(missing)} of the model's parameters (the first "
            f"is parameter #{missing[0]}): build it on module.parameters() of the model you "
            "wrap"
        )


class OuterLoop:
    """The outer loop of one CloudDDP (module docstring)."""

    def __init__(
        self,
        config: CompressionConfig,
        topo: Topology,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        stats: CommStats,
        steps: Callable[[], int],
        *,
        samples: Callable[[], int] | None = None,
        sharded: bool = False,
    ) -> None:
        """`steps()`: the gradient syncs done so far (the hook's step count) - the clock of the
        schedule, the same on every rank even where an optimizer step was skipped. `samples()`:
        the samples this rank trained on so far (CloudDDP's count), which rounds add up and
        work="time" weights by. `sharded`: FSDP's parameters (cloudtrain.sharded): the outer
        state is of this rank's shard, swapped whole with its owners in the other regions."""
        outer = config.outer
        if not isinstance(outer, OuterConfig):
            raise ValueError("OuterLoop needs a CompressionConfig with outer=OuterConfig(...)")
        if outer.work == "time" and (sharded or samples is None):
            raise ValueError(
                "outer.work='time' with cloudtrain.fully_shard is not supported yet (it needs the "
                "samples each rank trains on); use work='steps', or CloudDDP"
            )
        self.config, self.outer, self.topo = config, outer, topo
        self.params = [p for p in params if p.requires_grad]
        check_optimizer(optimizer, self.params)
        self.optimizer = optimizer
        self.sharded = sharded
        self.parts = Fragments(self.params, outer.fragments, _local_shard if sharded else None)
        self.numel, self.fragments = self.parts.numel, outer.fragments
        self.cut = 1 if sharded else topo.shards  # pieces of a region's pseudo-gradient
        _check_fragments(self.numel, self.fragments, self.cut)
        dtype = outer.torch_dtype
        # host_copy: the outer state in host memory (INTELLECT-1); a sync moves one fragment
        self.home = torch.device("cpu") if outer.host_copy else None
        with torch.no_grad():
            self.global_ = [
                self.parts.local(f).to(device=self.home, dtype=dtype) for f in range(self.fragments)
            ]
        self.momentum: list[torch.Tensor | None] = [None] * self.fragments
        self.ef = ErrorFeedback(dtype) if outer.error_feedback else None
        self.stats = stats
        self._steps = steps
        self._samples = samples or (lambda: 0)
        self.step = 0
        self.rounds = Rounds()
        self.flights: dict[int, _FragmentSync] = {}
        self._times: list[float] = []
        self._last = time.perf_counter()
        self.schedule = fixed_schedule(outer, topo)
        self.codecs = Codecs(config)
        self.links: list[LinkEstimate] | None = None
        if self.schedule is None and not topo.single_region:
            matrix = topo.links if topo.links is not None else topo.probe()  # every rank, now
            self.links = region_links(matrix, topo.members, topo.shards)
        # the exchange may run on a background thread while the hook reduces gradients
        self.own = topo.private(own_group_names(topo), config.timeout)
        self.path = CrossRegion(config, self.own, self.codecs, self.ef, stats)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cloudtrain-outer")
        self._handle = optimizer.register_step_post_hook(self._after_step)
        self.buffers: Any = None
        """The module's buffers (cloudtrain.buffers.RegionBuffers), reconciled across regions at
        every sync of fragment 0; None: none, or broadcast by DDP."""
        self.elastic: Any = None
        """The region's membership (cloudtrain.elastic.ElasticRegion) in an elastic run: syncs
        then run over the regions present."""

    def offset(self, f: int, h: int | None = None) -> int:
        """Fragment f's sync step in a round of h steps (default the schedule's H)."""
        assert self.schedule is not None
        return f * (h or self.schedule.sync_every) // self.fragments

    def round_length(self) -> int:
        """This region's inner steps in the round (cloudtrain.rounds): H_r, or H."""
        assert self.schedule is not None
        steps = self.rounds.steps
        return self.schedule.sync_every if steps is None else steps[self.topo.region]

    @property
    def samples_done(self) -> int:
        """The run's samples over all regions up to the last round boundary (cloudtrain.rounds):
        with work="time" exact and the same on every rank; with "steps" this rank's samples x
        the world size (exact where every rank's batches are alike)."""
        return self.rounds.samples_done

    # -- every inner step ---------------------------------------------------------------------
    @torch.no_grad()
    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step post-hook: time the step, then run the schedule (catch_up). A
        sync's own time (waiting for the other regions) is not the step's."""
        self._times.append(time.perf_counter() - self._last)
        if self.elastic is not None:  # no round boundaries clear them (its plans' step: recent)
            del self._times[:-ELASTIC_STEP_TIMES]
        self.catch_up()
        self._last = time.perf_counter()

    def catch_up(self) -> None:
        """Run the schedule up to the gradient syncs done - its clock, not optimizer steps:
        AMP's GradScaler skips the step of only the region whose gradients overflowed, so
        counting steps would put the regions' syncs apart. After every optimizer step; and,
        for a region whose step was skipped, at the start of its next training forward, in
        sync_all() and in state_dict(): before any other collective the ranks then issue (DDP's
        buffer broadcast, a checkpoint's gather), so a region waiting in a sync is never
        waited for. (A collective of the user's own between optimizer.step() and the next
        forward, on a step AMP skipped in one region and with overlap 0, would still wait.)"""
        while self.step < self._steps():
            self.step += 1
            self._at_step()

    def _at_step(self) -> None:
        if self.schedule is None:
            if self.step < DECIDE_AFTER:
                return
            self._decide()
        for flight in sorted(self.flights.values(), key=lambda x: x.fragment):
            if flight.merge == self.step:
                self._merge(flight)
        for f in range(self.fragments):
            if self._due(f):
                self._sync(f)

    def _due(self, f: int) -> bool:
        """Fragment f syncs now: at its offset in every round, fragment 0 at the round's end.
        With work="time", a first round whose end passed before the schedule was chosen (an H
        under DECIDE_AFTER) ends at once: every region chose at the same step, so every region
        syncs there."""
        schedule = self.schedule
        assert schedule is not None
        if schedule.provisional:
            return f == 0 and self.step - schedule.start == schedule.sync_every
        if self.outer.work == "steps":
            return (self.step - schedule.start - self.offset(f)) % schedule.sync_every == 0
        h, into = self.round_length(), self.step - self.rounds.start
        return into >= h if f == 0 else into == self.offset(f, h)

    def _decide(self) -> None:
        """H and the codecs, from rank 0's measured step time (with work="time" the slowest
        rank's) and the probed links; every rank gets rank 0's choice."""
        outer = self.outer
        choice: list[Any] = [None]
        step_s = self._step_s()
        if outer.work == "time":
            step_s = max(s for s, _ in self._gather(step_s, 0))
        if self.topo.rank == 0:
            links = self.links or [LinkEstimate(1e12, 0.0)] * len(self.topo.regions)
            choice[0] = self.choose(links, step_s)
            log.info("cloudtrain outer loop: %s", choice[0].describe(step_s, links))
        dist.broadcast_object_list(choice, src=0, group=self.topo.group("control"))
        self.schedule = choice[0]

    @property
    def ladder(self) -> tuple[Rung, ...]:
        """The codecs the schedule chooses from: the outer ladder, or the one configured."""
        outer = self.outer
        return OUTER_LADDER if outer.codec == AUTO else ((outer.codec, outer.level),)

    def choose(self, links: Sequence[LinkEstimate], step_s: float) -> Schedule:
        """H and each region's codec for `links` (by region index) and an inner step of
        `step_s` seconds (choose_schedule): as configured where not "auto"."""
        outer = self.outer
        setting = SyncSetting(self.numel, links, self.cut, step_s, self.fragments, outer.overlap)
        return choose_schedule(setting, self.codecs.wire_nbytes, outer.sync_every, self.ladder)

    def _delta(self, f: int, local: torch.Tensor) -> torch.Tensor:
        """Fragment f's pseudo-gradient, where the outer copy lives; scaled by the region's
        sample weight where regions trained on different numbers of samples (cloudtrain.rounds)."""
        delta = self.global_[f].float() - local.to(self.global_[f].device)
        weights = self.rounds.weights
        return delta if weights is None else delta.mul_(weights[self.topo.region])

    def _sync(self, f: int) -> None:
        if self.elastic is not None:  # over the regions present (cloudtrain.elastic)
            self.elastic.sync(f)
            return
        if f == 0:
            self._reconcile_buffers()
            self._end_round()
        local = self.parts.local(f)
        delta = self._delta(f, local)
        step, label = self.step, self._label(f)
        if self.outer.overlap == 0:
            self._apply(f, self._exchange(f, delta, label), local, local)
            return
        future = self._pool.submit(self._exchange, f, delta, label)
        self.flights[f] = _FragmentSync(f, step, step + self.outer.overlap, local, future)

    def _label(self, f: int) -> int:
        """The step that labels fragment f's exchange (its packets' headers, a codec's seed),
        the same in every region: the step itself with work="steps"; with "time", where the
        regions' steps differ, the step the sync would have with "steps" - k*H + f*H//F after
        k round boundaries (fragment 0's at its own boundary) - which is the region's own step
        while every H_r is H."""
        if self.outer.work == "steps":
            return self.step
        assert self.schedule is not None
        return self.rounds.index * self.schedule.sync_every + self.offset(f)

    def _reconcile_buffers(self) -> None:
        """The regions' buffers made one (cloudtrain.buffers), on the training thread."""
        if self.buffers is not None and not self.topo.single_region:
            where = f" at outer step {self.step}"
            self.buffers.across_regions(self.topo.group("control"), self.config.timeout, where)

    def _end_round(self) -> None:
        """The round boundary, at fragment 0's sync (cloudtrain.rounds): the samples of the run
        so far; with work="time" also every region's H_r for the next round and the weights of
        the syncs until the next boundary, from every rank's gathered step time and samples."""
        rounds = self.rounds
        samples = self._samples() - rounds.samples_at_start
        if self.outer.work == "time":
            step_s, per_region = region_totals(
                self._gather(self._step_s(), samples), self.topo.members
            )
            assert self.schedule is not None
            h, frags, tau = self.schedule.sync_every, self.fragments, self.outer.overlap
            rounds.steps = round_steps(h, step_s, frags, tau)
            by_samples = self.outer.weighting == "samples"
            rounds.weights = sample_weights(per_region) if by_samples else None
            rounds.samples_done += sum(per_region)
        else:
            rounds.samples_done += samples * self.topo.world_size
        rounds.start, rounds.samples_at_start = self.step, self._samples()
        rounds.index += 1
        self._times = []

    def _step_s(self) -> float:
        """The median inner step of the round so far, the run's first (its warm-up) left out;
        0 where none was timed."""
        times = self._times[1:] if self.rounds.index == 0 else self._times
        return statistics.median(times or self._times or [0.0])

    def _gather(self, step_s: float, samples: int) -> list[tuple[float, int]]:
        """Every rank's (step seconds, samples), by rank: one small all-gather of all ranks, on
        the training thread."""
        mine = torch.tensor([step_s, float(samples)], dtype=torch.float64)  # exact below 2**53
        everyone = [torch.empty_like(mine) for _ in range(self.topo.world_size)]
        run_and_wait(
            "round report", list(range(self.topo.world_size)), self.config.timeout,
            lambda: dist.all_gather(everyone, mine, group=self.topo.group("control"),
                                    async_op=True),
            f" at outer step {self.step}",
        )  # fmt: skip
        return [(float(t[0]), int(t[1])) for t in everyone]

    def _merge(self, flight: _FragmentSync) -> None:
        del self.flights[flight.fragment]
        mean = flight.future.result()  # its error, if any, is raised here, on the training thread
        self._apply(flight.fragment, mean, flight.local_at_send, self.parts.local(flight.fragment))

    def _exchange(
        self,
        f: int,
        delta: torch.Tensor,
        step: int,
        path: CrossRegion | None = None,
        plan: Plan | None = None,
        divisor: int | None = None,
        failures: list[BaseException] | None = None,
    ) -> torch.Tensor:
        """The mean over regions of the regions' pseudo-gradients of fragment f. An elastic run
        (cloudtrain.elastic) gives the present regions' `path` and `plan`, the `divisor` (the
        regions that contribute) and `failures`: a failed exchange across regions is appended
        there, and the rank still takes part in the gather inside its region."""
        path = path or self.path
        topo = path.topo
        regions = len(topo.regions)
        if regions == 1:
            return delta
        assert self.schedule is not None
        where = f" at outer step {step}, fragment {f}"
        device = delta.device
        delta = delta.cpu()  # the groups are gloo's (Topology.private)
        plan = plan or Plan(self.schedule.rungs, zstd=(outer_zstd(self.config),) * regions)
        if self.sharded:  # this rank's shard is the region's: swapped whole, nothing to gather
            if delta.numel() == 0:  # (a shard FSDP left empty: empty on every region alike)
                return delta.to(device)
            summed = path.collect(path.issue(delta, plan, step, f, where, delta.numel()))
            return (summed / (divisor or regions)).to(device)
        padded, n, m = pad_to_shards(delta, topo.shards)
        mine = None
        if topo.shard is not None:
            mine = padded[topo.shard * m : (topo.shard + 1) * m].contiguous()
        summed = None
        if mine is not None:
            try:
                summed = path.exchange(mine, plan, step, f, n, where)
            except CommError as e:
                if failures is None:
                    raise
                failures.append(e)
                summed = torch.zeros(m, dtype=torch.float32)
        path.gather_in_region(Shard(padded, n, m, mine), summed, where)
        return (padded[:n] / (divisor or regions)).to(device)

    def _apply(
        self, f: int, mean: torch.Tensor, local_at_send: torch.Tensor, local_now: torch.Tensor
    ) -> None:
        """The outer step on fragment f's outer copy; the local parameters become it (plus what
        the region learnt since the exchange started)."""
        self.global_[f], self.momentum[f] = outer_step(
            self.outer, self.global_[f], self.momentum[f], mean
        )
        new = self.global_[f].float().to(local_now.device)
        if local_now is not local_at_send:
            new = new + (local_now - local_at_send)
        self.parts.write(f, new)

    # -- end and state -----------------------------------------------------------------------
    @torch.no_grad()
    def sync_all(self) -> None:
        """Merge what is in flight, then sync every fragment once (all ranks call): every
        replica then holds the same parameters (e.g. before the final evaluation or export).
        Nothing in a region that left the run (a spot notice: its pseudo-gradient was handed
        over, and the others go on without it)."""
        if self.elastic is not None and self.elastic.stats.left:
            return
        self.catch_up()  # a region whose last step AMP skipped
        for flight in sorted(self.flights.values(), key=lambda x: x.fragment):
            self._merge(flight)
        if self.schedule is None:
            self._decide()
        if self.elastic is None:
            self._reconcile_buffers()
        for f in range(self.fragments):
            if self.elastic is not None:
                self.elastic.sync(f)
                continue
            local = self.parts.local(f)
            label = self._label(0)  # as the last boundary's, where a samples_done loop ends
            self._apply(f, self._exchange(f, self._delta(f, local), label), local, local)

    def _wait(self) -> None:
        for flight in self.flights.values():
            flight.future.result()

    def state_dict(self) -> dict[str, Any]:
        """Outer copy, momentum, residuals, in-flight fragments (their exchanges are waited for,
        so that the residuals are the ones after them) and the schedule; on a region's first rank
        also the region's own parameters, buffers and inner optimizer state ("region"): regions differ
        between syncs, and a checkpoint's one copy of the model and optimizer is one region's."""
        self.catch_up()
        self._wait()
        region = None  # sharded: every region saves its own shards (cloudtrain.checkpoint)
        if self.topo.local_index == 0 and not self.topo.single_region and not self.sharded:
            region = region_state(self.params, self.optimizer, self.buffers)
        state = {
            "region": region,
            "format": OUTER_STATE_FORMAT,
            "step": self.step,
            "schedule": None if self.schedule is None else dataclasses.asdict(self.schedule),
            "global": [g.detach().cpu().clone() for g in self.global_],
            "momentum": [None if b is None else b.detach().cpu().clone() for b in self.momentum],
            "residuals": None if self.ef is None else self.ef.state_dict(),
            "flights": [
                fl.state_dict() for fl in sorted(self.flights.values(), key=lambda x: x.fragment)
            ],
            "rounds": self.rounds.state_dict(self._samples()),
            "round_times": list(self._times),  # the round's steps so far: its median goes on
        }
        if self.elastic is not None:
            state["elastic"] = self.elastic.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") not in (1, OUTER_STATE_FORMAT):
            raise ValueError(
                "outer state: expected the 'outer' entry of CloudDDP.comm_state_dict() of this "
                "cloudtrain release"
            )
        if state["format"] == 1 and self.outer.work == "time":
            raise ValueError(
                "outer state: saved by a release without outer.work, so without the round that "
                "work='time' resumes; resume it with work='steps'"
            )
        if len(state["global"]) != self.fragments:
            raise ValueError(
                f"outer state has {len(state['global'])} fragments, this run {self.fragments}: "
                "resume with the same outer.fragments"
            )
        self._wait()
        device = self.global_[0].device  # the outer copy's home (host memory with host_copy)
        self.step = int(state["step"])
        sched = state["schedule"]
        self.schedule = None if sched is None else Schedule.from_state(sched)
        self.global_ = [g.to(device) for g in state["global"]]
        self.momentum = [None if b is None else b.to(device) for b in state["momentum"]]
        if self.ef is not None:
            residuals = state["residuals"] or {}
            if "dtype" not in residuals:  # saved before residuals had ErrorFeedback's own form
                residuals = {"dtype": self.outer.dtype, "residuals": residuals}
            self.ef.load_state_dict(residuals)
        self.flights = {
            fl["fragment"]: _FragmentSync.from_state(fl, device, self.params[0].device)
            for fl in state["flights"]
        }
        if "region" in state and not self.topo.single_region and not self.sharded:
            load_region(self, state["region"])
        if self.elastic is not None and state.get("elastic") is not None:
            self.elastic.load_state_dict(state["elastic"])
        rounds = state.get("rounds")  # (format 1: samples_done counts from the resume)
        self.rounds = Rounds() if rounds is None else Rounds.from_state(rounds, self._samples())
        self._times, self._last = list(state.get("round_times", [])), time.perf_counter()

    def settle(self) -> None:
        """Wait until the exchanges in flight have crossed (every rank has started them); they
        are still merged at their steps, and an error is raised there."""
        concurrent.futures.wait([flight.future for flight in self.flights.values()])

    def close(self) -> None:
        self._handle.remove()
        self._pool.shutdown(wait=False)
