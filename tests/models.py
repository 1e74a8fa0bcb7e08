"""The models, data and training loop the CloudDDP tests share (import as `from models import ...`).

Every rank and every replay builds the same weights (`make_model` and `Branchy` seed torch
themselves) and reads the same batches (`batch` is a function of rank and step), so runs of
different processes, and a process against a single-process replay, can be compared bit for bit.
`train_span` is the worker of the resume tests: steps start..stop of a run, resumed from and
saved to a folder.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def make_model(hidden: int = 48, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An MLP 20 -> hidden -> hidden -> 5, the same weights at every call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 5),
    ).to(dtype)


def batch(rank: int, step: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch at `step`: 8 inputs of 20 features and their 5-class labels."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 20, generator=g).to(dtype)
    return x, torch.randint(0, 5, (8,), generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_identical(results: list[list[torch.Tensor]]) -> None:
    """Every rank's parameters are rank 0's, bit for bit."""
    for rank, params in enumerate(results[1:], start=1):
        for a, b in zip(results[0], params, strict=True):
            assert torch.equal(a, b), f"rank {rank}'s parameters differ from rank 0's"


class Branchy(torch.nn.Module):
    """A model whose second head is unused on odd steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(20, 32)
        self.head_a = torch.nn.Linear(32, 5)
        self.head_b = torch.nn.Linear(32, 5)

    def forward(self, x, use_b: bool = True):
        h = torch.tanh(self.body(x))
        return self.head_a(h) + (self.head_b(h) if use_b else 0)


def train_span(
    rank: int,
    world: int,
    config: Any,
    start: int,
    stop: int,
    state_dir: str | None,
    ddp_options: dict[str, Any] | None = None,
    in_flight: bool = False,
) -> tuple[list[torch.Tensor], int]:
    """Steps start..stop of CloudDDP(make_model(), config) with momentum SGD, on `run_ranks`.

    With start > 0 the model, optimiser and comm state come from state_dir/rank<r>.pt; with a
    state_dir they are saved there at the end (with `in_flight`, the save must hold exchanges
    still in the pipeline). A run with a controller must have decided. Returns the parameters
    and the communication step."""
    import cloudtrain

    cloudtrain.init()
    model = make_model()
    cloud = cloudtrain.CloudDDP(model, config, **(ddp_options or {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(state_dir, f"rank{rank}.pt") if state_dir else None
    if start:
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        cloud.load_comm_state_dict(state["comm"])
    for step in range(start, stop):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss_of(cloud, x, y).backward()
        opt.step()
    if path:
        comm = cloud.comm_state_dict()
        if in_flight:
            assert len(comm["pipeline"]) > 0, "the save must hold exchanges in flight"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "comm": comm}, path)
    if cloud.comm.controller is not None:
        assert cloud.comm.controller.history, "the controller never decided"
    return params_of(model), cloud.comm.step
