"""The prober on the real emulated WAN: it measures a tbf-shaped link to within 15% of its rate,
and clustering on its measurements recovers the emulator's regions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from cloudtrain.tools import netem
from cloudtrain.tools.netem import Emulator, teardown

AVAILABLE, WHY = netem.available()
pytestmark = [
    pytest.mark.skipif(not AVAILABLE, reason=f"WAN emulator unavailable: {WHY}"),
    pytest.mark.timeout(180),
]

PROBE = """
import json, torch.distributed as dist
import cloudtrain
from cloudtrain.probe import probe, cluster_regions
cloudtrain.init()
links = probe()
if dist.get_rank() == 0:
    print(json.dumps({"beta": [[b if b != float("inf") else None for b in row] for row in links.beta],
                      "alpha": links.alpha, "regions": cluster_regions(links)}))
dist.destroy_process_group()
"""


@pytest.fixture
def wan_name():
    name = f"p{os.getpid() % 100000}-{uuid.uuid4().hex[:6]}"
    yield name
    teardown(name)


def run_probe(wan: Emulator) -> dict:
    env = {"WORLD_SIZE": str(wan.world_size), "MASTER_PORT": "29531"}
    procs = [
        wan.popen(
            r,
            [sys.executable, "-c", PROBE],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(wan.world_size)
    ]
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return json.loads(outs[0].strip().splitlines()[-1])


def test_probe_measures_the_shaped_rate_within_15_percent(wan_name):
    with Emulator({"us": 1, "eu": 1}, mbit=100, name=wan_name) as wan:
        result = run_probe(wan)
    for i, j in ((0, 1), (1, 0)):
        mbit = 8 * result["beta"][i][j] / 1e6
        assert 85 <= mbit <= 115, f"link {i}->{j} measured at {mbit:.1f} Mbit/s, shaped at 100"


def test_clustering_on_measurements_recovers_the_regions(wan_name):
    with Emulator({"us": 2, "eu": 2}, mbit={"us": 100, "eu": 200}, name=wan_name) as wan:
        result = run_probe(wan)
    assert result["regions"] == [0, 0, 1, 1], result
    cross = 8 * result["beta"][0][2] / 1e6
    inside = 8 * result["beta"][0][1] / 1e6
    assert inside > 5 * cross, (inside, cross)
