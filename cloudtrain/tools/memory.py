"""What a rank holds in memory for training: parameters, gradients, optimizer state and
cloudtrain's own state, counted by tensor storage; and the process's peak resident memory.

    held = rank_memory(model, optimizer, wrapper)   # {"params": bytes, "grads": ..., ...}
    peak = peak_rss_bytes()                          # VmHWM of this process

`wrapper` is a CloudDDP or a ShardedComm (cloudtrain.sharded): its state is the error-feedback
residuals, the pipeline's sums in flight and, with an outer loop, the outer copy, its momentum,
the outer residuals and the fragments in flight. Each storage is counted once, whole (FSDP's
padded shards and its flat gradient buffers as they are allocated). Not counted: DDP's gradient
buckets (CloudDDP keeps them as DDP does: as much again as the gradients), activations, and the
buffers one exchange uses while it runs - `peak_rss_bytes` has everything, with the process's
fixed cost (the Python runtime and torch's libraries, a few hundred MB) on top.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

CATEGORIES = ("params", "grads", "optimizer", "cloudtrain")


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield _local(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def cloudtrain_tensors(wrapper: Any) -> list[torch.Tensor]:
    """The tensors of cloudtrain's own state in a CloudDDP or a ShardedComm (module docstring)."""
    comm = getattr(wrapper, "comm", wrapper)  # CloudDDP's CommState, or the ShardedComm itself
    out: list[torch.Tensor] = []
    path = getattr(comm, "path", None)
    if path is not None and path.ef is not None:
        out += list(path.ef.residuals.values())
    out += [f.values for f in comm.pipeline.flights if f.values is not None]
    outer = getattr(wrapper, "outer", None)
    if outer is not None:
        out += list(outer.global_)
        out += [m for m in outer.momentum if m is not None]
        if outer.ef is not None:
            out += list(outer.ef.residuals.values())
        for flight in outer.flights.values():
            out.append(flight.local_at_send)
            if flight.future.done():
                out.append(flight.future.result())
    return out


def rank_memory(model: torch.nn.Module, optimizer: Any, wrapper: Any) -> dict[str, int]:
    """Bytes this rank holds, by category (CATEGORIES) and in total."""
    seen: set[int] = set()
    params = list(model.parameters())
    held = {
        "params": _storage_bytes((_local(p) for p in params), seen),
        "grads": _storage_bytes((_local(p.grad) for p in params if p.grad is not None), seen),
        "optimizer": _storage_bytes(_tensors(optimizer.state_dict()["state"]), seen),
        "cloudtrain": _storage_bytes(cloudtrain_tensors(wrapper), seen),
    }
    held["total"] = sum(held[c] for c in CATEGORIES)
    return held


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM of /proc/self/status; 0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
