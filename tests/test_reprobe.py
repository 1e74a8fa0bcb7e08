"""The controller's re-probe on the real emulated WAN: a link that falls while "auto" trains is
found by the next re-probe, which measures it with nothing else on the link (the exchanges in
flight finished, every rank waiting) - not what training leaves of it - and confirmed by the one
at the decision after it. Packets alone cannot lower an estimate (cloudtrain.estimates), so the
estimate after the fall is the re-probes'."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
from distributed import spawn_in_regions

from cloudtrain.tools import netem
from cloudtrain.tools.netem import Emulator, teardown

WORKER = """
import json, sys
import torch
import cloudtrain
from cloudtrain import CompressionConfig
from cloudtrain.plan import describe

cloudtrain.init(timeout_s=120)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
# a decision every step, so that the re-probes come within this test's steps
config = CompressionConfig.resolve("auto", timeout_s=120, controller={"interval": 1})
ddp = cloudtrain.CloudDDP(model, config)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
rank = torch.distributed.get_rank()

def step(i):
    g = torch.Generator().manual_seed(100 * i + rank)
    opt.zero_grad()
    ddp(torch.randn(32, 256, generator=g)).square().mean().backward()
    opt.step()

for i in range(5):
    step(i)
print("warm", flush=True)
sys.stdin.readline()  # the link falls now
probed = ddp.stats().controller["probed"]["decisions_ago"]
for i in range(5, 400):
    step(i)
    seen = ddp.stats().controller["probed"]
    # a decision that carried a re-probe took effect, and nothing waits for another (a fall
    # for its second reading, a step-time jump for its re-probe)
    if seen["decisions_ago"] < probed and not seen["unsettled"]:
        break
    probed = seen["decisions_ago"]
# the cost model's pick for the links as the controller believes them (whole links, given as
# a user would measure them) is its pick on its own estimates (one shard owner's share each)
ctl, numels = ddp.comm.controller, ddp.comm.shard_numels()
believed = {n: (l["bandwidth_mbit"] * l["senders"], l["rtt_ms"]) for n, l in ctl.snapshot()["links"].items()}
own = [ctl.options.ladder[r] for r in ctl.planner.rungs_for(ctl.estimates, numels, ctl.guard)]
same = list(ctl.plan_for_links(believed, numels).values()) == [describe(r) for r in own]
print(json.dumps({"step": i, "same_pick": same, **ddp.stats().controller}), flush=True)
ddp.close()
torch.distributed.destroy_process_group()  # as README's scripts end (a live gloo group can abort at exit)
"""


@pytest.mark.skipif(not netem.available()[0], reason=f"no WAN emulator: {netem.available()[1]}")
@pytest.mark.timeout(400)
def test_a_link_that_falls_is_found_by_the_reprobe_while_training_runs():
    name = f"rp{os.getpid() % 10000}-{uuid.uuid4().hex[:4]}"
    rate = {"us": 200, "eu": 200}
    try:
        with Emulator({"us": 2, "eu": 2}, rate, rtt_ms=20, name=name, down_mbit=rate) as wan:
            procs = spawn_in_regions(wan, WORKER, 29541, stdin=subprocess.PIPE)
            for p in procs:
                assert p.stdout.readline().strip() == "warm"
            for region in rate:
                wan.set_rate(region, 50, down_mbit=50)
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            outs = [p.communicate(timeout=300)[0] for p in procs]
            assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    finally:
        teardown(name)
    report = json.loads(outs[0].strip().splitlines()[-1])
    print(f"re-probed by step {report['step']}: {report['links']}")
    assert report["step"] < 399, report  # a re-probe came
    assert report["same_pick"], report
    for region, link in report["links"].items():
        estimate = link["bandwidth_mbit"] * link["senders"]
        # the link as one flow sees it, not the half or less that training left of it
        assert 37.5 <= estimate <= 62.5, (region, link)
        assert 15 <= link["rtt_ms"] <= 30, (region, link)
