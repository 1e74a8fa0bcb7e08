"""Data-parallel training of a small MLP on scikit-learn's handwritten digits (real data that ships
with scikit-learn: 1797 8x8 images, 10 classes), with gradients compressed by CloudDDP.

Run it however the job is launched (`cloudtrain.init()` reads the launcher's environment):

    python examples/train_digits.py                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/train_digits.py --config topk-1pct
    horovodrun --gloo -np 2 -H localhost:2 python examples/train_digits.py \
        --config topk-1pct --regions per-rank

--config is a cloudtrain preset ("none", "fp16", "quant4", "topk-1pct", "cocktail", "auto", ...),
a codec spec ("topk:0.05", "randomk:0.1>topk:0.1>quant:4"), or "ddp" for plain PyTorch
DistributedDataParallel, to compare against. Compression only applies between regions: with the
default --regions env all processes on one machine are one region and gradients are all-reduced
densely; --regions per-rank puts every rank in its own region so everything crosses a "WAN" and
is compressed (how to exercise compression on one machine); --regions us,us,eu,eu names each
rank's region. --config diloco (or diloco-sparse, diloco-int8, diloco-4bit, diloco-streaming)
trains with the outer loop: parameters cross regions every --sync-every steps, and the test
accuracy is measured after its final sync. --shares (with "auto") shares each global batch among the ranks by their
measured throughput (CompressionConfig(global_batch=--batch), cloudtrain.ShareSampler): a rank
on a faster machine gets more of it.

Every rank trains on its slice of each global batch. The model's initial weights and the order of
the global batches depend only on --seed, so two runs with different --config (or launchers) see
the same data in the same order: their results differ only by what compression did. Rank 0 shows
a progress bar, prints the test accuracy and a last line `RESULT {json}` for scripts (accuracy,
loss, steps, world size, config, ms/step, the bytes CloudDDP sent across regions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import cloudtrain
from cloudtrain.tools.data import digits, digits_mlp


def wrap(
    model: torch.nn.Module,
    config: str,
    regions: str,
    opt: torch.optim.Optimizer,
    sync_every: str | None = None,
    global_batch: int | None = None,
) -> torch.nn.Module:
    """Plain DDP for --config ddp, else CloudDDP with the preset or codec spec (an outer-loop
    preset such as "diloco" syncs every `sync_every` steps where given)."""
    if config == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    resolved = cloudtrain.CompressionConfig.resolve(
        config, regions=regions, global_batch=global_batch
    )
    if resolved.outer is not None and sync_every is not None:
        h = sync_every if sync_every == "auto" else int(sync_every)
        resolved = dataclasses.replace(
            resolved, outer=dataclasses.replace(resolved.outer, sync_every=h)
        )
    return cloudtrain.CloudDDP(model, resolved, optimizer=opt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="auto", help='preset ("auto", "topk-1pct", ...), codec spec, or "ddp"'
    )
    parser.add_argument(
        "--regions", default="env", help='"env", "probe", "per-rank" or name,name,...'
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-every", help="with --config diloco: inner steps per sync, or auto")
    parser.add_argument(
        "--shares", action="store_true", help="with auto: batch shares by measured throughput"
    )
    args = parser.parse_args()

    cloudtrain.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world and not args.shares:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} processes")
    x_train, y_train, x_test, y_test = digits(args.seed)
    torch.manual_seed(args.seed)  # the same initial weights whatever the config
    net = digits_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)  # before wrapping
    model = wrap(
        net, args.config, args.regions, opt, args.sync_every, args.batch if args.shares else None
    )

    batches = torch.Generator().manual_seed(args.seed + 1)  # same global batches on every rank
    per_rank = args.batch // world
    # a redraw per second on a terminal; in a log (horovodrun pipes it) one line per 15 s at most
    progress = tqdm(
        range(args.steps),
        desc=f"digits x{world} {args.config}",
        disable=rank != 0,
        mininterval=1.0 if sys.stderr.isatty() else 15.0,
    )
    shared = None
    if args.shares:  # this rank's share of each global batch, epoch after epoch
        sampler = cloudtrain.ShareSampler(len(x_train), model, seed=args.seed)
        shared = (b for _ in iter(int, 1) for b in sampler)
    start = time.perf_counter()
    for step in progress:
        idx = torch.randint(len(x_train), (args.batch,), generator=batches)  # (batch,)
        mine = idx[rank * per_rank : (rank + 1) * per_rank]  # (batch / world,)
        if shared is not None:
            mine = torch.tensor(next(shared))  # (its share,)
        loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0:
            progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    if isinstance(model, cloudtrain.CloudDDP):
        model.finish_outer()  # with an outer loop: every replica then holds the same model
    elapsed = time.perf_counter() - start
    progress.close()

    with torch.no_grad():  # replicas are identical, so every rank gets the same figures
        logits = model.module(x_test)  # (n_test, 10)
        accuracy = (logits.argmax(1) == y_test).float().mean().item()
        test_loss = F.cross_entropy(logits, y_test).item()
    cloud = isinstance(model, cloudtrain.CloudDDP)  # plain DDP counts nothing
    sent = torch.tensor([model.stats().wan_bytes_sent if cloud else 0], dtype=torch.int64)
    dist.all_reduce(sent)  # bytes all ranks together sent to other regions
    if rank == 0:
        ms = 1000 * elapsed / max(args.steps, 1)
        print(
            f"test accuracy {100 * accuracy:.2f}%, test loss {test_loss:.4f} after {args.steps} "
            f"steps on {world} processes ({args.config}), {ms:.1f} ms/step",
            flush=True,
        )
        result = {
            "accuracy": accuracy,
            "loss": test_loss,
            "steps": args.steps,
            "world_size": world,
            "config": args.config,
            "regions": None if args.config == "ddp" else args.regions,
            "seed": args.seed,
            "ms_per_step": ms,
            "wan_bytes_sent": int(sent.item()) if cloud else None,
            "host": os.uname().nodename,
        }
        print("RESULT " + json.dumps(result), flush=True)
    if cloud:
        model.close()  # its background collectives finish before the groups go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
