"""Codec and native-op throughput, measured side by side in one run (a benchmark, not a test).

    python -m cloudtrain.compress.bench [--sizes 1000000 25000000] [--json]
    python -m cloudtrain.compress.bench --sizes 25000000 --skip-codecs --json   # the ops only
    python -m cloudtrain.compress.bench --device cuda --sizes 100000000 --skip-codecs --json
    python -m cloudtrain.compress.bench --skip-codecs --skip-ops --gradients grads.pt  # zstd only

Codecs (CPU): encode, encode with error feedback, and decode throughput in GB/s of fp32 input,
and the compression ratio (input bytes / wire bytes), with the baselines the numbers mean
something against: a plain memory copy of the same tensor and `torch.topk` of |x| at 1% and 0.1%.

Ops (on --device): each native op of compress/ops.py (`torch.ops.cloudtrain.*`) beside its
reference in reference.py, on the same input, with an fp32 residual where the op has one. Per op:
seconds native and reference, `speedup` (reference / native), and two bandwidth ratios against
the copy `dst.copy_(x)` of the same n fp32 elements measured in the same run:
- `input_vs_copy` = t(copy) / t(op): GB/s of fp32 input, the op's against the copy's (strict:
  the copy moves 8 bytes per element, a fused op with residual 12 or more);
- `traffic_vs_copy` = (bytes the op must move / t(op)) / (8 n / t(copy)): its effective memory
  bandwidth as a fraction of the copy's (`traffic` says which bytes: reads + writes).
`targets` lists the native kernels' performance goals with the measured value and whether each
is met.

zstd gain per codec (`zstd`): for each rung of the controller's ladder (ladders.LADDER) and zstd
levels 1 and 3, `zstd.zstd_gain` on a sample gradient - the wire ratio without/with the zstd stage,
its CPU cost in ns per byte (compress on the sender, decompress per receiver), and the link
speed below which the stage pays (`pays_below_mbit`: saved link time = CPU time, one receiver).
The sample is heavy-tailed synthetic noise, or real gradients saved with torch.save (a tensor, or
a list or dict of tensors, flattened and joined) given with --gradients; e.g. the digits MLP's:

    python -c "import torch; from cloudtrain.tools.data import digits, digits_mlp
    x, y, *_ = digits(); m = digits_mlp(); torch.nn.functional.cross_entropy(m(x), y).backward()
    torch.save([p.grad for p in m.parameters()], 'grads.pt')"
 Each figure is the median of several timed repetitions after a warm-up (CUDA: synchronised).
Machines are shared and noisy: compare ratios within one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from . import ops, reference
from .codecs import parse_spec
from .feedback import ErrorFeedback
from .ladders import LADDER, rung_spec
from .rng import RandomKey
from .zstd import zstd_gain

CORE_CASES = [
    "none",
    "fp16",
    "bf16",
    "quant:8",
    "quant:4",
    "quant:2",
    "sign",
    "topk:0.01",
]
"""Every built-in dense codec at each of its levels, and top-k at 1 %: what every sweep over the
codecs starts with (this bench's, and tests/test_fuzz.py's, which adds its edge cases)."""

CASES = [
    *CORE_CASES,
    "topk:0.001",
    "randomk:0.01",
    "topk:0.01>quant:8",
    "randomk:0.1>topk:0.1>quant:4",
]
"""The codec table's specs (--cases)."""

ZSTD_CASES = [rung_spec(rung) for rung in LADDER]
"""The zstd table's specs: the controller's ladder, where zstd might be switched on."""

ZSTD_LEVELS = (1, 3)


def timeit(fn: Callable[[], object], min_reps: int = 3, budget_s: float = 1.0) -> float:
    """Median seconds per call: one warm-up, then at least min_reps calls or budget_s seconds."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_size(n: int, cases: list[str], budget_s: float) -> list[dict]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * torch.rand(n) ** 3
    nbytes = x.numel() * x.element_size()
    rows = []
    dst = torch.empty_like(x)
    rows.append(
        {
            "n": n,
            "case": "memcpy",
            "encode_gbps": gbps(nbytes, timeit(lambda: dst.copy_(x), budget_s=budget_s)),
        }
    )
    for density in (0.01, 0.001):
        k = max(1, int(density * n))
        t = timeit(lambda k=k: torch.topk(x.abs(), k, sorted=False), budget_s=budget_s)
        rows.append({"n": n, "case": f"torch.topk:{density}", "encode_gbps": gbps(nbytes, t)})
    for spec in cases:
        codec, level = parse_spec(spec)
        key = RandomKey(seed=1, step=1, bucket=0, rank=0)
        packet = codec.encode(x, level, key)
        ef = ErrorFeedback()
        t_enc = timeit(lambda c=codec, lv=level, k=key: c.encode(x, lv, k), budget_s=budget_s)
        t_ef = timeit(
            lambda c=codec, lv=level, e=ef, k=key: e.encode(0, x, c, lv, k), budget_s=budget_s
        )
        t_dec = timeit(lambda c=codec, p=packet: c.decode(p), budget_s=budget_s)
        rows.append(
            {
                "n": n,
                "case": spec,
                "codec": codec.name,
                "encode_gbps": gbps(nbytes, t_enc),
                "encode_ef_gbps": gbps(nbytes, t_ef),
                "decode_gbps": gbps(nbytes, t_dec),
                "ratio": nbytes / codec.nbytes(n, level),
            }
        )
    return rows


def load_gradients(path: str) -> torch.Tensor:
    """A tensor, or a list / dict of tensors, saved with torch.save: one flat fp32 tensor."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(saved, dict):
        saved = list(saved.values())
    tensors = saved if isinstance(saved, (list, tuple)) else [saved]
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"{path}: expected a tensor or a list or dict of tensors")
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def bench_zstd(sample: torch.Tensor, cases: list[str], repeats: int = 5) -> list[dict]:
    """zstd gain per codec and zstd level on `sample` (see the module docstring)."""
    rows = []
    for spec in cases:
        codec, level = parse_spec(spec)
        for zstd_level in ZSTD_LEVELS:
            gain = zstd_gain(codec, level, sample, zstd_level, repeats=repeats)
            rows.append(
                {
                    "n": sample.numel(),
                    "case": spec,
                    "zstd_level": zstd_level,
                    "ratio": gain.ratio,
                    "encode_ns_per_byte": gain.encode_s_per_byte * 1e9,
                    "decode_ns_per_byte": gain.decode_s_per_byte * 1e9,
                    "pays_below_mbit": gain.pays_below() * 8 / 1e6,
                }
            )
    return rows


# The native kernels' performance goals: (device type, goal, case, field, at least). Bandwidth
# is bytes moved (read + written) per second, the op's `traffic` against the copy's 8 per element.
TARGETS = [
    ("cpu", "ef_topk_select 1% >= 5x its torch.topk reference", "ef_topk_select:0.01", "speedup", 5),
    ("cpu", "ef_quantize 8-bit stochastic >= 50% memcpy bandwidth", "ef_quantize:8:stochastic",
     "traffic_vs_copy", 0.5),
    ("cpu", "ef_quantize 8-bit nearest >= 50% memcpy bandwidth", "ef_quantize:8:nearest",
     "traffic_vs_copy", 0.5),
    ("cuda", "ef_topk_select 0.1% >= 10x torch.topk", "ef_topk_select:0.001", "vs_torch_topk", 10),
    ("cuda", "ef_topk_select 0.1% >= 50% copy bandwidth", "ef_topk_select:0.001",
     "traffic_vs_copy", 0.5),
    ("cuda", "ef_topk_select 1% >= 50% copy bandwidth", "ef_topk_select:0.01", "traffic_vs_copy",
     0.5),
    ("cuda", "ef_quantize 8-bit stochastic >= 50% copy bandwidth", "ef_quantize:8:stochastic",
     "traffic_vs_copy", 0.5),
    ("cuda", "ef_quantize 8-bit nearest >= 50% copy bandwidth", "ef_quantize:8:nearest",
     "traffic_vs_copy", 0.5),
    ("cuda", "dequantize_accumulate >= 50% copy bandwidth", "dequantize_accumulate:4x8bit",
     "traffic_vs_copy", 0.5),
]  # fmt: skip


def bench_ops(n: int, device: torch.device, budget_s: float) -> tuple[list[dict], list[dict]]:
    """Native ops beside their references on n fp32 elements. Returns (rows, targets)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def seconds(fn: Callable[[], object], min_reps: int = 3) -> float:
        def run() -> None:
            fn()
            sync()

        return timeit(run, min_reps=min_reps, budget_s=budget_s)

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 3).to(device)
    dst = torch.empty_like(x)
    t_copy = seconds(lambda: dst.copy_(x))
    rows = [{"n": n, "device": device.type, "case": "copy", "seconds": t_copy, "traffic": "8n"}]
    t_topk = {}
    for density in (0.01, 0.001):
        k = max(1, int(density * n))
        t_topk[density] = seconds(lambda k=k: torch.topk(x.abs(), k, sorted=False))
        rows.append(
            {
                "n": n,
                "device": device.type,
                "case": f"torch.topk:{density}",
                "seconds": t_topk[density],
            }
        )
    native = {op for op, dev in ops.KERNELS if dev == device.type}
    cl = torch.ops.cloudtrain if native else None

    def row(case: str, op: str, traffic: int, traffic_doc: str, run_native, run_reference) -> dict:
        r = {"n": n, "device": device.type, "case": case, "traffic": traffic_doc}
        r["reference_seconds"] = seconds(run_reference, min_reps=2)
        if op in native:
            t = r["native_seconds"] = seconds(run_native)
            r["speedup"] = r["reference_seconds"] / t
            r["input_vs_copy"] = t_copy / t
            r["traffic_vs_copy"] = (traffic / t) / (8 * n / t_copy)
        rows.append(r)
        return r

    res_native, res_ref = torch.zeros_like(x), torch.zeros_like(x)
    for density in (0.01, 0.001):
        k = max(1, int(density * n))
        r = row(
            f"ef_topk_select:{density}",
            "ef_topk_select",
            12 * n,
            "12n: grad, residual in and out",
            lambda k=k: cl.ef_topk_select(x, res_native, k, False),
            lambda k=k: reference.ef_topk_select(x, res_ref, k, False),
        )
        if "native_seconds" in r:
            r["vs_torch_topk"] = t_topk[density] / r["native_seconds"]
    key = RandomKey(seed=1, step=1)
    for bits, stochastic in ((8, True), (8, False), (4, True), (1, False)):
        rounding = "stochastic" if stochastic else "nearest"
        row(
            f"ef_quantize:{bits}:{rounding}",
            "ef_quantize",
            12 * n + n * bits // 8,
            f"12n + {bits}n/8: grad, residual in and out, codes",
            lambda b=bits, s=stochastic: cl.ef_quantize(
                x, res_native, b, 512, s, key.private_seed()
            ),
            lambda b=bits, s=stochastic: reference.ef_quantize(
                x, res_ref, b, 512, s, key.private(device) if s else None
            ),
        )
    packets = [reference.ef_quantize(x * (i + 1), None, 8, 512, False) for i in range(4)]
    out = torch.zeros_like(x)
    row(
        "dequantize_accumulate:4x8bit",
        "dequantize_accumulate",
        8 * n + 4 * n,
        "8n + 4n: out in and out, 4 packets of 1 byte per element",
        lambda: cl.dequantize_accumulate(
            out, [p[0] for p in packets], [p[1] for p in packets], [p[2] for p in packets],
            [8] * 4, 512,
        ),
        lambda: reference.dequantize_accumulate(out, packets, [8] * 4, 512),
    )  # fmt: skip
    k = max(1, n // 100)
    pairs = [
        (torch.randperm(n, generator=gen)[:k].sort().values.to(device), x[:k] * (i + 1))
        for i in range(4)
    ]
    row(
        "sparse_accumulate:4x0.01",
        "sparse_accumulate",
        4 * k * 16,
        "16 bytes per sent value: index, value, out in and out",
        lambda: cl.sparse_accumulate(out, [p[0] for p in pairs], [p[1] for p in pairs]),
        lambda: reference.sparse_accumulate(out, pairs),
    )

    by_case = {r["case"]: r for r in rows}
    targets = []
    for device_type, name, case, field, goal in TARGETS:
        if device_type == device.type:
            value = by_case[case].get(field)
            met = value is not None and value >= goal
            targets.append({"target": name, "value": value, "goal": goal, "met": met})
    return rows, targets


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument(
        "--cases", nargs="+", default=CASES, help="codec specs, e.g. topk:0.01 quant:4"
    )
    parser.add_argument(
        "--budget", type=float, default=1.0, help="seconds of repetitions per figure"
    )
    parser.add_argument("--device", default="cpu", help="device of the ops benchmark (cpu, cuda)")
    parser.add_argument("--skip-codecs", action="store_true", help="only the native ops")
    parser.add_argument("--skip-ops", action="store_true", help="only the codecs")
    parser.add_argument("--skip-zstd", action="store_true", help="no zstd gain table")
    parser.add_argument(
        "--gradients",
        help="torch.save'd gradients (tensor, list or dict) for the zstd table; default: synthetic",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document instead of a table"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    rows, op_rows, targets, zstd_rows = [], [], [], []
    if not args.skip_zstd:
        if args.gradients:
            sample = load_gradients(args.gradients)
        else:
            n = min(args.sizes)
            g = torch.Generator().manual_seed(0)
            sample = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3
        zstd_rows = bench_zstd(sample, ZSTD_CASES)
    for n in args.sizes:
        if not args.skip_codecs:
            rows += bench_size(n, args.cases, args.budget)
        if not args.skip_ops:
            more, targets = bench_ops(n, device, args.budget)  # targets: of the largest size
            op_rows += more
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "torch": torch.__version__,
        "native": ops.NATIVE,
        "unit": "GB/s of fp32 input; ratio = input bytes / wire bytes",
        "rows": rows,
        "ops": op_rows,
        "targets": targets,
        "zstd": zstd_rows,
        "zstd_sample": args.gradients or "synthetic heavy-tailed",
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_tables(report, device)


def print_tables(report: dict, device: torch.device) -> None:
    """The report as text tables: codecs, native ops and their targets, zstd gain."""
    rows, op_rows, targets, zstd_rows = (report[k] for k in ("rows", "ops", "targets", "zstd"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads - {report['unit']}")
    if rows:
        print(f"{'n':>10} {'case':32} {'encode':>8} {'enc+EF':>8} {'decode':>8} {'ratio':>8}")
    for r in rows:
        cells = [
            f"{r[k]:8.2f}" if k in r else f"{'':8}"
            for k in ("encode_gbps", "encode_ef_gbps", "decode_gbps")
        ]
        ratio = f"{r['ratio']:8.1f}" if "ratio" in r else ""
        print(f"{r['n']:>10} {r['case']:32} {' '.join(cells)} {ratio}")
    if op_rows:
        print(f"\nnative ops on {device} (seconds; ratios: see the module docstring)")
        fields = (
            "native_seconds",
            "reference_seconds",
            "speedup",
            "input_vs_copy",
            "traffic_vs_copy",
        )
        print(f"{'n':>10} {'case':32} " + " ".join(f"{f.split('_')[0][:9]:>9}" for f in fields))
    for r in op_rows:
        cells = [f"{r[f]:9.4g}" if f in r else f"{'':9}" for f in fields]
        if r["case"] in ("copy",) or r["case"].startswith("torch.topk"):
            cells[0] = f"{r['seconds']:9.4g}"
        print(f"{r['n']:>10} {r['case']:32} {' '.join(cells)}")
    for t in targets:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        print(f"target: {t['target']}: {value} ({'met' if t['met'] else 'NOT met'})")
    if zstd_rows:
        print(f"\nzstd gain per codec ({report['zstd_sample']}, {zstd_rows[0]['n']} elements)")
        print(
            f"{'case':24} {'zstd':>4} {'ratio':>7} {'enc ns/B':>9} {'dec ns/B':>9} "
            f"{'pays below Mbit/s':>18}"
        )
    for r in zstd_rows:
        print(
            f"{r['case']:24} {r['zstd_level']:>4} {r['ratio']:7.3f} "
            f"{r['encode_ns_per_byte']:9.2f} {r['decode_ns_per_byte']:9.2f} "
            f"{r['pays_below_mbit']:18.1f}"
        )


if __name__ == "__main__":
    main()
