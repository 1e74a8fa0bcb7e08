"""`cloudtrain bench`: the same training, side by side, over an emulated multi-region WAN.

    sudo cloudtrain bench                               # 2 regions x 2 ranks, 100 Mbit/s, 80 ms
    sudo cloudtrain bench --mbit 50 --rtt-ms 180        # slower and farther (us-asia)
    cloudtrain bench --scenario hetero|drop|unshaped    # the other measurements
    cloudtrain bench --steps 150 --json                 # machine-readable report on stdout
    sudo cloudtrain bench --estimates                   # the link estimates against TCP flows
    sudo cloudtrain bench --sharded                     # FSDP2 HSDP against cloudtrain's shards

Each method trains the same model on the same real data (scikit-learn's handwritten digits; an
MLP wide enough that its gradients are worth compressing) for the same steps with the same seed:
compute only (no gradient exchange at all, on loopback: the floor), plain DDP, PyTorch's fp16
hook, PyTorch's PowerSGD hook, CloudDDP "auto" and a fixed CloudDDP preset. With root every
method but compute only runs on the same `cloudtrain netem` links: two regions joined by
tbf-shaped links that also hold every frame for the round-trip time (netem, or the emulator's
userspace delay line where the kernel lacks netem); without root they run on loopback, and the
report says so. An emulator that fails to come up as root is an error, never a silent fall back
to loopback. Bytes that crossed the WAN come from the interface counters of the shaped links,
whatever the frameworks report, from the end of the warm-up to when every rank's collectives are
done (before any connection closes). The report's network line says which emulation was applied
("rate + delay (userspace delay line)", "rate + delay (netem)" or "rate only").

Scenarios (SCENARIOS; --mbit and --rtt-ms override a scenario's rate and RTT):
`wan` (both regions at 100 Mbit/s with 80 ms RTT, us-east to eu-west), `unshaped` (no shaping
and no delay: auto must choose no lossy compression and stay within 5% of DDP), `hetero` (one
region sends at 1000 Mbit/s, the other at 50; no delay unless --rtt-ms), `drop` (1000 Mbit/s,
falling to 50 at --drop-at while CloudDDP auto trains: how many steps until the step time is
back within 1.5x of compute only; at a global batch of 2048, so that the link before the drop
needs little compression and the one after it much; no delay unless --rtt-ms). hetero and drop
measure how the controller follows bandwidth; they keep 0 ms so that their figures stay
comparable with earlier runs and 1000 Mbit/s stays well inside what the delay line carries.

The ratio to compute only depends on how much compute a step has per gradient byte: this MLP at
batch 256 has little (a fixed ~40 ms of dense reduction inside regions on a 2-core machine is
several times its compute); `--batch 2048` gives each step about 6x the compute.

Prints a table (step time, ratio to compute only, WAN MB per step, final accuracy) with a
progress bar while it runs, and writes JSON and a PNG of accuracy against training time to
--out (default runs/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plan import Plan
from . import estimates, hetero, quality
from .runner import UNSHAPED_MBIT, Run, is_sharded, run_method, save_report, worker
from .workloads import WORKLOADS

METHODS = (
    "compute",
    "ddp-loopback",
    "ddp",
    "fp16",
    "powersgd",
    "cloud-auto",
    "cloud-topk-1pct",
    "cloud-diloco",
    "cloud-diloco-4bit",
)
SHARDED_METHODS = ("compute", "hsdp", "shard-auto", "shard-diloco-4bit")
"""`--sharded`: the transformer sharded with FSDP2 inside each region (runner.is_sharded)."""
LABELS = {
    "compute": "compute only (loopback)",
    "ddp-loopback": "DDP, unshaped (loopback)",
    "ddp": "DDP",
    "fp16": "DDP + fp16 hook",
    "powersgd": "DDP + PowerSGD hook",
    "cloud-auto": 'CloudDDP "auto"',
    "cloud-topk-1pct": 'CloudDDP "topk-1pct"',
    "cloud-diloco": 'CloudDDP "diloco" (outer loop)',
    "cloud-diloco-4bit": 'CloudDDP "diloco-4bit"',
    "hsdp": "FSDP2 HSDP (dense across regions)",
    "shard-auto": 'sharded "auto"',
    "shard-diloco-4bit": 'sharded "diloco-4bit"',
}


@dataclass(frozen=True)
class Scenario:
    """The emulated links of a scenario: per-region uplink/downlink Mbit/s and the RTT between
    the regions. `up` None: unshaped (no tbf, no delay)."""

    up: dict[str, float] | None
    down: dict[str, float] | None
    rtt_ms: float = 0.0


DROP_MBIT = 50.0
"""What the drop scenario's links fall to at --drop-at, every region's."""

SCENARIOS: dict[str, Scenario] = {
    "wan": Scenario({"us": 100.0, "eu": 100.0}, {"us": 100.0, "eu": 100.0}, 80.0),
    "unshaped": Scenario(None, None, 0.0),
    # us sends at 1 Gbit/s, eu at 50 Mbit/s; both receive at 1 Gbit/s
    "hetero": Scenario({"us": 1000.0, "eu": 50.0}, {"us": 1000.0, "eu": 1000.0}, 0.0),
    "drop": Scenario({"us": 1000.0, "eu": 1000.0}, {"us": 1000.0, "eu": 1000.0}, 0.0),
    "hetero-compute": Scenario({"us": 100.0, "eu": 100.0}, {"us": 100.0, "eu": 100.0}, 80.0),
}


def scenario_links(args: argparse.Namespace) -> Scenario:
    """The scenario's links with --mbit (both directions of every region) and --rtt-ms applied."""
    base = SCENARIOS[args.scenario]
    rtt = base.rtt_ms if args.rtt_ms is None else args.rtt_ms
    if base.up is None:
        if rtt:
            raise SystemExit("cloudtrain bench: --rtt-ms needs shaped links; use --scenario wan")
        return base
    if args.mbit is None:
        return Scenario(base.up, base.down, rtt)
    rates = dict.fromkeys(base.up, args.mbit)
    return Scenario(rates, dict(rates), rtt)


def bench_methods(args: argparse.Namespace) -> list[str]:
    """The rows a run measures: those --methods names (on the WAN scenarios, after DDP over
    unshaped links, which the targets compare with), or the scenario's own."""
    if args.sharded:
        return list(args.methods or SHARDED_METHODS)
    if args.scenario in ("hetero", "drop", "unshaped"):
        return list(args.methods or ("compute", "ddp", "cloud-auto"))
    methods = list(args.methods or METHODS)
    return methods if "ddp-loopback" in methods else ["ddp-loopback", *methods]


def _plot(runs: list[Run], path: Path, title: str, metric: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    scale = 100 if metric == "accuracy" else 1
    for run in runs:
        ts, accs = zip(*run.curve, strict=True)
        ax.plot(ts, [scale * a for a in accs], marker=".", label=LABELS.get(run.method, run.method))
    ax.set_xscale("log")
    ax.set_xlabel("training time per rank (s, log)")
    ax.set_ylabel("test accuracy (%)" if metric == "accuracy" else "held-out loss")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def drive(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from . import netem

    counts = dict(zip(("us", "eu"), args.ranks_per_region, strict=True))
    regions = [region for region, n in counts.items() for _ in range(n)]
    ok, why = netem.available()  # False only where the machine lacks root, ip/tc or tbf
    wan = None
    links = scenario_links(args)
    if ok:
        unshaped = dict.fromkeys(counts, UNSHAPED_MBIT)
        name = f"bench{os.getpid()}"  # unique among the benches running now
        wan = netem.Emulator(
            counts,
            links.up or unshaped,
            rtt_ms=links.rtt_ms,
            name=name,
            down_mbit=links.down or unshaped,
        ).up()
        network = (
            f"{_ranks_describe(counts)} in network namespaces, {netem_describe(links)}; "
            f"emulation: {wan.emulation} ({wan.emulation_note})"
        )
    else:
        network = f"loopback, no WAN shaping ({why}); the figures show overheads, not WAN savings"
    methods = bench_methods(args)
    runs: list[Run] = []
    try:
        if args.scenario == "hetero-compute":  # rows of their own (cloudtrain.tools.hetero)
            rows = args.hetero_rows or list(hetero.ROWS)
            with tqdm(total=args.steps * len(rows), desc="bench", unit="step") as progress:
                report = hetero.drive(args, regions, wan, progress)
            return _hetero_report(args, report, network)
        with tqdm(
            total=args.steps * len(methods), desc="bench", unit="step", mininterval=1.0
        ) as progress:
            for method in methods:
                progress.set_postfix_str(method)
                drop = None
                if args.scenario == "drop" and method != "compute" and wan is not None:
                    for region, rate in (links.up or {}).items():  # back to before the drop
                        wan.set_rate(region, rate)
                    drop = lambda: [wan.set_rate(r, DROP_MBIT) for r in links.up or {}]  # noqa: E731
                runs.append(run_method(method, args, wan, regions, progress, drop))
    finally:
        if wan is not None:
            wan.down()
    compute = next((r for r in runs if r.method == "compute"), None)
    baseline = next(
        (r for r in runs if r.method == ("ddp" if args.scenario == "unshaped" else "ddp-loopback")),
        None,
    )
    hsdp = next((r for r in runs if r.method == "hsdp"), None)
    rows = []
    for run in runs:
        row = {
            "method": run.method,
            "label": LABELS.get(run.method, run.method),
            "step_ms": run.step_ms,
            "mean_step_ms": _mean_ms(run, args.warmup),
            "x_compute": run.step_ms / compute.step_ms if compute else None,
            "x_ddp_unshaped": run.step_ms / baseline.step_ms if baseline else None,
            "staleness": run.staleness,
            "wan_mb_per_step": (
                run.wan_bytes / (args.steps - args.warmup) / 1e6
                if run.wan_bytes is not None
                else None
            ),
            "accuracy": run.accuracy,
            "plans": run.plans,
            "comm_ms_per_step": run.comm_ms,
            "controller_decisions": run.decisions,
            "curve": run.curve,
            "step_times_ms": [1000 * t for t in run.step_times],
            "memory": run.memory,
        }
        if hsdp is not None and run.method != "compute":
            row["x_hsdp"] = run.step_ms / hsdp.step_ms
            if run.wan_bytes and hsdp.wan_bytes:
                row["hsdp_wan_x"] = hsdp.wan_bytes / run.wan_bytes  # times fewer bytes than HSDP
        rows.append(row)
    report: dict[str, Any] = {
        "scenario": args.scenario,
        "network": network,
        "emulation": wan.emulation if wan is not None else "none (loopback)",
        "rtt_ms": links.rtt_ms if wan is not None else 0.0,
        "model": (
            f"MLP 64-{args.hidden}-{args.hidden}-10 on scikit-learn digits"
            if args.workload == "bench-mlp"
            else f"{args.workload}: {WORKLOADS[args.workload].about}"
        ),
        "steps": args.steps,
        "global_batch": runs[0].per_rank * len(regions) if runs else args.batch,
        "ranks": len(regions),
        "drop_at": args.drop_at if args.scenario == "drop" else None,
        "metric": runs[0].metric if runs else "accuracy",
        "rows": rows,
    }
    if args.scenario == "drop" and compute:
        report["drop"] = _recovery(rows, compute.step_ms, args.drop_at, args.warmup)
    if compute is not None:
        phases = [(0, links)]  # the links in force from a step on
        if args.scenario == "drop":
            fallen = dict.fromkeys(links.up or {}, DROP_MBIT)
            phases.append((args.drop_at, Scenario(fallen, dict(fallen), links.rtt_ms)))
        # a sharded outer row's ordinary step is an inner step: FSDP2's reductions inside the
        # region with the compute, which the sharded rows' predictions start from
        inner = next((r for r in runs if is_sharded(r.method) and r.outer_schedule), None)
        for row, run in zip(rows, runs, strict=True):
            base = inner if is_sharded(run.method) else baseline
            row["predicted_step_ms"], row["predicted_wan_mb_per_step"] = _predict_phases(
                run, compute, base, phases, wan, (args.steps, args.warmup)
            )
    name = f"bench-{'sharded-' if args.sharded else ''}{args.scenario}"
    stem = save_report(report, args.out, name).with_suffix("")
    title = f"{args.scenario}: {netem_describe(links) if wan is not None else 'loopback'}"
    if _plot(runs, stem.with_suffix(".png"), title, report["metric"]):
        report["plot"] = str(stem.with_suffix(".png"))
    return report


def _hetero_report(args: argparse.Namespace, report: dict[str, Any], network: str) -> dict:
    mlp = args.workload == "bench-mlp"  # (the other workloads have a global batch of their own)
    report.update(scenario=args.scenario, network=network, steps=args.steps,
                  global_batch=report["global_batch"] if mlp else "the workload's",
                  model=f"MLP 64-{args.hidden}-{args.hidden}-10 on digits" if mlp
                  else f"workload {args.workload}")  # fmt: skip
    save_report(report, args.out, f"bench-{args.scenario}")
    return report


def _sharded_per_step(run: Run) -> bool:
    """cloudtrain.fully_shard with a per-step exchange across regions (not HSDP, no outer loop)."""
    return is_sharded(run.method) and run.method != "hsdp" and run.outer_schedule is None


def _predict_phases(
    run: Run,
    compute: Run,
    ddp: Run | None,
    phases: list[tuple[int, Scenario]],
    wan: Any,
    counted: tuple[int, int],
) -> tuple[float | None, float | None]:
    """_predict over a run whose links change: each phase's (the links in force from a step
    on; the drop scenario's fall) over its counted steps, weighted by them."""
    steps, warmup = counted
    ends = [start for start, _ in phases[1:]] + [steps]
    parts = []
    for (start, links), end in zip(phases, ends, strict=True):
        begin = max(start, warmup)
        if end > begin:
            ms, mb = _predict(run, compute, ddp, links, wan, (end, begin))
            if ms is None or mb is None:
                return None, None
            parts.append((end - begin, ms, mb))
    counted_steps = sum(n for n, _, _ in parts)
    return (
        sum(n * ms for n, ms, _ in parts) / counted_steps,
        sum(n * mb for n, _, mb in parts) / counted_steps,
    )


def _predict(
    run: Run, compute: Run, ddp: Run | None, links: Scenario, wan: Any, counted: tuple[int, int]
) -> tuple[float | None, float | None]:
    """The planner's step time (ms) and WAN MB/step for this row (cloudtrain.forecast), from
    the measured compute step, the row's own measured dense in-region costs and the scenario's
    links; None where the model has no such mode (PowerSGD, the loopback rows). Every row's
    all-reduce goes over gloo, whose messages wait for their receivers (Setting.handshake).

    The planner predicts a step's mean (a run's time over its steps), so the prediction stands
    beside the counted steps' mean (`mean_step_ms`), not their median (`step_ms`): where plans
    differ severalfold in time, or the outer loop syncs one step in H, the median is an ordinary
    step's. Its inputs are means too: the compute row's and DDP's unshaped step. "auto" is
    predicted for each plan it ran, weighted by the counted steps each was in force, from the
    row's measured dense reduction in the regions and its codecs' CPU (encode, decode, the
    guard's statistics). zstd, where a plan had it on (the outer loop's always, unless the
    config says no), is counted at its ratio on normal values (Codecs.zstd_ratio). Left out:
    the wire's framing - headers, acknowledgements, gloo's preamble, about 0.8 KB a packet -
    which the emulator counts, and re-probes.

    The outer loop's inner step is DDP's inside a region: its base is DDP's unshaped step (the
    all-reduce overlapping backward as DDP overlaps it) where the bench ran it (`ddp`). Its syncs
    are those of the counted steps (`counted`: the run's steps and warm-up) and the run's last
    one (`finish_outer`), as the measurement counts them.

    A sharded row's compute is a sharded inner step - FSDP2's all-gathers and reduce-scatters
    inside the region are in no stage of their own - measured as the median step of the
    run's sharded outer row (`ddp`): HSDP adds its dense all-reduce across, the per-step rows
    their plans, predicted as "auto"'s (`sharded`: one that compresses nothing is HSDP's),
    and the outer row its syncs (its own median being its inner step). Without a sharded outer
    row in the run, HSDP and the outer row start from the compute row (FSDP2's reductions left
    out) and the per-step rows have no prediction."""
    from ..costs import LinkEstimate
    from ..forecast import Setting, predict_ddp, predict_outer, predict_rungs

    if wan is None or run.method in ("compute", "ddp-loopback", "powersgd"):
        return None, None
    sharded = _sharded_per_step(run)
    if sharded and ddp is None:
        return None, None  # FSDP2's reductions in the region: no sharded outer row measured them
    from_inner = is_sharded(run.method) and ddp is not None  # ddp: the sharded outer row
    shards, world = 2, 4
    up = links.up or dict.fromkeys(("us", "eu"), UNSHAPED_MBIT)
    per_owner = tuple(
        LinkEstimate(up[r] * 1e6 / 8 / shards, links.rtt_ms / 1000) for r in ("us", "eu")
    )
    stages = {k: v / 1000 for k, v in (run.comm_ms or {}).items()}
    compute_s = _mean_ms(compute, counted[1]) / 1000
    if from_inner:
        compute_s = ddp.step_ms / 1000  # the median: an inner step, not a sync's
    if run.method in ("ddp", "fp16", "hsdp"):
        setting = Setting(run.numel, world, per_owner, shards, compute_s, 0.0, handshake=True)
        hsdp = run.method == "hsdp"
        step, sent = predict_ddp(setting, 2 if run.method == "fp16" else 4, hsdp, run.units)
    elif run.outer_schedule is not None:
        h, rungs, *streaming = run.outer_schedule  # (a report without them: 1 fragment, 0)
        fragments, overlap = streaming or (1, 0)
        intra = stages.get("allreduce", 0.0)
        setting = Setting(run.numel, world, per_owner, shards, compute_s, intra, handshake=True)
        sends = [(r[0], _level(r[1])) for r in rungs]
        step, sent = predict_outer(setting, h, sends, fragments=fragments, overlap=overlap)
        steps, warmup = counted
        # syncs run / syncs per H (fragment 0's: with fragments at offsets, another fragment's
        # count in the window may differ by one)
        share = (steps // h - warmup // h + 1) * h / (steps - warmup)
        base = compute_s + intra if ddp is None or from_inner else _mean_ms(ddp, warmup) / 1000
        step = base + (step - setting.compute_s - intra) * share
        sent = [b * share for b in sent]
    else:
        sends = [(r[0], _level(r[1])) for r in run.sends or [["none", None]] * 2]
        # (step, senders, zstd by region; a report without the zstd: none)
        plans = [(p[0], p[1], p[2] if len(p) > 2 else ()) for p in run.plan_history or [(0, sends)]]
        # the stages are per step of the whole run; they ran in its compressed steps only
        total = len(run.step_times) or counted[0]
        ran = _spans([p[0] for p in plans], total, 0)
        packed = sum(n for n, p in zip(ran, plans, strict=True) if not _plan(p[1]).lossless)
        scale = total / packed if packed else 1.0
        reduce = scale * stages.get("intra_reduce", 0.0)
        # the gather moves back what the reduce moved; where it took longer, it was waiting for
        # the region's other owner's packet (an uplink two owners share unevenly), which the
        # exchange's model already counts
        intra = reduce + min(scale * stages.get("intra_gather", 0.0), reduce)
        cpu = scale * sum(stages.get(k, 0.0) for k in ("encode", "decode", "guard"))
        setting = Setting(run.numel, world, per_owner, shards, compute_s, intra, True, cpu)
        spans = _spans([p[0] for p in plans], *counted)
        predicted = [
            predict_rungs(setting, [(c, _level(lv)) for c, lv in p], sharded, zstd=z)
            for _, p, z in plans
        ]
        step = sum(n * t for n, (t, _) in zip(spans, predicted, strict=True)) / sum(spans)
        sent = [sum(n * sum(b) for n, (_, b) in zip(spans, predicted, strict=True)) / sum(spans)]
    return 1000 * step, sum(sent) / 1e6


def _ranks_describe(counts: dict[str, int]) -> str:
    """'2 regions x 2 ranks', or each region's ranks where they differ ('2 ranks in us, 1 rank
    in eu')."""

    def ranks(n: int) -> str:
        return f"{n} rank{'s' if n != 1 else ''}"

    if len(set(counts.values())) == 1:
        return f"{len(counts)} regions x {ranks(next(iter(counts.values())))}"
    return ", ".join(f"{ranks(n)} in {region}" for region, n in counts.items())


def _plan(senders: list) -> Plan:
    """A run's plan as reported, (codec, level) by region, as a Plan."""
    return Plan(tuple((codec, _level(level)) for codec, level in senders))


def _mean_ms(run: Run, warmup: int) -> float:
    """The mean of a run's counted steps (after `warmup`), ms: its time over its steps (its
    median where it carries no step times)."""
    times = run.step_times[warmup:] or run.step_times
    return 1000 * statistics.fmean(times) if times else run.step_ms


def _spans(starts: list[int], steps: int, warmup: int) -> list[int]:
    """How many of the counted steps (warm-up to the end) each plan was in force, for plans in
    force from `starts` (the first also stands for the steps before it)."""
    ends = [*starts[1:], steps]
    return [
        max(min(end, steps) - max(start if i else warmup, warmup), 0)
        for i, (start, end) in enumerate(zip(starts, ends, strict=True))
    ]


def _level(level: Any) -> Any:
    return tuple(level) if isinstance(level, list) else level


def netem_describe(links: Scenario) -> str:
    """The scenario's links in words: rates per region and the RTT between regions."""
    if links.up is None or links.down is None:
        return "links unshaped, no added delay"
    ups, downs = links.up, links.down
    rates = ", ".join(
        f"{r} {ups[r]:g} Mbit/s" if ups[r] == downs[r] else f"{r} {ups[r]:g} up/{downs[r]:g} down"
        for r in ups
    )
    return f"region links {rates}, {links.rtt_ms:g} ms RTT between regions"


def _recovery(
    rows: list[dict[str, Any]], compute_ms: float, drop_at: int, warmup: int
) -> dict[str, Any]:
    """How each method took the drop: step time before (median), the worst 5-step rolling
    median after, and the steps after the drop until the rolling median is back within 1.5x
    compute only (the target) and within 1.2x of its own time before the drop."""
    out = {}
    for row in rows:
        if row["method"] == "compute":
            continue
        times = row["step_times_ms"]
        before = statistics.median(times[warmup:drop_at]) if drop_at > warmup else None
        rolling = [statistics.median(times[s : s + 5]) for s in range(drop_at, len(times) - 4)]
        out[row["method"]] = {
            "before_ms": before,
            "worst_after_ms": max(rolling) if rolling else None,
            "steps_to_1.5x_compute": next(
                (k for k, t in enumerate(rolling) if t <= 1.5 * compute_ms), None
            ),
            "steps_to_1.2x_before": next(
                (k for k, t in enumerate(rolling) if before and t <= 1.2 * before), None
            ),
        }
    return out


def print_table(report: dict[str, Any]) -> None:
    metric = report.get("metric", "accuracy")  # "loss" for the transformers
    print(f"\ncloudtrain bench - scenario {report['scenario']}: {report['network']}")
    print(
        f"{report['model']}, {report['ranks']} ranks, global batch {report['global_batch']}, {report['steps']} steps"
    )
    print(
        f"{'method':31} {'step ms':>8} {'x compute':>9} {'x DDP unshaped':>14} "
        f"{'WAN MB/step':>11} {'staleness':>9} {metric:>8} {'mean ms':>8} {'predicted: ms':>13} "
        f"{'MB/step':>8}"
    )
    for row in report["rows"]:
        ratio = f"{row['x_compute']:9.2f}" if row["x_compute"] is not None else f"{'':>9}"
        versus = row.get("x_ddp_unshaped")
        versus = f"{versus:14.2f}" if versus is not None else f"{'':>14}"
        stale = row.get("staleness")
        stale = "-" if not stale else ",".join(map(str, stale))
        wan = (
            f"{row['wan_mb_per_step']:11.3f}"
            if row["wan_mb_per_step"] is not None
            else f"{'-':>11}"
        )
        pred_ms, pred_mb = row.get("predicted_step_ms"), row.get("predicted_wan_mb_per_step")
        predicted = f" {row['mean_step_ms']:8.1f}" if "mean_step_ms" in row else ""
        predicted += "" if pred_ms is None else f" {pred_ms:13.1f} {pred_mb:8.3f}"
        print(
            f"{row['label']:31} {row['step_ms']:8.1f} {ratio} {versus} {wan} {stale:>9} "
            + (
                f"{100 * row['accuracy']:7.2f}%"
                if metric == "accuracy"
                else f"{row['accuracy']:8.4f}"
            )
            + predicted
        )
    for row in report["rows"]:
        if row.get("comm_ms_per_step"):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in row["comm_ms_per_step"].items())
            print(f"  {row['label']} communication thread, ms/step on rank 0: {parts}")
        if row.get("plans"):
            print(
                f"  {row['label']} levels: "
                + "; ".join(f"decided at step {s}: {lv}" for s, lv in row["plans"][-4:])
            )
    if "drop" in report:
        for method, info in report["drop"].items():
            print(
                f"  drop at step {report['drop_at']}, {method}: {info['before_ms']:.0f} ms/step "
                f"before, worst {info['worst_after_ms']:.0f} after; back within 1.5x compute only "
                f"after {info['steps_to_1.5x_compute']} steps, within 1.2x of before after "
                f"{info['steps_to_1.2x_before']} steps (None: not within the run)"
            )
    print(
        f"report: {report.get('json')}" + (f", plot: {report['plot']}" if "plot" in report else "")
    )


def print_sharded_table(report: dict[str, Any]) -> None:
    """The sharded rows (--sharded): step time against HSDP's, WAN bytes and how many times
    fewer than HSDP's, rank 0's tensor memory and peak RSS, and the final loss."""
    print(f"\ncloudtrain bench --sharded - scenario {report['scenario']}: {report['network']}")
    print(f"{report['model']}, {report['ranks']} ranks, {report['steps']} steps")
    print(
        f"{'method':36} {'step ms':>8} {'x HSDP':>7} {'WAN MB/step':>11} {'x fewer':>8} "
        f"{'held MB':>8} {'peak RSS MB':>11} {'loss':>7} {'mean ms':>8} {'predicted: ms':>13} "
        f"{'MB/step':>8}"
    )
    for row in report["rows"]:
        x = row.get("x_hsdp")
        fewer, wan = row.get("hsdp_wan_x"), row["wan_mb_per_step"]
        held = (row.get("memory") or {}).get("total")
        rss = (row.get("memory") or {}).get("peak_rss")
        pred_ms, pred_mb = row.get("predicted_step_ms"), row.get("predicted_wan_mb_per_step")
        print(
            f"{row['label']:36} {row['step_ms']:8.1f} "
            + (f"{x:7.2f} " if x is not None else f"{'':7} ")
            + (f"{wan:11.3f} " if wan is not None else f"{'-':>11} ")
            + (f"{fewer:8.0f} " if fewer is not None else f"{'':8} ")
            + (f"{held / 1e6:8.1f} " if held else f"{'':8} ")
            + (f"{rss / 1e6:11.0f} " if rss else f"{'':11} ")
            + f"{row['accuracy']:7.4f}"
            + (f" {row['mean_step_ms']:8.1f}" if "mean_step_ms" in row else "")
            + ("" if pred_ms is None else f" {pred_ms:13.1f} {pred_mb:8.3f}")
        )
    for row in report["rows"]:
        if row.get("plans"):
            last = "; ".join(f"step {s}: {lv}" for s, lv in row["plans"][-3:])
            print(f"  {row['label']} plans: {last}")
    print(f"report: {report.get('json')}")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="wan")
    parser.add_argument(
        "--mbit", type=float, help="rate of every region link (default: the scenario's; wan 100)"
    )
    parser.add_argument(
        "--rtt-ms",
        type=float,
        help="RTT between regions (default: the scenario's; wan 80, the others 0)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=dict.fromkeys(METHODS + SHARDED_METHODS),
        help="a subset of the methods",
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="the sharded rows instead: a transformer (charlm-wide) sharded with FSDP2 inside each "
        "region - torch's HSDP with its dense all-reduce across regions, cloudtrain.fully_shard "
        '"auto" and "diloco-4bit" - with step time, WAN bytes, memory per rank and loss',
    )
    parser.add_argument(
        "--ranks-per-region",
        nargs=2,
        type=int,
        default=[2, 2],
        metavar=("US", "EU"),
        help="ranks in region us and in region eu (default 2 2; other than 2 2 with --scenario "
        "hetero-compute only, e.g. 1 1: one rank a region, or 2 1: region eu with half the GPUs)",
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the step time")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument(
        "--batch",
        type=int,
        help="global batch (default 256; 2048 for drop, enough compute per step that 1 Gbit/s "
        "needs little compression and the drop to 50 needs much)",
    )
    parser.add_argument(
        "--lr", type=float, help="learning rate (default: the workload's own; the bench's MLP 0.05)"
    )
    parser.add_argument(
        "--momentum", type=float, help="SGD momentum of the MLP workloads (default: theirs, 0.9)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--drop-at", type=int, default=60, help="step of the drop (scenario drop)")
    parser.add_argument("--out", default="runs", help="folder for the JSON report and the plot")
    parser.add_argument(
        "--json", action="store_true", help="print the JSON report instead of a table"
    )
    parser.add_argument(
        "--quality",
        action="store_true",
        help="the quality matrix instead: auto and every preset against DDP on several workloads "
        "(cloudtrain.tools.quality)",
    )
    parser.add_argument(
        "--estimates",
        action="store_true",
        help="the link estimates instead: auto's estimate of each link against one TCP flow, on "
        "a grid of rates and round trips (cloudtrain.tools.estimates)",
    )
    quality.configure(parser)
    estimates.configure(parser)
    hetero.configure(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)  # METHODS, or cloud-<any preset>
    parser.add_argument(
        "--workload",
        default="bench-mlp",
        choices=sorted(WORKLOADS),
        help="the model every row trains (default: the bench's MLP; with --sharded: charlm-wide)",
    )
    parser.add_argument("--overrides", help=argparse.SUPPRESS)  # CompressionConfig fields, JSON


def run(args: argparse.Namespace) -> int:
    if args.batch is None:
        args.batch = 2048 if args.scenario in ("drop", "hetero-compute") else 256
    if args.sharded and not args.worker:
        if args.workload == "bench-mlp":
            args.workload = "charlm-wide"
        if args.scenario not in ("wan", "unshaped"):
            raise SystemExit("cloudtrain bench --sharded: --scenario wan or unshaped")
    if args.sample_ms is None:
        args.sample_ms = hetero.SAMPLE_MS if args.scenario == "hetero-compute" else 0.0
    if args.worker:
        return worker(args)
    if args.ranks_per_region != [2, 2] and args.scenario != "hetero-compute":
        raise SystemExit(
            f"--ranks-per-region {' '.join(map(str, args.ranks_per_region))}: only with --scenario "
            "hetero-compute (the other scenarios' predictions and tables are for 2 regions x 2 "
            "ranks); leave it out, or add --scenario hetero-compute"
        )
    if min(args.ranks_per_region) < 1:
        raise SystemExit("--ranks-per-region: every region needs at least 1 rank, e.g. 2 1")
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be below --steps {args.steps}")
    if args.scenario == "drop" and not args.warmup < args.drop_at <= args.steps - 5:
        later = args.drop_at if args.drop_at > args.warmup else args.warmup + 1
        hint = "" if later == args.drop_at else f"--drop-at {later} "
        raise SystemExit(
            f"--scenario drop: --drop-at {args.drop_at} must be after --warmup {args.warmup} and "
            f"at least 5 steps before --steps {args.steps} (the recovery is timed over 5-step "
            f"windows after it): e.g. {hint}--steps {max(args.steps, later + 40)}"
        )
    tool = quality if args.quality else estimates if args.estimates else None
    report = tool.drive(args) if tool is not None else drive(args)
    if args.json:
        print(json.dumps(report))
    elif tool is not None:
        tool.print_table(report)
    elif args.scenario == "hetero-compute":
        print(f"\ncloudtrain bench - scenario hetero-compute: {report['network']}")
        print(f"{report['model']}, global batch {report['global_batch']}, {report['steps']} steps")
        hetero.print_table(report)
        print(f"report: {report['json']}")
    elif args.sharded:
        print_sharded_table(report)
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="cloudtrain bench", description=__doc__.split("\n\n")[0])
    configure(p)
    sys.exit(run(p.parse_args()))
