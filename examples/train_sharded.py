"""A GPT-style character transformer sharded with FSDP2 inside each region and trained across
regions with cloudtrain (cloudtrain.fully_shard): per block and at the root, as torchtitan shards,
with the optimizer built after sharding. Data: the Python standard library's source, as
train_charlm.py reads it.

    torchrun --standalone --nproc-per-node 4 examples/train_sharded.py --regions a,a,b,b
    torchrun --standalone --nproc-per-node 4 examples/train_sharded.py --regions a,a,b,b \
        --config diloco-4bit --sync-every 20          # the outer loop on shards
    torchrun --standalone --nproc-per-node 4 examples/train_sharded.py --regions a,a,b,b \
        --ckpt /tmp/sharded-run                       # resumes from the newest step there
    torchrun --standalone --nproc-per-node 2 examples/train_sharded.py --regions a,b \
        --ckpt /tmp/sharded-run --new-mesh            # the same run on 1 rank a region
    horovodrun --gloo -np 4 -H localhost:4 python examples/train_sharded.py --regions a,a,b,b

--config: a cloudtrain preset or codec spec ("auto" by default: the controller picks the codec
per link), or "hsdp" for plain FSDP2 HSDP (torch's fully_shard on the same 2-D mesh, a dense
all-reduce across regions) to compare with. Every region needs the same number of ranks. Rank 0
prints the loss every 20 steps and a last line `RESULT {json}` (loss, steps, the step it resumed
from, ms/step, bytes sent across regions, this rank's memory of parameters + gradients +
optimizer + cloudtrain state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import torch.nn.functional as F

import cloudtrain
from cloudtrain.tools.data import CharLM, stdlib_text, windows
from cloudtrain.tools.memory import rank_memory


def shard(model: CharLM, config: cloudtrain.CompressionConfig, hsdp: bool) -> None:
    """Each block an FSDP unit, then the root (embeddings, final norm, tied head)."""
    if hsdp:  # plain FSDP2 HSDP on the regions' mesh, for comparison
        from torch.distributed.fsdp import fully_shard

        mesh = cloudtrain.device_mesh(config)  # its regions
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return
    for block in model.blocks:
        cloudtrain.fully_shard(block, config=config)  # was: torch's fully_shard(block)
    cloudtrain.fully_shard(model, config=config)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="auto")
    ap.add_argument("--regions", default="env")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--sync-every", type=int, default=None, help="the outer loop's H")
    ap.add_argument(
        "--ckpt", default=None, help="a folder or s3://BUCKET-{region}/PREFIX: resume, save"
    )
    ap.add_argument("--save-every", type=int, default=50, help="steps between saves to --ckpt")
    ap.add_argument(
        "--new-mesh", action="store_true",
        help="resume a --ckpt saved with another number of ranks a region: the model and "
        "optimizer are resharded, cloudtrain's own state starts afresh",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.config == "hsdp" and args.ckpt:
        ap.error("--ckpt saves cloudtrain's sharded state; --config hsdp has none to save")
    if (
        args.sync_every is not None
        and not cloudtrain.CompressionConfig.resolve(
            "none" if args.config == "hsdp" else args.config
        ).outer
    ):
        ap.error(f"--sync-every is the outer loop's H; --config {args.config} has no outer loop")
    return args


def main() -> None:
    args = arguments()
    cloudtrain.init()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    text = stdlib_text(400_000)
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])  # (chars,)
    torch.manual_seed(args.seed)
    model = CharLM(len(vocab), args.block, args.width, args.layers, heads=4)

    hsdp = args.config == "hsdp"
    config = cloudtrain.CompressionConfig.resolve(
        "none" if hsdp else args.config, regions=args.regions
    )
    if config.outer is not None and args.sync_every is not None:
        outer = dataclasses.replace(config.outer, sync_every=args.sync_every)
        config = dataclasses.replace(config, outer=outer)
    shard(model, config, hsdp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # after sharding, as FSDP2 wants
    comm = None if hsdp else cloudtrain.ShardedComm.of(model)

    start = 0
    ckpt = None
    if args.ckpt and comm is not None:
        from cloudtrain.checkpoint import ShardedCheckpointer

        ckpt = ShardedCheckpointer(args.ckpt)
        start = ckpt.load(model, opt, comm, comm_state=not args.new_mesh) or 0
    g = torch.Generator().manual_seed(args.seed)
    t0, loss = time.perf_counter(), torch.tensor(0.0)
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.block - 1, (world * args.batch,), generator=g)
        if step < start:
            continue  # the same batches as an uninterrupted run
        x, y = windows(data, starts[rank::world], args.block)  # (batch, block) each
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, len(vocab)), y.reshape(-1))
        loss.backward()
        opt.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
        if ckpt is not None and (step + 1) % args.save_every == 0:
            ckpt.save(step + 1, model, opt, comm)
    ms = 1000 * (time.perf_counter() - t0) / max(1, args.steps - start)
    if comm is not None:
        comm.finish_outer()
    held = rank_memory(model, opt, comm) if comm is not None else {}
    wan = comm.stats().wan_bytes_sent if comm is not None else None
    if rank == 0:
        result = {"loss": loss.item(), "steps": args.steps, "start": start,
                  "ms_per_step": round(ms, 1), "config": args.config, "wan_bytes_sent": wan,
                  "memory": held}  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)
    if comm is not None:
        comm.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
