"""What a run will cost before anything is provisioned: step time, compute utilisation, traffic
across regions, dollars and memory per GPU for each mode, from the same cost model the controller
uses (cloudtrain.costs, cloudtrain.outer.choose_schedule). `cloudtrain plan` is its command.

    cluster = Cluster.parse("us-east-1=2xp5.48xlarge,eu-west-1=2xp5.48xlarge")
    links = {("us-east-1", "eu-west-1"): Link(1000, 80), ("eu-west-1", "us-east-1"): Link(1000, 80)}
    result = forecast(Workload(params=7e9, tokens_per_gpu=16384), cluster, links)
    print(result.table())

Inputs: the model (parameters, and either tokens per GPU per step - compute from 6 x parameters x
tokens / (the GPU's peak x `mfu`) - or a measured step time), the cluster (regions, hosts and
instance types; the instance's GPUs from PRICES), the links (Mbit/s and RTT per direction of
every region pair), and a dated price table (PRICES, overridable by a file).

Modes: DDP (a ring all-reduce across regions, fp32 and fp16; FSDP2 HSDP with `shard`), per-step
"auto" (the cost model's rung per link under the quality guard's first ceiling, 4-bit: sparse rungs
come only after a trial keeps quality; and with them), and the outer loop (by default diloco, H
and codec as `sync_every="auto"` chooses them, and the diloco-4bit preset; any outer preset, H
fixed or not, with `outer=`). What it leaves out: activations (give `activation_gb`), overlap of
the all-reduce with backward beyond the cost model's hidden share (less the last bucket's, which
starts when the backward ends), stragglers, the CPU of the codecs (small on GPUs), a
connection's first transfers (TCP's startup: two or three round trips more on each of the outer
loop's first two syncs, once a run; docs/measurements.md), quality (the outer loop changes the
algorithm; docs/quality.md).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .compress.ladders import LADDER, OUTER_LADDER
from .config import AUTO, PRESETS, CompressionConfig, ControllerOptions
from .costs import CostModel, LinkEstimate, Ring, default_codecs, plain_seconds, plan_levels
from .guard import first_ceiling
from .options import read_json
from .outer import SyncSetting, choose_schedule, fragment_exchange_seconds, outer_zstd
from .plan import Rung, ceil_div, describe
from .replan import LinkBook, PairLink

BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default bucket (bucket_cap_mb=25)."""

STATE_BYTES = 16
"""Bytes per parameter of DDP with AdamW in mixed precision: fp32 weights, gradients and the two
moments."""

GPUS: dict[str, tuple[float, float]] = {
    # name: (memory GB, nominal dense bf16 TFLOPS)
    "A10G": (24, 70),
    "L4": (24, 121),
    "L40S": (48, 362),
    "A100-40GB": (40, 312),
    "A100-80GB": (80, 312),
    "H100": (80, 989),
    "H200": (141, 989),
}

INTERCONNECT_GBIT: dict[str, tuple[float, float]] = {
    # type: (between the GPUs of one host, between hosts of a region), Gbit/s per GPU's ring
    "g5.xlarge": (10, 10),  # one GPU a host: its hosts' network only
    "g5.12xlarge": (128, 40),  # PCIe 4.0 x16
    "g5.48xlarge": (128, 100),
    "g6.xlarge": (10, 10),
    "g6e.12xlarge": (128, 100),
    "p4d.24xlarge": (2400, 400),  # NVLink 3: 300 GB/s a direction; 4 x 100 Gbit/s EFA
    "p4de.24xlarge": (2400, 400),
    "p5.48xlarge": (3600, 3200),  # NVLink 4: 450 GB/s a direction; 32 x 100 Gbit/s EFA
    "p5en.48xlarge": (3600, 3200),
}
"""Bandwidth inside a region for its dense reductions, by instance type: NVLink or PCIe inside a
host, the host's network (EFA) between hosts. A type not listed (from a price file) is taken at
DEFAULT_INTRA_GBIT; Workload.intra_gbit overrides both."""

DEFAULT_INTRA_GBIT = 100.0

PRICES: dict[str, Any] = {
    "date": "2026-11",
    "note": "us-east-1 list prices on demand, spot as typically seen; override with --prices",
    "instances": {
        # type: [GPU, GPUs per host, on demand $/h, spot $/h]
        "g5.xlarge": ["A10G", 1, 1.006, 0.40],
        "g5.12xlarge": ["A10G", 4, 5.672, 2.30],
        "g5.48xlarge": ["A10G", 8, 16.288, 6.50],
        "g6.xlarge": ["L4", 1, 0.805, 0.35],
        "g6e.12xlarge": ["L40S", 4, 10.493, 4.20],
        "p4d.24xlarge": ["A100-40GB", 8, 21.96, 9.50],
        "p4de.24xlarge": ["A100-80GB", 8, 27.45, 11.00],
        "p5.48xlarge": ["H100", 8, 55.04, 24.00],
        "p5en.48xlarge": ["H200", 8, 63.30, 28.00],
    },
    # $/GB a region's egress to another region costs
    "inter_region_per_gb": {
        "default": 0.02,
        "ap-northeast-1": 0.09,
        "ap-northeast-2": 0.08,
        "ap-southeast-1": 0.09,
        "ap-southeast-2": 0.098,
        "ap-south-1": 0.086,
        "sa-east-1": 0.138,
    },
    "regions": [
        "us-east-1",
        "us-east-2",
        "us-west-1",
        "us-west-2",
        "ca-central-1",
        "eu-west-1",
        "eu-west-2",
        "eu-west-3",
        "eu-central-1",
        "eu-north-1",
        "ap-northeast-1",
        "ap-northeast-2",
        "ap-southeast-1",
        "ap-southeast-2",
        "ap-south-1",
        "sa-east-1",
    ],
}
"""The built-in price table (dated: prices change; `load_prices` reads a file of the same form)."""


def load_prices(path: str | Path | None = None) -> dict[str, Any]:
    """PRICES, with the entries of a JSON file of the same form (instances, inter_region_per_gb,
    regions) over them; a file missing a field or with a malformed entry is refused, naming it."""
    if path is None:
        return PRICES
    given = read_json("price file", path)
    if not isinstance(given, dict):
        raise ValueError(
            f"price file {path}: a JSON object of instances, inter_region_per_gb and regions "
            "(cloudtrain.forecast.PRICES' form)"
        )
    prices = {**PRICES, **{k: v for k, v in given.items() if k in ("date", "note")}}
    prices["regions"] = list(dict.fromkeys([*PRICES["regions"], *given.get("regions", [])]))
    prices["instances"] = {**PRICES["instances"], **given.get("instances", {})}
    prices["inter_region_per_gb"] = {
        **PRICES["inter_region_per_gb"], **given.get("inter_region_per_gb", {})
    }  # fmt: skip
    for name, entry in prices["instances"].items():
        if not (
            isinstance(entry, list) and len(entry) == 4 and entry[0] in GPUS
            and isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] >= 1
            and all(_price(x) for x in entry[2:])
        ):  # fmt: skip
            raise ValueError(
                f"price file {path}: instances[{name!r}] must be [GPU, GPUs per host, on-demand "
                f"$/h, spot $/h] with GPU one of {sorted(GPUS)}, at least one GPU and prices of 0 "
                f"or more, got {entry!r}"
            )
    for name, rate in prices["inter_region_per_gb"].items():
        if not _price(rate):
            raise ValueError(
                f"price file {path}: inter_region_per_gb[{name!r}] must be $ per GB, 0 or more, "
                f"got {rate!r}"
            )
    return prices


def _price(value: Any) -> bool:
    """A price: a number, finite, 0 or more."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class Region:
    name: str
    instance_type: str
    hosts: int
    spot: bool = True


@dataclass(frozen=True)
class Cluster:
    regions: tuple[Region, ...]

    @classmethod
    def parse(cls, text: str, spot: bool = True) -> Cluster:
        """From "us-east-1=2xp5.48xlarge,eu-west-1=1xp4d.24xlarge" (region=HOSTSxTYPE)."""
        regions = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"([a-z0-9-]+)=(\d+)x([a-z0-9.-]+)", part)
            if not m:
                raise ValueError(
                    f"cluster {part!r}: write REGION=HOSTSxINSTANCE_TYPE, e.g. us-east-1=2xp5.48xlarge"
                )
            if any(r.name == m[1] for r in regions):
                raise ValueError(f"cluster: region {m[1]!r} named twice; give each region once")
            regions.append(Region(m[1], m[3], int(m[2]), spot))
        return cls(tuple(regions))

    @classmethod
    def from_tfvars(cls, variables: Mapping[str, Any]) -> Cluster:
        """From the `regions` of a terraform.tfvars(.json): {name: {instance_count,
        instance_type, slots, spot}} (the Terraform in terraform/)."""
        if "regions" not in variables:
            raise ValueError(
                "terraform variables: no `regions` (name -> {instance_count, instance_type})"
            )
        regions = []
        for name, r in sorted(variables["regions"].items()):
            missing = [k for k in ("instance_type", "instance_count") if k not in r]
            if missing:
                raise ValueError(
                    f"terraform variables: regions[{name!r}] has no {' or '.join(missing)} "
                    "(name -> {instance_count, instance_type, slots, spot})"
                )
            regions.append(
                Region(
                    name, r["instance_type"], int(r["instance_count"]), bool(r.get("spot", True))
                )
            )
        return cls(tuple(regions))


@dataclass(frozen=True)
class Link:
    """One direction of a region pair: single-flow Mbit/s and round trip in ms."""

    mbit: float
    rtt_ms: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mbit) and self.mbit > 0):
            raise ValueError(f"a link of {self.mbit!r} Mbit/s: give its rate, above 0")
        if not (math.isfinite(self.rtt_ms) and 0 <= self.rtt_ms <= 60_000):
            raise ValueError(
                f"a link with a {self.rtt_ms!r} ms round trip: give it in milliseconds, 0 to 60000"
            )


@dataclass(frozen=True)
class Workload:
    params: float
    """Trainable parameters."""
    tokens_per_gpu: float | None = None
    """Tokens (or samples x their length) each GPU computes per step: compute from FLOPs."""
    step_s: float | None = None
    """A measured compute time per step (a short local run); replaces the FLOPs estimate."""
    mfu: float = 0.4
    """Model FLOPs utilisation assumed with tokens_per_gpu."""
    activation_gb: float = 0.0
    """Activation memory per GPU, if known (not modelled)."""
    intra_gbit: float | None = None
    """Bandwidth inside a region for its dense reductions, Gbit/s; None: the instance type's
    (INTERCONNECT_GBIT: NVLink or PCIe in one host, EFA between hosts)."""
    shard: bool = False
    """FSDP inside each region (cloudtrain.fully_shard; FSDP2 HSDP for DDP's rows): the model's
    state and cloudtrain's are divided among the region's GPUs."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.params) and self.params >= 1):
            raise ValueError(f"params={self.params!r}: the model's parameter count, e.g. 7e9")
        if (self.tokens_per_gpu is None) == (self.step_s is None):
            raise ValueError("give the compute per step as tokens_per_gpu or as a measured step_s")
        for name, value in (
            ("tokens_per_gpu", self.tokens_per_gpu), ("step_s", self.step_s),
            ("mfu", self.mfu), ("intra_gbit", self.intra_gbit),
        ):  # fmt: skip
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r}: give a number above 0")
        if self.mfu > 1:
            raise ValueError(f"mfu={self.mfu!r}: a share of the GPU's peak FLOPs, at most 1")
        if not (math.isfinite(self.activation_gb) and self.activation_gb >= 0):
            raise ValueError(f"activation_gb={self.activation_gb!r}: give 0 or more GB")


def transformer_blocks(params: float) -> int:
    """FSDP2's units in a transformer of `params` parameters wrapped a block each (as torchtitan
    does), each all-reduced across the regions on its own: Llama's depths (16 blocks at 1 B, 32
    at 7 B, 80 at 70 B) follow about 17 (params / 1e9) ** 0.37."""
    return max(1, round(17 * (params / 1e9) ** 0.37))


def _intra_gbit(instance_type: str, hosts: int) -> float:
    """The bandwidth of a region's ring of `hosts` hosts of `instance_type` (INTERCONNECT_GBIT)."""
    in_host, between = INTERCONNECT_GBIT.get(instance_type, (DEFAULT_INTRA_GBIT,) * 2)
    return between if hosts > 1 else in_host


OUTER_MODES = ("diloco", "diloco-4bit")
"""The outer-loop rows by default: diloco's H and codec chosen for the links, and diloco-4bit."""


def outer_mode(text: str) -> tuple[str, int | None]:
    """ "PRESET" or "PRESET@H" (H fixed, e.g. "diloco-int8@100") -> (preset, H or None)."""
    preset, _, every = text.partition("@")
    try:
        cfg = CompressionConfig.resolve(preset).outer
    except ValueError as e:
        raise ValueError(f"outer mode {text!r}: {e}") from None
    if cfg is None:
        raise ValueError(f"outer mode {text!r}: {preset!r} is not an outer-loop preset (diloco...)")
    if every and not (every.isdigit() and int(every) > 0):
        raise ValueError(f"outer mode {text!r}: after @ give H, the steps between syncs, e.g. @100")
    return preset, int(every) if every else None


@dataclass
class ModeForecast:
    mode: str
    config: dict[str, Any] | None
    """The CompressionConfig of the mode (CompressionConfig.to_dict; with fp16, the "fp16"
    preset's), None for plain DDP."""
    step_s: float
    compute_s: float
    wan_gb_per_1000: float
    dollars_per_1000: float
    egress_dollars_per_1000: float
    memory_gb: float
    fits: bool
    detail: str = ""

    @property
    def utilisation(self) -> float:
        return self.compute_s / self.step_s


@dataclass
class Forecast:
    rows: list[ModeForecast]
    gpu_memory_gb: float
    prices_date: str
    notes: list[str] = field(default_factory=list)

    @property
    def recommended(self) -> ModeForecast:
        """The cheapest mode per 1000 steps that fits in memory."""
        fitting = [r for r in self.rows if r.fits]
        return min(fitting, key=lambda r: r.dollars_per_1000)

    def table(self) -> str:
        head = (
            f"{'mode':44} {'step s':>8} {'compute':>8} {'WAN GB/1k':>10} {'$/1k steps':>11} "
            f"{'(egress)':>9} {'GB/GPU':>7} {'fits':>5}"
        )
        lines = [head]
        for r in self.rows:
            lines.append(
                f"{r.mode:44} {r.step_s:8.3f} {r.utilisation:8.0%} {r.wan_gb_per_1000:10.2f} "
                f"{r.dollars_per_1000:11.2f} {r.egress_dollars_per_1000:9.2f} "
                f"{r.memory_gb:7.1f} {'yes' if r.fits else 'NO':>5}"
                + (f"  {r.detail}" if r.detail else "")
            )
        best = self.recommended
        lines.append(f"recommended: {best.mode} ({best.dollars_per_1000:.2f} $ per 1000 steps)")
        lines.append(f"prices of {self.prices_date}; {'; '.join(self.notes)}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [{**dataclasses.asdict(r), "utilisation": r.utilisation} for r in self.rows],
            "recommended": self.recommended.mode,
            "gpu_memory_gb": self.gpu_memory_gb,
            "prices_date": self.prices_date,
            "notes": self.notes,
        }


def _check(cluster: Cluster, links: Mapping[tuple[str, str], Link], prices: dict) -> None:
    if len(cluster.regions) < 1:
        raise ValueError("cluster: name at least one region")
    names = [r.name for r in cluster.regions]
    for region in cluster.regions:
        if region.name not in prices["regions"]:
            raise ValueError(
                f"unknown region {region.name!r}: use one of {prices['regions']}, or add it to "
                "the price file's `regions` (with its `inter_region_per_gb` if not the default)"
            )
        if region.instance_type not in prices["instances"]:
            raise ValueError(
                f"unknown instance type {region.instance_type!r} in {region.name}: use one of "
                f"{sorted(prices['instances'])}, or add it to the price file's `instances` as "
                "[GPU, GPUs per host, on-demand $/h, spot $/h]"
            )
        if region.hosts < 1:
            raise ValueError(f"region {region.name}: at least one host")
    strangers = sorted({r for pair in links for r in pair} - set(names))
    if strangers:
        raise ValueError(
            f"a link names {', '.join(map(repr, strangers))}, not a region of the cluster "
            f"{names}: check the spelling of --link"
        )
    missing = [(a, b) for a in names for b in names if a != b and (a, b) not in links]
    if missing:
        raise ValueError(
            f"no link given for {', '.join(f'{a} -> {b}' for a, b in missing)}: give each "
            "direction's Mbit/s and RTT (--link A,B=MBIT:RTT_MS, a --profile for every pair, or "
            "--probe FILE from `cloudtrain probe --json`)"
        )


def forecast(
    workload: Workload,
    cluster: Cluster,
    links: Mapping[tuple[str, str], Link],
    prices: dict[str, Any] | None = None,
    outer: Sequence[str] = OUTER_MODES,
) -> Forecast:
    """Every mode's step time, traffic, dollars and memory per GPU (module docstring); `outer`:
    the outer-loop rows (`outer_mode`'s form)."""
    prices = prices or PRICES
    _check(cluster, links, prices)
    modes = [outer_mode(text) for text in outer]
    kinds = [prices["instances"][r.instance_type] for r in cluster.regions]
    gpus = [k[1] * r.hosts for k, r in zip(kinds, cluster.regions, strict=True)]
    memory, peak = min(GPUS[k[0]][0] for k in kinds), min(GPUS[k[0]][1] for k in kinds)
    if workload.step_s is not None:
        compute = workload.step_s
    else:  # the slowest region's GPU sets the pace
        compute = 6 * workload.params * workload.tokens_per_gpu / (peak * 1e12 * workload.mfu)
    ctx = _Context(workload, cluster, links, prices, gpus, compute)
    need = ctx.memory_gb(0) + workload.activation_gb  # DDP's, the least of any mode
    if need > 0.9 * memory:  # before the modes: their packets' sizes take long to count
        more = "more GPUs in each region" if workload.shard else "--shard (FSDP inside each region)"
        raise ValueError(
            f"the model fits no mode: {need:.0f} GB per GPU against {0.9 * memory:.0f} GB usable "
            f"(90 % of {memory:.0f}): choose GPUs with more memory, or {more}"
        )
    rows = [ctx.ddp(4), ctx.ddp(2)]
    if len(cluster.regions) > 1:
        rows += [*ctx.auto(), *(ctx.outer(preset, every) for preset, every in modes)]
    for row in rows:
        row.fits = row.memory_gb + workload.activation_gb <= 0.9 * memory
    result = Forecast(rows, memory, prices["date"], [
        f"{sum(gpus)} GPUs, compute {1000 * compute:.0f} ms/step",
        ("memory: sharded inside each region (FSDP), " if workload.shard else "memory: ")
        + "weights, gradients, AdamW and cloudtrain's state; activations not modelled"
        if not workload.activation_gb else f"memory includes {workload.activation_gb} GB activations",
    ])  # fmt: skip
    return result


@dataclass(frozen=True)
class Setting:
    """What predicting one step needs: the model's size, the cluster's shape, each region's
    link as its shard owners share it, and the compute and dense in-region costs."""

    numel: int
    world: int
    links: tuple[LinkEstimate, ...]
    """By region: its link per shard owner (estimates.region_links' form)."""
    shards: int
    compute_s: float
    intra_s: float
    """Seconds per step of the dense reduction (and gather) inside a region."""
    handshake: bool = False
    """True where DDP's and HSDP's all-reduce go over gloo (CPU tensors: the bench), whose every
    message waits for its receiver's word (costs.Ring); on GPUs NCCL's ring pipelines without
    it."""
    cpu_s: float = 0.0
    """Seconds per step the codecs take where a region compresses (encode, decode, the guard's
    statistics): small on GPUs, left at 0 by the planner; the bench gives what it measured."""

    @property
    def buckets(self) -> int:
        return max(1, ceil_div(4 * self.numel, BUCKET_BYTES))

    def shard_numels(self) -> list[int]:
        per = BUCKET_BYTES // 4
        return [ceil_div(min(per, self.numel - i), self.shards) for i in range(0, self.numel, per)]

    def cost_model(self, ladder: Sequence[Rung] = LADDER) -> CostModel:
        options = ControllerOptions(ladder=tuple(ladder))
        extra = [0.0 if name == "none" else self.intra_s for name, _ in ladder]
        cpu = [0.0 if name == "none" else self.cpu_s for name, _ in ladder]
        return CostModel(self.links, self.compute_s, self.shard_numels(), options, cpu=cpu,
                         extra=extra, codecs=default_codecs())  # fmt: skip


def predict_ddp(
    s: Setting, nbytes_per_param: int, hsdp: bool = False, units: int | None = None
) -> tuple[float, list[float]]:
    """(step seconds, bytes each region sends across per step) of DDP's ring all-reduce over
    every rank (costs.plain_seconds over the world's ring: each region boundary carries 2 (n-1)/n
    of the gradients), or with `hsdp` FSDP2 HSDP's: the reduction inside each region, then one
    ring a shard across the regions (one rank each, every hop crossing) on the shared link. The
    step waits for the slowest link. units: how many all-reduces a step waits for in turn (FSDP2
    reduces each wrapped unit on its own; default DDP's 25 MB buckets). torch's DDP makes its
    first bucket 1 MB, so a model of a few MB has two, which gloo can reduce at once (two worker
    threads): counted as one here (the bench's MLP, 4.2 + 0.3 MB, was predicted within 2 %;
    whether its two run at once was not measured)."""
    grad = int(s.numel * nbytes_per_param)
    intra = s.intra_s * nbytes_per_param / 4
    if len(s.links) == 1:
        return s.compute_s + intra, [0.0]
    slowest = min(s.links, key=lambda lk: lk.bandwidth)
    link = LinkEstimate(slowest.bandwidth * s.shards, max(lk.rtt for lk in s.links))
    regions = len(s.links)
    ranks = regions if hsdp else s.world
    crossing = 2 * (ranks - 1) / ranks * grad
    ring = Ring(ranks, regions, s.handshake)
    exchange = plain_seconds(grad, link, units or s.buckets, ring=ring)
    return s.compute_s + (intra if hsdp else 0.0) + exchange, [crossing] * regions


def predict_rungs(
    s: Setting, rungs: Sequence[Rung], sharded: bool = False, zstd: Sequence[bool] = ()
) -> tuple[float, list[float]]:
    """(step seconds, bytes each region sends across per step) of per-step CloudDDP sending
    these rungs (codec, level) by region, synchronous: compute, and what of the exchange does
    not hide in compute - half its round trip, its transfer, the codecs' CPU and the dense reduction
    inside the region that its packets need (costs.CostModel.rung_seconds, whose `extra` holds
    the reduction, so that it is counted once). What may hide is the cost model's share of the
    compute (`usable`) less a bucket's: the last bucket's exchange starts when the backward
    ends, so a model of one bucket (of BUCKET_BYTES: torch's smaller first bucket is not
    counted) hides none. The controller's decisions (costs.plan_levels) fit a rung to the whole
    share; this is the step they lead to. A plan that compresses nothing runs the plain path:
    DDP's all-reduce over every rank, or with `sharded` FSDP2's reduction in the region and an
    exchange of the shards across (predicted as HSDP's): predict_ddp, its bytes and time.
    `zstd`, by region: its packets go through zstd (the plan's), which shrinks them by
    Codecs.zstd_ratio (its CPU is the codecs', in `s.cpu_s`)."""
    ladder = [("none", None), *dict.fromkeys(r for r in rungs if r[0] != "none")]
    at = [ladder.index(r) if r[0] != "none" else 0 for r in rungs]
    if not any(at):
        return predict_ddp(
            s, 4, hsdp=sharded, units=transformer_blocks(s.numel) if sharded else None
        )
    model = s.cost_model(ladder)
    zstd = list(zstd) or [False] * len(at)
    ratios = [
        model.codecs.zstd_ratio(ladder[r]) if z else 1.0 for r, z in zip(at, zstd, strict=True)
    ]
    exchange = max(  # a packet 1/q the size: its link time as on a link q times as fast
        model.rung_seconds(LinkEstimate(lk.bandwidth * q, lk.rtt), r, 0, plain=False)
        for lk, r, q in zip(model.links, at, ratios, strict=True)
    )
    hidden = model.usable * (1 - 1 / model.buckets)
    step = s.compute_s + max(exchange - hidden, 0.0)
    return step, [s.shards * model.sizes[r] / q for r, q in zip(at, ratios, strict=True)]


def predict_outer(
    s: Setting,
    sync_every: int,
    rungs: Sequence[Rung],
    zstd: bool = True,
    fragments: int = 1,
    overlap: int = 0,
) -> tuple[float, list[float]]:
    """(step seconds, bytes each region sends across per step) of the outer loop: inner steps
    reduce inside the region; each of the `fragments` syncs once every H steps, in turn, and its
    exchange (half a round trip and the fragment's packet to every other region,
    outer.fragment_exchange_seconds) stalls but for the `overlap` steps it hides behind, and the
    link carries at most one exchange at a time. Its packets go through zstd unless the config
    says no (`zstd`), which shrinks them by Codecs.zstd_ratio (its CPU, once per H steps, is left
    out)."""
    codecs, receivers = default_codecs(), len(s.links) - 1
    m = ceil_div(ceil_div(s.numel, fragments), s.shards)
    sizes = [codecs.wire_nbytes(r, m) / (codecs.zstd_ratio(r) if zstd else 1.0) for r in rungs]
    exchange = max(
        fragment_exchange_seconds(lk, size, receivers)
        for lk, size in zip(s.links, sizes, strict=True)
    )
    inner = s.compute_s + s.intra_s
    stall = max(0.0, exchange - overlap * inner)
    wan = [s.shards * receivers * size * fragments / sync_every for size in sizes]
    return max(inner + fragments * stall / sync_every, fragments * exchange / sync_every), wan


@dataclass
class _Context:
    """What every mode's forecast is computed from."""

    workload: Workload
    cluster: Cluster
    links: Mapping[tuple[str, str], Link]
    prices: dict[str, Any]
    gpus: list[int]
    compute: float

    @property
    def shards(self) -> int:
        return min(self.gpus)  # shard owners per region (as CloudDDP's topology)

    def region_links(self) -> list[LinkEstimate]:
        """Each region's link as the controller reads the probe (LinkBook.links, which calls
        estimates.region_links): its slowest outgoing link, shared by its shard owners, and the
        fastest round trip of its links either way."""
        book = LinkBook(
            {
                pair: PairLink(lk.rtt_ms / 1000, lk.mbit * 1e6 / 8, 0.0)
                for pair, lk in self.links.items()
            }
        )
        return book.links([r.name for r in self.cluster.regions], self.shards)

    def intra_s(self, nbytes: float) -> float:
        """A dense ring all-reduce of `nbytes` inside each region, the slowest's: of its k GPUs
        each sends 2 (k - 1) / k of it, at Workload.intra_gbit or its instance type's
        (INTERCONNECT_GBIT); nothing where a region has one GPU."""
        seconds = [0.0]
        for region, k in zip(self.cluster.regions, self.gpus, strict=True):
            if k > 1:
                gbit = self.workload.intra_gbit or _intra_gbit(region.instance_type, region.hosts)
                seconds.append(2 * (k - 1) / k * nbytes / (gbit * 1e9 / 8))
        return max(seconds)

    def dollars(self, step_s: float, wan_bytes_by_region: Sequence[float]) -> tuple[float, float]:
        """(instances + egress, egress) $ per 1000 steps."""
        hours = 1000 * step_s / 3600
        inst = sum(
            r.hosts * self.prices["instances"][r.instance_type][3 if r.spot else 2] * hours
            for r in self.cluster.regions
        )
        rates = self.prices["inter_region_per_gb"]
        egress = sum(
            b * 1000 / 1e9 * rates.get(r.name, rates["default"])
            for r, b in zip(self.cluster.regions, wan_bytes_by_region, strict=True)
        )
        return inst + egress, egress

    def row(
        self, mode: str, config: dict, step: float, wan: Sequence[float], mem: float, detail: str
    ) -> ModeForecast:
        total, egress = self.dollars(step, wan)
        return ModeForecast(mode, config, step, self.compute, sum(wan) * 1000 / 1e9, total, egress,
                            mem, True, detail)  # fmt: skip

    def setting(self) -> Setting:
        intra = self.intra_s(4 * self.workload.params)
        links = tuple(self.region_links())
        return Setting(
            int(self.workload.params), sum(self.gpus), links, self.shards, self.compute, intra
        )

    def memory_gb(self, cloudtrain_bytes: float) -> float:
        """Per GPU: the model's state (weights, gradients, AdamW) and `cloudtrain_bytes` per
        parameter of cloudtrain's own; sharded, both are divided among the region's GPUs."""
        per_param = STATE_BYTES + cloudtrain_bytes
        return per_param * self.workload.params / (self.shards if self.workload.shard else 1) / 1e9

    def ddp(self, nbytes_per_param: int) -> ModeForecast:
        shard = self.workload.shard
        units = transformer_blocks(self.workload.params) if shard else None
        step, wan = predict_ddp(self.setting(), nbytes_per_param, hsdp=shard, units=units)
        mode = "HSDP (FSDP2)" if self.workload.shard else "DDP"
        mode += "" if nbytes_per_param == 4 else " + fp16 hook"
        config = None if nbytes_per_param == 4 else dict(PRESETS["fp16"])
        return self.row(mode, config, step, wan, self.memory_gb(0), "")

    def auto(self) -> list[ModeForecast]:
        """Per-step "auto": the cost model's rung per link, synchronous (the quality guard
        pipelines only where the gradient barely moves), under its first ceiling and without."""
        setting = self.setting()
        model = setting.cost_model()
        rows = []
        mem = self.memory_gb(4 if self.workload.shard else 4 / self.shards)  # the residuals
        for label, ceiling in (
            ("≤ 4-bit: the guard's start", first_ceiling(LADDER)),
            ("sparse rungs kept", len(LADDER) - 1),
        ):
            rungs, _, _ = plan_levels(model, ceilings=[ceiling] * len(model.links))
            step, wan = predict_rungs(setting, [LADDER[r] for r in rungs], self.workload.shard)
            levels = ", ".join(describe(LADDER[r]) for r in rungs)
            config = CompressionConfig().to_dict()
            rows.append(self.row(f'per-step "auto" ({label})', config, step, wan, mem, levels))
        return rows

    def outer(self, preset: str, sync_every: int | None = None) -> ModeForecast:
        """The outer loop of `preset`: H and codec as outer.choose_schedule picks them where the
        preset leaves them to it; `sync_every` fixes H."""
        setting, resolved = self.setting(), CompressionConfig.resolve(preset)
        cfg = resolved.outer
        if sync_every is not None:
            cfg = dataclasses.replace(cfg, sync_every=sync_every)
        codecs = default_codecs()
        ladder = OUTER_LADDER if cfg.codec == AUTO else ((cfg.codec, cfg.level),)
        sync = SyncSetting(
            setting.numel,
            setting.links,
            self.shards,
            self.compute + setting.intra_s,
            cfg.fragments,
            cfg.overlap,
        )
        sched = choose_schedule(sync, codecs.wire_nbytes, cfg.sync_every, ladder)
        step, wan = predict_outer(
            setting, sched.sync_every, sched.rungs, outer_zstd(resolved), cfg.fragments, cfg.overlap
        )
        # the outer copy, its momentum, and the residuals (of a shard, unless sharded)
        state = (
            4
            + (4 if cfg.outer_momentum > 0 else 0)
            + (4 if self.workload.shard else 4 / self.shards)
        )
        name = f"outer loop ({preset}{'' if sync_every is None else f', H={sync_every}'})"
        chosen = dataclasses.replace(cfg, sync_every=sched.sync_every)
        config = CompressionConfig.resolve(preset, outer=chosen).to_dict()
        streaming = f", {cfg.fragments} fragments" if cfg.fragments > 1 else ""
        streaming += f", overlap {cfg.overlap}" if cfg.overlap else ""
        rungs = ", ".join(describe(r) for r in sched.rungs)
        detail = f"H={sched.sync_every}{streaming}, {rungs}"
        return self.row(name, config, step, wan, self.memory_gb(state), detail)
