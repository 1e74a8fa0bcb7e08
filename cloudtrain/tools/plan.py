"""`cloudtrain plan`: step time, traffic, dollars and memory per GPU of each mode, before anything
is provisioned (cloudtrain.forecast), and the config and Terraform variables to run the best one.

    cloudtrain plan --params 1.3e9 --tokens-per-gpu 16384 \
        --cluster us-east-1=2xp5.48xlarge,eu-west-1=2xp5.48xlarge --profile us-eu
    cloudtrain plan --params 110e3 --step-ms 40 --tfvars terraform.tfvars.json \
        --link us-east-1,eu-west-1=100:80 --link eu-west-1,us-east-1=100:80 --emit plan/
    cloudtrain plan ... --probe probe.json      # the links `cloudtrain probe --json` measured
    cloudtrain plan ... --prices prices.json     # a price table of your own (forecast.PRICES' form)

--emit DIR writes DIR/cloudtrain.json (the recommended CompressionConfig: `CloudDDP(model,
"DIR/cloudtrain.json")`, and the examples' --config take it) and DIR/terraform.tfvars (the
cluster, as terraform/examples/two-region takes it: set operator_cidrs to your address). --json prints the forecast as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

from ..forecast import (
    OUTER_MODES,
    Cluster,
    Link,
    Workload,
    forecast,
    load_prices,
)
from ..options import read_json, read_text


def _links(args: argparse.Namespace, names: list[str]) -> dict[tuple[str, str], Link]:
    links: dict[tuple[str, str], Link] = {}
    if args.profile:
        from .netem.spec import link_profile

        profile = link_profile(args.profile)
        links = {(a, b): Link(profile.mbit, profile.rtt_ms) for a in names for b in names if a != b}
    if args.probe:
        links.update(_probed(args.probe, names, args.ranks_per_region))
    for text in args.link or []:
        try:
            pair, value = text.split("=")
            a, b = pair.split(",")
            mbit, rtt = (float(x) for x in value.split(":"))
        except ValueError:
            raise ValueError(
                f"--link {text!r}: write FROM,TO=MBIT:RTT_MS, e.g. us-east-1,eu-west-1=1000:80"
            ) from None
        try:
            links[(a.strip(), b.strip())] = Link(mbit, rtt)
        except ValueError as e:
            raise ValueError(f"--link {text!r}: {e}") from None
    return links


def _unquoted(value: Any) -> Any:
    """The values without the quotes python-hcl2 keeps on HCL strings (its version 8 does;
    older ones did not)."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    if isinstance(value, dict):
        return {_unquoted(k): _unquoted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unquoted(v) for v in value]
    return value


HOROVOD_PREFIX = re.compile(r"^\[\d+\]<stdout>:", re.MULTILINE)
"""What horovodrun puts before each line a rank prints (`cloudtrain launch` runs horovodrun)."""


def _probe_json(path: str) -> Any:
    """`cloudtrain probe --json`'s output, as it was saved: alone, or as `cloudtrain launch ...
    -- cloudtrain probe --json > probe.json` leaves it (horovodrun's "[0]<stdout>:" before it)."""
    text = HOROVOD_PREFIX.sub("", read_text("--probe", path))
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        lines = [line for line in text.splitlines() if line.lstrip().startswith("{")]
        try:  # the last line of JSON, after what other ranks or the launcher printed
            return json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            pass
        raise ValueError(f"--probe {path}: not JSON ({e})") from None


def _probed(path: str, names: list[str], per_region: int | None) -> dict[tuple[str, str], Link]:
    """The links between the regions' first ranks in `cloudtrain probe --json`'s matrix; ranks
    are the regions' in order, `per_region` each (default: as the probe clustered them)."""
    data = _probe_json(path)
    if not isinstance(data, dict) or not {"beta_Bps", "alpha_s"} <= set(data):
        raise ValueError(
            f"--probe {path}: no beta_Bps and alpha_s matrices; give what `cloudtrain probe "
            "--json` writes"
        )
    beta, alpha = data["beta_Bps"], data["alpha_s"]
    if per_region is not None and not (per_region >= 1 and len(beta) % per_region == 0):
        raise ValueError(
            f"--ranks-per-region {per_region}: the probe measured {len(beta)} ranks, which it "
            "does not divide; give the ranks of each region"
        )
    labels = (
        data.get("regions") if per_region is None else [r // per_region for r in range(len(beta))]
    )
    if labels is None:
        raise ValueError(f"--probe {path}: no regions in it; give --ranks-per-region")
    firsts = {label: labels.index(label) for label in sorted(set(labels))}
    if len(firsts) != len(names):
        raise ValueError(
            f"--probe {path}: {len(firsts)} regions measured, the cluster has {len(names)}: give "
            "--ranks-per-region"
        )
    leaders = list(firsts.values())
    return {
        (names[a], names[b]): Link(8 * beta[la][lb] / 1e6, 1000 * alpha[la][lb])
        for a, la in enumerate(leaders)
        for b, lb in enumerate(leaders)
        if a != b
    }


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.tfvars:
        if args.tfvars.endswith(".json"):
            variables: Any = read_json("--tfvars", args.tfvars)
        else:
            text = read_text("--tfvars", args.tfvars)
            try:
                import hcl2
            except ImportError:
                raise SystemExit(
                    "reading .tfvars needs python-hcl2; or give terraform.tfvars.json"
                ) from None
            try:
                variables = _unquoted(hcl2.loads(text))
            except Exception as e:  # the parser's own errors (lark), of several types
                raise ValueError(f"--tfvars {args.tfvars}: not HCL ({e})") from None
        if not isinstance(variables, dict):
            raise ValueError(f"--tfvars {args.tfvars}: no variables (`regions = {{...}}`)")
        cluster = Cluster.from_tfvars(variables)
        if args.on_demand:  # over the file's `spot`
            cluster = Cluster(tuple(dataclasses.replace(r, spot=False) for r in cluster.regions))
        return cluster
    if not args.cluster:
        raise SystemExit("give the cluster: --cluster REGION=HOSTSxTYPE,... or --tfvars FILE")
    return Cluster.parse(args.cluster, spot=not args.on_demand)


def _tfvars(cluster: Cluster, prices: dict[str, Any]) -> str:
    lines = ['cluster_name = "my-cluster"', "regions = {"]
    for r in cluster.regions:
        slots = prices["instances"][r.instance_type][1]
        lines.append(
            f'  "{r.name}" = {{ instance_count = {r.hosts}, instance_type = "{r.instance_type}", '
            f"slots = {slots}, spot = {str(r.spot).lower()} }}"
        )
    lines += ["}", 'operator_cidrs = ["203.0.113.10/32"] # your own address as a /32', ""]
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument(
        "--params", type=float, required=True, help="trainable parameters, e.g. 7e9"
    )
    compute = parser.add_mutually_exclusive_group(required=True)
    compute.add_argument("--tokens-per-gpu", type=float, help="tokens each GPU computes per step")
    compute.add_argument("--step-ms", type=float, help="compute time per step, measured")
    parser.add_argument(
        "--mfu", type=float, default=0.4, help="with --tokens-per-gpu (default 0.4)"
    )
    parser.add_argument(
        "--activation-gb", type=float, default=0.0,
        help="GB of activations per GPU, counted in its memory (default 0: not counted)",
    )  # fmt: skip
    parser.add_argument(
        "--intra-gbit", type=float, default=None,
        help="Gbit/s between the GPUs of a region, for its dense reductions (default: the "
        "instance type's: NVLink or PCIe in one host, EFA between hosts; 100 if not known)",
    )  # fmt: skip
    parser.add_argument(
        "--shard", action="store_true",
        help="FSDP inside each region (cloudtrain.fully_shard): state divided by the region's GPUs",
    )  # fmt: skip
    parser.add_argument(
        "--outer", action="append", metavar="PRESET[@H]",
        help="an outer-loop row (repeatable; default: diloco and diloco-4bit), e.g. diloco-int8@100",
    )  # fmt: skip
    parser.add_argument(
        "--cluster", help="REGION=HOSTSxINSTANCE_TYPE,... (spot unless --on-demand)"
    )
    parser.add_argument("--tfvars", help="the cluster from a terraform.tfvars(.json) of terraform/")
    parser.add_argument("--on-demand", action="store_true", help="price hosts on demand")
    parser.add_argument("--profile", help="one link profile for every pair (cloudtrain netem's)")
    parser.add_argument("--link", action="append", help="FROM,TO=MBIT:RTT_MS (one direction)")
    parser.add_argument("--probe", help="links from `cloudtrain probe --json` output")
    parser.add_argument("--ranks-per-region", type=int, help="with --probe: ranks of each region")
    parser.add_argument("--prices", help="a price table file (forecast.PRICES' form)")
    parser.add_argument("--emit", metavar="DIR", help="write cloudtrain.json and terraform.tfvars")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    try:
        cluster = _cluster(args)
        prices = load_prices(args.prices)
        links = _links(args, [r.name for r in cluster.regions])
        workload = Workload(
            args.params, args.tokens_per_gpu, None if args.step_ms is None else args.step_ms / 1000,
            args.mfu, args.activation_gb, args.intra_gbit, args.shard,
        )  # fmt: skip
        result = forecast(workload, cluster, links, prices, args.outer or OUTER_MODES)
    except ValueError as e:
        raise SystemExit(f"cloudtrain plan: {e}") from None
    print(json.dumps(result.to_json()) if args.json else result.table())
    if args.emit:
        out = Path(args.emit)
        best = result.recommended
        config = best.config if best.config is not None else {"codec": "none"}
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "cloudtrain.json").write_text(json.dumps(config, indent=1) + "\n")
            (out / "terraform.tfvars").write_text(_tfvars(cluster, prices))
        except OSError as e:
            raise SystemExit(f"cloudtrain plan: --emit {args.emit}: {e.strerror or e}") from None
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="cloudtrain plan")
    configure(p)
    sys.exit(run(p.parse_args()))
