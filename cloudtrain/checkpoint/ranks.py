"""The collectives of one save or load: small Python objects (what each rank wrote, a manifest,
a verdict) gathered or broadcast in cloudtrain's own gloo group (bootstrap.control_group) with
its timeout (CLOUDTRAIN_TIMEOUT, default 300 s), so a rank that never arrives is an error, not a
hang. The error is a CheckpointError whose text is collectives.collective_failure's, the text of
every failed collective in cloudtrain.

    ranks = Ranks(timeout_s, " in save(step=12)")
    gathered = ranks.all_gather(written, "checkpoint gather of written files")

One process alone (no torch.distributed) is a world of one: all_gather gives [obj], broadcast
gives obj back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..bootstrap import TIMEOUT_ENV, control_group, timeout_seconds
from ..collectives import collective_failure
from .errors import CheckpointError

_T = TypeVar("_T")


def dist_or_none() -> Any:
    """torch.distributed when a process group is up, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): torch.distributed's in a distributed run (where the arguments may only
    repeat them), else the arguments, defaulting to 0 of 1."""
    dist = dist_or_none()
    if dist is not None:
        real_rank, real_size = dist.get_rank(), dist.get_world_size()
        if rank not in (None, real_rank) or world_size not in (None, real_size):
            raise CheckpointError(
                f"rank={rank}, world_size={world_size} contradict torch.distributed "
                f"(rank {real_rank} of {real_size}): leave them out in a distributed run"
            )
        return real_rank, real_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise CheckpointError(f"rank={rank} is not in [0, world_size={world_size})")
    return rank, world_size


class Ranks:
    """The collectives of one save/load, in cloudtrain's own group and timeout. `where` says
    which call they belong to (" in save(step=12)"), for the error."""

    def __init__(self, timeout_s: float | None, where: str = "") -> None:
        self.dist = dist_or_none()
        self.timeout_s = timeout_seconds(timeout_s)
        self.group = control_group(self.timeout_s) if self.dist is not None else None
        self.where = where

    @property
    def many(self) -> bool:
        return self.dist is not None and self.dist.get_world_size() > 1

    def _run(self, stage: str, collective: Callable[[], None]) -> None:
        t0 = time.monotonic()
        try:
            collective()
        except Exception as e:
            text = collective_failure(
                stage,
                range(self.dist.get_world_size()),
                self.dist.get_rank(),
                self.where,
                time.monotonic() - t0,
                e,
                timeout_s=self.timeout_s,
                knob=TIMEOUT_ENV,
                hint="Every rank must call save(), load() and latest_step() at the same points.",
            )
            raise CheckpointError(text) from e

    def all_gather(self, obj: _T, stage: str) -> list[_T]:
        """Every rank's `obj`, in rank order."""
        if not self.many:
            return [obj]
        out: list[Any] = [None] * self.dist.get_world_size()
        self._run(stage, lambda: self.dist.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast(self, obj: _T, stage: str) -> _T:
        """Rank 0's `obj` on every rank."""
        if not self.many:
            return obj
        box = [obj]
        self._run(stage, lambda: self.dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def run_everywhere(self, fn: Callable[[], Any], stage: str) -> None:
        """fn() on this rank, then a gather of every rank's outcome: if it failed anywhere, the
        same CheckpointError (what failed, by rank) is raised on every rank."""
        error = None
        try:
            fn()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        errors = self.all_gather(error, stage)
        if any(errors):
            raise CheckpointError(f"{stage} failed{self.where}: {by_text(enumerate(errors))}")


def by_text(failures: Iterable[tuple[int, str | None]], who: str = "rank") -> str:
    """Ranks' failures with the ranks of each distinct text together ("ranks 2, 3: ...")."""
    ranks: dict[str, list[int]] = {}
    for rank, text in failures:
        if text:
            ranks.setdefault(text, []).append(rank)
    return "; ".join(
        f"{who}{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {text}"
        for text, rs in ranks.items()
    )
