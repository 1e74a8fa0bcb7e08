"""The per-step exchange of cloudtrain.sharded (its module docstring has the picture): FSDP's
all-reduce hook tells which unit was just reduce-scattered in the region - the one before it is
final then - and its gradient shard goes to the communication thread (cloudtrain.hook.CommThread),
which encodes it and issues its swap with the same shard's owners in the other regions; at the
end of backward whatever is left is issued and every swap is collected in unit order, summed and
written back into the gradient shards (or, pipelined, step t - s's sums are). A mixin of
ShardedComm, which owns the state it uses (units, path, plan, pipeline, step, thread, relay)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .hook import check_finite, next_plan
from .plan import Plan
from .shard_units import Unit


@dataclass
class _Job:
    """Work for the communication thread (cloudtrain.hook.CommThread)."""

    work: Any
    future: torch.futures.Future
    ready: Any = None  # CUDA event after which the gradients it reads are final


class UnitExchange:
    """Every step's work of a ShardedComm (module docstring)."""

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self.ready:
            self.set_up()
        if self.outer is not None and module.training and torch.is_grad_enabled():
            self.outer.catch_up()  # where AMP skipped this region's last step (OuterLoop)

    def _reduced(self, unit: Unit) -> None:
        """FSDP's all-reduce hook: `unit` was just reduce-scattered in the region; the unit
        reduced before it is final now."""
        if self._relay.error is not None:
            raise self._relay.error
        if not self._queued:
            # runs after FSDP's own end of backward (queued at the start of backward)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._queued = True
        try:
            if self._reducing is not None and self.crosses and not self._reducing.offload:
                self._issue(self._reducing)
            self._reducing = unit
            self._owed.add(unit.index)
        except Exception as e:
            raise self._relay.fail(e) from None

    def _issue(self, unit: Unit) -> None:
        """Hand `unit`'s final gradient shard to the communication thread, if it syncs now."""
        if not unit.syncs or unit.index not in self._owed:
            return
        if any(u is unit for u, _ in self._issued):
            return
        if not self._issued:
            self._begin()
        self._owed.discard(unit.index)
        plan, step, scale = self.plan, self.step, 1.0 / self.regions
        where = f" at step {step}, unit {unit.index}"

        def issue() -> Any:
            flat = unit.flat_grad(scale)
            if flat.numel() == 0:  # FSDP left this shard empty (in every region alike)
                return None
            return self.path.issue(flat, plan, step, unit.index, where, flat.numel())

        self._submit(issue, unit)

    def _submit(self, work: Any, unit: Unit | None) -> torch.futures.Future:
        cuda = self.device.type == "cuda"
        # on a GPU, waiting for the future orders the current stream after the thread's
        fut: torch.futures.Future = torch.futures.Future(devices=[self.device] if cuda else None)
        job = _Job(work, fut)
        if cuda:
            # the current stream is where FSDP wrote the gradients this job reads
            job.ready = torch.cuda.Event()
            job.ready.record()
        self._thread.put(job)
        if unit is not None:
            self._issued.append((unit, fut))
        return fut

    def _begin(self) -> None:
        """At a step's first exchange: the replica check when due, and the step's plan."""
        every = self.config.verify_every
        if every and self.step and self.step % every == 0:
            self.verify_replicas()
        if self.controller is not None and self.controller.due(self.step):
            self.plan = next_plan(
                self.controller, self.path, self.step, self.shard_numels(),
                self._finish_flights,
            )  # fmt: skip

    def _end_backward(self) -> None:
        """Queued on the autograd engine at the first reduction of a backward: hand over what is
        left, wait for this step's sums (or, pipelined, step t - s's) and write them into the
        gradient shards. Errors are raised as themselves, from backward()."""
        self._queued = False
        last, self._reducing = self._reducing, None
        due = [u for u in self.units if u.index in self._owed and u.syncs]
        if last is not None and last.syncs:
            due = [last] + [u for u in due if u is not last]
        if not due and not self._issued:
            return  # a micro-step: FSDP accumulates, nothing crosses
        try:
            if self._relay.error is not None:
                raise self._relay.error
            if self.crosses:
                self._exchange_rest(due)
            else:
                self._owed.difference_update(u.index for u in due)
            self._end_step()
        except Exception as e:
            self._issued = []
            raise self._relay.fail(e) from None

    def _exchange_rest(self, due: Sequence[Unit]) -> None:
        for unit in due:
            self._issue(unit)
        issued, self._issued = self._issued, []
        if self.path.observer is not None:
            self.path.observer.compute_finished()
        plan, step = self.plan, self.step
        pipelined = plan.staleness > 0 or bool(self.pipeline)

        def collect() -> None:
            # unit by unit, each sum written as soon as it is in: one unit's sum at a time
            for unit, fut in issued:
                swap = fut.value()
                if swap is None:
                    continue
                if pipelined:
                    summed = self._pipelined(unit, swap, plan, step)
                else:
                    summed = self.path.collect(swap)
                check_finite(self.config, summed, step, unit.index)
                unit.write_grad(summed)

        self._submit(collect, None).wait()
        if self.path.observer is not None:
            self.path.observer.step_started()

    def _pipelined(self, unit: Unit, swap: Any, plan: Plan, step: int) -> torch.Tensor:
        """Staleness s > 0: this step's swap waits in the pipeline; what the unit gets is the sum
        of step t - s (zeros in the first s steps: nothing is applied yet)."""
        layout = ((unit.index, 0, swap.m),)
        self.pipeline.add(step, layout, swap)
        buf = torch.zeros(swap.m, device=swap.device)
        self.pipeline.apply_due(step - plan.staleness, layout, buf, self.path.collect)
        return buf

    def _end_step(self) -> None:
        self.step += 1
        stats = self.path.stats
        stats.steps += 1
        if self.crosses:
            stats.compressed_steps += 1
