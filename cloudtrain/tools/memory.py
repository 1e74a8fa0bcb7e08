"""What a rank holds in memory for training: parameters, gradients, optimizer state and
cloudtrain's own state, counted by tensor storage; and the process's peak resident memory.

    held = rank_memory(model, optimizer, wrapper)   # {"params": bytes, "grads": ..., ...}
    peak = peak_rss_bytes()                          # VmHWM of this process

    cloudtrain memory [--width 512 --layers 8 --regions 2 --per-region 2]

`cloudtrain memory` trains a GPT-style transformer (cloudtrain.tools.data.CharLM, 25 M
parameters by default) with AdamW for a few steps on regions x per-region local processes over
gloo, as CloudDDP and as cloudtrain.fully_shard, per step (quant4, error feedback) and with the
outer loop (diloco-4bit), and prints each rank's memory of every mode side by side, with the
sharded/CloudDDP ratio. Expected per rank for N parameters, k ranks a region and AdamW in fp32:
CloudDDP 16 N bytes (+ 4 N / k of residuals per step; + 12 N of outer copy, momentum and
residuals with the outer loop), sharded all of it / k.

`wrapper` is a CloudDDP or a ShardedComm (cloudtrain.sharded): its state is the error-feedback
residuals, the pipeline's sums in flight, the receives posted ahead for the next exchange across
regions (cloudtrain.collectives.ReceivesAhead) and, with an outer loop, the outer copy, its
momentum, the outer residuals and the fragments in flight. Each storage is counted once, whole
(FSDP's padded shards and its flat gradient buffers as they are allocated). Not counted: DDP's
gradient buckets (CloudDDP keeps them as DDP does: as much again as the gradients), activations,
and the other buffers one exchange uses while it runs - `peak_rss_bytes` has everything, with the
process's fixed cost (the Python runtime and torch's libraries, a few hundred MB) on top.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
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
    if not hasattr(comm, "pipeline"):  # not cloudtrain's (DDP, torch's own fully_shard): none
        return out
    path = getattr(comm, "path", None)
    if path is not None:
        if path.ef is not None:
            out += list(path.ef.residuals.values())
        out += path.receive_buffers()
    out += [f.values for f in comm.pipeline.flights if f.values is not None]
    outer = getattr(wrapper, "outer", None)
    if outer is not None:
        out += outer.path.receive_buffers()
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


# -- the command: CloudDDP and fully_shard side by side ----------------------------------------------
MODES = (
    ("per-step", "quant4"),
    ("outer loop", "diloco-4bit"),
)
"""(mode, the CompressionConfig preset or codec of it)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--width", type=int, default=512, help="the transformer's width")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--regions", type=int, default=2, help="regions (local processes)")
    parser.add_argument("--per-region", type=int, default=2, help="ranks in each region")
    parser.add_argument("--steps", type=int, default=3, help="training steps before measuring")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    report = measure(args.width, args.layers, args.regions, args.per_region, args.steps)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def measure(width: int, layers: int, regions: int, per_region: int, steps: int) -> dict:
    """Every rank's memory in every mode (MODES), as CloudDDP and sharded: regions x per_region
    local processes over gloo."""
    world = regions * per_region
    names = [f"r{r}" for r in range(regions) for _ in range(per_region)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "memory.json")
        spec = (width, layers, steps, ",".join(names), port, out)
        torch.multiprocessing.start_processes(
            _rank, (world, spec), nprocs=world, start_method="spawn"
        )
        with open(out) as f:
            return json.load(f)


def transformer(width: int, layers: int) -> torch.nn.Module:
    """The GPT-style transformer of the memory and speed figures (the same weights at every
    call): 256 tokens, a block of 64, 8 heads."""
    from .data import CharLM

    torch.manual_seed(0)
    return CharLM(vocab=256, block=64, d=width, layers=layers, heads=8)


def _train(model: torch.nn.Module, opt: Any, rank: int, steps: int) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(0, 256, (2, 65), generator=g)  # (batch, block + 1)
        opt.zero_grad()
        logits = model(idx[:, :-1])  # (batch, block, vocab)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()


def _measure(width: int, layers: int, steps: int, config: Any, sharded: bool, rank: int) -> dict:
    """One mode: train `steps` steps, then this rank's memory by category."""
    import cloudtrain

    model = transformer(width, layers)
    if sharded:
        for block in model.blocks:
            cloudtrain.fully_shard(block, config=config)
        cloudtrain.fully_shard(model, config=config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        wrapper: Any = cloudtrain.ShardedComm.of(model)
        trained: torch.nn.Module = model
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        outer = {"optimizer": opt} if config.outer is not None else {}
        wrapper = trained = cloudtrain.CloudDDP(model, config, **outer)
    _train(trained, opt, rank, steps)
    held = rank_memory(model, opt, wrapper)
    held["parameters"] = sum(p.numel() for p in transformer(width, layers).parameters())
    wrapper.close()
    return held


def _rank(index: int, world: int, spec: tuple) -> None:
    width, layers, steps, regions, port, out = spec
    os.environ.update(
        {"RANK": str(index), "WORLD_SIZE": str(world), "LOCAL_RANK": str(index)},
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    import dataclasses

    import torch.distributed as dist

    import cloudtrain
    from cloudtrain import CompressionConfig

    cloudtrain.init()
    rows = []
    for mode, preset in MODES:
        config = CompressionConfig.resolve(preset, regions=regions)
        if config.outer is not None:  # a sync within the steps: the outer state is all there
            config = dataclasses.replace(
                config, outer=dataclasses.replace(config.outer, sync_every=2)
            )
        ddp = _measure(width, layers, steps, config, False, index)
        shard = _measure(width, layers, steps, config, True, index)
        rows.append({"mode": mode, "config": preset, "clouddp": ddp, "sharded": shard})
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, rows)
    if index == 0:
        with open(out, "w") as f:
            json.dump({"ranks": everyone, "regions": regions}, f)
    dist.destroy_process_group()


def format_report(report: dict) -> str:
    """The table `cloudtrain memory` prints: per rank and mode, MB by category, side by side."""
    lines = []
    first = report["ranks"][0][0]["clouddp"]
    lines.append(
        f"per-rank memory, {first['parameters'] / 1e6:.1f} M parameters, AdamW fp32, "
        f"regions {report['regions']} (MB of tensor storage)"
    )
    head = f"{'rank':>4} {'mode':<11} {'wrapper':<8}" + "".join(f"{c:>11}" for c in CATEGORIES)
    lines.append(head + f"{'total':>11}{'ratio':>8}")
    for rank, rows in enumerate(report["ranks"]):
        for row in rows:
            for name in ("clouddp", "sharded"):
                held = row[name]
                cells = "".join(f"{held[c] / 1e6:>11.1f}" for c in CATEGORIES)
                ratio = held["total"] / row["clouddp"]["total"]
                label = "CloudDDP" if name == "clouddp" else "sharded"
                lines.append(
                    f"{rank:>4} {row['mode']:<11} {label:<8}{cells}{held['total'] / 1e6:>11.1f}"
                    f"{ratio:>8.2f}"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="cloudtrain memory", description=__doc__)
    configure(parser)
    sys.exit(run(parser.parse_args()))
