"""Regions that differ: OuterConfig(work="time") against work="steps", and its two ways of
averaging the regions' pseudo-gradients - equally (weighting="equal", the default), or weighted
by the samples each region trained on (weighting="samples") - on scikit-learn's digits, regions of processes on this
machine (--regions, default "a,b": one process each), the last region made 2x (--slower) slower
by sleeping in proportion to its batch.

    python examples/outer_time_weighting.py                  # iid data, seeds 0 1 2
    python examples/outer_time_weighting.py --split label    # region a digits 0-4, region b 5-9
    python examples/outer_time_weighting.py --regions a,a,b --slower 1   # b: fewer GPUs

Every arm trains until the run has seen --samples samples (CloudDDP.samples_done) and prints a
line per arm and seed: test accuracy and loss after finish_outer(), seconds, inner steps per
region. Its figures: docs/measurements.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

ARMS = ("steps", "equal", "samples")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_data(last: bool, split: str, seed: int) -> tuple[torch.Tensor, ...]:
    """A rank's training data (all of it, or its region's half of the labels: the last region
    5-9) and the test set."""
    from cloudtrain.tools.data import digits

    x, y, x_test, y_test = digits(seed)
    if split == "label":
        mine = (y >= 5) == last
        x, y = x[mine], y[mine]
    return x, y, x_test, y_test


def worker(rank: int, port: int, arm: str, args: argparse.Namespace, seed: int, out) -> None:
    regions = args.regions.split(",")
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(len(regions))}
        | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    last = regions[rank] == regions[-1]
    torch.set_num_threads(1)
    import cloudtrain

    cloudtrain.init()
    x, y, x_test, y_test = rank_data(last, args.split, seed)
    from cloudtrain.tools.data import digits_mlp

    torch.manual_seed(seed)
    net = digits_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    outer = {"sync_every": args.sync_every, "codec": "none", "work": "steps"}
    if arm != "steps":
        outer |= {"work": "time", "weighting": arm}
    config = cloudtrain.CompressionConfig(regions=args.regions, outer=outer)
    model = cloudtrain.CloudDDP(net, config, optimizer=opt)
    draw = torch.Generator().manual_seed(seed * 100 + rank)
    per_sample = args.per_sample_ms / 1000 * (args.slower if last else 1)
    steps, start = 0, time.perf_counter()
    while model.samples_done < args.samples:
        idx = torch.randint(len(x), (args.batch,), generator=draw)  # (batch,)
        time.sleep(per_sample * args.batch)  # region 1's GPUs: --slower times slower
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
    model.finish_outer()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        logits = model.module(x_test)  # (n_test, 10)
        accuracy = (logits.argmax(1) == y_test).float().mean().item()
        test_loss = F.cross_entropy(logits, y_test).item()
    out.put((rank, {"accuracy": accuracy, "loss": test_loss, "seconds": seconds, "steps": steps}))
    torch.distributed.destroy_process_group()


def run(arm: str, args: argparse.Namespace, seed: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    world = len(args.regions.split(","))
    procs = [ctx.Process(target=worker, args=(r, port, arm, args, seed, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return {**got[0], "steps": [got[r]["steps"] for r in range(world)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=("iid", "label"), default="iid")
    parser.add_argument("--regions", default="a,b", help="each rank's region; the last is slower")
    parser.add_argument("--samples", type=int, default=20000, help="samples of the run")
    parser.add_argument("--batch", type=int, default=32, help="samples a rank's step")
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--per-sample-ms", type=float, default=1.0, help="the faster region's")
    parser.add_argument("--slower", type=float, default=2.0, help="region 1's step / region 0's")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    rows = {arm: [] for arm in ARMS}
    for seed in args.seeds:
        for arm in ARMS:
            row = run(arm, args, seed)
            rows[arm].append(row)
            print(json.dumps({"arm": arm, "seed": seed, "split": args.split, **row}), flush=True)
    for arm in ARMS:
        acc = [100 * r["accuracy"] for r in rows[arm]]
        loss = [r["loss"] for r in rows[arm]]
        secs = [r["seconds"] for r in rows[arm]]
        print(
            f"{arm:8s} accuracy {statistics.mean(acc):.2f} % ({', '.join(f'{a:.2f}' for a in acc)}), "
            f"loss {statistics.mean(loss):.4f}, {statistics.mean(secs):.1f} s"
        )


if __name__ == "__main__":
    main()
