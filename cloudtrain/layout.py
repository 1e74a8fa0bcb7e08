"""Which parameters sit where in DDP's gradient buckets, and what happens to residuals when that
changes.

DDP builds its buckets in the order of `parameters()` reversed, then rebuilds them once after
the first step in the order the gradients were ready. Error-feedback residuals are kept per
(bucket, shard), so a change of layout must not lose them: `BucketLayouts` learns each bucket's
layout - (parameter index, offset in the bucket, numel) of every parameter in it - and when DDP's
layout no longer matches, every residual is cut at parameter boundaries into `pending` pieces and
added into those parameters' next gradients (the region's reduction then carries them to their
new owner, who compresses them with feedback: nothing is dropped).

Resumes: the saved run's layouts come back with the comm state, while a fresh DDP starts with its
one initial bucket. `units` then splits DDP's bucket into the saved buckets, so the resumed run
reduces exactly the buckets the saved run did and repeats its math bit for bit.

Unused parameters (find_unused_parameters): DDP leaves the gradient of a parameter unused on every
rank alone, so what a step's sum holds for it - residuals error feedback let go of, pieces that
waited for it - would be lost; `track_unused` has it taken back into `pending` after DDP's end of
backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .compress import ErrorFeedback
from .plan import ceil_div

BucketLayout = tuple[tuple[int, int, int], ...]
"""A bucket's (parameter index, offset in the bucket, numel) for every parameter in it."""


def layout_numel(layout: BucketLayout) -> int:
    return sum(numel for _, _, numel in layout)


@dataclass(frozen=True)
class Unit:
    """A bucket of `layouts` inside DDP's bucket: its index and layout, and `placement` - where
    its parameters sit in DDP's bucket - when DDP's bucket is not exactly this one."""

    index: int
    layout: BucketLayout
    placement: BucketLayout | None = None

    def gather(self, buf: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """The unit's gradient laid out as its own bucket: `buf` itself where DDP's bucket is
        this unit (a copy of it with `copy`), else its parameters' pieces gathered from `buf`."""
        if self.placement is None:
            return buf.clone() if copy else buf
        piece = buf.new_empty(layout_numel(self.layout))
        for (_, here, numel), (_, there, _) in zip(self.layout, self.placement, strict=True):
            piece[here : here + numel] = buf[there : there + numel]
        return piece

    def scatter(self, piece: torch.Tensor, buf: torch.Tensor) -> None:
        """Write `piece` (as from `gather`) back at the unit's places in DDP's bucket `buf`."""
        if self.placement is None:
            if piece.data_ptr() != buf.data_ptr():
                buf.copy_(piece)
            return
        for (_, here, numel), (_, there, _) in zip(self.layout, self.placement, strict=True):
            buf[there : there + numel] = piece[here : here + numel]


class BucketLayouts:
    """The learnt bucket layouts and the residual pieces waiting for their parameters."""

    __slots__ = (
        "_param_index",
        "_reclaims",
        "_used_map",
        "_written",
        "layouts",
        "names",
        "params",
        "pending",
    )

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str] = ()) -> None:
        self.params, self.names = list(params), list(names)
        self._param_index = {id(p): i for i, p in enumerate(self.params)}
        self.layouts: dict[int, BucketLayout] = {}
        self.pending: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._used_map: Any = None  # with find_unused_parameters: DDP's, after backward
        self._reclaims = False
        self._written: list[tuple[BucketLayout, torch.Tensor]] = []

    def signature(
        self, buffer: torch.Tensor, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> BucketLayout:
        """(parameter index, offset in the bucket, numel) of every parameter in DDP's bucket."""
        base, size = buffer.data_ptr(), buffer.element_size()
        return tuple(
            (self._param_index[id(p)], (g.data_ptr() - base) // size, g.numel())
            for p, g in zip(params, grads, strict=True)
        )

    def units(self, index: int, sig: BucketLayout, ef: ErrorFeedback | None) -> list[Unit]:
        """The known buckets DDP's bucket `index` (with layout `sig`) consists of.

        A DDP bucket that is neither a known bucket nor made of known buckets means DDP changed
        its layout: every residual goes back into its parameters' gradients (`pending`), and the
        new layout is learnt.
        """
        known = self.layouts.get(index)
        if known == sig:
            return [Unit(index, sig)]
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
                Unit(b, self.layouts[b], tuple(where[pi] for pi, _, _ in self.layouts[b]))
                for b in inside
            ]
        if known is not None or any(
            set(where) & {pi for pi, _, _ in lay} for lay in self.layouts.values()
        ):
            self.release_all(ef)
        self.layouts[index] = sig
        return [Unit(index, sig)]

    def release_all(self, ef: ErrorFeedback | None) -> None:
        """Every residual goes back to its parameters (pending), and the layouts are forgotten."""
        self.release_residuals(ef)
        self.layouts.clear()

    def release_residuals(self, ef: ErrorFeedback | None) -> None:
        """Every bucket's residuals go back to their parameters (pending)."""
        for b in list(self.layouts):
            self.release(b, ef)

    def release(self, index: int, ef: ErrorFeedback | None) -> None:
        """Bucket `index`'s residuals (one per shard) leave the error feedback, cut at parameter
        boundaries into `pending`."""
        if ef is None:
            return
        layout = self.layouts[index]
        n = layout_numel(layout)
        for key in [k for k in ef.residuals if k[0] == index]:
            residual = ef.take(key)
            m = residual.numel()
            lo, hi = key[1] * m, min((key[1] + 1) * m, n)
            for pi, offset, numel in layout:
                a, b = max(lo, offset), min(hi, offset + numel)
                if a < b:
                    piece = residual[a - lo : b - lo].float().clone()
                    self.pending.setdefault(pi, []).append((a - offset, piece))

    def inject(self, layout: BucketLayout, buf: torch.Tensor) -> None:
        """Add residual pieces of this bucket's parameters into its (scaled) gradient."""
        if not self.pending:
            return
        for pi, offset, _ in layout:
            for start, piece in self.pending.pop(pi, ()):
                view = buf[offset + start : offset + start + piece.numel()]
                view.add_(piece.to(device=view.device, dtype=view.dtype))

    @property
    def device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def shard_numels(self, shards: int) -> list[int]:
        """Elements of each bucket's shard (before the first step: the model as one bucket)."""
        if self.layouts:
            return [ceil_div(layout_numel(lay), shards) for lay in self.layouts.values()]
        return [ceil_div(sum(p.numel() for p in self.params if p.requires_grad), shards)]

    # -- unused parameters ----------------------------------------------------------------------
    def track_unused(self, used_map: Any, reclaims: bool) -> None:
        """With find_unused_parameters: `used_map` gives DDP's used map after backward (one entry
        per trainable parameter); `reclaims`: this rank takes back what an unused parameter's
        sum held (rank 0: every rank's sum is the same)."""
        self._used_map, self._reclaims = used_map, reclaims

    def watch_backward(self) -> None:
        """At a step's first bucket, inside backward: have `_reclaim` run right after DDP's own
        end of backward (which DDP queues after its last bucket; a callback queued from a
        callback runs after those queued before it)."""
        if self._used_map is None:
            return
        engine = torch.autograd.Variable._execution_engine
        # RuntimeError: not inside a backward pass (DDP's join() shadows buckets)
        with contextlib.suppress(RuntimeError):
            engine.queue_callback(lambda: engine.queue_callback(self._reclaim))

    def written(self, signature: BucketLayout, result: torch.Tensor) -> None:
        """A bucket's result as DDP gets it (a reference, not a copy: `_reclaim` runs right after
        DDP's end of backward, before anything writes the bucket again)."""
        if self._used_map is not None:
            self._written.append((signature, result))

    def _reclaim(self) -> None:
        """What this step's sum holds for parameters unused on every rank goes into `pending`:
        added into that parameter's next gradient, once, as any pending piece is."""
        written, self._written = self._written, []
        used = self._used_map()
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        unused = {trainable[j] for j in range(min(len(trainable), used.numel())) if not used[j]}
        if not unused or not self._reclaims:
            return
        for signature, result in written:
            for pi, offset, numel in signature:
                if pi in unused:
                    piece = result[offset : offset + numel].float().cpu().clone()
                    if bool(piece.any()):
                        self.pending.setdefault(pi, []).append((0, piece))

    def state_dict(self) -> dict[str, Any]:
        return {
            "layouts": {b: list(sig) for b, sig in self.layouts.items()},
            "pending": {
                pi: [(s, t.clone()) for s, t in pieces] for pi, pieces in self.pending.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.layouts = {int(b): tuple(tuple(t) for t in sig) for b, sig in state["layouts"].items()}
        self.pending = {
            int(pi): [(int(s), t.clone()) for s, t in pieces]
            for pi, pieces in state["pending"].items()
        }
