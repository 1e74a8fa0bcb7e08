"""CloudDDP: DistributedDataParallel whose gradients cross regions compressed.

    import cloudtrain
    cloudtrain.init()                                   # horovodrun, torchrun, or one process
    model = cloudtrain.CloudDDP(model, "topk-1pct")     # or "auto", "cocktail", a CompressionConfig

Data path of one gradient bucket (DESIGN.md), run by `CommState`:
1. scale by 1/world size (as DDP does: times the reciprocal);
2. inside a region (fast links): dense reduce-scatter, so each of the region's k ranks owns 1/k;
3. across regions (slow links): each shard owner compresses its shard with error feedback,
   exchanges packets with the owners of the same shard in the other regions (all_gather when all
   packets have one size, point-to-point when the plan gives senders different levels), decodes
   every packet - its own from the same bytes - and sums them in region order;
4. inside a region: dense all-gather of the shards, written into the bucket.
One region, or a plan that compresses nothing: a plain all-reduce (exactly DDP's), issued from
the hook as DDP's own.

Compressed buckets go to one communication thread per CloudDDP, which issues their collectives
bucket after bucket, so every rank issues the same collectives in the same order however the
buckets' callbacks interleave (PyTorch's PowerSGD hook, which issues from callbacks, fails on gloo
with several buckets in flight). Compression on that thread overlaps the rest of the backward.

Invariants kept here: replicas agree bit for bit (every rank sums the same bytes in the same
order); all ranks agree on every collective's size (sizes come from the config or the broadcast
plan, never local measurements); no state is lost (residuals, the step and the controller are in
`comm_state_dict()`, and a change of DDP's bucket layout folds old residuals into the next
gradients instead of dropping them); randomness comes from (seed, step, bucket), never the user's
RNG; bad input and mismatched ranks raise clear errors; every collective has a timeout.
"""

import dataclasses
import logging
import queue
import threading
import time
import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .bootstrap import init
from .collectives import (
    CommError,
    all_gather_single,
    exchange_fixed,
    exchange_sized,
    finish,
    reduce_scatter_single,
)
from .compress import Codec, ErrorFeedback, PacketError, RandomKey, from_wire, to_wire
from .compress.codecs import Level, all_finite
from .config import AUTO, CompressionConfig
from .topology import Topology

log = logging.getLogger("cloudtrain")

COMM_STATE_FORMAT = 1


class ConfigMismatch(RuntimeError):
    """Ranks disagree on the model or the compression config."""


class ReplicaMismatch(RuntimeError):
    """Replicas' parameters no longer agree bit for bit."""


Layout = tuple[tuple[int, int, int], ...]
"""A bucket's (parameter index, offset in the bucket, numel) for every parameter in it."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What each region's shard owners send: (codec name, level) by region index. Decided on one
    rank (or fixed by the config) so that every rank knows every packet's size."""

    senders: tuple[tuple[str, Level], ...]

    @property
    def uniform(self) -> bool:
        return len(set(map(repr, self.senders))) == 1

    @property
    def lossless(self) -> bool:
        return all(name == "none" for name, _ in self.senders)


@dataclasses.dataclass
class _Job:
    index: int
    buffer: torch.Tensor
    is_last: bool
    parameters: list[torch.Tensor]
    gradients: list[torch.Tensor]
    future: torch.futures.Future
    ready: Any = None  # CUDA event recorded when the hook was called


class CommState:
    """Everything CloudDDP's comm hook keeps between calls (one per CloudDDP)."""

    __slots__ = (
        "_codecs",
        "_first_of_step",
        "_lock",
        "_queue",
        "_thread",
        "config",
        "controller",
        "direct",
        "ef",
        "error",
        "layouts",
        "param_index",
        "param_names",
        "params",
        "pending",
        "plan",
        "stats",
        "step",
        "stream",
        "timeout",
        "topo",
        "world_size",
    )

    def __init__(
        self,
        config: CompressionConfig,
        topo: Topology,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
    ) -> None:
        self.config = config
        self.topo = topo
        self.world_size = topo.world_size
        self.timeout = timedelta(seconds=config.timeout_s)
        self.params = list(params)
        self.param_names = list(names)
        self.param_index = {id(p): i for i, p in enumerate(self.params)}
        self.ef = ErrorFeedback(config.residual_torch_dtype) if config.error_feedback else None
        self._codecs: dict[str, Codec] = {}
        self.step = 0
        self.layouts: dict[int, Layout] = {}
        self.pending: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.error: BaseException | None = None
        self.stats: dict[str, Any] = {"wan_bytes_sent": 0, "steps": 0, "buckets": 0, "seconds": {}}
        self.controller = None
        if config.codec == AUTO and not topo.single_region:
            from .controller import Controller

            if topo.links is None:
                topo.probe()
            device = self.params[0].device if self.params else "cpu"
            self.controller = Controller(config, topo, self.shard_numels(), device)
        self.plan = self._static_plan()
        self.direct = topo.single_region
        self._first_of_step = True
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.stream = None

    # -- plan ------------------------------------------------------------------------------------
    def codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = self.config.make_codec(name)
        return codec

    def _static_plan(self) -> Plan:
        if self.controller is not None:
            return self.controller.initial_plan()
        if self.config.codec == AUTO:  # one region: nothing crosses a slow link
            return Plan(tuple(("none", None) for _ in self.topo.regions))
        level = self.codec(self.config.codec).check_level(self.config.level)
        return Plan(tuple((self.config.codec, level) for _ in self.topo.regions))

    def shard_numels(self) -> list[int]:
        """Elements of each bucket's shard (before the first step: the model as one bucket)."""
        shards = self.topo.shards
        if self.layouts:
            return [-(-sum(n for _, _, n in lay) // shards) for lay in self.layouts.values()]
        return [-(-sum(p.numel() for p in self.params if p.requires_grad) // shards)]

    # -- the hook's two paths ---------------------------------------------------------------------
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        fut: torch.futures.Future = torch.futures.Future(
            devices=[buffer.device] if buffer.is_cuda else None
        )
        if self.error is not None:
            fut.set_exception(self.error)
            return fut
        job = _Job(
            bucket.index(), buffer, bucket.is_last(), bucket.parameters(), bucket.gradients(), fut
        )
        self.stats["buckets"] = max(self.stats["buckets"], job.index + 1)
        if job.is_last and self.controller is not None:
            self.controller.compute_finished()
        if self.direct or self.controller is not None:
            try:
                self._begin()  # this step's checks and plan, before its first collective
            except Exception as e:
                self.error = e
                fut.set_exception(e)
                return fut
            if self.direct or self.plan.lossless:
                return self._allreduce(job)
        if buffer.is_cuda:
            job.ready = torch.cuda.Event()
            job.ready.record()
        self._ensure_thread()
        self._queue.put(job)
        return fut

    def _allreduce(self, job: _Job) -> torch.futures.Future:
        """Exactly what DDP does (scale by 1/world, all-reduce), on cloudtrain's own group, issued
        from the hook: for one region, and for the controller's plans without compression (a
        hierarchy buys nothing then; residuals left from compressed steps are added in first)."""
        buf = job.buffer.mul_(1.0 / self.world_size)
        try:
            if self.controller is not None:
                self._units(job)  # keep learning DDP's layout
                self._inject_pending(self._signature(job), buf)
        except Exception as e:
            self.error = e
            job.future.set_exception(e)
            return job.future
        t0 = time.perf_counter()
        work = dist.all_reduce(buf, group=self.topo.group("dense"), async_op=True)
        step, index, last = self.step, job.index, job.is_last
        if last:
            self._end_step()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            try:
                result = fut.value()[0]
            except Exception as e:
                err = CommError(
                    f"cloudtrain: all-reduce with ranks {list(range(self.world_size))} failed on rank "
                    f"{self.topo.rank} at step {step}, bucket {index}: {e}"
                )
                self.error = err
                raise err from e
            self._spent("allreduce", t0)
            if last and self.controller is not None:
                self.controller.step_started()
            self._check_finite(result, step, index)
            return result

        return work.get_future().then(done)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="cloudtrain-comm", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        if torch.cuda.is_available():
            self.stream = torch.cuda.Stream()
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self.error is not None:
                job.future.set_exception(self.error)
                continue
            try:
                if job.ready is not None:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(job.ready)
                        result = self._reduce(job)
                else:
                    result = self._reduce(job)
                job.future.set_result(result)
            except BaseException as e:
                self.error = e
                job.future.set_exception(e)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)

    # -- per step ------------------------------------------------------------------------------
    def _begin(self) -> None:
        """At the first bucket of a step: the replica check when due, and the step's plan."""
        if not self._first_of_step:
            return
        self._first_of_step = False
        every = self.config.verify_every
        if every and self.step and self.step % every == 0:
            self.verify_replicas()
        if self.controller is not None:
            self.plan = self.controller.plan_for_step(self.step, self)
            if self.plan.lossless and self.ef is not None and self.ef.residuals:
                # compression stops: what it kept back goes into the next gradients
                for b in list(self.layouts):
                    self._residuals_to_pending(b, self.layouts[b])

    def _end_step(self) -> None:
        self._first_of_step = True
        self.step += 1
        self.stats["steps"] += 1

    def _reduce(self, job: _Job) -> torch.Tensor:
        """The bucket's data path (module docstring), on the communication thread.

        DDP's bucket is reduced as the buckets of `layouts` it is made of: itself, normally; in
        the first step after a resume, DDP's one initial bucket holds all the buckets the saved
        run used, and each is reduced as it was then, so the resumed run repeats its math.
        """
        self._begin()
        buf = job.buffer
        buf.mul_(1.0 / self.world_size)  # as DDP: times the reciprocal, not divided
        for index, layout, placement in self._units(job):
            if placement is None:
                self._reduce_unit(job, index, layout, buf)
                continue
            unit = buf.new_empty(sum(numel for _, _, numel in layout))
            for (_, here, numel), (_, there, _) in zip(layout, placement, strict=True):
                unit[here : here + numel] = buf[there : there + numel]
            self._reduce_unit(job, index, layout, unit)
            for (_, here, numel), (_, there, _) in zip(layout, placement, strict=True):
                buf[there : there + numel] = unit[here : here + numel]
        self._check_finite(buf, self.step, job.index)
        if job.is_last:
            self._end_step()
            if self.controller is not None:
                self.controller.step_started()
        return buf

    def _reduce_unit(self, job: _Job, index: int, layout: Layout, buf: torch.Tensor) -> None:
        """Steps 2-4 of the data path for bucket `index` (already scaled), in place."""
        topo = self.topo
        where = f" at step {self.step}, bucket {index}"
        self._inject_pending(layout, buf)
        n, shards = buf.numel(), topo.shards
        m = -(-n // shards)  # shard length; the bucket is padded to shards * m
        padded = buf if n == shards * m else torch.cat([buf, buf.new_zeros(shards * m - n)])
        region, local = topo.region, topo.local_index
        members = topo.members[region]
        rgroup = topo.groups.get(f"region{region}")
        shard = topo.shard
        # 2. inside the region: each owner gets the region's sum of its shard
        t0 = time.perf_counter()
        if len(members) == shards and shards > 1:
            mine = buf.new_empty(m)
            finish(
                "intra-region reduce-scatter",
                members,
                self.timeout,
                lambda: reduce_scatter_single(mine, padded, group=rgroup, async_op=True),
                where,
            )
        elif len(members) > 1:
            finish(
                "intra-region all-reduce",
                members,
                self.timeout,
                lambda: dist.all_reduce(padded, group=rgroup, async_op=True),
                where,
            )
            mine = padded[local * m : (local + 1) * m] if shard is not None else None
        else:
            mine = padded
        self._spent("intra_reduce", t0)
        # 3. across regions: compressed exchange of the shard
        if shard is not None:
            summed = self._exchange(index, mine, shard, m, n, where).to(buf.dtype)
        # 4. inside the region: everyone gets every shard
        t0 = time.perf_counter()
        if len(members) == shards and shards > 1:
            finish(
                "intra-region all-gather",
                members,
                self.timeout,
                lambda: all_gather_single(padded, summed, group=rgroup, async_op=True),
                where,
            )
        elif len(members) > 1:
            if shard is not None:
                padded[local * m : (local + 1) * m] = summed
            for j in range(shards):
                piece = padded[j * m : (j + 1) * m]
                finish(
                    "intra-region broadcast",
                    members,
                    self.timeout,
                    lambda piece=piece, j=j: dist.broadcast(
                        piece, src=members[j], group=rgroup, async_op=True
                    ),
                    where,
                )
        else:
            padded = summed
        if padded is not buf:
            buf.copy_(padded[:n])
        self._spent("intra_gather", t0)

    def _spent(self, stage: str, since: float) -> None:
        """Add the seconds since `since` to stats["seconds"][stage] (for reports and tuning)."""
        seconds = self.stats["seconds"]
        seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - since

    def _exchange(
        self, index: int, x: torch.Tensor, shard: int, m: int, n: int, where: str
    ) -> torch.Tensor:
        """Compress this rank's shard, swap packets with the other regions' owners, sum them."""
        topo, plan = self.topo, self.plan
        me = topo.region
        bucket_key = index * topo.shards + shard
        name, level = plan.senders[me]
        codec = self.codec(name)
        key = RandomKey(self.config.seed, self.step, bucket_key, me)
        t0 = time.perf_counter()
        if self.ef is not None:  # also at "none": what earlier levels kept back goes out now
            packet = self.ef.encode((index, shard), x, codec, level, key)
            residual = self.ef.residuals[(index, shard)]
            valid = n - shard * m
            if valid < m:  # padding is not gradient: keep nothing for it
                residual[max(valid, 0) :] = 0
        else:
            packet = codec.encode(x, level, key)
        wire = to_wire(packet)
        self._spent("encode", t0)
        t0 = time.perf_counter()
        peers = topo.shard_owners(shard)
        group = topo.group(f"cross{shard}")
        if plan.uniform and self.controller is None:
            wires = exchange_fixed(wire, peers, group, self.timeout, where)
        else:  # per-sender sizes; the controller also times each sender's packet
            sizes = [self.codec(c).nbytes(m, lv, x.dtype) for c, lv in plan.senders]
            timings: dict[int, float] | None = {} if self.controller is not None else None
            wires = exchange_sized(wire, sizes, peers, me, group, self.timeout, where, timings)
            for region, seconds in (timings or {}).items():
                self.controller.received(region, sizes[region], seconds)
        self.stats["wan_bytes_sent"] += wire.numel() * (len(peers) - 1)
        self._spent("exchange", t0)
        t0 = time.perf_counter()
        out = torch.zeros(m, dtype=torch.float32, device=x.device)
        for region, data in enumerate(wires):
            cname, clevel = plan.senders[region]
            rcodec = self.codec(cname)
            packet = from_wire(data, rcodec)
            expect = RandomKey(self.config.seed, self.step, bucket_key, region)
            if (
                packet.key != expect
                or packet.numel != m
                or packet.level != rcodec.check_level(clevel)
            ):
                raise PacketError(
                    f"packet from region {topo.regions[region]!r}{where} is for step {packet.key.step}, "
                    f"bucket {packet.key.bucket}, sender {packet.key.rank}, {packet.numel} elements, level "
                    f"{packet.level}; expected step {self.step}, bucket {bucket_key}, sender {region}, {m}, "
                    f"{clevel}: ranks are out of step"
                )
            if x.is_cuda:
                packet = dataclasses.replace(
                    packet, parts=tuple(p.to(x.device, non_blocking=True) for p in packet.parts)
                )
            rcodec.accumulate([packet], out)
        self._spent("decode", t0)
        return out

    def _check_finite(self, result: torch.Tensor, step: int, index: int) -> None:
        if self.config.nonfinite == "raise" and not all_finite(result):
            raise ValueError(
                f"cloudtrain: the summed gradient of bucket {index} at step {step} has NaN or Inf "
                "(raised on every rank). Fix the loss, or with AMP's GradScaler set "
                "CompressionConfig(nonfinite='pass')"
            )

    # -- bucket layouts and residuals ---------------------------------------------------------
    def _signature(self, job: _Job) -> tuple[tuple[int, int, int], ...]:
        """(parameter index, offset in the bucket, numel) of every parameter in the bucket."""
        base, size = job.buffer.data_ptr(), job.buffer.element_size()
        return tuple(
            (self.param_index[id(p)], (g.data_ptr() - base) // size, g.numel())
            for p, g in zip(job.parameters, job.gradients, strict=True)
        )

    def _units(self, job: _Job) -> list[tuple[int, Layout, Layout | None]]:
        """The buckets of `layouts` that DDP's bucket consists of, as (index, layout, placement):
        placement None when DDP's bucket is that bucket, else where its parameters sit in DDP's.

        A DDP bucket that is neither a known bucket nor made of known buckets means DDP changed
        its layout (it rebuilds its buckets after the first step): every residual then goes back
        into the gradients of its parameters (`pending`), and the new layout is learnt.
        """
        sig = self._signature(job)
        known = self.layouts.get(job.index)
        if known == sig:
            return [(job.index, sig, None)]
        where = {pi: (pi, offset, numel) for pi, offset, numel in sig}
        inside = [
            b for b, lay in sorted(self.layouts.items()) if all(pi in where for pi, _, _ in lay)
        ]
        covered = {pi for b in inside for pi, _, _ in self.layouts[b]}
        if (
            inside
            and covered == set(where)
            and sum(len(self.layouts[b]) for b in inside) == len(sig)
        ):
            return [
                (b, self.layouts[b], tuple(where[pi] for pi, _, _ in self.layouts[b]))
                for b in inside
            ]
        if known is not None or any(
            set(where) & {pi for pi, _, _ in lay} for lay in self.layouts.values()
        ):
            for b in list(self.layouts):
                self._residuals_to_pending(b, self.layouts.pop(b))
        self.layouts[job.index] = sig
        return [(job.index, sig, None)]

    def _pieces(self, layout, shard: int, residual: torch.Tensor) -> None:
        """Split a shard's residual at parameter boundaries into `pending`."""
        n = sum(numel for _, _, numel in layout)
        m = residual.numel()
        lo, hi = shard * m, min((shard + 1) * m, n)
        for pi, offset, numel in layout:
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                self.pending.setdefault(pi, []).append(
                    (a - offset, residual[a - lo : b - lo].float().clone())
                )

    def _residuals_to_pending(self, index: int, layout) -> None:
        if self.ef is None:
            return
        for key in [k for k in self.ef.residuals if k[0] == index]:
            self._pieces(layout, key[1], self.ef.residuals.pop(key))

    def _inject_pending(self, layout: Layout, buf: torch.Tensor) -> None:
        """Add residual pieces of this bucket's parameters into its (scaled) gradient: the region's
        reduction then carries them to the shard's new owner, who compresses them with feedback."""
        if not self.pending:
            return
        for pi, offset, _ in layout:
            for start, piece in self.pending.pop(pi, ()):
                view = buf[offset + start : offset + start + piece.numel()]
                view.add_(piece.to(device=view.device, dtype=view.dtype))

    # -- checks --------------------------------------------------------------------------------
    def verify_replicas(self) -> None:
        """Raise ReplicaMismatch unless every rank's parameters are bit-identical to rank 0's."""
        sums = [
            zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().data)
            for p in self.params
        ]
        gathered: list[Any] = [None] * self.world_size
        group = self.topo.group("control")
        try:
            dist.all_gather_object(gathered, sums, group=group)
        except Exception as e:
            raise CommError(
                f"cloudtrain: replica check failed on rank {self.topo.rank}: {e}"
            ) from e
        for rank, other in enumerate(gathered):
            if other != gathered[0]:
                bad = next(
                    i for i, (a, b) in enumerate(zip(other, gathered[0], strict=True)) if a != b
                )
                raise ReplicaMismatch(
                    f"cloudtrain: after step {self.step} rank {rank}'s parameter "
                    f"{self.param_names[bad]!r} differs from rank 0's: replicas diverged"
                )

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        residuals = (
            {}
            if self.ef is None
            else {k: v.detach().cpu().clone() for k, v in self.ef.residuals.items()}
        )
        return {
            "format": COMM_STATE_FORMAT,
            "config": self.config.fingerprint(),
            "rank": self.topo.rank,
            "regions": list(self.topo.rank_regions),
            "step": self.step,
            "layouts": {b: list(sig) for b, sig in self.layouts.items()},
            "residuals": residuals,
            "pending": {
                pi: [(s, t.clone()) for s, t in pieces] for pi, pieces in self.pending.items()
            },
            "controller": None if self.controller is None else self.controller.state_dict(),
            "stats": {k: v for k, v in self.stats.items() if k != "seconds"},  # times are not state
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != COMM_STATE_FORMAT:
            raise ValueError(
                "comm state: expected a dict from CloudDDP.comm_state_dict() of this cloudtrain release"
            )
        if state["config"] != self.config.fingerprint():
            raise ValueError(
                "comm state was saved with a different CompressionConfig; resume with the same config"
            )
        if state["rank"] != self.topo.rank:
            raise ValueError(
                f"comm state of rank {state['rank']} loaded on rank {self.topo.rank}: load each rank's own"
            )
        self.step = int(state["step"])
        self.layouts = {int(b): tuple(tuple(t) for t in sig) for b, sig in state["layouts"].items()}
        self.pending = {
            int(pi): [(int(s), t.clone()) for s, t in pieces]
            for pi, pieces in state["pending"].items()
        }
        if self.ef is not None:
            self.ef.reset()
            self.ef.residuals.update({tuple(k): v.clone() for k, v in state["residuals"].items()})
        if list(state["regions"]) != list(self.topo.rank_regions):
            # another cluster shape: shards have new owners, so residuals go back into gradients
            for b in list(self.layouts):
                self._residuals_to_pending(b, self.layouts.pop(b))
        self.stats = {**state["stats"], "seconds": {}}
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
        self._first_of_step = True


def compressed_hook(
    state: CommState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: hand the bucket to CloudDDP's data path. (This module has no
    `from __future__ import annotations`: DDP checks these annotations at registration.)"""
    return state.submit(bucket)


def _model_description(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [
        (name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
    ]


def _check_agreement(module: torch.nn.Module, config: CompressionConfig) -> None:
    """All ranks compare model and config before the first step; a difference raises, named."""
    from . import __version__

    mine = {
        "version": __version__,
        "config": config.fingerprint(),
        "model": _model_description(module),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
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
                f"{ref['config']}); every rank must pass the same config to CloudDDP"
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


class CloudDDP(DistributedDataParallel):
    """DistributedDataParallel that compresses gradients between regions (module docstring).

    config: a CompressionConfig, a preset name ("auto", "none", "fp16", "topk-1pct", "cocktail",
    ...) or a codec spec ("topk:0.01"). Other keyword arguments go to DistributedDataParallel.
    """

    def __init__(
        self, module: torch.nn.Module, config: CompressionConfig | str = AUTO, **ddp_kwargs: Any
    ) -> None:
        config = CompressionConfig.resolve(config)
        init(timeout_s=config.timeout_s)
        if "process_group" in ddp_kwargs:
            raise ValueError("CloudDDP makes its own process groups; do not pass process_group")
        _check_agreement(module, config)
        super().__init__(module, **ddp_kwargs)
        topo = Topology.discover(config, timedelta(seconds=config.timeout_s))
        params = list(self.module.parameters())
        names = [name for name, _ in self.module.named_parameters()]
        self.comm = CommState(config, topo, params, names)
        self.register_comm_hook(self.comm, compressed_hook)
        if topo.single_region and not config.lossless and config.codec != AUTO:
            log.info(
                "cloudtrain: all ranks are in one region, so gradients are all-reduced without lossy "
                "compression; set CLOUDTRAIN_REGION per host (or regions='per-rank') to compress"
            )
        log.info("cloudtrain: %s; config %s", topo.describe(), config.codec)

    @property
    def compression_config(self) -> CompressionConfig:
        return self.comm.config

    @property
    def topology(self) -> Topology:
        return self.comm.topo

    def comm_state_dict(self) -> dict[str, Any]:
        """This rank's communication state: error-feedback residuals, step, controller."""
        return self.comm.state_dict()

    def load_comm_state_dict(self, state: dict[str, Any]) -> None:
        self.comm.load_state_dict(state)

    def verify_replicas(self) -> None:
        """Check now that all replicas' parameters agree bit for bit (all ranks must call it)."""
        self.comm.verify_replicas()

    def __del__(self) -> None:
        comm = self.__dict__.get("comm")
        if comm is not None:
            comm.close()
