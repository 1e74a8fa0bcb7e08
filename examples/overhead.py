"""What CloudDDP costs when it compresses nothing: step time of CloudDDP (config "none", one
region) against plain PyTorch DistributedDataParallel, side by side in one run. The target is a
ratio within 1.05.

    python examples/overhead.py                        # starts itself on 2 processes (torchrun)
    python examples/overhead.py --nproc 4 --width 2048 --configs none,fp16
    torchrun --standalone --nproc-per-node 2 examples/overhead.py

The model is a synthetic MLP (--layers Linear(width, width) + ReLU; the default is 4.2M
parameters, a 16.8 MB gradient) so that a step is compute and all-reduce, not Python overhead.
Both models live in the same processes and train on the same fixed batch; each repetition times
--steps steps of one, then of the other, alternating which goes first, so that load from other
programs on the machine falls on both alike. The figure is the median over repetitions of ms/step;
rank 0 prints a table, the ratios, and a last line `RESULT {json}`. --nonfinite pass turns off
CloudDDP's check of every summed bucket for NaN/Inf, to see what that check costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cloudtrain


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())))


def wrap(model: nn.Module, config: str, regions: str, nonfinite: str) -> nn.Module:
    """Plain DDP for "ddp", else CloudDDP with the preset or codec spec."""
    if config == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    cfg = cloudtrain.CompressionConfig.resolve(config, regions=regions, nonfinite=nonfinite)
    return cloudtrain.CloudDDP(model, cfg)


def time_steps(model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """ms per training step over `steps` steps, as rank 0 sees it (all ranks start together)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
    dist.barrier()
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="none", help="CloudDDP configs to compare with ddp")
    parser.add_argument("--regions", default="env", help='"env" (one region here) or "per-rank"')
    parser.add_argument(
        "--nonfinite",
        default="raise",
        choices=["raise", "pass"],
        help='CloudDDP\'s NaN/Inf check of every summed bucket: "raise" (on) or "pass" (off)',
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed repetition")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2, help="processes, when not launched by one")
    args = parser.parse_args()

    if not ({"RANK", "HOROVOD_RANK"} & set(os.environ)) and args.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # a thread per process, as torchrun would
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        rest, argv = [], iter(sys.argv[1:])
        for a in argv:  # --nproc is this launch's (torchrun would take it for --nproc-per-node)
            if a == "--nproc":
                next(argv, None)
            elif not a.startswith("--nproc="):
                rest.append(a)
        launch += [f"--nproc-per-node={args.nproc}", __file__, *rest]
        os.execv(sys.executable, launch)

    cloudtrain.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    names = ["ddp", *args.configs.split(",")]
    models = [
        wrap(make_model(args.width, args.layers), name, args.regions, args.nonfinite)
        for name in names
    ]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)  # (batch, width)
    y = torch.randn(args.batch, args.width, generator=g)
    for model, opt in zip(models, opts, strict=True):  # warm up: DDP rebuilds its buckets
        time_steps(model, opt, x, y, 2)

    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        order = list(range(len(names)))
        if rep % 2:
            order.reverse()
        for i in order:
            times[names[i]].append(time_steps(models[i], opts[i], x, y, args.steps))

    if rank == 0:
        params = sum(p.numel() for p in models[0].parameters())
        median = {name: statistics.median(ts) for name, ts in times.items()}
        print(
            f"{world} processes, {params / 1e6:.1f}M parameters, {args.reps} repetitions of "
            f"{args.steps} steps, regions {args.regions}, nonfinite {args.nonfinite}"
        )
        for name, ts in times.items():
            print(
                f"  {name:>10}: median {median[name]:7.1f} ms/step  "
                f"(min {min(ts):.1f}, max {max(ts):.1f})"
            )
        ratios = {name: median[name] / median["ddp"] for name in names[1:]}
        for name, ratio in ratios.items():
            print(f"  {name} / ddp = {ratio:.3f}")
        result = {
            "world_size": world,
            "params": params,
            "regions": args.regions,
            "nonfinite": args.nonfinite,
            "ms_per_step": median,
            "ratio_to_ddp": ratios,
        }
        print("RESULT " + json.dumps(result), flush=True)
    for model in models:
        if isinstance(model, cloudtrain.CloudDDP):
            model.close()  # its background collectives finish before the groups go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
