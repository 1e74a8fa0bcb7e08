"""Live state transfer to a joining region (cloudtrain.elastic).

A joiner receives the state - an outer-loop region's outer copy, momentum, inner optimizer
state, buffers, step and schedule (`OuterReplica`); a per-step region's parameters, buffers,
optimizer state and step (`StepReplica`) - from its source region, decided by cloudtrain.quorum:
rank j of the source sends chunk j to rank j of the joiner on their quorum's cross group (k
parallel flows, each 1/k of the bytes; zstd where it pays), the joiner's ranks gather the chunks
inside their region, check the sha256 the source sent and the digest (of the outer copy, or of
the parameters) the source announced in the quorum.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .collectives import CommError, all_gather_single, collective_failure
from .plan import ceil_div
from .quorum import View

log = logging.getLogger("cloudtrain")

TRANSFER_TAG = 0x5E1F
"""The tag of the state transfer's point-to-point messages on a cross group."""
HEADER_BYTES = 64
"""A transfer's header: total and raw length, zstd flag, sha256 of the raw payload."""
ZSTD_PAYS = 0.9
"""The state is sent zstd-compressed where that leaves at most this share of its bytes."""


def outer_digest(tensors: Sequence[torch.Tensor]) -> int:
    """CRC of the outer copy, fragment after fragment (what every present region must agree on)."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().data, crc)
    return crc


class StateTransfer:
    """One rank's part in moving the state between regions (module docstring)."""

    def __init__(
        self,
        region: str,
        group: Any,
        local: int,
        k: int,
        timeout_s: float,
        stats: Any,
        replica: Any,
    ) -> None:
        self.region, self.group, self.local, self.k = region, group, local, k
        self.timeout_s, self.timeout = timeout_s, timedelta(seconds=timeout_s)
        self.stats = stats
        """The region's ElasticStats (recovery bytes and seconds)."""
        self.replica = replica
        """What is moved: an OuterReplica or a StepReplica."""

    def payload(self, commits: int) -> dict[str, Any]:
        return {"step": self.replica.step, "commits": commits, **self.replica.payload()}

    def send(self, view: View, cross: Any, commits: int) -> None:
        """A source region's ranks send the state to its joiners (module docstring): rank 0
        serializes it, the region shares the bytes, rank j sends chunk j to rank j of each."""
        t0 = time.perf_counter()
        raw = None
        if self.local == 0:
            buffer = io.BytesIO()
            torch.save(self.payload(commits), buffer)
            raw = buffer.getvalue()
        got = [raw]
        dist.broadcast_object_list(got, src=0, group=self.group)  # inside the region
        if cross is None:
            raise CommError("cloudtrain elastic: no cross-region group to send the state on")
        raw = got[0]
        wire, packed = raw, 0
        import zstandard

        small = zstandard.ZstdCompressor(level=1).compress(raw)
        if len(small) <= ZSTD_PAYS * len(raw):
            wire, packed = small, 1
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[:8] = torch.tensor([len(wire)], dtype=torch.int64).view(torch.uint8)
        header[8:16] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
        header[16] = packed
        header[17:49] = torch.frombuffer(bytearray(hashlib.sha256(raw).digest()), dtype=torch.uint8)
        chunk = ceil_div(len(wire), self.k)
        data = torch.frombuffer(bytearray(wire), dtype=torch.uint8)
        piece = data[self.local * chunk : (self.local + 1) * chunk]
        mine = [j for j, s in view.sources.items() if s == view.me]

        def start() -> list[Any]:
            works = []
            for j in mine:
                works.append(dist.isend(header, group=cross, group_dst=j, tag=TRANSFER_TAG))
                if piece.numel():
                    works.append(dist.isend(piece, group=cross, group_dst=j, tag=TRANSFER_TAG))
            return works

        self.wait(start, view, "sending the state", t0)
        sent = len(mine) * (HEADER_BYTES + piece.numel())
        self.stats.recovery_bytes_sent += sent
        self.replica.stats.wan_bytes_sent += sent
        self.stats.recovery_s += time.perf_counter() - t0

    def wait(self, start: Callable[[], list[Any]], view: View, stage: str, t0: float) -> None:
        """Issue `start()`'s point-to-point or collective calls on a quorum's group and wait for
        them, each within the exchange timeout; any failure (a peer lost) is a CommError."""
        try:
            for w in start():
                w.wait(self.timeout)
        except Exception as e:
            raise CommError(
                collective_failure(
                    stage,
                    view.regions,
                    self.local,
                    f" at step {view.step}",
                    time.perf_counter() - t0,
                    e,
                    timeout_s=self.timeout_s,
                    knob="elastic.exchange_timeout_s",
                )
            ) from e

    def receive(self, view: View, cross: Any) -> dict[str, Any] | None:
        """This rank's chunk from its counterpart in the source region, then the region's
        chunks gathered; checked against the sha256 sent and the digest announced. A rank whose
        part failed takes part in the gather all the same (the region agrees after it)."""
        t0 = time.perf_counter()
        src = view.sources[view.me]
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        failure = None
        try:
            if cross is None:
                raise CommError("cloudtrain elastic: no cross-region group to receive the state on")
            self.wait(lambda: [dist.irecv(header, group=cross, group_src=src, tag=TRANSFER_TAG)], view,
                       "receiving the state's header", t0)  # fmt: skip
        except CommError as e:
            failure = e
        total, raw_len = (int(v) for v in header[:16].view(torch.int64))
        chunk = ceil_div(total, self.k)
        piece = torch.zeros(chunk, dtype=torch.uint8)
        lo = self.local * chunk
        if failure is None and lo < total:
            mine = piece[: min(chunk, total - lo)]
            try:
                self.wait(lambda: [dist.irecv(mine, group=cross, group_src=src, tag=TRANSFER_TAG)],
                           view, "receiving the state", t0)  # fmt: skip
            except CommError as e:
                failure = e
        self.stats.recovery_bytes_received += HEADER_BYTES + piece.numel()
        sizes = torch.tensor([chunk], dtype=torch.int64)
        if self.k > 1:  # every rank of the region takes part, whatever happened to its chunk
            everyone = torch.zeros(self.k, dtype=torch.int64)
            all_gather_single(everyone, sizes, group=self.group)
            if failure is None and int(everyone.min()) != int(everyone.max()):
                failure = CommError("cloudtrain elastic: the region's ranks got different headers")
            width = int(everyone.max())
            piece = torch.cat([piece, piece.new_zeros(width - chunk)]) if width > chunk else piece
            whole = torch.zeros(self.k * width, dtype=torch.uint8)
            all_gather_single(whole, piece, group=self.group)
        else:
            whole = piece
        if failure is not None:
            raise failure
        wire = whole[:total].numpy().tobytes()
        if header[16]:
            import zstandard

            wire = zstandard.ZstdDecompressor().decompress(wire, max_output_size=raw_len)
        digest = bytes(header[17:49].tolist())
        if len(wire) != raw_len or hashlib.sha256(wire).digest() != digest:
            raise CommError(
                f"cloudtrain elastic: the state received from region "
                f"{view.members[src].region} does not match its sha256: not used"
            )
        state = torch.load(io.BytesIO(wire), weights_only=False)
        if self.replica.digest_of(state) != view.members[src].digest:
            raise CommError(
                f"cloudtrain elastic: the {self.replica.what} received from region "
                f"{view.members[src].region} differs from the one it announced: not used"
            )
        self.stats.recovery_s += time.perf_counter() - t0
        return state

    def load(self, view: View, state: dict[str, Any]) -> int:
        """A joiner takes the state received (the replica's `load`). Returns the source's count
        of committed syncs (or steps)."""
        self.replica.load(state)
        log.warning(
            "cloudtrain elastic: region %s took the state of region %s at step %s (%d bytes "
            "received by this rank)", self.region, view.members[view.sources[view.me]].region,
            state["step"], self.stats.recovery_bytes_received,
        )  # fmt: skip
        return int(state["commits"])


class OuterReplica:
    """An outer-loop region's state: the outer copy, momentum, inner optimizer state, the
    module's other tensors (buffers), the step and the schedule. A joiner's parameters become
    the outer copy, so its pseudo-gradient at the sync it joins is exactly zero."""

    what = "outer copy"

    def __init__(self, loop: Any, module: torch.nn.Module, set_step: Callable[[int], None]) -> None:
        self.loop, self.module, self.set_step = loop, module, set_step

    @property
    def step(self) -> int:
        return self.loop.step

    @property
    def stats(self) -> Any:
        return self.loop.stats

    def digest(self) -> int:
        return outer_digest(self.loop.global_)

    @staticmethod
    def digest_of(state: dict[str, Any]) -> int:
        return outer_digest(state["global"])

    def payload(self) -> dict[str, Any]:
        from .outer_state import cpu_copy

        loop = self.loop
        trainable = {id(p) for p in loop.params}
        rest = {
            name: t.detach().cpu().clone()
            for name, t in self.module.state_dict(keep_vars=True).items()
            if id(t) not in trainable
        }
        return {
            "global": [g.detach().cpu().clone() for g in loop.global_],
            "momentum": [None if m is None else m.detach().cpu().clone() for m in loop.momentum],
            "optimizer": cpu_copy(loop.optimizer.state_dict()),
            "module": rest,
            "schedule": dataclasses.asdict(loop.schedule),
        }

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        from .outer import Schedule

        loop = self.loop
        device = loop.global_[0].device
        loop.global_ = [g.to(device) for g in state["global"]]
        loop.momentum = [None if m is None else m.to(device) for m in state["momentum"]]
        loop.schedule = Schedule.from_state(state["schedule"])
        loop.optimizer.load_state_dict(state["optimizer"])
        _copy_into(self.module, state["module"])
        for f in range(loop.fragments):
            loop.parts.write(f, loop.global_[f].float())
        if loop.ef is not None:
            loop.ef.reset()  # nothing of this region's was held back
        loop.step = int(state["step"])
        self.set_step(loop.step)


class StepReplica:
    """A per-step region's state between two steps: the module's parameters and buffers, the
    optimizer's state, the step and DDP's bucket layouts. Error-feedback residuals are not
    moved: a joiner has held nothing back (its residuals start at zero) and the source keeps its
    own. A learning-rate scheduler's count is the user's: derive the rate from
    CloudDDP.steps_done, which a joiner takes from the run."""

    what = "parameter set"

    def __init__(
        self, comm: Any, module: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        self.comm, self.module, self.optimizer = comm, module, optimizer

    @property
    def step(self) -> int:
        return self.comm.step

    @property
    def stats(self) -> Any:
        return self.comm.stats

    def digest(self) -> int:
        return outer_digest(list(self.module.parameters()))

    def digest_of(self, state: dict[str, Any]) -> int:
        names = [name for name, _ in self.module.named_parameters()]
        return outer_digest([state["module"][name] for name in names])

    def payload(self) -> dict[str, Any]:
        from .outer_state import cpu_copy

        module = {n: t.detach().cpu().clone() for n, t in self.module.state_dict().items()}
        return {
            "module": module,
            "optimizer": cpu_copy(self.optimizer.state_dict()),
            # DDP's buckets as the run has them: the joiner's first backward hands over one
            # bucket of every parameter, reduced as these (cloudtrain.layout, as after a resume)
            "layouts": self.comm.layouts.state_dict()["layouts"],
        }

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        _copy_into(self.module, state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.comm.layouts.load_state_dict({"layouts": state["layouts"], "pending": {}})
        if self.comm.ef is not None:
            self.comm.ef.reset()
        self.comm.step = int(state["step"])


def _copy_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """The received tensors into the module's own, by name (shapes were agreed by identity)."""
    own = module.state_dict(keep_vars=True)
    for name, value in tensors.items():
        own[name].detach().copy_(value)
