"""Data-parallel training of a small MLP on scikit-learn's handwritten digits (real data that
ships with scikit-learn: 1797 8x8 images, 10 classes).

Run with any number of processes:

    torchrun --nproc-per-node 2 examples/train_digits.py --steps 300

Each rank trains on its own slice of every global batch; gradients are averaged by
DistributedDataParallel over gloo. Rank 0 shows a progress bar and prints the test accuracy and
a final JSON line (`RESULT {...}`) for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from tqdm import tqdm


def digits_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardized digits, split 80/20 by a fixed permutation: (x_train, y_train, x_test, y_test)."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_train = int(0.8 * len(x))
    mean, std = x[:n_train].mean(0), x[:n_train].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def make_model(hidden: int = 256) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} processes")
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = digits_data(args.seed)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    batches = torch.Generator().manual_seed(args.seed + 1)  # same global batches on every rank
    per_rank = args.batch // world
    start = time.perf_counter()
    progress = tqdm(range(args.steps), desc=f"digits x{world}", disable=rank != 0, mininterval=1.0)
    for step in progress:
        idx = torch.randint(len(x_train), (args.batch,), generator=batches)
        mine = idx[rank * per_rank : (rank + 1) * per_rank]
        loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0:
            progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:
        print(
            f"test accuracy {100 * accuracy:.2f}% after {args.steps} steps on {world} processes, "
            f"{1000 * elapsed / args.steps:.1f} ms/step"
        )
        result = {
            "accuracy": accuracy,
            "steps": args.steps,
            "world_size": world,
            "ms_per_step": 1000 * elapsed / args.steps,
            "host": os.uname().nodename,
        }
        print("RESULT " + json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
