"""CloudDDP's communication hook: DDP hands it each gradient bucket, it returns a future.

    state = CommState(config, topo, params, names)
    ddp.register_comm_hook(state, compressed_hook)

Two paths:
- plain: one region, or a plan that compresses nothing - scale by 1/world and all-reduce, exactly
  DDP's own hook, issued right away on cloudtrain's own group;
- compressed: the bucket goes to the communication thread (`CommThread`, one per CloudDDP),
  which runs the data path (cloudtrain.datapath: reduce-scatter in the region, compressed exchange
  across regions, all-gather) bucket after bucket, so every rank issues the same collectives in
  the same order however DDP's callbacks interleave (PyTorch's PowerSGD hook, which issues from
  callbacks, fails on gloo with several buckets in flight). Compression on that thread overlaps
  the backward; a pipelined plan (staleness s > 0) applies the exchanges of step t - s
  (cloudtrain.pipeline).

At the first bucket of a step the plan is fixed for the step (the controller decides every few
steps; cloudtrain.controller) and, when due, replicas are verified. Residuals of DDP's changing
bucket layouts are kept by cloudtrain.layout.

Errors reach the training loop as what they are (CommError, PacketError, ValueError for NaN;
`FailureRelay`): the hook's futures are chained so DDP's C++ side sees a failed future (never an
exception object where a tensor belongs), and a callback queued on the autograd engine re-raises
the original exception from `backward()`. After an error every later bucket fails at once:
nothing waits for a collective that will not come.
"""

import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import CommError, all_reduce_async, collective_failure
from .compress import ErrorFeedback
from .compress.codecs import all_finite
from .config import AUTO, CompressionConfig
from .datapath import CrossRegion
from .guard import QualityProbe
from .layout import BucketLayout, BucketLayouts
from .pipeline import Pipeline
from .plan import NONE, Codecs, Plan
from .shares import BatchShares
from .stats import CommStats, Observer, ring_wan_bytes
from .topology import Topology

log = logging.getLogger("cloudtrain")

COMM_STATE_FORMAT = 1


class ReplicaMismatch(RuntimeError):
    """Replicas' parameters no longer agree bit for bit."""


@dataclass(eq=False)  # a job is itself: compared and hashed by identity
class _Job:
    """One DDP bucket handed to the communication thread."""

    index: int
    buffer: torch.Tensor
    is_last: bool
    signature: BucketLayout
    future: torch.futures.Future
    ready: Any = None  # CUDA event recorded when the hook was called


class FailureRelay:
    """Delivers a failure into `backward()` as itself, and fails every later bucket at once.

    Tolerant (an elastic per-step run): a CommError fails the step, not the run - its buckets
    and every later one of the step complete with zeros, `step_error` holds it, and the elastic
    region drops the step (cloudtrain.elastic.ElasticSteps)."""

    __slots__ = ("_futures", "error", "step_error", "tolerant")

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._futures: list[torch.futures.Future] | None = None
        self.tolerant = False
        self.step_error: BaseException | None = None

    def soft(self, e: BaseException) -> bool:
        """Tolerant and `e` a lost peer: recorded as the step's failure (True); else False."""
        if not (self.tolerant and isinstance(e, CommError)):
            return False
        self.step_error = self.step_error or e
        return True

    def fail(self, e: BaseException) -> BaseException:
        """Record `e` (the first failure stays) and return the one to raise."""
        self.error = self.error or e
        return self.error

    def failed(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(self.error)
        return self.chained(fut)

    @staticmethod
    def chained(fut: torch.futures.Future) -> torch.futures.Future:
        """`fut`, chained so that an exception set on it fails the returned future in C++ too:
        DDP (and join()'s shadow all-reduces) then see an error, not an exception object where
        a tensor belongs."""
        return fut.then(_value)

    def watch(self, fut: torch.futures.Future) -> None:
        """Inside backward(): at the end of the pass, re-raise a bucket's failure as itself."""
        if self._futures is None:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._raise)
            except RuntimeError:  # not inside a backward pass (DDP's join() shadows buckets)
                return
            self._futures = []
        self._futures.append(fut)

    def _raise(self) -> None:
        """Queued on the autograd engine: runs before DDP's own end of backward (which DDP queues
        after the last bucket is handed over) and raises what failed, with its own type."""
        futures, self._futures = self._futures or [], None
        for fut in futures:
            try:
                fut.wait()
            except Exception:
                if self.error is None:
                    raise
        if self.error is not None:
            raise self.error


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()


class CommThread:
    """The thread that runs `work` on every compressed bucket, in the order they were put: one
    per CloudDDP, so that every rank issues the same collectives in the same order. `work` may
    complete a bucket later (a step's exchanges are all in flight before the first is waited
    for); after a failure every bucket handed over fails with it. On a GPU it works on a stream
    of its own, after the event the hook recorded."""

    __slots__ = ("_queue", "_relay", "_thread", "_work", "device", "stream")

    def __init__(
        self,
        work: Callable[[Any], list[tuple[Any, torch.Tensor]]],
        relay: FailureRelay,
        device: Any,
    ) -> None:
        self._work, self._relay, self.device = work, relay, device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.stream = None

    def put(self, job: _Job) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="cloudtrain-comm", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            # a new thread starts on cuda:0; this rank's device may be another (local_rank > 0)
            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream(self.device)
        waiting: list[_Job] = []  # handed over, their results not yet complete
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._relay.error is not None:
                job.future.set_exception(self._relay.error)
                continue
            if self._relay.step_error is not None:  # the step failed: nothing more crosses
                job.future.set_result(job.buffer.zero_())
                continue
            waiting.append(job)
            try:
                if job.ready is None:
                    self._complete(self._work(job), waiting)
                    continue
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(job.ready)
                    # set inside the stream: the future's completion event is recorded on the
                    # comm stream, so DDP waits for the GPU work it stands for
                    self._complete(self._work(job), waiting)
            except BaseException as e:
                soft = self._relay.soft(e)
                if not soft:
                    self._relay.error = e
                for stuck in waiting:  # nothing waits for a collective that will not come
                    if soft:
                        stuck.future.set_result(stuck.buffer.zero_())
                    else:
                        stuck.future.set_exception(e)
                waiting.clear()

    @staticmethod
    def _complete(done: list[tuple[_Job, torch.Tensor]], waiting: list[_Job]) -> None:
        """`work` returns the buckets whose results are complete (maybe none yet, maybe earlier
        ones too): their futures get them."""
        for job, result in done:
            job.future.set_result(result)
            waiting.remove(job)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)

    def here(self, fn: Callable[[], None]) -> None:
        """`fn` on another thread while this one is idle (between steps, at a step's first
        bucket), on this thread's CUDA stream where it has one: what `fn` finishes (a pipeline's
        flights) is allocated where the thread will use and free it."""
        if self.stream is None:
            fn()
            return
        with torch.cuda.stream(self.stream):
            fn()


def wants_controller(config: CompressionConfig, topo: Topology) -> bool:
    """Whether per-step "auto" runs a controller here: several regions, no outer loop."""
    return config.codec == AUTO and not topo.single_region and config.outer is None


class CommState:
    """Everything CloudDDP's comm hook keeps between calls (one per CloudDDP): the config and
    topology, the plan and step, and the parts that do the work."""

    __slots__ = (  # noqa: RUF023 - grouped by meaning, as PowerSGDState's, not sorted
        # what the run is
        "config",
        "topo",
        # the step
        "plan",
        "step",
        "_first_of_step",
        "_begun",
        "_saved",
        # samples trained on: in all, and in the forwards of the step now computed; with a
        # global batch, each rank's share of it (cloudtrain.shares)
        "samples",
        "_step_samples",
        "shares",
        # the parts: bucket layouts and residuals' pieces, the data path (codecs, error feedback,
        # counters, what the controller and the quality guard are shown), the pipeline, the
        # controller, the communication thread and the failure relay
        "layouts",
        "path",
        "pipeline",
        "controller",
        "_thread",
        "_relay",
        "_open",
    )

    def __init__(
        self,
        config: CompressionConfig,
        topo: Topology,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
    ) -> None:
        """With an outer loop (config.outer), every bucket is reduced inside the region and
        nothing across: the outer loop crosses regions itself."""
        self.config, self.topo = config, topo
        self.layouts = BucketLayouts(params, names)
        self.step, self._first_of_step = 0, True
        self._begun, self._saved = 0, None
        self.samples, self._step_samples = 0, 0
        self.shares = None
        if config.global_batch is not None:
            self.shares = BatchShares(config.global_batch, topo.world_size)
        codecs = Codecs(config)
        self.controller = None
        if wants_controller(config, topo):
            from .controller import Controller

            if topo.links is None:
                topo.probe()
            self.controller = Controller(
                config, topo, codecs, self.shard_numels(), self.layouts.device, self.shares
            )
        ef = ErrorFeedback(config.residual_torch_dtype) if config.error_feedback else None
        self.path = self._data_path(topo, codecs, ef, CommStats())
        self.pipeline = Pipeline()
        self.plan = first_plan(config, topo, codecs, self.controller)
        self._relay = FailureRelay()
        self._open: list[tuple] = []  # this step's exchanges in flight (synchronous plans)
        self._thread = CommThread(self._reduce, self._relay, self.layouts.device)

    def _data_path(
        self, topo: Topology, codecs: Codecs, ef: ErrorFeedback | None, stats: CommStats
    ) -> CrossRegion:
        """The data path over `topo`, observed for the controller where there is one."""
        controller = self.controller
        guarded = controller is not None and controller.guard is not None
        return CrossRegion(
            self.config, topo, codecs, ef, stats,
            Observer() if controller is not None else None,
            QualityProbe(self.config.controller.quality_sample) if guarded else None,
        )  # fmt: skip

    # the data path's parts, as the hook's
    @property
    def stats(self) -> CommStats:
        return self.path.stats

    @property
    def ef(self) -> ErrorFeedback | None:
        return self.path.ef

    @property
    def probe(self) -> QualityProbe | None:
        return self.path.probe

    @property
    def error(self) -> BaseException | None:
        return self._relay.error

    @property
    def region_only(self) -> bool:
        """Buckets are reduced inside the region only (the inner steps of an outer loop)."""
        return self.config.outer is not None and not self.topo.single_region

    def shard_numels(self) -> list[int]:
        return self.layouts.shard_numels(self.topo.shards)

    @property
    def direct(self) -> bool:
        """Buckets are all-reduced from the hook: one region, reduced inside the region only, or
        nothing compressed and nothing in the pipeline."""
        if self.topo.single_region or self.region_only:
            return True
        if self._relay.tolerant:  # an elastic run has no group of every region's ranks
            return False
        return self.plan.lossless and self.plan.staleness == 0 and not self.pipeline

    def count_samples(self, n: int) -> None:
        """A training forward of n samples (CloudDDP.forward): the step's, until its gradients
        are reduced (several forwards under no_sync add up)."""
        self.samples += n
        self._step_samples += n

    # -- the hook --------------------------------------------------------------------------------
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        try:
            fut = self._submit(bucket)
        except Exception as e:
            if self._relay.soft(e):
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer().zero_())
                return fut
            self._relay.fail(e)
            fut = self._relay.failed()
        self._relay.watch(fut)
        return fut

    def _submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """The plain path now, or the bucket onto the communication thread (`_reduce`)."""
        if self._relay.error is not None:
            raise self._relay.error
        if self._relay.step_error is not None:
            raise self._relay.step_error
        buffer = bucket.buffer()
        index, last = bucket.index(), bucket.is_last()
        self.stats.buckets = max(self.stats.buckets, index + 1)
        if last:
            self._check_share()
            if self.path.observer is not None:
                self.path.observer.compute_finished(self._step_samples)
            self._step_samples = 0
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
        self._thread.put(job)
        return self._relay.chained(fut)

    def _reduce(self, job: _Job) -> list[tuple[_Job, torch.Tensor]]:
        """The compressed path of one DDP bucket, on the communication thread: the buckets whose
        results are complete.

        DDP's bucket is reduced as the buckets of `layouts` it is made of: itself, normally; in
        the first step after a resume, DDP's one initial bucket holds all the buckets the saved
        run used, and each is reduced as it was then, so the resumed run repeats its math.
        Synchronous steps start every bucket's exchange as DDP hands it over and finish them all
        at its last bucket, in order: the step waits for one exchange's latency, not one per bucket.
        Pipelined ones apply the exchanges due now (of step t - s; cloudtrain.pipeline).
        """
        buf = job.buffer
        buf.mul_(self.weight)  # as DDP: times the reciprocal of the world size, not divided
        units = self.layouts.units(job.index, job.signature, self.ef)
        synchronous = self.plan.staleness == 0 and not self.pipeline
        for unit in units:
            piece = unit.gather(buf, copy=not synchronous)
            self.layouts.inject(unit.layout, piece)
            where = f" at step {self.step}, bucket {unit.index}"
            exchange = self.path.start(piece, self.plan, self.step, unit.index, where)
            if synchronous:
                self._open.append((job, unit, piece, exchange))
            else:
                self.pipeline.add(self.step, unit.layout, exchange)
        done: list[tuple[_Job, torch.Tensor]] = []
        if not synchronous:
            buf.zero_()
            upto = self.step - self.plan.staleness
            self.pipeline.apply_due(upto, job.signature, buf, self.path.finish)
            done.append((job, self._result(job)))
        elif job.is_last:
            opened, self._open = self._open, []
            for owner, unit, piece, exchange in opened:
                result = self.path.finish(exchange)
                if result.data_ptr() != piece.data_ptr():
                    piece.copy_(result)
                unit.scatter(piece, owner.buffer)
            jobs = list(dict.fromkeys(owner for owner, *_ in opened))
            done += [(owner, self._result(owner)) for owner in jobs]
        if job.is_last:
            self.stats.compressed_steps += 1
            self._end_step()
            if self.path.observer is not None:
                self.path.observer.step_started()
        return done

    def _result(self, job: _Job) -> torch.Tensor:
        """A bucket's complete result, checked, as DDP gets it."""
        check_finite(self.config, job.buffer, self.step, job.index)
        self.layouts.written(job.signature, job.buffer)
        return job.buffer

    def _allreduce(
        self, index: int, buffer: torch.Tensor, last: bool, signature: BucketLayout
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
        buf = buffer.mul_(1.0 / len(ranks) if self.region_only else self.weight)
        if self.controller is not None:
            for unit in self.layouts.units(index, signature, self.ef):  # keep learning the layout
                self.layouts.inject(unit.layout, buf)
        if not self.region_only:
            self.stats.wan_bytes_sent += ring_wan_bytes(
                buf.numel() * buf.element_size(), topo.rank, topo.rank_regions
            )
        t0 = time.perf_counter()
        where = f" at step {self.step}, bucket {index}"
        summed = all_reduce_async(buf, ranks, group, where, self.config.timeout_s)
        step = self.step
        if last:
            self._end_step()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            try:
                result = fut.value()
                self.stats.add_seconds("allreduce", time.perf_counter() - t0)
                if last and self.path.observer is not None:
                    self.path.observer.step_started()
                check_finite(self.config, result, step, index)
                self.layouts.written(signature, result)
                return result
            except Exception as e:
                if self._relay.soft(e):
                    return buffer.zero_()
                raise self._relay.fail(e) from None

        return summed.then(done)

    # -- per step ----------------------------------------------------------------------------------
    @property
    def weight(self) -> float:
        """The factor of this rank's gradient in the sum: 1 / world size, or with a global batch
        its share of it (cloudtrain.shares)."""
        if self.shares is None:
            return 1.0 / self.topo.world_size
        return self.shares.weight(self.step, self.topo.rank, self.topo.world_size)

    def batch_size(self) -> int:
        """This rank's share of the global batch at the step now computed."""
        if self.shares is None:
            raise ValueError(
                "CloudDDP.batch_size(): this run has no global batch to share; build the config "
                "with CompressionConfig(global_batch=N)"
            )
        return self.shares.at(self.step)[self.topo.rank]

    def check_share(self, n: int) -> None:
        """The forward whose gradients are reduced (CloudDDP.forward, before DDP's, so a
        refused batch leaves the model usable): with a global batch, the step's samples with
        these n must be this rank's share - a gradient weighted by a share it was not computed
        on would bias the mean."""
        self._check_share(self._step_samples + n)

    def _check_share(self, samples: int | None = None) -> None:
        samples = self._step_samples if samples is None else samples
        if self.shares is None or samples == 0:
            return
        share = self.batch_size()
        if samples != share:
            raise ValueError(
                f"rank {self.topo.rank}'s batch at step {self.step} had {samples} "
                f"samples (the leading dimension of the forward's first tensor), its share of the "
                f"global batch is {share}: draw each step's batch with cloudtrain.ShareSampler or "
                "CloudDDP.batch_size(), one batch per step"
            )

    def _begin(self) -> None:
        """At the first bucket of a step: the replica check when due, and the step's plan."""
        if not self._first_of_step:
            return
        self._first_of_step = False
        self._begun = self.step
        if self._relay.tolerant and self.ef is not None:  # put back if the step is dropped
            self._saved = {key: r.clone() for key, r in self.ef.residuals.items()}
        self.layouts.watch_backward()
        every = self.config.verify_every
        if every and self.step and self.step % every == 0:
            self.verify_replicas()
        if self.controller is not None and self.controller.due(self.step):
            self.plan = next_plan(
                self.controller, self.path, self.step, self.shard_numels(),
                self._finish_flights,
            )  # fmt: skip
            if self.plan.lossless:  # compression stops: what it kept back goes into the gradients
                self.layouts.release_residuals(self.ef)

    # -- elastic per-step runs (cloudtrain.elastic.ElasticSteps) ----------------------------------
    def tolerate_failures(self) -> None:
        """A lost peer fails the step, not the run (FailureRelay); plans never pipeline."""
        self._relay.tolerant = True

    @property
    def step_failure(self) -> BaseException | None:
        """The CommError of the step just reduced (tolerant), or None."""
        return self._relay.step_error

    def use_regions(self, topo: Topology, timeout: Any, controller: Any = None) -> None:
        """Buckets cross the regions of `topo` from the next step (a quorum's present regions,
        on its groups): the data path keeps its codecs, residuals and counters. With "auto",
        `controller` plans for them (made for these regions: the last one is closed)."""
        old = self.path
        if self.controller is not None and self.controller is not controller:
            self.controller.close()
        self.topo, self.controller = topo, controller
        self.path = self._data_path(topo, old.codecs, old.ef, old.stats)
        self.path.timeout = timeout
        self.plan = first_plan(self.config, topo, old.codecs, controller)

    def drop_step(self) -> None:
        """The step whose exchange failed is undone on this rank (between steps; the thread is
        idle): its count, what it held back (the residuals as they were before it), its
        exchanges."""
        self.step, self._first_of_step = self._begun, True
        self._open.clear()
        if self.ef is not None and self._saved is not None:
            self.ef.reset()
            for key, r in self._saved.items():
                self.ef.put(key, r)
        self._saved = None
        self._relay.step_error = None

    def _end_step(self) -> None:
        self._first_of_step = True
        self.step += 1
        self.stats.steps += 1

    def _finish_flights(self) -> None:
        """Exchanges in flight (staleness > 0) finished now - collectives: every rank calls it at
        the same step. Nothing is applied early: the pipeline keeps the finished values."""
        self._thread.here(lambda: self.pipeline.finish_all(self.path.finish))

    def settle(self) -> None:
        """Exchanges in flight finished (_finish_flights), and the controller's decision on its
        way crosses, before this returns."""
        self._finish_flights()
        if self.controller is not None:
            self.controller.settle()

    def close(self) -> None:
        self._thread.close()
        if self.controller is not None:
            self.controller.close()

    # -- checks and state -----------------------------------------------------------------------
    def verify_replicas(self) -> None:
        """Raise ReplicaMismatch unless every rank's parameters are bit-identical to rank 0's."""
        layouts = self.layouts
        verify_replicas(layouts.params, layouts.names, self.topo, self.step, self.config.timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state. With exchanges in flight (staleness > 0) they are finished first -
        collectives: every rank must call it at the same step, as checkpoints do."""
        self._finish_flights()  # nothing to do without flights in the air
        return {
            "format": COMM_STATE_FORMAT,
            "config": self.config.fingerprint(),
            "rank": self.topo.rank,
            "regions": list(self.topo.rank_regions),
            "step": self.step,
            **self.layouts.state_dict(),
            **self.path.state_dict(),
            # (an elastic run's is made for each quorum's regions: not saved, not resumed)
            "controller": None
            if self.controller is None or self._relay.tolerant
            else self.controller.state_dict(),
            "pipeline": self.pipeline.state_dict(),
            "shares": None if self.shares is None else self.shares.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, self.config, self.topo.rank)
        self.step, self._first_of_step = int(state["step"]), True
        self.layouts.load_state_dict(state)
        self.path.load_state_dict(state)
        if list(state["regions"]) != list(self.topo.rank_regions):
            # another cluster shape: shards have new owners, so residuals go back into gradients
            self.layouts.release_all(self.ef)
        self.pipeline.load_state_dict(state.get("pipeline", []), self.layouts.device)
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
            self.plan = self.controller.plan()
        if self.shares is not None and state.get("shares") is not None:
            self.shares.load_state_dict(state["shares"])


def next_plan(
    controller: Any,
    path: CrossRegion,
    step: int,
    shard_numels: Sequence[int],
    quiet: Callable[[], None],
) -> Plan:
    """At a step the controller is due (all ranks): what the data path saw since the last
    decision goes to the controller, its plan comes back, and what a re-probe sent is counted.
    `quiet` finishes the exchanges in flight (for a re-probe: nothing else may cross then)."""
    seen = path.observer.take(path.stats)
    if path.probe is not None:
        seen.quality = path.probe.take()
    t0 = time.monotonic()
    plan = controller.decide(step, seen, shard_numels, path.stats.wan_bytes_sent, quiet)
    path.observer.exclude(time.monotonic() - t0)  # a re-probe's seconds are not the step's
    path.stats.wan_bytes_sent += controller.take_probe_sent()  # a re-probe's
    return plan


def first_plan(config: CompressionConfig, topo: Topology, codecs: Codecs, controller: Any) -> Plan:
    """The plan before any decision: the controller's first, the config's codec, or (one region
    with "auto") nothing compressed."""
    regions = len(topo.regions)
    if controller is not None:
        return controller.plan()
    if config.codec == AUTO:  # one region: nothing crosses a slow link
        return Plan.same(NONE, regions)
    rung = (config.codec, codecs(config.codec).check_level(config.level))
    return Plan.same(rung, regions, config.staleness or 0, config.zstd is True)


def check_finite(config: CompressionConfig, result: torch.Tensor, step: int, index: int) -> None:
    if config.nonfinite == "raise" and not all_finite(result):
        raise ValueError(
            f"cloudtrain: the summed gradient of bucket {index} at step {step} has NaN or Inf "
            "(raised on every rank). Fix the loss, or with AMP's GradScaler set "
            "CompressionConfig(nonfinite='pass')"
        )


def verify_replicas(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    topo: Topology,
    step: int,
    timeout_s: float,
    reference: Callable[[int], int] = lambda rank: 0,
) -> None:
    """Raise ReplicaMismatch unless every rank's `tensors` are bit-identical to those of
    `reference(rank)` (rank 0 for replicas; for shards, the rank that holds the same shard in the
    first region). Their CRCs are gathered on the control group: every rank calls."""
    # a copy: numpy's view of a tensor makes its storage unresizable, and FSDP resizes storage
    sums = [
        zlib.crc32(t.detach().to("cpu", copy=True).view(torch.uint8).numpy().data) for t in tensors
    ]
    gathered: list[Any] = [None] * topo.world_size
    t0 = time.perf_counter()
    try:
        dist.all_gather_object(gathered, sums, group=topo.group("control"))
    except Exception as e:
        text = collective_failure(
            "replica check", range(topo.world_size), topo.rank, f" after step {step}",
            time.perf_counter() - t0, e, timeout_s=timeout_s,
        )  # fmt: skip
        raise CommError(text) from e
    for rank, other in enumerate(gathered):
        ref = reference(rank)
        if other != gathered[ref]:
            bad = next(
                i for i, (a, b) in enumerate(zip(other, gathered[ref], strict=True)) if a != b
            )
            raise ReplicaMismatch(
                f"cloudtrain: after step {step} rank {rank}'s parameter "
                f"{names[bad]!r} differs from rank {ref}'s: replicas diverged"
            )


def _check_state(state: dict[str, Any], config: CompressionConfig, rank: int) -> None:
    """A comm state that is not this rank's, of this config and release, is refused, named."""
    if not isinstance(state, dict) or state.get("format") != COMM_STATE_FORMAT:
        raise ValueError(
            "comm state: expected a dict from CloudDDP.comm_state_dict() of this cloudtrain release"
        )
    if state["config"] != config.fingerprint():
        raise ValueError(
            "comm state was saved with a different CompressionConfig; resume with the same config"
        )
    if state["rank"] != rank:
        raise ValueError(
            f"comm state of rank {state['rank']} loaded on rank {rank}: load each rank's own"
        )


def compressed_hook(
    state: CommState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: hand the bucket to CloudDDP's data path. (This module has no
    `from __future__ import annotations`: DDP checks these annotations at registration.)"""
    return state.submit(bucket)
