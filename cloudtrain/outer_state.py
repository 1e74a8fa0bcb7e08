"""The outer loop's state that is not its arithmetic: a fragment's exchange in flight and how it is
saved, and a region's own parameters, buffers and inner optimizer state, which regions keep apart
between syncs (saved on a region's first rank, loaded by all of the region's ranks)."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import CommError, collective_failure

log = logging.getLogger("cloudtrain")


@dataclass
class _FragmentSync:
    """A fragment's exchange started at `sent` and merged at `merge`."""

    fragment: int
    sent: int
    merge: int
    local_at_send: torch.Tensor
    future: concurrent.futures.Future

    def state_dict(self) -> dict[str, Any]:
        """Its fragment, steps, the local parameters at the send and the mean (waited for)."""
        return {
            "fragment": self.fragment,
            "sent": self.sent,
            "merge": self.merge,
            "local_at_send": self.local_at_send.cpu().clone(),
            "mean": self.future.result().cpu().clone(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], home: Any, device: Any) -> _FragmentSync:
        """A finished exchange from its state: the mean on `home` (the outer copy's device), the
        local parameters at the send on `device` (the model's)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(state["mean"].to(home))
        at_send = state["local_at_send"].to(device)
        return cls(state["fragment"], state["sent"], state["merge"], at_send, done)


def cpu_copy(obj: Any) -> Any:
    """`obj` (an optimizer's state dict) with every tensor copied to the CPU: a snapshot that
    training does not change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def region_state(params: Any, optimizer: Any, buffers: Any) -> dict[str, Any]:
    """A region's own parameters, inner optimizer state and buffers, copied to the CPU."""
    return {
        "params": [p.detach().cpu().clone() for p in params],
        "optimizer": cpu_copy(optimizer.state_dict()),
        "buffers": None if buffers is None else [b.detach().cpu().clone() for b in buffers.buffers],
    }


def load_region(loop: Any, region: dict[str, Any] | None) -> None:
    """This region's parameters and inner optimizer state, from its first rank's state (all
    ranks of the region call): after the user's load of the checkpoint's one model and
    optimizer, which are another region's where regions trained apart."""
    members = loop.topo.members[loop.topo.region]
    got = [region]
    if len(members) > 1:
        group = loop.own.groups[f"region{loop.topo.region}"]
        t0 = time.perf_counter()
        try:
            dist.broadcast_object_list(got, src=members[0], group=group)
        except Exception as e:
            text = collective_failure(
                f"the region's outer-loop state from rank {members[0]}", members,
                loop.topo.rank, "", time.perf_counter() - t0, e,
                timeout_s=loop.config.timeout_s,
            )  # fmt: skip
            raise CommError(text) from e
    if got[0] is None:
        # this rank was not a region's first when the state was saved (another cluster
        # layout): the region keeps the checkpoint's model and optimizer, as loaded
        log.warning(
            "cloudtrain: outer state has no parameters of region %s (the regions' ranks "
            "differ from the saved run's): it resumes from the checkpoint's model",
            loop.topo.regions[loop.topo.region],
        )
        return
    params = got[0]["params"]
    if [tuple(t.shape) for t in params] != [tuple(p.shape) for p in loop.params]:
        raise ValueError("outer state: the region's parameters do not fit this model")
    with torch.no_grad():
        for p, value in zip(loop.params, params, strict=True):
            p.copy_(value)
        buffers = got[0].get("buffers")  # (absent in older states)
        if buffers is not None and loop.buffers is not None:
            for b, value in zip(loop.buffers.buffers, buffers, strict=True):
                b.copy_(value)
    loop.optimizer.load_state_dict(got[0]["optimizer"])
