"""CloudDDP's communication hook: DDP hands it each gradient bucket, it returns a future.

    state = CommState(config, topo, params, names)
    ddp.register_comm_hook(state, compressed_hook)

Two paths:
- plain: one region, or a plan that compresses nothing - scale by 1/world and all-reduce, exactly
  DDP's own hook, issued right away on cloudtrain's own group;
- compressed: the bucket goes to one communication thread per CloudDDP, which runs the data path
  (cloudtrain.datapath: reduce-scatter in the region, compressed exchange across regions,
  all-gather) bucket after bucket, so every rank issues the same collectives in the same order
  however DDP's callbacks interleave (PyTorch's PowerSGD hook, which issues from callbacks, fails
  on gloo with several buckets in flight). Compression on that thread overlaps the backward.

At the first bucket of a step the plan is fixed for the step (the controller decides every few
steps; cloudtrain.controller) and, when due, replicas are verified. Residuals of DDP's changing
bucket layouts are kept by cloudtrain.layout.

Errors reach the training loop as what they are (CommError, PacketError, ValueError for NaN):
the hook's futures are chained so DDP's C++ side sees a failed future (never an exception object
where a tensor belongs), and a callback queued on the autograd engine re-raises the original
exception from `backward()`. After an error every later bucket fails at once: nothing waits for
a collective that will not come.
"""

import logging
import queue
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import CommError
from .compress import ErrorFeedback
from .compress.codecs import all_finite
from .config import AUTO, CompressionConfig
from .datapath import CrossRegion
from .guard import QualityProbe
from .layout import BucketLayouts, Unit
from .pipeline import Pipeline
from .plan import NONE, Codecs, Plan
from .stats import CommStats, Observer, ring_wan_bytes
from .topology import Topology

log = logging.getLogger("cloudtrain")

COMM_STATE_FORMAT = 1


class ReplicaMismatch(RuntimeError):
    """Replicas' parameters no longer agree bit for bit."""


@dataclass
class _Job:
    """One DDP bucket handed to the communication thread."""

    index: int
    buffer: torch.Tensor
    is_last: bool
    signature: tuple
    future: torch.futures.Future
    ready: Any = None  # CUDA event recorded when the hook was called


class CommState:
    """Everything CloudDDP's comm hook keeps between calls (one per CloudDDP)."""

    __slots__ = (
        "_first_of_step",
        "_queue",
        "_step_futures",
        "_thread",
        "_written",
        "codecs",
        "config",
        "controller",
        "ef",
        "error",
        "layouts",
        "observer",
        "param_names",
        "params",
        "path",
        "pipeline",
        "plan",
        "probe",
        "region_only",
        "stats",
        "step",
        "stream",
        "topo",
        "used_map",
    )

    def __init__(
        self,
        config: CompressionConfig,
        topo: Topology,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        *,
        region_only: bool = False,
    ) -> None:
        """region_only: reduce every bucket inside the region and nothing across (the inner
        steps of an outer loop, which crosses regions itself)."""
        self.config = config
        self.region_only = region_only and not topo.single_region
        self.topo = topo
        self.params = list(params)
        self.param_names = list(names)
        self.codecs = Codecs(config)
        self.ef = ErrorFeedback(config.residual_torch_dtype) if config.error_feedback else None
        self.layouts = BucketLayouts(self.params)
        self.stats = CommStats()
        self.observer = Observer()
        self.step = 0
        self.error: BaseException | None = None
        self.controller = None
        if config.codec == AUTO and not topo.single_region and not self.region_only:
            from .controller import Controller

            if topo.links is None:
                topo.probe()
            device = self.params[0].device if self.params else "cpu"
            self.controller = Controller(config, topo, self.codecs, self.shard_numels(), device)
        timed = self.observer if self.controller is not None else None
        self.probe = (
            QualityProbe(config.controller.quality_sample)
            if self.controller is not None and self.controller.guard is not None
            else None
        )
        self.path = CrossRegion(config, topo, self.codecs, self.ef, self.stats, timed, self.probe)
        self.pipeline = Pipeline()
        self.plan = self._first_plan()
        self._first_of_step = True
        self._step_futures: list[torch.futures.Future] | None = None
        self.used_map: Any = None
        """With find_unused_parameters: a callable giving DDP's used map after backward (one
        entry per trainable parameter), so what is sent for unused ones is not lost."""
        self._written: list[tuple[tuple, torch.Tensor]] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.stream = None

    def _first_plan(self) -> Plan:
        regions = len(self.topo.regions)
        if self.controller is not None:
            return self.controller.plan()
        if self.config.codec == AUTO:  # one region: nothing crosses a slow link
            return Plan.same(NONE, regions)
        level = self.codecs(self.config.codec).check_level(self.config.level)
        rung = (self.config.codec, level)
        return Plan.same(rung, regions, self.config.staleness or 0, self.config.zstd is True)

    def shard_numels(self) -> list[int]:
        return self.layouts.shard_numels(self.topo.shards, self.params)

    @property
    def direct(self) -> bool:
        """Buckets are all-reduced from the hook: one region, reduced inside the region only, or
        nothing compressed and nothing in the pipeline."""
        if self.topo.single_region or self.region_only:
            return True
        return self.plan.lossless and self.plan.staleness == 0 and not self.pipeline

    # -- the hook --------------------------------------------------------------------------------
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        try:
            fut = self._submit(bucket)
        except Exception as e:
            self.error = self.error or e
            fut = torch.futures.Future()
            fut.set_exception(self.error)
            fut = _failing(fut)
        self._watch(fut)
        return fut

    def _submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self.error is not None:
            raise self.error
        buffer = bucket.buffer()
        index, last = bucket.index(), bucket.is_last()
        self.stats.buckets = max(self.stats.buckets, index + 1)
        if last:
            self.observer.compute_finished()
        signature = self.layouts.signature(buffer, bucket.parameters(), bucket.gradients())
        self._begin()  # this step's plan and checks, before its first collective
        if self.direct:
            return self._allreduce(index, buffer, last, signature)
        fut: torch.futures.Future = torch.futures.Future(
            devices=[buffer.device] if buffer.is_cuda else None
        )
        job = _Job(index, buffer, last, signature, fut)
        if buffer.is_cuda:
            job.ready = torch.cuda.Event()
            job.ready.record()
        self._ensure_thread()
        self._queue.put(job)
        return _failing(fut)

    def _watch(self, fut: torch.futures.Future) -> None:
        """Inside backward(): at the end of the pass, re-raise a bucket's failure as itself."""
        if self._step_futures is None:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._raise_failure)
            except RuntimeError:  # not inside a backward pass (DDP's join() shadows buckets)
                return
            self._step_futures = []
        self._step_futures.append(fut)

    def _raise_failure(self) -> None:
        """Queued on the autograd engine: runs before DDP's own end of backward (which DDP queues
        after the last bucket is handed over) and raises what failed, with its own type."""
        futures, self._step_futures = self._step_futures or [], None
        if self.used_map is not None:  # runs after DDP's end of backward: callbacks run in order
            torch.autograd.Variable._execution_engine.queue_callback(self._reclaim_unused)
        for fut in futures:
            try:
                fut.wait()
            except Exception:
                if self.error is None:
                    raise
        if self.error is not None:
            raise self.error

    def _allreduce(
        self, index: int, buffer: torch.Tensor, last: bool, signature: tuple
    ) -> torch.futures.Future:
        """Exactly what DDP does (scale by 1/world, all-reduce), on cloudtrain's own group - or
        on the region's, with region_only. With a controller, residuals left from compressed
        steps are added in first."""
        topo = self.topo
        if self.region_only:
            ranks = topo.members[topo.region]
            group = topo.groups.get(f"region{topo.region}")
        else:
            ranks, group = tuple(range(topo.world_size)), topo.group("dense")
        buf = buffer.mul_(1.0 / len(ranks))
        if self.controller is not None:
            for unit in self.layouts.units(index, signature, self.ef):  # keep learning the layout
                self.layouts.inject(unit.layout, buf)
        if not self.region_only:
            self.stats.wan_bytes_sent += ring_wan_bytes(
                buf.numel() * buf.element_size(), topo.rank, topo.rank_regions
            )
        t0 = time.perf_counter()
        if len(ranks) == 1:
            work_future = torch.futures.Future()
            work_future.set_result([buf])
        else:
            work_future = dist.all_reduce(buf, group=group, async_op=True).get_future()
        step = self.step
        if last:
            self._end_step()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            try:
                result = fut.value()[0]
                self.stats.add_seconds("allreduce", time.perf_counter() - t0)
                if last:
                    self.observer.step_started()
                self._check_finite(result, step, index)
                self._keep_written(signature, result)
                return result
            except Exception as e:
                if not isinstance(e, ValueError):
                    e = CommError(
                        f"cloudtrain: all-reduce with ranks {list(ranks)} failed on rank "
                        f"{topo.rank} at step {step}, bucket {index}: {e}"
                    )
                self.error = self.error or e
                raise e from None

        return work_future.then(done)

    # -- the communication thread ------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="cloudtrain-comm", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        device = self.params[0].device if self.params else None
        if device is not None and device.type == "cuda":
            # a new thread starts on cuda:0; this rank's device may be another (local_rank > 0)
            torch.cuda.set_device(device)
            self.stream = torch.cuda.Stream(device)
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self.error is not None:
                job.future.set_exception(self.error)
                continue
            try:
                if job.ready is None:
                    job.future.set_result(self._reduce(job))
                    continue
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(job.ready)
                    # set inside the stream: the future's completion event is recorded on the
                    # comm stream, so DDP waits for the GPU work it stands for
                    job.future.set_result(self._reduce(job))
            except BaseException as e:
                self.error = e
                job.future.set_exception(e)

    def settle(self) -> None:
        """Exchanges in flight (staleness > 0) are finished - collectives: every rank calls it
        at the same step - and the controller's decision on its way crosses, before this
        returns. Nothing is applied early: the pipeline keeps the finished values."""
        self.pipeline.finish_all(self.path.finish)
        if self.controller is not None:
            self.controller.settle()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        if self.controller is not None:
            self.controller.close()

    # -- per step ----------------------------------------------------------------------------------
    def _begin(self) -> None:
        """At the first bucket of a step: the replica check when due, and the step's plan."""
        if not self._first_of_step:
            return
        self._first_of_step = False
        every = self.config.verify_every
        if every and self.step and self.step % every == 0:
            self.verify_replicas()
        if self.controller is not None and self.controller.due(self.step):
            seen = self.observer.take(self.stats)
            if self.probe is not None:
                seen.quality = self.probe.take()
            self.plan = self.controller.decide(
                self.step, seen, self.shard_numels(), self.stats.wan_bytes_sent
            )
            if self.plan.lossless:  # compression stops: what it kept back goes into the gradients
                for index in list(self.layouts.layouts):
                    self.layouts.release(index, self.ef)

    def _end_step(self) -> None:
        self._first_of_step = True
        self.step += 1
        self.stats.steps += 1

    def _reduce(self, job: _Job) -> torch.Tensor:
        """The compressed path of one DDP bucket, on the communication thread.

        DDP's bucket is reduced as the buckets of `layouts` it is made of: itself, normally; in
        the first step after a resume, DDP's one initial bucket holds all the buckets the saved
        run used, and each is reduced as it was then, so the resumed run repeats its math.
        """
        buf = job.buffer
        buf.mul_(1.0 / self.topo.world_size)  # as DDP: times the reciprocal, not divided
        units = self.layouts.units(job.index, job.signature, self.ef)
        staleness = self.plan.staleness
        if staleness == 0 and not self.pipeline:  # synchronous: in place
            for unit in units:
                self._reduce_unit(unit, buf)
        else:  # pipelined: start this step's exchanges, apply those due now (cloudtrain.pipeline)
            for unit in units:
                where = f" at step {self.step}, bucket {unit.index}"
                flight = self.path.start(
                    self._piece(unit, buf), self.plan, self.step, unit.index, where
                )
                self.pipeline.add(self.step, unit.layout, flight)
            buf.zero_()
            self.pipeline.apply_due(self.step - staleness, job.signature, buf, self.path.finish)
        self._check_finite(buf, self.step, job.index)
        self._keep_written(job.signature, buf)
        if job.is_last:
            self.stats.compressed_steps += 1
            self._end_step()
            self.observer.step_started()
        return buf

    def _piece(self, unit: Unit, buf: torch.Tensor) -> torch.Tensor:
        """A copy of the unit's gradient, with its parameters' pending residuals added."""
        if unit.placement is None:
            piece = buf.clone()
        else:
            piece = buf.new_empty(sum(numel for _, _, numel in unit.layout))
            for (_, here, numel), (_, there, _) in zip(unit.layout, unit.placement, strict=True):
                piece[here : here + numel] = buf[there : there + numel]
        self.layouts.inject(unit.layout, piece)
        return piece

    def _reduce_unit(self, unit: Unit, buf: torch.Tensor) -> None:
        where = f" at step {self.step}, bucket {unit.index}"
        if unit.placement is None:
            self.layouts.inject(unit.layout, buf)
            self.path.reduce_bucket(buf, self.plan, self.step, unit.index, where)
            return
        piece = buf.new_empty(sum(numel for _, _, numel in unit.layout))
        for (_, here, numel), (_, there, _) in zip(unit.layout, unit.placement, strict=True):
            piece[here : here + numel] = buf[there : there + numel]
        self.layouts.inject(unit.layout, piece)
        self.path.reduce_bucket(piece, self.plan, self.step, unit.index, where)
        for (_, here, numel), (_, there, _) in zip(unit.layout, unit.placement, strict=True):
            buf[there : there + numel] = piece[here : here + numel]

    def _keep_written(self, signature: tuple, result: torch.Tensor) -> None:
        # a reference, not a copy: _reclaim_unused runs right after DDP's end of backward,
        # before anything writes the bucket again
        if self.used_map is not None:
            self._written.append((signature, result))

    def _reclaim_unused(self) -> None:
        """After DDP's end of backward: DDP leaves the gradient of a parameter unused on every
        rank alone, so what this step's sum holds for it - residuals that error feedback let go
        of, pieces that waited for it - would be lost. Rank 0 takes it back (pending): it is
        added into that parameter's next gradient, once, as any pending piece is."""
        written, self._written = self._written, []
        used = self.used_map()
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        unused = {trainable[j] for j in range(min(len(trainable), used.numel())) if not used[j]}
        if not unused or self.topo.rank != 0:
            return
        for signature, result in written:
            for pi, offset, numel in signature:
                if pi in unused:
                    piece = result[offset : offset + numel].float().cpu().clone()
                    if bool(piece.any()):
                        self.layouts.pending.setdefault(pi, []).append((0, piece))

    def _check_finite(self, result: torch.Tensor, step: int, index: int) -> None:
        if self.config.nonfinite == "raise" and not all_finite(result):
            raise ValueError(
                f"cloudtrain: the summed gradient of bucket {index} at step {step} has NaN or Inf "
                "(raised on every rank). Fix the loss, or with AMP's GradScaler set "
                "CompressionConfig(nonfinite='pass')"
            )

    # -- checks ------------------------------------------------------------------------------------
    def verify_replicas(self) -> None:
        """Raise ReplicaMismatch unless every rank's parameters are bit-identical to rank 0's."""
        sums = [
            zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().data)
            for p in self.params
        ]
        gathered: list[Any] = [None] * self.topo.world_size
        try:
            dist.all_gather_object(gathered, sums, group=self.topo.group("control"))
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

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state. With exchanges in flight (staleness > 0) they are finished first -
        collectives: every rank must call it at the same step, as checkpoints do."""
        self.pipeline.finish_all(self.path.finish)  # nothing to do without flights in the air
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
            **self.layouts.state_dict(),
            "residuals": residuals,
            "controller": None if self.controller is None else self.controller.state_dict(),
            "stats": self.stats.state_dict(),
            "pipeline": self.pipeline.state_dict(),
            "quality_probe": None if self.probe is None else self.probe.state_dict(),
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
        self.layouts.load_state_dict(state)
        if self.ef is not None:
            self.ef.reset()
            for key, residual in state["residuals"].items():
                self.ef.put(tuple(key), residual)
        if list(state["regions"]) != list(self.topo.rank_regions):
            # another cluster shape: shards have new owners, so residuals go back into gradients
            self.layouts.release_all(self.ef)
        self.stats.load_state_dict(state["stats"])
        device = self.params[0].device if self.params else "cpu"
        self.pipeline.load_state_dict(state.get("pipeline", []), device)
        self.observer.reset()
        if self.probe is not None and state.get("quality_probe") is not None:
            self.probe.load_state_dict(state["quality_probe"])
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
            self.plan = self.controller.plan()
        self._first_of_step = True


def _failing(fut: torch.futures.Future) -> torch.futures.Future:
    """`fut`, chained so that an exception set on it fails the returned future in C++ too: DDP
    (and join()'s shadow all-reduces) then see an error, not an exception where a tensor goes."""
    return fut.then(_value)


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()


def compressed_hook(
    state: CommState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: hand the bucket to CloudDDP's data path. (This module has no
    `from __future__ import annotations`: DDP checks these annotations at registration.)"""
    return state.submit(bucket)
