"""`cloudtrain bench --estimates`: does the controller's estimate of each link track the link?

    sudo cloudtrain bench --estimates                          # 50/200/1000 Mbit/s x 0/80/180 ms
    sudo cloudtrain bench --estimates --est-mbit 200 --est-rtt-ms 80 --steps 100

For every rate and round trip of the grid, on the emulated network (2 regions x 2 ranks, both
directions of each region's link at the rate): first one TCP flow each way between the regions
(`Emulator.measure_mbit`, what a single connection carries there once out of its start: the link as
a transfer sees it; FLOW_RTTS), then per-step "auto" for --steps steps of the bench's MLP. The table
gives, by region, the controller's estimate of the link at the end (`stats().controller["links"]`:
one sender's share times the region's senders, its shard owners, which send at once) against that
flow, its round trip against the one asked, the plan "auto" ended on (`stats().controller["plan"]`)
against the rung the cost model picks for the link as it is (`Controller.plan_for_links`: the flow's
rate shared by the region's senders, the asked round trip, everything else as measured) - afresh,
and where decisions from the plan in force would settle on that link (hysteresis keeps a rung whose
neighbour is not clearly better, so a plan on the edge between two rungs is kept rather than
missed), and the seconds from CloudDDP's construction to the end of its first step. A link is
tracked when its estimate is within 25 % of the flow's rate. Beside it, the region's two shard
owners each run a flow at once to their counterparts (`Emulator.measure_flows`), summed: where one
flow is held back by its own window (a send buffer under the link's bandwidth-delay product), that
is what the region's senders carry, and the estimate is of them. These two are timed from each one's
first byte, their starts in them: the senders start a process launch apart, and windows that each
left out their own start would count the later sender alone at the end of its window over more of
the sum (two flows read 210.7-213 Mbit/s through 200 Mbit/s so). Where a start takes long (1000
Mbit/s at 180 ms: 776-781 Mbit/s from the first byte, 992 once out of it) the two together read less
than the one alone.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .runner import run_method, save_report

GRID_MBIT = (50.0, 200.0, 1000.0)
GRID_RTT_MS = (0.0, 80.0, 180.0)
TOLERANCE = 0.25
"""An estimate within this share of one TCP flow's rate tracks the link."""
FLOW_SECONDS = 3.0
FLOW_RTTS = 30
"""Each TCP flow runs FLOW_RTTS round trips and FLOW_SECONDS; the one flow alone has its rate
from the FLOW_SECONDS after those round trips: what a connection carries once out of its start.
Slow start takes 6-8 round trips to fill the links with 4 MiB buffers; with WAN buffers
(cloudtrain.tcp) a flow through 1000 Mbit/s at 180 ms averaged 779 Mbit/s over its first 8.4 s
and 875 over 20 s."""
REGIONS = ("us", "eu")


def _measure(args: argparse.Namespace, mbit: float, rtt_ms: float, progress: Any) -> list[dict]:
    """One grid point: the flows, then "auto"; a row per region."""
    from . import netem

    rate = dict.fromkeys(REGIONS, mbit)
    try:
        wan = netem.Emulator(
            {r: 2 for r in REGIONS}, rate, rtt_ms=rtt_ms, name=f"est{os.getpid()}", down_mbit=rate
        ).up()
    except netem.EmulatorError as e:  # e.g. a rate the delay line cannot carry on this machine
        return [{"mbit": mbit, "rtt_ms": rtt_ms, "region": r, "error": str(e)} for r in REGIONS]
    try:
        # region us is ranks 0-1, eu 2-3: a region's estimate is of its packets to the other
        start = FLOW_RTTS * rtt_ms / 1000
        seconds = FLOW_SECONDS + start
        flow = {
            "us": wan.measure_mbit(0, 2, seconds, skip_s=start),
            "eu": wan.measure_mbit(2, 0, seconds, skip_s=start),
        }
        # and one flow per shard owner at once, as the region's owners send (from their first
        # bytes: module docstring)
        flows = {
            "us": sum(wan.measure_flows([(0, 2), (1, 3)], seconds)),
            "eu": sum(wan.measure_flows([(2, 0), (3, 1)], seconds)),
        }
        run_args = argparse.Namespace(**vars(args))
        run_args.workload, run_args.overrides = "bench-mlp", None
        run_args.true_link = json.dumps({r: [flow[r], rtt_ms] for r in REGIONS})
        run = run_method("cloud-auto", run_args, wan, ["us", "us", "eu", "eu"], progress)
    finally:
        wan.down()
    rows = []
    for region in REGIONS:
        link = (run.links or {}).get(region, {})
        share = link.get("bandwidth_mbit")  # one shard owner's: the region's send at once
        estimate = None if share is None else share * link["senders"]
        ratio = None if estimate is None or not flow[region] else estimate / flow[region]
        together = None if estimate is None or not flows[region] else estimate / flows[region]
        plan = (run.plan_by_region or {}).get(region)
        rung = None if plan is None else plan.removesuffix(" + zstd")  # zstd: the link's choice
        true_plan = (run.true_link_plan or {}).get(region)
        settled = (run.true_link_settled or {}).get(region)
        rows.append({
            "mbit": mbit, "rtt_ms": rtt_ms, "region": region, "flow_mbit": flow[region],
            "estimate_mbit": estimate, "ratio": ratio,
            "tracks": ratio is not None and abs(ratio - 1) <= TOLERANCE,
            "flows_mbit": flows[region], "ratio_flows": together,
            "tracks_flows": together is not None and abs(together - 1) <= TOLERANCE,
            "rtt_estimate_ms": link.get("rtt_ms"), "plan": plan, "true_link_plan": true_plan,
            "true_link_settled": settled, "same_rung": rung is not None and rung == true_plan,
            "kept_rung": rung is not None and rung == settled,
            "ready_s": run.ready_s, "step_ms": run.step_ms,
        })  # fmt: skip
    return rows


def drive(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from . import netem

    ok, why = netem.available()
    if not ok:
        raise SystemExit(f"cloudtrain bench --estimates: needs the emulated network ({why})")
    grid = [(m, r) for m in args.est_mbit for r in args.est_rtt_ms]
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(grid) * args.steps, desc="estimates", unit="step", mininterval=2.0) as bar:
        for mbit, rtt in grid:
            bar.set_postfix_str(f"{mbit:g} Mbit/s, {rtt:g} ms")
            rows += _measure(args, mbit, rtt, bar)
    report = {"steps": args.steps, "tolerance": TOLERANCE, "rows": rows}
    save_report(report, args.out, "bench-estimates")
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f'\ncloudtrain bench --estimates: per-step "auto", {report["steps"]} steps of the bench\'s '
        "MLP, 2 regions x 2 ranks; estimates at the end against one TCP flow, and against the "
        "region's two senders' flows at once"
    )
    print(
        f"  {'Mbit/s':>6} {'RTT':>4} {'region':6} {'TCP flow':>8} {'estimate':>8} {'ratio':>6} "
        f"{'':6} {'2 flows':>7} {'ratio':>6} {'':6} {'RTT est':>7} {'ready s':>7}  "
        "plan (cost model on the true link)"
    )
    for r in report["rows"]:
        if "error" in r:
            print(f"  {r['mbit']:6g} {r['rtt_ms']:4g} {r['region']:6} not emulated: {r['error']}")
            continue
        est = "-" if r["estimate_mbit"] is None else f"{r['estimate_mbit']:8.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:6.2f}"
        rtt = "-" if r["rtt_estimate_ms"] is None else f"{r['rtt_estimate_ms']:7.1f}"
        both = "-" if r["ratio_flows"] is None else f"{r['ratio_flows']:6.2f}"
        print(
            f"  {r['mbit']:6g} {r['rtt_ms']:4g} {r['region']:6} {r['flow_mbit']:8.1f} {est:>8} "
            f"{ratio:>6} {'ok' if r['tracks'] else 'MISS':6} {r['flows_mbit']:7.1f} {both:>6} "
            f"{'ok' if r['tracks_flows'] else 'MISS':6} {rtt:>7} {r['ready_s']:7.1f}  "
            f"{r['plan']} ({_against_true_link(r)})"
        )
    print(f"\nreport: {report['json']}")


def _against_true_link(row: dict[str, Any]) -> str:
    """The plan in force against the true link's: the same rung as the cost model's pick
    afresh; else kept - where decisions from it on the true link would stay (hysteresis keeps
    a rung whose neighbour is not clearly better: a pick on the edge between two); else the
    rungs those would go to, and the pick afresh."""
    if row["same_rung"]:
        return "the same"
    if row.get("kept_rung"):
        return f"kept on the true link; afresh {row['true_link_plan']}"
    settled, afresh = row.get("true_link_settled"), row["true_link_plan"]
    return f"MISS: the true link settles on {settled}, afresh {afresh}"


def configure(parser: argparse.ArgumentParser) -> None:
    """The --estimates options (the bench's --steps, --warmup, --out, --seed also apply)."""
    parser.add_argument(
        "--est-mbit", nargs="+", type=float, default=list(GRID_MBIT),
        help="with --estimates: the link rates of the grid (default 50 200 1000)",
    )  # fmt: skip
    parser.add_argument(
        "--est-rtt-ms", nargs="+", type=float, default=list(GRID_RTT_MS),
        help="with --estimates: the round trips of the grid (default 0 80 180)",
    )  # fmt: skip
    parser.add_argument("--true-link", help=argparse.SUPPRESS)  # JSON: the link as it is
