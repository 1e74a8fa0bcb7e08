"""Training workloads for the benchmark: a model, its optimizer, its data and its metric, built the
same way on every rank from a seed.

    trainer = WORKLOADS["charlm"].build(seed=0)
    for step in range(steps):
        trainer.set_lr(step, steps)
        x, y = trainer.batch(rank, world)            # this rank's slice of the step's global batch
        loss = trainer.loss(ddp(x), y)
        ...
    quality = trainer.evaluate(model)                # accuracy (higher is better) or loss

`bench-mlp` is the benchmark's own digits MLP (`cloudtrain bench`). The others are the quality
matrix's (`cloudtrain bench --quality`): models of different architectures, optimizers and batch
sizes with their usual hyper-parameters, none of them tuned for cloudtrain:

    mlp         64-1024-1024-512-10 MLP on the digits scaled to [0, 1], SGD momentum 0.9, lr 0.05,
                32 samples per rank
    mlp-large   the same at 512 samples per rank
    cnn         two 3x3 convolutions with BatchNorm and a linear head on the standardized digits,
                Adam lr 2e-3, 32 samples per rank
    charlm      the char transformer of examples/train_charlm.py (AdamW lr 3e-3, betas 0.9/0.99,
                weight decay 0.1, warm-up then cosine), 8 sequences of 64 characters per rank
    charlm-wide the same 256 wide with 4 blocks (3.2 M parameters) at lr 1e-3 (at charlm's 3e-3
                it stalls after the warm-up, and runs that differ only in float rounding, as
                DDP's and HSDP's, leave the stall 10 steps apart): the sharded bench's
                (`cloudtrain bench --sharded`), where FSDP2 shards each block

The global batch of a step depends only on the seed and the step, so runs with different configs
see the same data in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..shares import share_slice
from .data import CharLM, digits, digits_mlp, stdlib_text, windows


@dataclass
class Trainer:
    """One workload, built: call `batch` once per step on every rank."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    per_rank: int
    draw: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]
    """(generator, global batch) -> the step's global batch (inputs, targets)."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], float]
    metric: str
    """"accuracy" (higher is better) or "loss" (lower is better)."""
    schedule: Callable[[int, int], float] | None = None
    generator: Any = None
    rebuild: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    """The workload's optimizer, built anew on a model's (sharded) parameters: FSDP2 wants the
    optimizer built after sharding. None: the workload cannot be sharded."""

    def batch(
        self, rank: int, world: int, shares: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the step's global batch: per_rank samples, or with `shares`
        (cloudtrain.shares, summing to per_rank x world) its share."""
        x, y = self.draw(self.generator, self.per_rank * world)
        if shares is None:
            mine = slice(rank * self.per_rank, (rank + 1) * self.per_rank)
        else:
            mine = share_slice(shares, rank)
        return x[mine], y[mine]

    def set_lr(self, step: int, steps: int) -> None:
        if self.schedule is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.schedule(step, steps)


@dataclass(frozen=True)
class Workload:
    name: str
    build_fn: Callable[..., Trainer]
    about: str

    def build(self, seed: int = 0, per_rank: int | None = None, **options: Any) -> Trainer:
        """The workload's model, optimizer and data for `seed` (`per_rank`: its batch per rank,
        else the workload's own; `options`: the workload's own, e.g. bench-mlp's hidden, lr)."""
        torch.manual_seed(seed)  # the same initial weights on every rank and for every config
        try:
            trainer = self.build_fn(seed, per_rank, **options)
        except TypeError as e:
            raise ValueError(
                f"workload {self.name!r} takes no option {sorted(options)}: {e}"
            ) from None
        trainer.generator = torch.Generator().manual_seed(seed + 1)
        return trainer


def _classifier(x_test: torch.Tensor, y_test: torch.Tensor) -> Callable[[nn.Module], float]:
    @torch.no_grad()
    def accuracy(model: nn.Module) -> float:
        was = model.training
        model.eval()
        correct = (model(x_test).argmax(1) == y_test).float().mean().item()
        model.train(was)
        return correct

    return accuracy


def _rows(x: torch.Tensor, y: torch.Tensor):
    def draw(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(x), (n,), generator=gen)
        return x[idx], y[idx]

    return draw


def _bench_mlp(
    seed: int, per_rank: int | None, hidden: int = 1024, lr: float = 0.05, momentum: float = 0.9
) -> Trainer:
    x, y, xt, yt = digits(seed)
    model = digits_mlp(hidden)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return Trainer(model, opt, per_rank or 64, _rows(x, y), F.cross_entropy, _classifier(xt, yt),
                   "accuracy")  # fmt: skip


def _mlp(per_rank_default: int) -> Callable[[int, int | None], Trainer]:
    def build(seed: int, per_rank: int | None, lr: float = 0.05, momentum: float = 0.9) -> Trainer:
        x, y, xt, yt = digits(seed, scale="unit")
        model = nn.Sequential(
            nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10),
        )  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        return Trainer(model, opt, per_rank or per_rank_default, _rows(x, y), F.cross_entropy,
                       _classifier(xt, yt), "accuracy")  # fmt: skip

    return build


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions with BatchNorm, a max-pool and two linear layers, on 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.fc1, self.fc2 = nn.Linear(64 * 4 * 4, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.b1(self.c1(x)))
        x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)  # (n, 64, 4, 4)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _cnn(seed: int, per_rank: int | None) -> Trainer:
    x, y, xt, yt = digits(seed)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    return Trainer(model, opt, per_rank or 32, _rows(x, y), F.cross_entropy, _classifier(xt, yt),
                   "accuracy")  # fmt: skip


def _charlm(
    width: int, layers: int, heads: int, base: float
) -> Callable[[int, int | None], Trainer]:
    def build(seed: int, per_rank: int | None) -> Trainer:
        return _charlm_trainer(width, layers, heads, base, per_rank)

    return build


def _charlm_trainer(
    width: int, layers: int, heads: int, base: float, per_rank: int | None
) -> Trainer:
    block = 64
    text = stdlib_text(1_000_000)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text])  # (chars,)
    n_train = int(0.9 * len(data))
    train, val = data[:n_train], data[n_train:]
    model = CharLM(len(vocab), block, width, layers, heads)

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=base, betas=(0.9, 0.99), weight_decay=0.1)

    def draw(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return windows(train, torch.randint(len(train) - block, (n,), generator=gen), block)

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        starts = torch.randint(len(val) - block, (256,), generator=torch.Generator().manual_seed(2))
        x, y = windows(val, starts, block)
        return loss(model(x), y).item()

    def schedule(step: int, steps: int) -> float:  # as examples/train_charlm.py
        warmup = max(1, steps // 10)
        if step < warmup:
            return base * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return base * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    return Trainer(model, optimizer(model), per_rank or 8, draw, loss, evaluate, "loss", schedule,
                   rebuild=optimizer)  # fmt: skip


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("bench-mlp", _bench_mlp, "the bench's MLP 64-1024-1024-10, SGD momentum 0.9"),
        Workload(
            "mlp", _mlp(32), "MLP 64-1024-1024-512-10, digits in [0, 1], SGD momentum 0.9, 32/rank"
        ),
        Workload("mlp-large", _mlp(512), "the same MLP at 512 samples per rank"),
        Workload("cnn", _cnn, "CNN with BatchNorm, Adam, 32/rank"),
        Workload(
            "charlm",
            _charlm(64, 2, 4, 3e-3),
            "char transformer, AdamW with warm-up and cosine, 8x64/rank",
        ),
        Workload(
            "charlm-wide", _charlm(256, 4, 8, 1e-3), "the same transformer 256 wide, 4 blocks"
        ),
    )
}
"""The workloads by name (module docstring)."""

QUALITY = ("mlp", "mlp-large", "cnn", "charlm")
"""The quality matrix's workloads."""
