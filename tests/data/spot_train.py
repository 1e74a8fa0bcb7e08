"""A tiny data-parallel training run that checkpoints, obeys spot notices and resumes.

tests/test_spot.py launches it as real processes (torchrun-style environment: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; gloo on loopback) to check that a preempted and resumed run ends
bit-identical to one that was never stopped:

    python tests/data/spot_train.py --steps 10 --checkpoint s3://bucket/run --out DIR

Everything a resumed run needs comes back from the checkpoint: the model, the Adam moments,
CloudDDP's per-rank communication state (error-feedback residuals, step) and each rank's RNG
(dropout draws from it). Batches are a pure function of (seed, step, rank), so there is no
loader position to restore. Each rank is its own region, so every gradient is compressed
(top-k 10% with error feedback) and the residuals differ from rank to rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cloudtrain import CloudDDP, CompressionConfig
from cloudtrain.checkpoint import Checkpointer
from cloudtrain.spot import PreemptionGuard, SpotWatcher

IN, HIDDEN = 8, 16


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(16, IN, generator=gen)  # [batch, IN]
    y = x.sum(1, keepdim=True).sin()  # [batch, 1]
    return x, y


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--checkpoint", default="", help="checkpoint URI; empty: no checkpoints")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for each rank's final state")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--poll", type=float, default=5.0, help="spot watcher poll interval (s)")
    p.add_argument("--hold-at", type=int, default=0, help="step at which --hold-rank waits")
    p.add_argument("--hold-rank", type=int, default=-1, help="rank that waits for a notice")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()

    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Dropout(0.2), nn.Linear(HIDDEN, 1))
    ddp = CloudDDP(model, CompressionConfig.resolve("topk-10pct", regions="per-rank", timeout_s=60))
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    torch.manual_seed(args.seed + 1 + rank)  # dropout: a different stream on every rank

    ckpt = Checkpointer(args.checkpoint, keep_last=2) if args.checkpoint else None
    start = 0
    if ckpt is not None and ckpt.latest_step() is not None:
        state = ckpt.load()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        ddp.load_comm_state_dict(state["comm_state"])
        torch.set_rng_state(state["extra"]["torch_rng"])
        start = state["step"]
        print(f"rank {rank}: resumed from step {start}", flush=True)

    def save(step: int) -> None:
        assert ckpt is not None
        ckpt.save(
            step,
            model=ddp,
            optimizer=optimizer,
            comm_state=ddp.comm_state_dict(),
            extra={"torch_rng": torch.get_rng_state()},
        )

    watcher = SpotWatcher(interval_s=args.poll, timeout_s=2.0).start()
    guard = PreemptionGuard(watcher)
    for step in range(start, args.steps):
        x, y = batch(args.seed, step, rank)
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done = step + 1
        print(f"rank {rank}: step {done}", flush=True)
        if done == args.hold_at and rank == args.hold_rank:
            # Test instrumentation: wait here until this rank's own watcher sees the notice, so
            # that the step the ranks agree on is known in advance.
            deadline = time.monotonic() + 30
            while not watcher.noticed and time.monotonic() < deadline:
                time.sleep(0.01)
        if guard.should_stop():
            if ckpt is not None:
                save(done)
            print(
                f"rank {rank}: preempted after step {done} (own notice: {watcher.noticed})",
                flush=True,
            )
            watcher.stop()
            dist.destroy_process_group()
            return 0
        if ckpt is not None and args.save_every and done % args.save_every == 0:
            save(done)

    watcher.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    final = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "comm_state": ddp.comm_state_dict(),
        "torch_rng": torch.get_rng_state(),
    }
    torch.save(final, out / f"rank-{rank}.pt")
    print(f"rank {rank}: finished {args.steps} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
