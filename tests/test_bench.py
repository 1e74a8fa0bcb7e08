"""`cloudtrain bench` runs end to end (briefly) and reports what crossed the emulated WAN.

Timing targets are the benchmark's business (see the closing notes' figures), not a test's: here
only what does not depend on a noisy machine - bytes on the shaped links, the report's parts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cloudtrain.tools import netem

pytestmark = pytest.mark.timeout(420)


def test_bench_reports_wan_bytes_from_the_shaped_links(tmp_path):
    cmd = [
        sys.executable, "-m", "cloudtrain.tools.bench", "--steps", "8", "--warmup", "2", "--hidden", "256",
        "--methods", "compute", "ddp", "cloud-topk-1pct", "--out", str(tmp_path), "--json",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"compute", "ddp", "cloud-topk-1pct"}
    assert (tmp_path / "bench-wan.json").exists() and (tmp_path / "bench-wan.png").exists()
    for row in rows.values():
        assert len(row["step_times_ms"]) == 8 and 0 <= row["accuracy"] <= 1
    if netem.available()[0]:
        assert "rate only" in report["emulation"] or "delay" in report["emulation"]
        ddp, cloud = rows["ddp"]["wan_mb_per_step"], rows["cloud-topk-1pct"]["wan_mb_per_step"]
        # 1% of the values plus their indices, against every value (twice, for a ring all-reduce)
        assert ddp > 20 * cloud > 0, (ddp, cloud)
    else:
        assert "loopback" in report["network"]
