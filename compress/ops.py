"""The hot operations of gradient compression, native where built, pure PyTorch otherwise.

    from cloudtrain.compress import ops
    indices, values = ops.ef_topk_select(grad, residual, k)          # residual updated in place
    codes, lo, step = ops.ef_quantize(grad, residual, 8, 512, True, key)
    ops.dequantize_accumulate(out, [(codes, lo, step), ...], [8, ...], 512)
    ops.sparse_accumulate(out, [(indices, values), ...])

Each function runs the native op `torch.ops.cloudtrain.<name>` (csrc/, built into the extension
`cloudtrain._C`: CPU always, CUDA where torch has CUDA) when it is loaded and has a kernel for the
input - its device, dtypes (grad fp32/bf16/fp16, residual fp32/bf16, codes uint8, indices int64)
and a contiguous 1-D layout - and the function of the same name in reference.py otherwise. Both
give the same result: the same bits for top-k, nearest rounding and the accumulations. Stochastic
rounding draws differently - the reference from a torch.Generator (`key.private(device)`), the
native op from a counter-based hash of (`key.private_seed()`, element index) - and each is
unbiased; the native draws are the same on CPU and CUDA and never depend on thread scheduling.

The native library is optional: if `cloudtrain._C` is missing, importing this module warns once
and everything runs on the reference (slower). CLOUDTRAIN_NO_NATIVE=1 skips the native library on
purpose, without a warning. `NATIVE` says whether it is in use. Every op has a fake (meta) kernel
here, so torch.compile can trace it.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Sequence

import torch

from . import reference
from .rng import RandomKey

OPS = ("ef_topk_select", "ef_quantize", "dequantize_accumulate", "sparse_accumulate")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)
MAX_GROUP_SIZE = 1 << 30
"""Elements per scale at most (the native ops' kMaxGroupSize): group counts and byte offsets
computed from it cannot overflow."""


def check_group_size(group_size: int) -> None:
    """Elements per scale in [1, MAX_GROUP_SIZE], or a ValueError naming the bound."""
    if not 1 <= group_size <= MAX_GROUP_SIZE:
        raise ValueError(f"group_size={group_size} must be in [1, 2^30]")


def _load_native() -> bool:
    if os.environ.get("CLOUDTRAIN_NO_NATIVE") == "1":
        return False
    try:
        importlib.import_module("cloudtrain._C")
    except ImportError as e:
        warnings.warn(
            f"cloudtrain's native ops are not built ({e}); compression runs on the pure-PyTorch "
            "reference, which is slower. Build them with "
            "`pip install --no-build-isolation -e .` (or `make install`).",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


NATIVE: bool = _load_native()

# (op, device type) pairs with a native kernel, read once: a set lookup is all torch.compile sees.
KERNELS: frozenset[tuple[str, str]] = frozenset(
    (op, device)
    for op in (OPS if NATIVE else ())
    for device, key in (("cpu", "CPU"), ("cuda", "CUDA"))
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"cloudtrain::{op}", key)
)


def _flat(t: torch.Tensor) -> bool:
    return t.dim() == 1 and t.is_contiguous()


def _native(op: str, device: torch.device) -> bool:
    return (op, device.type) in KERNELS


def ef_topk_select(
    grad: torch.Tensor, residual: torch.Tensor | None, k: int, sampled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """acc = grad + residual; the k largest |acc| (NaN first, ties to the lowest indices);
    residual = acc with those zeroed. Returns (indices int64[k] ascending, values fp32[k]).
    `sampled` picks the reference's algorithm; the result is the same either way."""
    n = grad.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be in [0, {n}] (the number of elements of grad)")
    if (
        _native("ef_topk_select", grad.device)
        and grad.dtype in GRAD_DTYPES
        and _flat(grad)
        and (residual is None or (residual.dtype in RESIDUAL_DTYPES and _flat(residual)))
        and (grad.device.type != "cuda" or n < 2**32)
    ):
        return torch.ops.cloudtrain.ef_topk_select(grad, residual, k, sampled)
    return reference.ef_topk_select(grad, residual, k, sampled)


def ef_quantize(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    bits: int,
    group_size: int,
    stochastic: bool,
    key: RandomKey | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize grad + residual in groups (reference.ef_quantize has the arithmetic); residual
    keeps the error. Returns (codes packed uint8, lo fp32[G], step fp32[G]). `key` seeds the
    stochastic rounding (RandomKey() when None)."""
    if bits not in reference.QUANT_BITS:
        raise ValueError(f"bits={bits} is not supported; use one of {reference.QUANT_BITS}")
    check_group_size(group_size)
    key = key or RandomKey()
    if (
        _native("ef_quantize", grad.device)
        and grad.dtype in GRAD_DTYPES
        and _flat(grad)
        and (residual is None or (residual.dtype in RESIDUAL_DTYPES and _flat(residual)))
        and (grad.device.type != "cuda" or group_size % 8 == 0)
    ):
        return torch.ops.cloudtrain.ef_quantize(
            grad, residual, bits, group_size, stochastic, key.private_seed()
        )
    generator = key.private(grad.device) if stochastic else None
    return reference.ef_quantize(grad, residual, bits, group_size, stochastic, generator)


def dequantize_accumulate(
    out: torch.Tensor,
    packets: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    bits: Sequence[int],
    group_size: int,
) -> torch.Tensor:
    """out (fp32) += lo + code * step for each (codes, lo, step) packet, in list order, in one
    pass. Returns out."""
    packets, bits = list(packets), list(bits)
    if len(bits) != len(packets):
        raise ValueError(f"{len(packets)} packets but {len(bits)} bit widths")
    check_group_size(group_size)
    if (
        _native("dequantize_accumulate", out.device)
        and out.dtype == torch.float32
        and _flat(out)
        and all(
            codes.dtype == torch.uint8
            and lo.dtype == torch.float32
            and step.dtype == torch.float32
            and _flat(codes)
            and _flat(lo)
            and _flat(step)
            for codes, lo, step in packets
        )
    ):
        torch.ops.cloudtrain.dequantize_accumulate(
            out,
            [p[0] for p in packets],
            [p[1] for p in packets],
            [p[2] for p in packets],
            bits,
            group_size,
        )
        return out
    return reference.dequantize_accumulate(out, packets, bits, group_size)


def sparse_accumulate(
    out: torch.Tensor, packets: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """out (fp32)[indices] += values for each (indices, values) packet, in list order (indices
    distinct within a packet). Returns out."""
    packets = list(packets)
    if (
        _native("sparse_accumulate", out.device)
        and out.dtype == torch.float32
        and _flat(out)
        and all(
            indices.dtype == torch.int64
            and values.dtype in GRAD_DTYPES
            and _flat(indices)
            and _flat(values)
            for indices, values in packets
        )
    ):
        torch.ops.cloudtrain.sparse_accumulate(
            out, [p[0] for p in packets], [p[1] for p in packets]
        )
        return out
    return reference.sparse_accumulate(out, packets)


# ---------------------------------------------------------------------------------------------
# fake kernels: output shapes and dtypes only, for torch.compile and torch.library.opcheck

if NATIVE:

    @torch.library.register_fake("cloudtrain::ef_topk_select")
    def _ef_topk_select_fake(grad, residual, k, sampled=False):
        torch._check(0 <= k <= grad.numel(), lambda: f"k={k} out of range")
        return grad.new_empty(k, dtype=torch.int64), grad.new_empty(k, dtype=torch.float32)

    @torch.library.register_fake("cloudtrain::ef_quantize")
    def _ef_quantize_fake(grad, residual, bits, group_size, stochastic, seed):
        n = grad.numel()
        groups = (n + group_size - 1) // group_size
        return (
            grad.new_empty((n * bits + 7) // 8, dtype=torch.uint8),
            grad.new_empty(groups, dtype=torch.float32),
            grad.new_empty(groups, dtype=torch.float32),
        )

    @torch.library.register_fake("cloudtrain::dequantize_accumulate")
    def _dequantize_accumulate_fake(out, codes, lo, step, bits, group_size):
        return None

    @torch.library.register_fake("cloudtrain::sparse_accumulate")
    def _sparse_accumulate_fake(out, indices, values):
        return None
