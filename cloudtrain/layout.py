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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .compress import ErrorFeedback

Layout = tuple[tuple[int, int, int], ...]
"""A bucket's (parameter index, offset in the bucket, numel) for every parameter in it."""


def layout_numel(layout: Layout) -> int:
    return sum(numel for _, _, numel in layout)


@dataclass(frozen=True)
class Unit:
    """A bucket of `layouts` inside DDP's bucket: its index and layout, and `placement` - where
    its parameters sit in DDP's bucket - when DDP's bucket is not exactly this one."""

    index: int
    layout: Layout
    placement: Layout | None = None


class BucketLayouts:
    """The learnt bucket layouts and the residual pieces waiting for their parameters."""

    __slots__ = ("_param_index", "layouts", "pending")

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._param_index = {id(p): i for i, p in enumerate(params)}
        self.layouts: dict[int, Layout] = {}
        self.pending: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def signature(
        self, buffer: torch.Tensor, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> Layout:
        """(parameter index, offset in the bucket, numel) of every parameter in DDP's bucket."""
        base, size = buffer.data_ptr(), buffer.element_size()
        return tuple(
            (self._param_index[id(p)], (g.data_ptr() - base) // size, g.numel())
            for p, g in zip(params, grads, strict=True)
        )

    def units(self, index: int, sig: Layout, ef: ErrorFeedback | None) -> list[Unit]:
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
        for b in list(self.layouts):
            self.release(b, ef)
            del self.layouts[b]

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

    def inject(self, layout: Layout, buf: torch.Tensor) -> None:
        """Add residual pieces of this bucket's parameters into its (scaled) gradient."""
        if not self.pending:
            return
        for pi, offset, _ in layout:
            for start, piece in self.pending.pop(pi, ()):
                view = buf[offset + start : offset + start + piece.numel()]
                view.add_(piece.to(device=view.device, dtype=view.dtype))

    def shard_numels(self, shards: int, params: Sequence[torch.Tensor]) -> list[int]:
        """Elements of each bucket's shard (before the first step: the model as one bucket)."""
        if self.layouts:
            return [-(-layout_numel(lay) // shards) for lay in self.layouts.values()]
        return [-(-sum(p.numel() for p in params if p.requires_grad) // shards)]

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
