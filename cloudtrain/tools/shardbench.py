"""Step time of a sharded transformer over an emulated WAN: plain FSDP2 HSDP (torch's fully_shard
on the regions' 2-D mesh: a dense all-reduce across regions every step) against
cloudtrain.fully_shard "auto" (the controller's codec per link), on 2 regions x 2 ranks, printed
side by side. Needs root (cloudtrain.tools.netem).

    python -m cloudtrain.tools.shardbench --mbit 100 --rtt-ms 80 [--width 256 --layers 4]

Each mode is a fresh launch of 4 processes in the emulator's namespaces; a rank trains the
transformer (cloudtrain.tools.data.CharLM, random tokens) with AdamW for --steps steps and the
median of the last half is its step time. WAN bytes: the emulator's interface counters over the
run (every byte that crossed, both modes alike) and, for cloudtrain, its own count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

import torch

MODES = ("hsdp", "auto")


def _worker(mode: str, width: int, layers: int, steps: int) -> None:
    import torch.nn.functional as F

    import cloudtrain

    from .memory import transformer

    torch.set_num_threads(1)
    cloudtrain.init()
    rank = torch.distributed.get_rank()
    model = transformer(width, layers)
    comm = None
    if mode == "hsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = cloudtrain.device_mesh()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        for block in model.blocks:
            cloudtrain.fully_shard(block, config=mode)
        cloudtrain.fully_shard(model, config=mode)
        comm = cloudtrain.ShardedComm.of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        idx = torch.randint(0, 256, (2, 65), generator=g)  # (batch, block + 1)
        opt.zero_grad()
        loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, 256), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    out = {"step_s": statistics.median(times[steps // 2 :]), "loss": loss.item()}
    if comm is not None:
        stats = comm.stats()
        out["cloudtrain_wan_bytes"] = stats.wan_bytes_sent
        out["plan"] = repr(comm.plan)
        comm.close()
    out["params"] = sum(p.numel() for p in transformer(width, layers).parameters())
    print(json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()


def _launch(mode: str, args: argparse.Namespace, port: int) -> dict:
    from .netem import Emulator, teardown

    name = f"sb{os.getpid() % 10000}-{uuid.uuid4().hex[:4]}"
    argv = [sys.executable, "-m", "cloudtrain.tools.shardbench", "--worker", mode]
    argv += ["--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
    try:
        with Emulator({"us": 2, "eu": 2}, args.mbit, rtt_ms=args.rtt_ms, name=name) as wan:
            before = _wan_bytes(wan)
            env = {"WORLD_SIZE": "4", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            procs = [
                wan.popen(r, argv, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
                for r in range(4)
            ]
            outs = [p.communicate(timeout=900)[0] for p in procs]
            if any(p.returncode for p in procs):
                raise SystemExit(f"{mode}: a rank failed:\n" + "\n".join(o[-2000:] for o in outs))
            crossed = _wan_bytes(wan) - before
    finally:
        teardown(name)
    ranks = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    return {"mode": mode, "step_s": max(r["step_s"] for r in ranks), "wan_bytes": crossed,
            "params": ranks[0]["params"], "plan": ranks[0].get("plan"),
            "loss": ranks[0]["loss"]}  # fmt: skip


def _wan_bytes(wan) -> int:
    """Bytes that left the regions over their WAN links so far (the interface counters)."""
    total = 0
    for region in wan.counters().values():
        total += region["tx_bytes"]  # what left each region: every byte that crossed, once
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbit", type=float, default=100.0)
    ap.add_argument("--rtt-ms", type=float, default=80.0)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.width, args.layers, args.steps)
        return 0
    rows = [_launch(mode, args, 29600 + i) for i, mode in enumerate(MODES)]
    print(f"{rows[0]['params'] / 1e6:.1f} M parameters, 2 regions x 2 ranks, "
          f"{args.mbit:g} Mbit/s, {args.rtt_ms:g} ms RTT, {args.steps} steps")  # fmt: skip
    print(f"{'mode':<28}{'step s':>10}{'WAN MB':>10}{'speed-up':>10}")
    for row in rows:
        label = "FSDP2 HSDP (dense)" if row["mode"] == "hsdp" else "cloudtrain sharded auto"
        print(f"{label:<28}{row['step_s']:>10.3f}{row['wan_bytes'] / 1e6:>10.1f}"
              f"{rows[0]['step_s'] / row['step_s']:>10.1f}x")  # fmt: skip
    print("cloudtrain's final plan:", rows[1]["plan"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
