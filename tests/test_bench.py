"""`cloudtrain bench` runs end to end (briefly) and reports what crossed the emulated WAN.

Timing targets are the benchmark's business (README: the bench's figures), not a test's: here
only what does not depend on a noisy machine - bytes on the shaped links, the report's parts, and
that the emulated network (with its round-trip time) was used wherever the machine allows it: as
root the bench never drops to loopback.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from support import EMULATOR_MACHINE, skip_or_fail

from cloudtrain.config import LADDER
from cloudtrain.plan import describe
from cloudtrain.tools import netem
from cloudtrain.tools.bench import SCENARIOS, _mean_ms, _predict, _spans
from cloudtrain.tools.runner import Run

pytestmark = pytest.mark.timeout(420)


def test_bench_reports_wan_bytes_from_the_shaped_links(tmp_path):
    cmd = [
        sys.executable, "-m", "cloudtrain.tools.bench", "--steps", "8", "--warmup", "2", "--hidden", "1024",
        "--methods", "compute", "ddp", "cloud-topk-1pct", "cloud-diloco", "--out", str(tmp_path),
        "--json",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    rows = {r["method"]: r for r in report["rows"]}
    asked = {"compute", "ddp", "cloud-topk-1pct", "cloud-diloco"}
    assert asked <= set(rows) <= asked | {"ddp-loopback"}  # the bench adds its DDP baseline
    assert (tmp_path / "bench-wan.json").exists() and (tmp_path / "bench-wan.png").exists()
    for row in rows.values():
        assert len(row["step_times_ms"]) == 8 and 0 <= row["accuracy"] <= 1
    if not EMULATOR_MACHINE:
        assert "loopback" in report["network"] and report["emulation"] == "none (loopback)"
        skip_or_fail("netem", "the bench's WAN half needs root with ip and tc: only loopback ran")
    # The wan scenario by default: 100 Mbit/s with 80 ms between the regions, emulated.
    assert "network namespaces" in report["network"], report["network"]
    assert "100 Mbit/s" in report["network"] and "80 ms RTT" in report["network"]
    assert report["emulation"] in (netem.DELAY_LINE, netem.DELAY_NETEM), report["network"]
    assert report["rtt_ms"] == 80
    for method in ("compute", "ddp-loopback"):  # loopback runs cross no emulated link
        assert method not in rows or rows[method]["wan_mb_per_step"] is None
    ddp, cloud = rows["ddp"]["wan_mb_per_step"], rows["cloud-topk-1pct"]["wan_mb_per_step"]
    # 1% of the values plus their indices, against every value (1.5x, for a ring of 4 ranks)
    assert ddp > 20 * cloud > 0, (ddp, cloud)
    # the outer loop: its H chosen for the link (>= 5), and the final sync of finish_outer() -
    # two syncs in 8 steps at most, whatever codec it picked (a sync every step would be 1.5x)
    outer = rows["cloud-diloco"]
    assert ddp > 3 * outer["wan_mb_per_step"] > 0, (ddp, outer["wan_mb_per_step"])
    assert outer["plans"] and outer["plans"][0][1][0].startswith("every "), outer["plans"]
    # every step of DDP waits for at least one round trip across the regions
    assert min(rows["ddp"]["step_times_ms"][2:]) >= 80, rows["ddp"]["step_times_ms"]
    # the planner's prediction beside every shaped row: its bytes are the emulator's counted
    # ones (a ring's, top-k's wire sizes; the outer loop's syncs, zstd left out of the model).
    # The wire's framing (headers, acknowledgements, gloo's preamble: ~0.8 KB a packet) is not
    # in the model: 1 % of a 64-256-256-10 MLP's gradient is 2.3 KB a packet, a third more on
    # the wire; of the 64-1024-1024-10 one's, 5 % more
    for method, tolerance in (("ddp", 0.1), ("cloud-topk-1pct", 0.1), ("cloud-diloco", 0.25)):
        row = rows[method]
        assert row["predicted_step_ms"] > 0, row
        ratio = row["predicted_wan_mb_per_step"] / row["wan_mb_per_step"]
        assert abs(ratio - 1) <= tolerance, (method, ratio)


def test_auto_is_predicted_for_each_plan_by_the_counted_steps_it_was_in_force():
    # plans in force from steps 12, 26 and 42 of 60, the first 5 steps not counted
    assert _spans([12, 26, 42], 60, 5) == [21, 16, 18]
    assert _spans([0], 60, 5) == [55]
    assert _spans([3, 4, 70], 60, 5) == [0, 55, 0]  # in force from the warm-up; after the end


def test_auto_is_predicted_as_each_plan_it_ran_by_the_counted_steps_in_force():
    plain, quant = [["none", None]] * 2, [["quant", 4]] * 2
    compute = Run("compute", 10.0, None, 0.9, [], None, [])

    def predict(history, method="cloud-auto"):  # 60 steps, 10 of warm-up, the wan scenario
        run = Run(method, 100.0, 0, 0.9, [], None, [], {}, numel=1_000_000,
                  plan_history=history)  # fmt: skip
        return _predict(run, compute, None, SCENARIOS["wan"], "emulated", (60, 10))

    (plain_ms, plain_mb), (quant_ms, quant_mb) = predict([(0, plain)]), predict([(0, quant)])
    # a plan that compresses nothing runs the hook's plain all-reduce over every rank: DDP's
    # ring, 1.5x the 4 MB gradient across each region's link, not the hierarchy's 1x
    assert (plain_ms, plain_mb) == pytest.approx(predict(None, "ddp"))
    assert plain_mb == pytest.approx(2 * 1.5 * 4.0)
    assert quant_mb == pytest.approx(2 * 4.0 / 8, rel=0.05) and quant_ms < plain_ms / 2
    # plain for the first 10 counted steps, 4-bit from step 20 on: 40 steps
    mixed_ms, mixed_mb = predict([(0, plain), (20, quant)])
    assert mixed_mb == pytest.approx((10 * plain_mb + 40 * quant_mb) / 50)
    assert mixed_ms == pytest.approx((10 * plain_ms + 40 * quant_ms) / 50)
    assert predict([(0, plain), (70, quant)]) == pytest.approx((plain_ms, plain_mb))


def test_auto_counts_the_gather_in_its_region_at_most_as_long_as_the_reduce():
    """The gather moves back what the reduce moved: where it took longer, it waited for the
    region's other owner's packet, which the exchange's model already counts."""
    compute, quant = Run("compute", 10.0, None, 0.9, [], None, []), [["quant", 4]] * 2

    def predict(reduce_ms, gather_ms):
        stages = {"intra_reduce": reduce_ms, "intra_gather": gather_ms}
        run = Run("cloud-auto", 100.0, 0, 0.9, [], None, [], stages, numel=1_000_000,
                  plan_history=[(0, quant)])  # fmt: skip
        return _predict(run, compute, None, SCENARIOS["wan"], "emulated", (60, 10))[0]

    assert predict(5.0, 30.0) == pytest.approx(predict(5.0, 5.0))
    assert predict(5.0, 2.0) == pytest.approx(predict(5.0, 5.0) - 3.0)


def test_auto_takes_its_stages_from_the_compressed_steps_and_its_codecs_cpu():
    """A row's stages are per step of the whole run, and ran only where the plan compressed:
    plain for 30 of 60 steps, a stage of 2.5 ms a step is 5 ms a compressed step. The codecs'
    encode, decode and guard stages count where a region compresses."""
    compute = Run("compute", 10.0, None, 0.9, [], None, [])
    plain, quant = [["none", None]] * 2, [["quant", 4]] * 2

    def predict(stages, history):
        run = Run("cloud-auto", 100.0, 0, 0.9, [], None, [], stages, numel=1_000_000,
                  plan_history=history)  # fmt: skip
        return _predict(run, compute, None, SCENARIOS["wan"], "emulated", (60, 0))[0]

    def even(ms):
        return {"intra_reduce": ms, "intra_gather": ms}

    half = [(0, plain), (30, quant)]
    assert predict(even(2.5), half) == pytest.approx(
        (30 * predict({}, [(0, plain)]) + 30 * predict(even(5.0), [(0, quant)])) / 60
    )
    codecs = {"encode": 2.0, "decode": 0.5, "guard": 0.5}
    assert predict(codecs, [(0, quant)]) == pytest.approx(predict({}, [(0, quant)]) + 3.0)


def test_an_outer_row_is_predicted_with_its_fragments_and_overlap():
    """Streaming DiLoCo's rows: the schedule the run reported carries its fragments and overlap
    (a report without them: one fragment, no overlap), and the prediction is
    forecast.predict_outer's with them - the same bytes, a different stall: a 4-bit exchange
    of 30 M parameters takes about 1.5 s at 100 Mbit/s and stalls a step of 0.4 s once every 20;
    a quarter of it hides behind one step (4 round trips a round: at a step of 10 ms it would
    cost more than it hides)."""
    compute, quant = Run("compute", 400.0, None, 0.9, [], None, []), [["quant", 4]] * 2

    def predict(schedule):
        run = Run("cloud-diloco", 420.0, 0, 0.9, [], None, [], {}, numel=30_000_000,
                  outer_schedule=schedule)  # fmt: skip
        return _predict(run, compute, None, SCENARIOS["wan"], "emulated", (60, 0))

    whole, old = predict([20, quant, 1, 0]), predict([20, quant])
    assert whole == old
    streaming = predict([20, quant, 4, 1])
    assert streaming[1] == pytest.approx(whole[1], rel=1e-3)
    assert streaming[0] < whole[0] - 30.0, (streaming, whole)


def test_a_sharded_per_step_row_is_predicted_from_a_sharded_inner_step():
    """Sharded per-step "auto": its compute is a sharded outer row's median step (an inner step:
    FSDP2's reductions in the region included), its plans predicted as "auto"'s from there;
    with no sharded outer row in the run, no prediction."""
    compute, quant = Run("compute", 50.0, None, 0.9, [], None, []), [["quant", 4]] * 2
    inner = Run("shard-diloco-4bit", 120.0, 0, 0.9, [], None, [], {}, numel=20_000_000,
                outer_schedule=[10, quant, 1, 0])  # fmt: skip

    def predict(base, history):
        run = Run("shard-auto", 400.0, 0, 0.9, [], None, [], {}, numel=20_000_000,
                  plan_history=history)  # fmt: skip
        return _predict(run, compute, base, SCENARIOS["wan"], "emulated", (60, 0))

    assert predict(None, [(0, quant)]) == (None, None)
    ms, mb = predict(inner, [(0, quant)])
    assert ms > 120.0 and mb == pytest.approx(2 * 80.0 / 8, rel=0.05)
    later = dataclasses.replace(inner, step_ms=220.0)
    assert ms < predict(later, [(0, quant)])[0] <= ms + 100.0 + 1e-6  # from the inner step on
    plain = predict(inner, [(0, [["none", None]] * 2)])  # compresses nothing: HSDP's
    hsdp = _predict(dataclasses.replace(inner, method="hsdp", outer_schedule=None),
                    compute, None, SCENARIOS["wan"], "emulated", (60, 0))  # fmt: skip
    assert plain[1] == pytest.approx(hsdp[1])


def test_predictions_stand_beside_the_mean_of_the_counted_steps():
    run = Run("ddp", 20.0, None, 0.9, [], None, [0.5, 0.01, 0.02, 0.03])
    assert _mean_ms(run, 1) == pytest.approx(20.0)  # the warm-up's 0.5 s left out
    assert _mean_ms(Run("ddp", 7.0, None, 0.9, [], None, []), 1) == 7.0  # no steps: the median


def test_a_run_whose_links_fall_is_predicted_phase_by_phase():
    """The drop scenario: its links at 1000 Mbit/s until --drop-at, at DROP_MBIT after; the
    prediction is each phase's over its counted steps, weighted by them."""
    from cloudtrain.tools.bench import DROP_MBIT, Scenario, _predict_phases

    compute = Run("compute", 10.0, None, 0.9, [], None, [])
    ddp = Run("ddp", 100.0, 0, 0.9, [], None, [], {}, numel=1_000_000)
    drop = SCENARIOS["drop"]
    fallen = Scenario(dict.fromkeys(drop.up, DROP_MBIT), dict.fromkeys(drop.up, DROP_MBIT))
    before = _predict(ddp, compute, None, drop, "emulated", (100, 10))
    after = _predict(ddp, compute, None, fallen, "emulated", (100, 10))
    both = _predict_phases(ddp, compute, None, [(0, drop), (60, fallen)], "emulated", (100, 10))
    assert after[0] > 10 * before[0]  # 50 Mbit/s against 1000
    assert both[0] == pytest.approx((50 * before[0] + 40 * after[0]) / 90)
    assert both[1] == pytest.approx(before[1])  # DDP's bytes do not depend on the link


def test_a_drop_the_run_does_not_reach_is_refused_before_anything_runs():
    cmd = [sys.executable, "-m", "cloudtrain.tools.bench", "--scenario", "drop", "--steps", "60"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "--drop-at 60 must be" in res.stderr, res.stderr[-2000:]
    assert "e.g. --steps 100" in res.stderr


def test_scenarios_carry_their_rtt_and_the_options_override_them():
    import argparse

    from cloudtrain.tools.bench import SCENARIOS, configure, netem_describe, scenario_links

    parser = argparse.ArgumentParser()
    configure(parser)
    wan = scenario_links(parser.parse_args([]))
    assert (wan.up, wan.rtt_ms) == ({"us": 100.0, "eu": 100.0}, 80.0)
    assert (
        netem_describe(wan)
        == "region links us 100 Mbit/s, eu 100 Mbit/s, 80 ms RTT between regions"
    )
    slow = scenario_links(parser.parse_args(["--mbit", "50", "--rtt-ms", "180"]))
    assert (slow.up, slow.down, slow.rtt_ms) == (
        {"us": 50.0, "eu": 50.0},
        {"us": 50.0, "eu": 50.0},
        180,
    )
    assert (
        SCENARIOS["unshaped"].rtt_ms == 0
        and scenario_links(parser.parse_args(["--scenario", "unshaped"])).up is None
    )
    hetero = scenario_links(parser.parse_args(["--scenario", "hetero", "--rtt-ms", "80"]))
    assert hetero.up == {"us": 1000.0, "eu": 50.0} and hetero.rtt_ms == 80
    with pytest.raises(SystemExit, match="--rtt-ms needs shaped links"):
        scenario_links(parser.parse_args(["--scenario", "unshaped", "--rtt-ms", "80"]))


def test_the_methods_named_are_the_rows_run():
    """--methods names the rows on every scenario (unshaped used to keep only compute, DDP and
    "auto" of them, silently); the WAN scenarios add DDP over unshaped links before them."""
    import argparse

    from cloudtrain.tools.bench import METHODS, bench_methods, configure

    parser = argparse.ArgumentParser()
    configure(parser)

    def rows(*argv: str) -> list[str]:
        return bench_methods(parser.parse_args(list(argv)))

    named = ["--methods", "ddp", "cloud-diloco-4bit"]
    assert rows("--scenario", "unshaped", *named) == ["ddp", "cloud-diloco-4bit"]
    assert rows("--scenario", "unshaped") == ["compute", "ddp", "cloud-auto"]
    assert rows(*named) == ["ddp-loopback", "ddp", "cloud-diloco-4bit"]
    assert rows() == list(METHODS)  # DDP over unshaped links among them
    assert rows("--scenario", "drop") == ["compute", "ddp", "cloud-auto"]
    assert rows("--sharded", "--methods", "hsdp") == ["hsdp"]


def test_hetero_throughput_counts_every_rank_over_the_window_all_share(tmp_path):
    """Regions stepping apart (work by time): the fast pair's warm-up of 10 one-second steps ends
    at 10 s, the slow pair's (two-second steps) at 20 s. Over the window both spend past their
    warm-ups (20 s to 40 s) the fast ranks train 200 samples each and the slow 100: 30 samples/s,
    the sum of the ranks' own rates. Samples over the longest rank's post-warm-up seconds would
    give 26.7, counting the slow pair over 20 s of the fast pair's 30."""
    from cloudtrain.tools.hetero import own_rates, read_reports, window_rate

    for rank, (seconds, steps) in enumerate([(1.0, 40), (1.0, 40), (2.0, 20), (2.0, 20)]):
        ends = [seconds * (i + 1) for i in range(steps)]
        report = {"samples": [10] * steps, "step_times": [seconds] * steps, "ends": ends}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(report))
    assert own_rates(read_reports(tmp_path, 4), 10) == [10.0, 10.0, 5.0, 5.0]
    assert window_rate(read_reports(tmp_path, 4), 10) == pytest.approx(30.0)
    # a step half inside the window counts half: the slow pair one second later
    for rank in (2, 3):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        report["ends"] = [end + 1.0 for end in report["ends"]]
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(report))
    assert window_rate(read_reports(tmp_path, 4), 10) == pytest.approx((2 * 190 + 2 * 95) / 19)
    with pytest.raises(ValueError, match="no wall-clock window past every rank.s 20 warm-up"):
        # a warm-up ending (41 s) after the last step (40 s)
        window_rate(read_reports(tmp_path, 4), 20)


def test_hetero_rows_keep_the_users_overrides_under_their_own():
    """--overrides reach the hetero-compute rows that set fields of their own (the "auto" rows'
    controller options, the by-time rows' outer options), and a row's own field wins where both
    set it."""
    from cloudtrain.tools.hetero import ROWS, row_overrides

    given = json.dumps({"controller": {"hidden_fraction": 0.1}, "global_batch": 64})
    merged = json.loads(row_overrides(given, ROWS["auto-shares"][2]))
    assert merged == {"controller": {"hidden_fraction": 0.1}, "global_batch": None}
    assert json.loads(row_overrides(None, {"outer": {"work": "time"}})) == {
        "outer": {"work": "time"}
    }
    # a section both set is merged: the user's outer momentum reaches the by-time row
    given = json.dumps({"outer": {"outer_momentum": 0.5, "work": "steps"}})
    assert json.loads(row_overrides(given, ROWS["diloco-time"][2])) == {
        "outer": {"outer_momentum": 0.5, "work": "time"}
    }


def test_hetero_compute_shares_the_batch_by_measured_throughput(tmp_path):
    """Region eu with half the ranks (--ranks-per-region 2 1) and its emulated accelerator 3x
    slower: alone its rank trains about a third as many samples per second as a fast one; with
    batch shares the fast ranks take the larger part of each step."""
    cmd = [
        sys.executable, "-m", "cloudtrain.tools.bench", "--scenario", "hetero-compute",
        "--steps", "40", "--warmup", "20", "--hidden", "256", "--batch", "192", "--sample-ms", "2",
        "--slowdown", "3", "--hetero-rows", "ideal", "auto-shares", "--ranks-per-region", "2", "1",
        "--out", str(tmp_path), "--json",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 3 and "2 ranks in us, 1 rank in eu" in report["network"]
    rows = {r["row"]: r for r in report["rows"]}
    fast, slow = rows["ideal"]["rank_samples_per_s"][:2], rows["ideal"]["rank_samples_per_s"][2:]
    assert len(slow) == 1 and min(fast) > 2 * slow[0], rows["ideal"]["rank_samples_per_s"]
    assert rows["ideal"]["x_ideal"] == 1 and rows["ideal"]["samples_per_s"] == sum(fast + slow)
    shared = rows["auto-shares"]["rank_samples_per_s"]
    # the shares are in force after the warm-up (SHARE_LEAD steps after the first warm decision):
    # in lockstep, the fast ranks' samples per second are their larger shares
    assert min(shared[:2]) > 1.3 * shared[2], shared
    assert report["slow_region_alone_samples_per_s"] == pytest.approx(slow[0])


def test_ranks_per_region_other_than_two_each_is_for_hetero_compute_only():
    """The other scenarios' tables and predictions are for 2 regions x 2 ranks: another layout
    is refused before anything starts, naming the scenario that takes it."""
    for argv, message in (
        (["--ranks-per-region", "2", "1"], "only with --scenario hetero-compute"),
        (["--scenario", "hetero-compute", "--ranks-per-region", "2", "0"], "at least 1 rank"),
    ):
        res = subprocess.run(
            [sys.executable, "-m", "cloudtrain.tools.bench", *argv],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert res.returncode != 0 and message in res.stderr, res.stderr[-2000:]


def test_estimates_bench_reports_each_link_against_one_tcp_flow(tmp_path):
    """`cloudtrain bench --estimates` at one point of its grid: one TCP flow each way, the
    region's two senders' flows at once, then "auto"; each region's row holds the flows' rates, the controller's estimate of the link (its
    senders' shares) and their ratio, its round trip near the one asked, the plan and the cost
    model's pick for the true link. (Whether estimates track the link is the bench's figure,
    docs/measurements.md: at this point 0.97-1.05x of the flow; tests/test_reprobe.py holds the
    re-probe to the link.)"""
    if not netem.available()[0]:
        skip_or_fail("netem", f"no WAN emulator: {netem.available()[1]}")
    cmd = [
        sys.executable, "-m", "cloudtrain.tools.bench", "--estimates", "--est-mbit", "200",
        "--est-rtt-ms", "80", "--steps", "40", "--warmup", "5", "--hidden", "256",
        "--out", str(tmp_path), "--json",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert (tmp_path / "bench-estimates.json").exists()
    rows = {r["region"]: r for r in report["rows"]}
    assert set(rows) == {"us", "eu"}
    for row in rows.values():
        assert 100 < row["flow_mbit"] <= 200, row  # one flow through a 200 Mbit/s link
        assert row["estimate_mbit"] > 0 and row["ratio"] == row["estimate_mbit"] / row["flow_mbit"]
        assert row["tracks"] == (abs(row["ratio"] - 1) <= report["tolerance"]), row
        # the region's two senders at once share the 200 Mbit/s link: together no more than it,
        # and not much less than one flow alone
        assert 0.8 * row["flow_mbit"] < row["flows_mbit"] <= 200 * 1.05, row
        assert row["ratio_flows"] == row["estimate_mbit"] / row["flows_mbit"], row
        assert row["tracks_flows"] == (abs(row["ratio_flows"] - 1) <= report["tolerance"]), row
        assert 70 <= row["rtt_estimate_ms"] <= 100, row
        assert row["plan"] and row["true_link_plan"] in {describe(r) for r in LADDER}, row
        assert row["same_rung"] == (row["plan"].removesuffix(" + zstd") == row["true_link_plan"])
        assert row["true_link_settled"] in {describe(r) for r in LADDER}, row
        assert row["kept_rung"] == (row["plan"].removesuffix(" + zstd") == row["true_link_settled"])
        assert 0 < row["ready_s"] < 120, row


def test_sharded_rows_hsdp_against_cloudtrain_on_the_shaped_links(tmp_path):
    """`cloudtrain bench --sharded`: the char transformer sharded with FSDP2 inside each region,
    torch's HSDP (a dense all-reduce across regions every step) beside cloudtrain.fully_shard in
    the outer loop, on the emulated WAN: the outer loop's bytes are a small part of HSDP's, and
    each row carries rank 0's memory and its loss."""
    cmd = [
        sys.executable, "-m", "cloudtrain.tools.bench", "--sharded", "--workload", "charlm",
        "--steps", "8", "--warmup", "2", "--eval-every", "4",
        "--methods", "compute", "hsdp", "shard-diloco-4bit", "--out", str(tmp_path), "--json",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"compute", "hsdp", "shard-diloco-4bit"}
    assert (tmp_path / "bench-sharded-wan.json").exists()
    assert report["global_batch"] == 32  # charlm's 8 sequences a rank
    for row in rows.values():
        assert len(row["step_times_ms"]) == 8 and 0 < row["accuracy"] < 6  # a loss
        held = row["memory"]
        # AdamW's two moments of the rank's parameters (FSDP2 pads its shards' storage)
        assert held["params"] < held["optimizer"] < 2.01 * held["params"], held
        assert held["peak_rss"] > held["total"]
    # sharded: each rank holds half of the model's parameters (2 ranks a region), unsharded all
    assert rows["hsdp"]["memory"]["params"] < 0.6 * rows["compute"]["memory"]["params"]
    outer = rows["shard-diloco-4bit"]
    assert outer["memory"]["cloudtrain"] > 0 and rows["hsdp"]["memory"]["cloudtrain"] == 0
    if not EMULATOR_MACHINE:
        skip_or_fail("netem", "the bench's WAN half needs root with ip and tc: only loopback ran")
    assert "network namespaces" in report["network"] and report["rtt_ms"] == 80
    hsdp = rows["hsdp"]
    # the outer loop syncs once in 8 steps (its H is larger): 4-bit of the shards, once,
    # against 8 dense all-reduces
    assert outer["hsdp_wan_x"] > 20, (hsdp["wan_mb_per_step"], outer["wan_mb_per_step"])
    assert outer["plans"][0][1][0].startswith("every "), outer["plans"]
    # every HSDP step waits for the regions' all-reduce, a round trip at least
    assert min(hsdp["step_times_ms"][2:]) >= 80, hsdp["step_times_ms"]
    assert abs(hsdp["predicted_wan_mb_per_step"] / hsdp["wan_mb_per_step"] - 1) < 0.1


def test_auto_counts_zstd_where_its_plans_had_it_on():
    """The runner reports each plan with its zstd stage by region; a plan with it on is
    predicted with packets Codecs.zstd_ratio smaller (a report without it: none)."""
    from cloudtrain.costs import default_codecs

    compute, quant = Run("compute", 10.0, None, 0.9, [], None, []), [["quant", 4]] * 2

    def predict(history):
        run = Run("cloud-auto", 100.0, 0, 0.9, [], None, [], {}, numel=1_000_000,
                  plan_history=history)  # fmt: skip
        return _predict(run, compute, None, SCENARIOS["wan"], "emulated", (60, 10))

    off, on = predict([(0, quant)]), predict([(0, quant, [True, True])])
    assert predict([(0, quant, [False, False])]) == off
    assert on[1] == pytest.approx(off[1] / default_codecs().zstd_ratio(("quant", 4)))
    assert on[0] < off[0]
