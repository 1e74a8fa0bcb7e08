"""Codec throughput, measured side by side in one run (a benchmark, not a test).

    python -m cloudtrain.compress.bench [--sizes 1000000 25000000] [--json]

For each size and codec/level: encode, encode with error feedback, and decode throughput in GB/s
of fp32 input, and the compression ratio (input bytes / wire bytes). In the same run, the
baselines the numbers mean something against: a plain memory copy of the same tensor and
`torch.topk` of |x| at 1% and 0.1%. Each figure is the median of several timed repetitions after
a warm-up. Machines are shared and noisy: compare ratios within one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from .codecs import parse_spec
from .feedback import ErrorFeedback
from .rng import RandomKey

CASES = [
    "none",
    "fp16",
    "bf16",
    "quant:8",
    "quant:4",
    "quant:2",
    "sign",
    "topk:0.01",
    "topk:0.001",
    "topk-sampled:0.01",
    "topk-sampled:0.001",
    "randomk:0.01",
    "topk:0.01>quant:8",
    "randomk:0.1>topk:0.1>quant:4",
]


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument(
        "--cases", nargs="+", default=CASES, help="codec specs, e.g. topk:0.01 quant:4"
    )
    parser.add_argument(
        "--budget", type=float, default=1.0, help="seconds of repetitions per figure"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document instead of a table"
    )
    args = parser.parse_args(argv)
    rows = []
    for n in args.sizes:
        rows += bench_size(n, args.cases, args.budget)
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "torch": torch.__version__,
        "unit": "GB/s of fp32 input; ratio = input bytes / wire bytes",
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads - {report['unit']}")
    print(f"{'n':>10} {'case':32} {'encode':>8} {'enc+EF':>8} {'decode':>8} {'ratio':>8}")
    for r in rows:
        cells = [
            f"{r[k]:8.2f}" if k in r else f"{'':8}"
            for k in ("encode_gbps", "encode_ef_gbps", "decode_gbps")
        ]
        ratio = f"{r['ratio']:8.1f}" if "ratio" in r else ""
        print(f"{r['n']:>10} {r['case']:32} {' '.join(cells)} {ratio}")


if __name__ == "__main__":
    main()
