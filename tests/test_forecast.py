"""`cloudtrain plan` (cloudtrain.forecast): each mode's forecast is the cost model's own answer
(the controller's rung choice, the outer loop's schedule, DDP's ring bytes), bad inputs are
refused naming what to add, and --emit writes a config CloudDDP loads and Terraform variables the
cluster's plan module accepts (real Terraform)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import hcl2
import pytest
from hcl2.utils import SerializationOptions
from support import plan_module_outputs

from cloudtrain import CompressionConfig
from cloudtrain.costs import LinkEstimate, Ring
from cloudtrain.forecast import (
    PRICES,
    Cluster,
    Link,
    Setting,
    Workload,
    forecast,
    load_prices,
    predict_ddp,
)

ROOT = Path(__file__).resolve().parents[1]
TWO = Cluster.parse("us-east-1=2xp5.48xlarge,eu-west-1=2xp5.48xlarge")
US_EU = {("us-east-1", "eu-west-1"): Link(1000, 80), ("eu-west-1", "us-east-1"): Link(1000, 80)}
MODEL = Workload(1.3e9, tokens_per_gpu=16384)


def rows(result):
    return {r.mode: r for r in result.rows}


def test_ddp_sends_the_ring_share_across_every_region_boundary():
    result = rows(forecast(MODEL, TWO, US_EU))
    n = 32  # GPUs
    per_step = 2 * (n - 1) / n * 4 * 1.3e9 * 2  # two boundaries, fp32 gradients
    assert result["DDP"].wan_gb_per_1000 == pytest.approx(1000 * per_step / 1e9)
    assert result["DDP + fp16 hook"].wan_gb_per_1000 == pytest.approx(500 * per_step / 1e9)
    assert result["DDP"].step_s > result["DDP + fp16 hook"].step_s > result["DDP"].compute_s


def test_modes_are_the_controllers_and_the_outer_loops_own_choices():
    from cloudtrain.outer import SyncSetting, choose_schedule
    from cloudtrain.plan import Codecs, describe

    result = rows(forecast(MODEL, TWO, US_EU))
    guarded = result['per-step "auto" (≤ 4-bit: the guard\'s start)']
    assert guarded.detail == "4-bit, 4-bit"  # sparse rungs only after the guard's trials
    assert "top-k" in result['per-step "auto" (sparse rungs kept)'].detail
    outer = result["outer loop (diloco)"]
    from cloudtrain.costs import LinkEstimate

    per_owner = LinkEstimate(1000e6 / 8 / 16, 0.08)  # a region's link shared by its 16 owners
    efa = 3200e9 / 8  # two p5 hosts a region: their ring runs on EFA
    sync = SyncSetting(int(1.3e9), [per_owner] * 2, 16, outer.compute_s + 2 * 15 / 16 * 5.2e9 / efa)
    sched = choose_schedule(sync, Codecs(CompressionConfig()).wire_nbytes)
    assert outer.detail == f"H={sched.sync_every}, " + ", ".join(describe(r) for r in sched.rungs)
    assert outer.config["outer"]["sync_every"] == sched.sync_every
    assert outer.wan_gb_per_1000 < guarded.wan_gb_per_1000 < result["DDP"].wan_gb_per_1000
    assert forecast(MODEL, TWO, US_EU).recommended.mode.startswith("outer loop")


def test_sharded_memory_is_divided_by_the_regions_gpus_and_outer_rows_take_any_preset():
    ten_b = Workload(10e9, step_s=22.8)
    with pytest.raises(ValueError, match="fits no mode: 160 GB per GPU"):
        forecast(ten_b, TWO, US_EU)  # 16 bytes a parameter on every GPU
    sharded = dataclasses.replace(ten_b, shard=True)
    result = rows(forecast(sharded, TWO, US_EU, outer=["diloco-int8@100", "diloco"]))
    assert result["HSDP (FSDP2)"].memory_gb == pytest.approx(16 * 10e9 / 16 / 1e9)  # 16 GPUs
    fixed = result["outer loop (diloco-int8, H=100)"]
    assert fixed.detail.startswith("H=100, 8-bit") and fixed.config["outer"]["sync_every"] == 100
    # the outer copy and the residuals of the rank's shard: 4 + 4 bytes more, divided as well
    assert fixed.memory_gb == pytest.approx((16 + 4 + 4) * 10e9 / 16 / 1e9)
    assert fixed.fits and "outer loop (diloco)" in result
    for bad, message in (("topk-1pct", "not an outer-loop preset"), ("diloco@x", "give H")):
        with pytest.raises(ValueError, match=message):
            forecast(sharded, TWO, US_EU, outer=[bad])


def test_a_regions_dense_reduction_runs_at_its_instance_types_interconnect():
    """HSDP's reduction inside a region: a ring of its k GPUs, each sending 2 (k - 1) / k of
    the gradients, on NVLink inside one host and on EFA between hosts (INTERCONNECT_GBIT);
    nothing with one GPU; --intra-gbit over the table (it was 100 Gbit/s for every type)."""
    grad = 4 * 1.3e9

    def hsdp_step(cluster: str, **workload) -> float:
        result = forecast(Workload(1.3e9, step_s=1.0, shard=True, **workload), Cluster.parse(cluster),
                          {("us-east-1", "eu-west-1"): Link(1e6, 0), ("eu-west-1", "us-east-1"): Link(1e6, 0)})  # fmt: skip
        return rows(result)["HSDP (FSDP2)"].step_s

    hosts_2 = hsdp_step("us-east-1=2xp5.48xlarge,eu-west-1=1xp5.48xlarge")
    host_1 = hsdp_step("us-east-1=1xp5.48xlarge,eu-west-1=1xp5.48xlarge")
    assert hosts_2 - host_1 == pytest.approx(
        2 * 15 / 16 * grad / 400e9 - 2 * 7 / 8 * grad / 450e9, rel=0.02
    )  # the slowest region's ring: two hosts on EFA against one on NVLink
    given = hsdp_step("us-east-1=1xp5.48xlarge,eu-west-1=1xp5.48xlarge", intra_gbit=100)
    assert given - host_1 == pytest.approx(2 * 7 / 8 * grad * (1 / 12.5e9 - 1 / 450e9), rel=0.02)
    a_gpu = hsdp_step("us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge", intra_gbit=1)
    assert a_gpu < host_1  # one GPU a region: no reduction inside it, whatever the bandwidth


def test_hsdp_reduces_across_regions_a_transformer_block_at_a_time():
    """FSDP2 all-reduces each wrapped unit across the regions on its own, one per block of a
    transformer (35 for 7 B), not DDP's 25 MB buckets (1120 for 7 B, each paying its round
    trips: 110 s a step at 10 Gbit/s, 80 ms)."""
    from cloudtrain.forecast import transformer_blocks

    assert [transformer_blocks(p) for p in (1e9, 7e9, 70e9, 1e5)] == [17, 35, 82, 1]
    ten = {("us-east-1", "eu-west-1"): Link(10000, 80), ("eu-west-1", "us-east-1"): Link(10000, 80)}
    hsdp = rows(forecast(Workload(7e9, step_s=1.7, shard=True), TWO, ten))["HSDP (FSDP2)"]
    wire = 4 * 7e9 / (10e9 / 8)  # a ring of the two regions sends the fp32 gradients once
    assert wire + 1.7 < hsdp.step_s < wire + 1.7 + 35 * 0.2  # and a few round trips a block


def test_a_single_region_has_no_cross_region_modes():
    one = Cluster.parse("us-east-1=2xp5.48xlarge")
    result = forecast(MODEL, one, {})
    assert [r.mode for r in result.rows] == ["DDP", "DDP + fp16 hook"]
    assert all(r.wan_gb_per_1000 == 0 for r in result.rows)


@pytest.mark.parametrize(
    "cluster, links, workload, message",
    [
        ("us-east-1=1xp9.huge,eu-west-1=1xg5.xlarge", US_EU, MODEL, "unknown instance type 'p9.huge'"),
        ("us-east-1=1xg5.xlarge,mars-1=1xg5.xlarge", US_EU, MODEL, "unknown region 'mars-1'"),
        ("us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge", dict(list(US_EU.items())[:1]), MODEL,
         "no link given for eu-west-1 -> us-east-1"),
        ("us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge", US_EU, Workload(7e9, step_s=1.0),
         "fits no mode: 112 GB per GPU against 22 GB usable"),
    ],
)  # fmt: skip
def test_bad_inputs_name_what_to_add(cluster, links, workload, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        forecast(workload, Cluster.parse(cluster), links)
    with pytest.raises(ValueError, match="tokens_per_gpu or as a measured step_s"):
        Workload(1e6)


def _plan(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cloudtrain.cli", "plan", "--params", "125e6", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_plan_reads_the_examples_tfvars_and_prices_them_on_demand():
    """The HCL file of terraform/examples/two-region (python-hcl2 keeps its strings' quotes),
    spot as it says, and on demand with --on-demand."""
    tfvars = str(ROOT / "terraform" / "examples" / "two-region" / "terraform.tfvars")
    base = ["--step-ms", "200", "--tfvars", tfvars, "--profile", "us-eu", "--json"]
    spot, on_demand = _plan(*base), _plan(*base, "--on-demand")
    assert spot.returncode == on_demand.returncode == 0, spot.stderr + on_demand.stderr
    ddp = [next(r for r in json.loads(res.stdout)["rows"] if r["mode"] == "DDP")
           for res in (spot, on_demand)]  # fmt: skip
    hours = 1000 * ddp[0]["step_s"] / 3600
    instances = [d["dollars_per_1000"] - d["egress_dollars_per_1000"] for d in ddp]
    g5 = PRICES["instances"]["g5.xlarge"]
    assert instances == pytest.approx([4 * g5[3] * hours, 4 * g5[2] * hours])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tfvars", "/nonexistent/terraform.tfvars.json"],
         "--tfvars /nonexistent/terraform.tfvars.json: No such file or directory"),
        (["--cluster", "us-east-1=1xg5.xlarge,us-east-1=2xg5.xlarge"], "'us-east-1' named twice"),
        (["--cluster", "us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge", "--profile", "us-eu",
          "--link", "us-east-1,eu-central-1=1000:80"],
         "a link names 'eu-central-1', not a region of the cluster"),
        (["--cluster", "us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge",
          "--link", "us-east-1,eu-west-1=0:80"], "0.0 Mbit/s: give its rate, above 0"),
        (["--cluster", "us-east-1=1xg5.xlarge", "--mfu", "0"], "mfu=0.0: give a number above 0"),
        (["--params", "inf", "--cluster", "us-east-1=1xg5.xlarge"], "params=inf"),
        # at once, before the modes' packets are counted (minutes for 1e13 parameters)
        (["--params", "1e13", "--cluster", "us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge",
          "--profile", "us-eu"], "fits no mode: 160000 GB per GPU against 22 GB usable"),
        (["--cluster", "us-east-1=1xg5.xlarge", "--prices", "PRICES"],
         "inter_region_per_gb['default'] must be $ per GB, 0 or more"),
        (["--cluster", "us-east-1=1xg5.xlarge", "--probe", "PROBE"],
         "no beta_Bps and alpha_s matrices"),
        (["--cluster", "us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge", "--probe", "FOUR",
          "--ranks-per-region", "3"], "the probe measured 4 ranks, which it does not divide"),
        (["--cluster", "us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge", "--probe", "FOUR"],
         "no regions in it; give --ranks-per-region"),
    ],
)  # fmt: skip
def test_plan_names_bad_input_in_one_line(tmp_path, args, message):
    prices, probe = tmp_path / "prices.json", tmp_path / "probe.json"
    prices.write_text(json.dumps({"inter_region_per_gb": {"default": -0.02}}))
    probe.write_text(json.dumps({"beta": []}))
    four = tmp_path / "four.json"  # 4 ranks, 2 regions of 2
    four.write_text(json.dumps({"beta_Bps": [[1e9] * 4] * 4, "alpha_s": [[0.01] * 4] * 4}))
    files = {"PRICES": prices, "PROBE": probe, "FOUR": four}
    args = [str(files[a]) if a in files else a for a in args]
    res = _plan(*([] if "--step-ms" in args else ["--step-ms", "200"]), *args)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("cloudtrain plan: ") and message in res.stderr, res.stderr


def test_plan_reads_a_probe_saved_through_cloudtrain_launch(tmp_path):
    """`cloudtrain launch ... -- cloudtrain probe --json > probe.json` leaves horovodrun's
    "[0]<stdout>:" before rank 0's line: the links read as from the bare output."""
    probe = {"alpha_s": [[0, 0.04], [0.04, 0]], "beta_Bps": [[None, 12.5e6], [25e6, None]],
             "regions": [0, 1]}  # fmt: skip
    bare, launched = tmp_path / "bare.json", tmp_path / "launched.json"
    bare.write_text(json.dumps(probe))
    launched.write_text(f"[1]<stderr>:a warning\n[0]<stdout>:{json.dumps(probe)}\n")
    base = ["--step-ms", "200", "--cluster", "us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge"]
    runs = [_plan(*base, "--probe", str(path), "--json") for path in (bare, launched)]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr
    assert json.loads(runs[0].stdout) == json.loads(runs[1].stdout)


def test_emit_writes_the_fp16_preset_where_the_fp16_row_is_recommended(tmp_path):
    res = _plan("--tokens-per-gpu", "8192", "--params", "7e9",
                "--cluster", "us-east-1=2xp5en.48xlarge", "--emit", str(tmp_path))  # fmt: skip
    assert res.returncode == 0 and "recommended: DDP + fp16 hook" in res.stdout, res.stdout
    assert CompressionConfig.resolve(str(tmp_path / "cloudtrain.json")).codec == "fp16"


def test_a_link_without_a_rate_or_with_a_round_trip_out_of_range_is_refused():
    for mbit in (0, -5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="give its rate, above 0"):
            Link(mbit, 80)
    for rtt_ms in (-1, 80_000, float("nan")):
        with pytest.raises(ValueError, match="give it in milliseconds, 0 to 60000"):
            Link(1000, rtt_ms)
    assert Link(0.5, 0) == Link(0.5, 0.0) and Link(1000, 60_000).rtt_ms == 60_000


def test_a_price_file_overrides_and_a_malformed_one_is_refused(tmp_path):
    good = tmp_path / "prices.json"
    good.write_text(
        json.dumps({"date": "2027-01", "instances": {"g5.xlarge": ["A10G", 1, 2.0, 1.0]}})
    )
    prices = load_prices(good)
    assert prices["date"] == "2027-01" and prices["instances"]["g5.xlarge"][3] == 1.0
    assert prices["instances"]["p5.48xlarge"] == PRICES["instances"]["p5.48xlarge"]
    bad = tmp_path / "bad.json"
    for entry in (["H100", 8], ["H100", 0, 1.0, 1.0], ["H100", 8, -16.3, 6.5], ["H100", "8", 1, 1]):
        bad.write_text(json.dumps({"instances": {"x.large": entry}}))
        with pytest.raises(ValueError, match=r"instances\['x.large'\] must be \[GPU, GPUs per"):
            load_prices(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="a JSON object of instances"):
        load_prices(bad)
    more = tmp_path / "more.json"  # a region added: the built-in ones stay known
    more.write_text(json.dumps({"regions": ["me-central-1"]}))
    assert load_prices(more)["regions"] == [*PRICES["regions"], "me-central-1"]


def test_emit_writes_a_config_cloudddp_loads_and_variables_terraform_accepts(tmp_path):
    cmd = [
        sys.executable, "-m", "cloudtrain.cli", "plan", "--params", "2e6", "--step-ms", "40",
        "--cluster", "us-east-1=2xg5.xlarge,eu-west-1=2xg5.xlarge", "--profile", "us-eu",
        "--emit", str(tmp_path), "--json",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    best = next(r for r in report["rows"] if r["mode"] == report["recommended"])
    config = CompressionConfig.resolve(str(tmp_path / "cloudtrain.json"))
    assert config.to_dict() == best["config"]
    options = SerializationOptions(with_comments=False, strip_string_quotes=True)
    variables = hcl2.loads(
        (tmp_path / "terraform.tfvars").read_text(), serialization_options=options
    )
    regions = variables["regions"]
    assert {name: (r["instance_count"], r["instance_type"]) for name, r in regions.items()} == {
        "us-east-1": (2, "g5.xlarge"),
        "eu-west-1": (2, "g5.xlarge"),
    }
    outputs = plan_module_outputs(
        tmp_path / "tf", {k: variables[k] for k in ("cluster_name", "regions", "operator_cidrs")}
    )
    assert set(outputs["regions"]) == {"us-east-1", "eu-west-1"}


def test_ddp_is_a_ring_over_every_rank_and_hsdp_one_over_the_regions():
    # 2 regions x 2 ranks, 20 MB/s links (10 per shard owner), 80 ms; 4 MB of gradients
    link = LinkEstimate(10e6, 0.08)
    s = Setting(1_000_000, 4, (link, link), 2, 0.01, 0.002)
    grad, trips = 4e6, s.buckets * 0.08
    step, wan = predict_ddp(s, 4)
    # each boundary carries 2 (n - 1) / n of the gradients; the ring's 6 steps wait for a chain
    # of hops that crosses 3 times (1.5 round trips a bucket)
    assert wan == [pytest.approx(1.5 * grad)] * 2
    assert step == pytest.approx(0.01 + 1.5 * grad / 20e6 + 1.5 * trips)
    # HSDP: reduced inside the region first, then a ring of the 2 regions: once, 1 round trip
    step, wan = predict_ddp(s, 4, hsdp=True)
    assert wan == [pytest.approx(grad)] * 2
    assert step == pytest.approx(0.01 + 0.002 + grad / 20e6 + trips)
    # 16 ranks: the chain through 30 steps crosses the two boundaries 4 times, not 15
    many = dataclasses.replace(s, world=16, shards=8, links=(LinkEstimate(2.5e6, 0.08),) * 2)
    step, wan = predict_ddp(many, 4)
    assert step == pytest.approx(0.01 + 30 / 16 * grad / 20e6 + 2 * trips)


def test_over_gloo_every_step_of_a_ring_across_regions_waits_for_its_crossing_hop():
    """gloo sends a message once its receiver has said it posted the receive: each of the ring's
    2 (n - 1) steps waits a round trip, or its message's transfer and half of one where that is
    longer, and the last half a round trip more (fitted to gloo's all-reduce on the emulated
    network: about 6 round trips a bucket at 4 ranks, where the pipelined ring's chain gives
    1.5)."""
    rtt, grad = 0.08, 4e6
    # 2 regions x 2 ranks; 1000 Mbit/s a region: a step's 1 MB takes 8 ms, under half a trip
    owner = LinkEstimate(62.5e6, rtt)
    gloo = Setting(1_000_000, 4, (owner, owner), 2, 0.0, 0.0, handshake=True)
    assert predict_ddp(gloo, 4)[0] == pytest.approx(6 * rtt + rtt / 2)
    nccl = dataclasses.replace(gloo, handshake=False)  # the pipelined ring: the chain of hops
    assert predict_ddp(nccl, 4)[0] == pytest.approx(1.5 * grad / 125e6 + 1.5 * rtt)
    # 100 Mbit/s: a step's 1 MB takes 80 ms, longer than half a round trip
    slow = dataclasses.replace(gloo, links=(LinkEstimate(6.25e6, rtt),) * 2)
    assert predict_ddp(slow, 4)[0] == pytest.approx(6 * (1e6 / 12.5e6 + rtt / 2) + rtt / 2)
    # the bytes do not change, and without a round trip neither does the time
    assert predict_ddp(slow, 4)[1] == predict_ddp(dataclasses.replace(slow, handshake=False), 4)[1]
    flat = dataclasses.replace(slow, links=(LinkEstimate(6.25e6, 0.0),) * 2)
    assert predict_ddp(flat, 4)[0] == pytest.approx(
        predict_ddp(dataclasses.replace(flat, handshake=False), 4)[0]
    )
    # HSDP's ring of the 2 regions: 2 steps; and a bucket's worth of that per unit, in turn
    assert predict_ddp(gloo, 4, hsdp=True)[0] == pytest.approx(2 * rtt + rtt / 2)
    assert predict_ddp(gloo, 4, hsdp=True, units=2)[0] == pytest.approx(2 * (2 * rtt + rtt / 2))
    with pytest.raises(ValueError, match="Ring: 1 ranks in 1 regions"):
        Ring(1, 1)


def test_per_step_rungs_hide_behind_compute_all_but_the_last_buckets_exchange():
    """predict_rungs: the exchange (half a round trip, transfer, codecs' CPU, the dense reduction in
    the region) past what hides in compute; the last bucket's starts when the backward ends, so
    a model of one bucket hides none, and a plan that compresses nothing is DDP's ring."""
    from cloudtrain.forecast import predict_rungs

    owner = LinkEstimate(6.25e6, 0.08)  # 100 Mbit/s a region, 2 shard owners
    four_bit = [("quant", 4)] * 2
    one = Setting(1_000_000, 4, (owner, owner), 2, 0.1, 0.004)  # 4 MB: one 25 MB bucket
    model = one.cost_model([("none", None), ("quant", 4)])
    exchange = model.rung_seconds(owner, 1, 0, plain=False)
    # half the round trip: the stream's receive was posted at its last exchange
    assert exchange == pytest.approx(0.08 / 2 + model.sizes[1] / 6.25e6 + 0.004)
    assert predict_rungs(one, four_bit)[0] == pytest.approx(0.1 + exchange)
    # the codecs' CPU counts where a region compresses
    cpu = dataclasses.replace(one, cpu_s=0.003)
    assert predict_rungs(cpu, four_bit)[0] == pytest.approx(0.1 + exchange + 0.003)
    # 100 M parameters, 16 buckets: all but one bucket's share of the usable compute hides
    many = dataclasses.replace(one, numel=100_000_000)
    big = many.cost_model([("none", None), ("quant", 4)])
    assert big.buckets == 16 and big.usable == pytest.approx(0.05)  # half of 100 ms
    assert predict_rungs(many, four_bit)[0] == pytest.approx(
        0.1 + big.rung_seconds(owner, 1, 0, plain=False) - 0.05 * 15 / 16
    )
    # nothing compressed: the hook's plain all-reduce, DDP's ring; sharded, HSDP's
    assert predict_rungs(one, [("none", None)] * 2) == predict_ddp(one, 4)
    assert predict_rungs(one, [("none", None)] * 2, sharded=True) == predict_ddp(one, 4, True)


def test_streaming_fragments_send_the_same_bytes_and_overlap_hides_their_exchange():
    """Streaming DiLoCo's schedule in the forecast: F fragments sync in turn, each once every H
    steps (the same bytes a step as one sync of the whole model, F half round trips); an exchange
    that overlaps tau steps stalls only what those steps do not hide, and a link that cannot
    carry the F exchanges within H steps sets the pace."""
    from cloudtrain.forecast import predict_outer

    four_bit, owner = ("quant", 4), LinkEstimate(6.25e6, 0.08)
    s = Setting(4_000_000, 4, (owner, owner), 2, 0.5, 0.0)
    whole, whole_sent = predict_outer(s, 100, [four_bit] * 2, zstd=False)
    split, split_sent = predict_outer(s, 100, [four_bit] * 2, zstd=False, fragments=4)
    assert split_sent == [pytest.approx(b, rel=1e-3) for b in whole_sent]  # 3 headers more
    # 3 more half round trips in H (each fragment's receives were posted at its last sync)
    assert split == pytest.approx(whole + 3 * 0.08 / 2 / 100, rel=1e-5)
    hidden, hidden_sent = predict_outer(s, 100, [four_bit] * 2, zstd=False, fragments=4, overlap=1)
    assert hidden_sent == split_sent
    exchange = 0.08 / 2 + 2 * 4_000_000 / 4 / 2 * 0.5 / 6.25e6  # a fragment: ~0.2 s, < a step
    assert exchange < 0.5 and hidden == pytest.approx(0.5)  # all of it behind the next step
    slow = Setting(4_000_000, 4, (LinkEstimate(1e5, 0.08),) * 2, 2, 0.5, 0.0)
    paced, _ = predict_outer(slow, 100, [four_bit] * 2, zstd=False, fragments=4, overlap=1)
    carried, _ = predict_outer(slow, 100, [four_bit] * 2, zstd=False, fragments=1, overlap=1)
    assert paced > 0.5 and carried > 0.5  # the link cannot carry them in H steps: it paces
    # a forecast row says the schedule it priced
    row = forecast(
        Workload(params=50e6, step_s=0.5),
        Cluster.parse("us-east-1=1xg5.xlarge,eu-west-1=1xg5.xlarge"),
        {("us-east-1", "eu-west-1"): Link(100, 80), ("eu-west-1", "us-east-1"): Link(100, 80)},
        outer=["diloco-streaming"],
    ).rows[-1]
    assert "4 fragments, overlap 1" in row.detail and row.step_s == pytest.approx(0.5, rel=0.01)


def test_zstd_shrinks_the_packets_it_is_on_for_by_its_ratio_on_normal_values():
    """Where a plan puts packets through zstd (the outer loop always, unless the config says
    no; per-step "auto" where the controller turned it on), a forecast counts them smaller by
    Codecs.zstd_ratio: zstd's ratio on the rung's packet of normal values (4-bit's: 1.15;
    the outer loop's bytes were 11-12 % over the emulator's with none counted). The ratio is
    computed from a generator of its own: the run's random state is not touched."""
    import torch

    from cloudtrain.costs import default_codecs
    from cloudtrain.forecast import predict_outer, predict_rungs
    from cloudtrain.plan import ceil_div

    codecs, four_bit = default_codecs(), ("quant", 4)
    state = torch.get_rng_state()
    ratio = codecs.zstd_ratio(four_bit)
    assert torch.equal(torch.get_rng_state(), state)
    assert 1.1 < ratio < 1.2 and codecs.zstd_ratio(("topk>quant", (0.02, 2))) >= 1.0
    owner = LinkEstimate(6.25e6, 0.08)
    s = Setting(1_000_000, 4, (owner, owner), 2, 0.1, 0.004)
    packet = codecs.wire_nbytes(four_bit, ceil_div(s.numel, s.shards))
    step, sent = predict_outer(s, 50, [four_bit] * 2)
    plain_step, plain_sent = predict_outer(s, 50, [four_bit] * 2, zstd=False)
    assert plain_sent == [pytest.approx(2 * packet / 50)] * 2  # two owners, one receiver
    assert sent == [pytest.approx(b / ratio) for b in plain_sent]
    saved = 2 * packet * (1 - 1 / ratio) / 6.25e6 / 50  # two owners' packets on the shared link
    assert step == pytest.approx(plain_step - saved / 2)  # each owner's own link time
    # per step: the region whose plan has zstd on sends 1/ratio of its bytes
    on, off = predict_rungs(s, [four_bit] * 2, zstd=[True, False]), predict_rungs(s, [four_bit] * 2)
    assert on[1] == [pytest.approx(off[1][0] / ratio), off[1][1]]
    assert on[0] == pytest.approx(off[0])  # the step waits for the region without it
    both = predict_rungs(s, [four_bit] * 2, zstd=[True, True])
    assert both[0] < off[0]
