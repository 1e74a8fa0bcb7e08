"""A small character-level transformer (nanoGPT-style: causal self-attention, pre-LayerNorm,
tied embeddings) trained data-parallel, with gradients compressed by CloudDDP, on real text every
machine has: the Python standard library's own source.

Run it however the job is launched (`cloudtrain.init()` reads the launcher's environment):

    python examples/train_charlm.py                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/train_charlm.py --config topk-10pct \
        --regions per-rank
    horovodrun --gloo -np 2 -H localhost:2 python examples/train_charlm.py --config cocktail \
        --regions per-rank
    torchrun --standalone --nproc-per-node 4 examples/train_charlm.py --config diloco \
        --regions a,a,b,b --sync-every 20     # the outer loop: parameters cross every 20 steps

Data: the top-level .py files of `sysconfig.get_paths()["stdlib"]` in sorted order, concatenated
up to --chars characters; the vocabulary is the sorted set of characters in that text; the first
90% is for training, the last 10% (other files) for validation. The same Python gives the same
text, vocabulary and split on every machine.

--config and --regions are as in train_digits.py: a cloudtrain preset or codec spec, or "ddp" for
plain PyTorch DistributedDataParallel; "env" (one region per machine: no lossy compression on one
machine), "per-rank" (every rank its own region: everything compressed), or name,name,... . The
initial weights and the order of the global batches depend only on --seed, so runs with different
configs see the same data in the same order. --config diloco (or diloco-sparse, diloco-int8,
diloco-4bit) trains with the outer loop (cloudtrain.outer): --sync-every, --outer-lr,
--outer-momentum, --fragments and --overlap set its options, and the validation loss is measured
after its final sync. Rank 0 shows a progress bar, prints the validation loss, a sample, and a
last line `RESULT {json}` (val_loss, steps, world size, config, ms/step, the bytes CloudDDP sent
across regions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import cloudtrain
from cloudtrain.tools.data import CharLM, stdlib_text, windows


def wrap(
    model: nn.Module, config: str, regions: str, opt: torch.optim.Optimizer, outer: dict
) -> nn.Module:
    """Plain DDP for --config ddp, else CloudDDP with the preset or codec spec; `outer` overrides
    the outer loop's options of an outer-loop preset ("diloco", ...)."""
    if config == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    resolved = cloudtrain.CompressionConfig.resolve(config, regions=regions)
    if resolved.outer is not None and outer:
        resolved = dataclasses.replace(resolved, outer=dataclasses.replace(resolved.outer, **outer))
    return cloudtrain.CloudDDP(model, resolved, optimizer=opt)


@torch.no_grad()
def val_loss(model: nn.Module, val: torch.Tensor, block: int, batch: int, seed: int) -> float:
    """Mean loss over fixed validation windows, shared out among the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    starts = torch.randint(
        len(val) - block, (8 * batch,), generator=torch.Generator().manual_seed(seed)
    )
    x, y = windows(val, starts[rank::world], block)
    logits = model(x)  # (n, block, vocab)
    total = torch.tensor(
        [F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item(), y.numel()],
        dtype=torch.float64,
    )
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


@torch.no_grad()
def sample(model: CharLM, prompt: torch.Tensor, n: int, block: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)  # not torch's global RNG
    idx = prompt[None]  # (1, t)
    for _ in range(n):
        probs = model(idx[:, -block:])[0, -1].softmax(-1)  # (vocab,)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)[None]], dim=1)
    return idx[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="auto", help='preset ("auto", "topk-1pct", ...), codec spec, or "ddp"'
    )
    parser.add_argument(
        "--regions", default="env", help='"env", "probe", "per-rank" or name,name,...'
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="global batch size, in sequences")
    parser.add_argument("--block", type=int, default=64, help="context length, characters")
    parser.add_argument("--width", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--chars", type=int, default=1_000_000, help="characters of stdlib text")
    parser.add_argument("--sample", type=int, default=200, help="characters to generate at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-every", help="outer loop: H, inner steps per sync, or auto")
    parser.add_argument("--outer-lr", type=float, help="outer loop: the outer SGD's lr")
    parser.add_argument("--outer-momentum", type=float, help="outer loop: its (Nesterov) momentum")
    parser.add_argument("--fragments", type=int, help="outer loop: fragments synced in turn")
    parser.add_argument("--overlap", type=int, help="outer loop: steps an exchange may run behind")
    parser.add_argument(
        "--outer-dtype", help="outer loop: float32 or bfloat16 (outer copy, momentum, residuals)"
    )
    parser.add_argument(
        "--outer-codec", help='outer loop: codec spec of the pseudo-gradients ("none", "quant:8")'
    )
    args = parser.parse_args()
    outer = {
        name: value
        for name, value in (
            ("sync_every", args.sync_every),
            ("outer_lr", args.outer_lr),
            ("outer_momentum", args.outer_momentum),
            ("fragments", args.fragments),
            ("overlap", args.overlap),
            ("dtype", args.outer_dtype),
        )
        if value is not None
    }
    if "sync_every" in outer and outer["sync_every"] != "auto":
        outer["sync_every"] = int(outer["sync_every"])
    if args.outer_codec:
        spec = cloudtrain.CompressionConfig.resolve(args.outer_codec)  # its codec and level
        outer["codec"], outer["level"] = spec.codec, spec.level

    cloudtrain.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} processes")
    text = stdlib_text(args.chars)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text])  # (chars,) int64
    n_train = int(0.9 * len(data))
    train, val = data[:n_train], data[n_train:]

    torch.manual_seed(args.seed)  # the same initial weights whatever the config
    net = CharLM(len(vocab), args.block, args.width, args.layers, args.heads)
    # built before wrapping: the outer loop hooks its steps
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)
    model = wrap(net, args.config, args.regions, opt, outer)
    warmup = max(1, args.steps // 10)  # then cosine decay to lr / 10

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    batches = torch.Generator().manual_seed(args.seed + 1)  # same global batches on every rank
    per_rank = args.batch // world
    progress = tqdm(
        range(args.steps),
        desc=f"charlm x{world} {args.config}",
        disable=rank != 0,
        mininterval=1.0 if sys.stderr.isatty() else 15.0,  # a log gets a line per 15 s at most
    )
    start = time.perf_counter()
    for step in progress:
        starts = torch.randint(len(train) - args.block, (args.batch,), generator=batches)
        x, y = windows(train, starts[rank * per_rank : (rank + 1) * per_rank], args.block)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0:
            progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    cloud = isinstance(model, cloudtrain.CloudDDP)  # plain DDP counts nothing
    if cloud:
        model.finish_outer()  # with an outer loop: every replica then holds the same model
    elapsed = time.perf_counter() - start
    progress.close()

    vloss = val_loss(net, val, args.block, args.batch, args.seed + 2)
    sent = torch.tensor([model.stats().wan_bytes_sent if cloud else 0], dtype=torch.int64)
    dist.all_reduce(sent)  # bytes all ranks together sent to other regions
    if rank == 0:
        ms = 1000 * elapsed / max(args.steps, 1)
        print(
            f"validation loss {vloss:.4f} nats/char after {args.steps} steps on {world} processes "
            f"({args.config}), {ms:.1f} ms/step; {len(text):,} characters, vocabulary {len(vocab)}",
            flush=True,
        )
        if args.sample:
            out = sample(net, val[: args.block], args.sample, args.block, args.seed)
            print("sample:\n" + "".join(vocab[i] for i in out.tolist()), flush=True)
        result = {
            "val_loss": vloss,
            "loss": vloss,
            "steps": args.steps,
            "world_size": world,
            "config": args.config,
            "regions": None if args.config == "ddp" else args.regions,
            "seed": args.seed,
            "params": sum(p.numel() for p in net.parameters()),
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
