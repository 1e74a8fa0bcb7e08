"""`cloudtrain bench --scenario hetero-compute`: one region's GPUs slower, on the emulated WAN.

    sudo cloudtrain bench --scenario hetero-compute                  # region eu 2x slower
    sudo cloudtrain bench --scenario hetero-compute --slowdown 4 --batch 1024

Every rank computes on an emulated accelerator (cloudtrain.tools.runner.accelerator: after each
forward it sleeps --sample-ms per sample of its batch, as a GPU takes time in proportion to its
batch), region eu's --slowdown times slower; 2 regions x 2 ranks joined by 100 Mbit/s links with
80 ms RTT (--mbit, --rtt-ms), at a global batch of 2048 (--batch).
Side by side, with the same data and seed:

- every rank alone, compute only (no communication, on loopback): the ideal - the sum of the
  ranks' standalone throughputs, the slow region's included;
- DDP with no region slowed: the quality reference;
- DDP, "auto" without and with batch shares (CompressionConfig(global_batch=...), cloudtrain.
  shares), all with region eu slowed;
- the outer loop ("diloco") counting H steps, and working by time (OuterConfig(work="time")),
  also with each exchange running one inner step behind (overlap=1).

Each row's throughput is the samples every rank trained on after the warm-up steps over the
longest rank's seconds for them (every rank reports its own: --rank-report); the table gives it
against the ideal and against twice the slow region's standalone throughput (what synchronous
equal batches reach on two regions), and the final quality against homogeneous DDP's at equal
samples (within 1 point of accuracy passes).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from .runner import Run, run_method

BEHIND = {"outer": {"work": "time", "overlap": 1}}
"""By time, each exchange merged one inner step after it started (OuterConfig.overlap)."""

ROWS: dict[str, tuple[str, str, dict | None, bool]] = {
    "ideal": ("every rank alone: the ideal", "compute", None, True),
    "ddp-even": ("DDP, no region slowed", "ddp", None, False),
    "ddp": ("DDP", "ddp", None, True),
    "auto": ('"auto"', "cloud-auto", None, True),
    "auto-shares": ('"auto" + batch shares', "cloud-auto", {"global_batch": None}, True),
    "diloco": ('"diloco", H steps', "cloud-diloco", None, True),
    "diloco-time": ('"diloco", work by time', "cloud-diloco", {"outer": {"work": "time"}}, True),
    "diloco-overlap": ('"diloco", by time, overlap 1', "cloud-diloco", BEHIND, True),
}
"""Row -> (label, method, CompressionConfig overrides, region eu slowed). global_batch None: the
workload's global batch (the bench's --batch for its MLP)."""

SLOW_REGION = "eu"

SAMPLE_MS = 0.5
"""The emulated accelerator's ms per sample in the fast region: at the global batch of 2048 (512
per rank) 256 ms of compute per step, which the WAN's costs can hide behind."""


def throughput(folder: Path, ranks: int, warmup: int) -> tuple[float, list[float]]:
    """(samples/s of the whole run - every rank's samples over the longest rank's seconds -,
    each rank's own samples/s) from the ranks' reports."""
    samples, seconds = [], []
    for rank in range(ranks):
        report = json.loads((folder / f"rank{rank}.json").read_text())
        samples.append(sum(report["samples"][warmup:]))
        seconds.append(sum(report["step_times"][warmup:]))
    own = [n / s for n, s in zip(samples, seconds, strict=True)]
    return sum(samples) / max(seconds), own


def drive(args: argparse.Namespace, regions: list[str], wan: Any, progress: Any) -> dict[str, Any]:
    """Every row of ROWS (or --hetero-rows) on the emulated network `wan` (None: loopback)."""
    rows, runs = [], []
    for name in args.hetero_rows or list(ROWS):
        label, method, overrides, slowed = ROWS[name]
        row_args = argparse.Namespace(**vars(args))
        if overrides is not None:
            row_args.overrides = json.dumps(overrides)
        row_args.slowdown = args.slowdown if slowed else 1.0
        row_args.slow_region = SLOW_REGION
        with tempfile.TemporaryDirectory(prefix="cloudtrain-hetero-") as folder:
            row_args.rank_report = folder
            progress.set_postfix_str(name)
            run: Run = run_method(method, row_args, wan, regions, progress)
            whole, own = throughput(Path(folder), len(regions), args.warmup)
        if method == "compute":  # the ranks alone, each at its own pace: the sum of their rates
            whole = sum(own)
        runs.append(run)
        rows.append({
            "row": name, "label": label, "samples_per_s": whole, "rank_samples_per_s": own,
            "accuracy": run.accuracy, "metric": run.metric, "plans": run.plans,
        })  # fmt: skip
    ideal = next((r for r in rows if r["row"] == "ideal"), None)
    reference = next((r for r in rows if r["row"] == "ddp-even"), None)
    slow = None
    if ideal is not None:
        slow_ranks = [i for i, r in enumerate(regions) if r == SLOW_REGION]
        slow = sum(ideal["rank_samples_per_s"][i] for i in slow_ranks)
    for row in rows:
        row["x_ideal"] = row["samples_per_s"] / ideal["samples_per_s"] if ideal else None
        row["x_twice_slow"] = row["samples_per_s"] / (2 * slow) if slow else None
        row["quality_vs_even_ddp"] = None
        if reference is not None and row["row"] != "ideal":  # ranks alone train no one model
            row["quality_vs_even_ddp"] = (
                row["accuracy"] - reference["accuracy"]
                if row["metric"] == "accuracy"
                else row["accuracy"] / reference["accuracy"] - 1
            )
    return {"slowdown": args.slowdown, "slow_region": SLOW_REGION, "rows": rows,
            "slow_region_alone_samples_per_s": slow}  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    print(
        f"\nregion {report['slow_region']} {report['slowdown']:g}x slower; alone it trains "
        f"{report['slow_region_alone_samples_per_s'] or 0:.0f} samples/s"
    )
    print(
        f"{'':31} {'samples/s':>9} {'x ideal':>7} {'x 2 slow':>8} {'quality':>8} {'vs DDP even':>11}"
    )
    for row in report["rows"]:
        x_ideal = "" if row["x_ideal"] is None else f"{row['x_ideal']:7.2f}"
        x_slow = "" if row["x_twice_slow"] is None else f"{row['x_twice_slow']:8.2f}"
        delta, accuracy = row["quality_vs_even_ddp"], row["metric"] == "accuracy"
        delta = "" if delta is None else f"{100 * delta:+.2f}" + (" pt" if accuracy else " %")
        quality = f"{100 * row['accuracy']:7.2f}%" if accuracy else f"{row['accuracy']:8.3f}"
        if row["row"] == "ideal":
            quality = f"{'-':>8}"
        print(
            f"{row['label']:31} {row['samples_per_s']:9.0f} {x_ideal:>7} {x_slow:>8} "
            f"{quality} {delta:>11}"
        )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--slowdown", type=float, default=2.0,
        help="hetero-compute: how many times slower region eu's accelerator is (default 2)",
    )  # fmt: skip
    parser.add_argument(
        "--sample-ms", type=float,
        help="the emulated accelerator's ms per sample (cloudtrain.tools.runner.accelerator; "
        f"hetero-compute's default {SAMPLE_MS}, the other scenarios' 0: none)",
    )  # fmt: skip
    parser.add_argument("--hetero-rows", nargs="+", choices=list(ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--slow-region", default=SLOW_REGION, help=argparse.SUPPRESS)
    parser.add_argument("--rank-report", help=argparse.SUPPRESS)  # a folder: rank<r>.json each
