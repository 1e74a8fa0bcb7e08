"""`cloudtrain bench --quality`: the quality matrix - final quality against DDP at equal steps, for
"auto" and every preset, on workloads that differ in architecture, optimizer and batch size.

    sudo cloudtrain bench --quality                       # the whole matrix (one to two hours here)
    sudo cloudtrain bench --quality --workloads mlp --scenarios wan --presets --steps 60

The workloads are cloudtrain.tools.workloads.QUALITY (none of them tuned for cloudtrain). For each:

- DDP on loopback: the reference quality and the unshaped step time;
- each preset (a fixed codec: its quality does not depend on the link), and one step of staleness
  alone (`CompressionConfig(codec="none", staleness=1)`), on loopback with two regions of two
  ranks, so that everything crosses "regions" compressed;
- per scenario - `wan` 100 Mbit/s with 80 ms RTT, `far` 50 Mbit/s with 180 ms, `unshaped` - on the
  emulated network: DDP, "auto" and "auto" without its quality guard
  (`controller={"quality_bound": None}`), whose plans do depend on the link.

A row's quality is accuracy (classifiers; within 1 point of DDP passes) or validation loss (the
char transformer; within 2 % passes). The table also gives each row's step time against DDP's
over the same links and unshaped, the bytes that crossed the emulated links per step (their
interface counters) and what "auto" ended on.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .runner import UNSHAPED_MBIT, Run, run_method, save_report

PRESETS = (
    "fp16", "bf16", "quant8", "quant4", "sign", "topk-10pct", "topk-1pct", "topk-0.1pct",
    "cocktail",
)  # fmt: skip
"""The fixed presets of the matrix (every per-step preset that compresses)."""

SCENARIOS = {"wan": (100.0, 80.0), "far": (50.0, 180.0), "unshaped": (None, 0.0)}
"""Scenario -> (Mbit/s of every region link, RTT ms); None: unshaped."""

NO_GUARD = json.dumps({"controller": {"quality_bound": None}})
STALE = json.dumps({"staleness": 1})
WAN_ROWS = {
    "ddp": ("DDP", "ddp", None),
    "auto": ('"auto"', "cloud-auto", None),
    "auto-noguard": ('"auto" without the guard', "cloud-auto", NO_GUARD),
}
"""The rows run on each scenario's emulated links."""


def passes(metric: str, quality: float, reference: float) -> bool:
    """Within 1 point of DDP's accuracy, or 2 % of its loss."""
    if metric == "accuracy":
        return quality >= reference - 0.01
    return quality <= 1.02 * reference


def _args(base: argparse.Namespace, workload: str, overrides: str | None) -> argparse.Namespace:
    args = argparse.Namespace(**vars(base))
    args.workload, args.overrides = workload, overrides
    return args


def _row(label: str, run: Run, metric: str, scenario: str) -> dict[str, Any]:
    return {
        "label": label,
        "scenario": scenario,
        "method": run.method,
        "quality": run.accuracy,
        "metric": metric,
        "step_ms": run.step_ms,
        "wan_bytes": run.wan_bytes,
        "plans": run.plans,
        "staleness": run.staleness,
        "curve": run.curve,
    }


def drive(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from . import netem
    from .workloads import WORKLOADS

    regions = ["us", "us", "eu", "eu"]
    presets = PRESETS if args.presets is None else tuple(args.presets)
    ok, why = netem.available()
    if args.scenarios and not ok:
        raise SystemExit(f"cloudtrain bench --quality: needs the emulated network ({why})")
    wan_rows = [WAN_ROWS[r] for r in args.wan_rows]
    runs = len(args.workloads) * (1 + len(presets) + 1 + len(wan_rows) * len(args.scenarios))
    rows: dict[str, list[dict[str, Any]]] = {w: [] for w in args.workloads}
    metrics: dict[str, str] = {}
    with tqdm(total=runs * args.steps, desc="quality", unit="step", mininterval=2.0) as progress:
        for workload in args.workloads:
            for label, method, overrides in [
                ("DDP", "ddp-loopback", None),
                *((preset, f"cloud-{preset}", None) for preset in presets),
                ("staleness 1 (no compression)", "cloud-none", STALE),
            ]:
                progress.set_postfix_str(f"{workload} {label}")
                run = run_method(method, _args(args, workload, overrides), None, regions, progress)
                metrics[workload] = run.metric
                rows[workload].append(_row(label, run, run.metric, "loopback"))
        for scenario in args.scenarios:
            mbit, rtt = SCENARIOS[scenario]
            rate = dict.fromkeys(("us", "eu"), mbit or UNSHAPED_MBIT)
            wan = netem.Emulator(
                {"us": 2, "eu": 2}, rate, rtt_ms=rtt, name=f"qual{os.getpid()}", down_mbit=rate
            ).up()
            try:
                for workload in args.workloads:
                    for label, method, overrides in wan_rows:
                        progress.set_postfix_str(f"{workload} {scenario} {label}")
                        run_args = _args(args, workload, overrides)
                        run = run_method(method, run_args, wan, regions, progress)
                        rows[workload].append(_row(label, run, run.metric, scenario))
            finally:
                wan.down()
    report = {
        "steps": args.steps,
        "counted_steps": args.steps
        - args.warmup,  # the emulated links' bytes are counted over these
        "scenarios": list(args.scenarios),
        "tables": {},
    }
    for workload, table in rows.items():
        reference = table[0]["quality"]
        unshaped = table[0]["step_ms"]
        shaped = {r["scenario"]: r["step_ms"] for r in table if r["label"] == "DDP"}
        for r in table:
            r["passes"] = passes(metrics[workload], r["quality"], reference)
            r["x_ddp_unshaped"] = r["step_ms"] / unshaped
            r["x_ddp_same_links"] = r["step_ms"] / shaped.get(r["scenario"], unshaped)
        report["tables"][workload] = {
            "about": WORKLOADS[workload].about,
            "metric": metrics[workload],
            "rows": table,
        }
    save_report(report, args.out, "bench-quality")
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"\ncloudtrain bench --quality: {report['steps']} steps; 2 regions x 2 ranks")
    for workload, table in report["tables"].items():
        metric = table["metric"]
        print(f"\n{workload}: {table['about']} ({metric})")
        print(
            f"  {'config':30} {'links':9} {metric:>9} {'vs DDP':>8} {'':4} {'step ms':>8} "
            f"{'x DDP same':>10} {'x DDP unsh.':>11} {'WAN MB/step':>11}  plan"
        )
        reference = table["rows"][0]["quality"]
        for r in table["rows"]:
            q = r["quality"]
            if metric == "accuracy":
                shown, delta = f"{100 * q:8.2f}%", f"{100 * (q - reference):+7.2f}"
            else:
                shown, delta = f"{q:9.4f}", f"{100 * (q / reference - 1):+7.2f}%"
            counted = report["counted_steps"]
            wan = "-" if r["wan_bytes"] is None else f"{r['wan_bytes'] / counted / 1e6:.3f}"
            plan = "" if not r["plans"] else "; ".join(map(str, r["plans"][-1][1]))
            print(
                f"  {r['label']:30} {r['scenario']:9} {shown:>9} {delta:>8} "
                f"{'ok' if r['passes'] else 'MISS':4} {r['step_ms']:8.1f} "
                f"{r['x_ddp_same_links']:10.2f} {r['x_ddp_unshaped']:11.2f} {wan:>11}  {plan}"
            )
    print(f"\nreport: {report['json']}")


def configure(parser: argparse.ArgumentParser) -> None:
    """The --quality options (the bench's --steps, --seed, --out, --warmup also apply)."""
    from .workloads import QUALITY, WORKLOADS

    parser.add_argument(
        "--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(QUALITY),
        help="with --quality: the workloads (default: the matrix's four)",
    )  # fmt: skip
    parser.add_argument(
        "--scenarios", nargs="*", choices=list(SCENARIOS), default=list(SCENARIOS),
        help="with --quality: the emulated links for auto (default: wan far unshaped; none: "
        "loopback rows only)",
    )  # fmt: skip
    parser.add_argument(
        "--presets", nargs="*", choices=PRESETS,
        help="with --quality: the fixed presets (default: all; none with an empty list)",
    )  # fmt: skip
    parser.add_argument(
        "--wan-rows", nargs="+", choices=list(WAN_ROWS), default=list(WAN_ROWS),
        help="with --quality: the rows run on each scenario's emulated links (default: all)",
    )  # fmt: skip
