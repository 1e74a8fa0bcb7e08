"""`cloudtrain bench --scenario hetero-compute`: one region's GPUs slower, on the emulated WAN.

    sudo cloudtrain bench --scenario hetero-compute                  # region eu 2x slower
    sudo cloudtrain bench --scenario hetero-compute --slowdown 4 --batch 1024

Every rank computes on an emulated accelerator (cloudtrain.tools.runner.accelerator: after each
forward it sleeps --sample-ms per sample of its batch, as a GPU takes time in proportion to its
batch), region eu's --slowdown times slower; 2 regions x 2 ranks (--ranks-per-region: e.g. 2 1,
region eu with half the GPUs) joined by 100 Mbit/s links with 80 ms RTT (--mbit, --rtt-ms), at a
global batch of 2048 (--batch).
Side by side, with the same data and seed:

- every rank alone, compute only (no communication, on loopback): the ideal - the sum of the
  ranks' standalone throughputs, the slow region's included;
- DDP with no region slowed: the quality reference;
- DDP, "auto" without and with batch shares (CompressionConfig(global_batch=...), cloudtrain.
  shares), all with region eu slowed;
- the outer loop ("diloco") with no region slowed: the outer rows' own quality reference (what
  the outer loop costs against DDP, apart from what a slower region does);
- the outer loop counting H steps, and working by time (OuterConfig(work="time")), also with
  each exchange running one inner step behind (overlap=1).

Each row's throughput is the samples every rank trained on in the wall-clock window that all
ranks spend past their warm-up steps, over that window (every rank reports its own steps:
--rank-report; window_rate() says why one window for all); the table gives it against the ideal
and against twice the slow region's standalone throughput (what synchronous equal batches reach
on two regions), and the final quality against homogeneous DDP's at equal samples (within 1
point of accuracy passes).
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
    "diloco-even": ('"diloco", no region slowed', "cloud-diloco", None, False),
    "diloco": ('"diloco", H steps', "cloud-diloco", None, True),
    "diloco-time": ('"diloco", work by time', "cloud-diloco", {"outer": {"work": "time"}}, True),
    "diloco-overlap": ('"diloco", by time, overlap 1', "cloud-diloco", BEHIND, True),
}
"""Row -> (label, method, CompressionConfig overrides, region eu slowed). global_batch None: the
workload's global batch (the bench's --batch for its MLP). A row's overrides go over the bench's
--overrides, field by field (e.g. --overrides '{"controller": {"hidden_fraction": 0.1}}' reaches
the "auto" rows)."""

SLOW_REGION = "eu"

SAMPLE_MS = 0.5
"""The emulated accelerator's ms per sample in the fast region: at the global batch of 2048 (512
per rank) 256 ms of compute per step, which the WAN's costs can hide behind."""


def read_reports(folder: Path, ranks: int) -> list[dict[str, list[float]]]:
    """Every rank's report: its samples, seconds and wall-clock end of each step."""
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(ranks)]


def own_rates(reports: list[dict[str, list[float]]], warmup: int) -> list[float]:
    """Each rank's samples after its warm-up steps over their seconds."""
    return [sum(rep["samples"][warmup:]) / sum(rep["step_times"][warmup:]) for rep in reports]


def window_rate(reports: list[dict[str, list[float]]], warmup: int) -> float:
    """Samples/s of the whole run: every rank's samples in the wall-clock window that all ranks
    spend past their warm-ups (from the last warm-up's end to the first rank's last step; a step
    half inside counts half) over that window. Regions working by time run different numbers of
    steps, so their warm-ups end at different times, and their samples over the longest rank's
    seconds would count the slow region over a shorter window than the others. For ranks that
    step together it is their samples over their seconds."""
    first = warmup - 1 if warmup else 0  # the step whose end (or, with no warm-up, start) opens
    start = max(rep["ends"][first] - (0 if warmup else rep["step_times"][0]) for rep in reports)
    stop = min(rep["ends"][-1] for rep in reports)
    if stop <= start:
        raise ValueError(f"no wall-clock window past every rank's {warmup} warm-up steps: "
                         "run more --steps or fewer --warmup")  # fmt: skip
    inside = 0.0
    for rep in reports:
        for n, took, end in zip(rep["samples"], rep["step_times"], rep["ends"], strict=True):
            overlap = min(end, stop) - max(end - took, start)
            inside += n * max(0.0, min(1.0, overlap / took)) if took > 0 else 0.0
    return inside / (stop - start)


def row_overrides(given: str | None, row: dict) -> str:
    """The CompressionConfig fields of a row (JSON): the row's over the bench's --overrides, field
    by field - a section both set (such as "outer" or "controller") merged, the row's fields
    winning."""
    merged = json.loads(given or "{}")
    for key, value in row.items():
        section = merged.get(key)
        both = isinstance(section, dict) and isinstance(value, dict)
        merged[key] = {**section, **value} if both else value
    return json.dumps(merged)


def drive(args: argparse.Namespace, regions: list[str], wan: Any, progress: Any) -> dict[str, Any]:
    """Every row of ROWS (or --hetero-rows) on the emulated network `wan` (None: loopback)."""
    rows, runs = [], []
    for name in args.hetero_rows or list(ROWS):
        label, method, overrides, slowed = ROWS[name]
        row_args = argparse.Namespace(**vars(args))
        if overrides is not None:
            row_args.overrides = row_overrides(args.overrides, overrides)
        row_args.slowdown = args.slowdown if slowed else 1.0
        row_args.slow_region = SLOW_REGION
        with tempfile.TemporaryDirectory(prefix="cloudtrain-hetero-") as folder:
            row_args.rank_report = folder
            progress.set_postfix_str(name)
            run: Run = run_method(method, row_args, wan, regions, progress)
            ranks = read_reports(Path(folder), len(regions))
        own = own_rates(ranks, args.warmup)
        # the ranks alone, each at its own pace, need not overlap in time: the sum of their rates
        whole = sum(own) if method == "compute" else window_rate(ranks, args.warmup)
        runs.append(run)
        rows.append({
            "row": name, "label": label, "samples_per_s": whole, "rank_samples_per_s": own,
            "accuracy": run.accuracy, "metric": run.metric, "plans": run.plans,
            "comm_ms_per_step": run.comm_ms,  # rank 0's stats().seconds over all its steps
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
            "slow_region_alone_samples_per_s": slow, "ranks": len(regions),
            "global_batch": runs[0].per_rank * len(regions)}  # fmt: skip


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
