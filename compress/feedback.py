"""Error feedback: what compression dropped this step is added back next step.

    ef = ErrorFeedback(dtype=torch.float32)       # or torch.bfloat16: half the memory
    packet = ef.encode("bucket-3", grad, codec, level, key)
    # acc = grad + residual; packet = encode(acc); residual = acc - decode(packet)
    packet = ef.encode("bucket-3", shard, codec, level, key, valid=700)  # [700:] is padding
    r = ef.take("bucket-3")                       # the residual leaves (e.g. to its parameters)
    ef.put("bucket-3", r)                         # and comes back (e.g. from a checkpoint)

Keyed by bucket, so one object serves a whole model. It is the only writer of residuals:
`residuals` is a read-only view, and codecs' `encode_ef` (the fused step) is called from here
only. Conservation: over any number of steps,
sum(decoded packets) + residual == sum(grads), up to float rounding (bf16 rounding with a bf16
residual) - nothing is lost, only delayed. Residuals are part of `state_dict()`, so a resumed
run continues exactly.

Non-finite gradients with the codec's nonfinite="pass": the packet carries them (every rank
then sums the same NaN/Inf and AMP skips the step), but the residual is left as it was, since a
NaN residual would poison every later step.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from .codecs.base import Codec, Level, all_finite, check_finite, flat_float
from .ops import RESIDUAL_DTYPES
from .packet import Packet
from .rng import RandomKey


class ErrorFeedback:
    """Residuals per bucket key, and the encode step that uses them."""

    __slots__ = ("_residuals", "dtype")

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in RESIDUAL_DTYPES:
            raise ValueError(
                f"dtype={dtype}: residuals are kept in torch.float32 or torch.bfloat16"
            )
        self.dtype = dtype
        self._residuals: dict[Hashable, torch.Tensor] = {}

    @property
    def residuals(self) -> Mapping[Hashable, torch.Tensor]:
        """The residual per key, read-only (write through encode, take, put, reset)."""
        return MappingProxyType(self._residuals)

    def take(self, key: Hashable) -> torch.Tensor | None:
        """Remove the residual of `key` and return it (None if there is none)."""
        return self._residuals.pop(key, None)

    def put(self, key: Hashable, residual: torch.Tensor) -> None:
        """Install a residual for `key` (e.g. from a checkpoint), converted to this object's
        dtype and copied: the caller's tensor is never written by a later encode."""
        residual = flat_float(residual, "residual")
        self._residuals[key] = residual.detach().to(dtype=self.dtype, copy=True)

    def residual(
        self, key: Hashable, numel: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The residual for `key`, created as zeros on first use."""
        r = self._residuals.get(key)
        if r is None:
            r = self._residuals[key] = torch.zeros(numel, dtype=self.dtype, device=device)
        elif r.numel() != numel:
            raise ValueError(
                f"bucket {key!r} held {r.numel()} elements and now has {numel}; the model's "
                "gradient buckets changed - call reset() after changing the model"
            )
        elif r.device != torch.device(device):  # e.g. loaded from a checkpoint on the CPU
            r = self._residuals[key] = r.to(device)
        return r

    def encode(
        self,
        key: Hashable,
        x: torch.Tensor,
        codec: Codec,
        level: Level = None,
        random_key: RandomKey | None = None,
        valid: int | None = None,
    ) -> Packet:
        """Compress x + residual[key]; keep what the packet did not carry in residual[key].

        valid: elements at index >= valid are padding (e.g. a bucket's last shard), not
        gradient: the residual keeps nothing for them, whatever the codec sent there.
        """
        if not isinstance(codec, Codec):
            raise TypeError(f"codec: expected a Codec (see make_codec), got {type(codec).__name__}")
        x = flat_float(x)
        if valid is not None and (not isinstance(valid, int) or isinstance(valid, bool)):
            raise TypeError(f"valid={valid!r} must be an int (elements before the padding)")
        level = codec.check_level(level)
        random_key = random_key or RandomKey()
        residual = self.residual(key, x.numel(), x.device)
        if not all_finite(x):
            if codec.nonfinite == "raise":
                check_finite(x)
            # pass: send x + residual as it is and leave the residual untouched
            acc = x.to(torch.float32) + residual.to(torch.float32)
            return codec.encode(acc.to(x.dtype), level, random_key)
        packet = codec.encode_ef(x, residual, level, random_key)
        if valid is not None and valid < x.numel():
            residual[max(valid, 0) :] = 0
        return packet

    def reset(self) -> None:
        self._residuals.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "residuals": {k: v.detach().cpu().clone() for k, v in self._residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "residuals" not in state:
            raise ValueError("state: expected a dict from ErrorFeedback.state_dict()")
        dtype = getattr(torch, state.get("dtype", "float32"), None)
        if dtype != self.dtype:
            raise ValueError(
                f"state holds {state.get('dtype')} residuals, this ErrorFeedback keeps {self.dtype}"
            )
        self._residuals = {k: v.to(dtype=self.dtype).clone() for k, v in state["residuals"].items()}
