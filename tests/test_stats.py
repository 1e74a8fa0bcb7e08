"""CloudDDP's counters (cloudtrain.stats): a plain all-reduce's share of the ring, and stats()
against the truth over the emulated WAN - the bytes the interface counters saw cross regions, on
a run that takes both paths."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
from distributed import spawn_in_regions

from cloudtrain.stats import CommStats, ring_wan_bytes
from cloudtrain.tools import netem
from cloudtrain.tools.netem import Emulator, teardown

WORKER = """
import json, sys
import torch
import cloudtrain
from cloudtrain import CompressionConfig

cloudtrain.init(timeout_s=120)
torch.manual_seed(0)
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256))
# one model all-reduced plainly (nothing to compress), one sending compressed packets, one
# sending them through the zstd stage (packets of sizes only their senders know)
plain = cloudtrain.CloudDDP(model(), CompressionConfig.resolve("none", timeout_s=120))
packed = cloudtrain.CloudDDP(model(), CompressionConfig.resolve("quant8", timeout_s=120))
zipped = cloudtrain.CloudDDP(model(), CompressionConfig.resolve("quant8", timeout_s=120, zstd=True))
rank = torch.distributed.get_rank()
torch.distributed.barrier()
print("built", flush=True)  # DDP's start-up broadcast is done: the counters are read now
sys.stdin.readline()
for step in range(12):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(32, 256, generator=g)
    for m in (plain, packed, zipped):
        m(x).square().mean().backward()
s_plain, s_packed = plain.stats(), packed.stats()
print(json.dumps({
    "plain": s_plain.wan_bytes_sent, "packed": s_packed.wan_bytes_sent,
    "zipped": zipped.stats().wan_bytes_sent,
    "plain_compressed_steps": s_plain.compressed_steps,
    "packed_compressed_steps": s_packed.compressed_steps, "steps": s_packed.steps,
}), flush=True)
for m in (plain, packed, zipped):
    m.close()
torch.distributed.barrier()
print("counted", flush=True)  # every rank's exchanges are done: the counters are read now
sys.stdin.readline()
torch.distributed.destroy_process_group()  # as README's scripts end (a live gloo group can abort at exit)
"""


def test_ring_share_of_a_plain_all_reduce():
    regions = ("us", "us", "eu", "eu")
    # gloo's ring sends 2 (n-1)/n of the buffer to the next rank; ranks 1 and 3 send across
    assert [ring_wan_bytes(4000, r, regions) for r in range(4)] == [0, 6000, 0, 6000]
    assert ring_wan_bytes(4000, 0, ("us",)) == 0
    stats = CommStats(steps=3, wan_bytes_sent=10, seconds={"encode": 1.0})
    copy = stats.copy()
    copy.seconds["encode"] = 2.0
    assert stats.seconds["encode"] == 1.0  # a copy, not a view


@pytest.mark.skipif(not netem.available()[0], reason=f"no WAN emulator: {netem.available()[1]}")
@pytest.mark.timeout(300)
def test_stats_agree_with_the_interface_counters():
    name = f"st{os.getpid() % 10000}-{uuid.uuid4().hex[:4]}"
    try:
        with Emulator({"us": 2, "eu": 2}, 1000, name=name) as wan:
            procs = spawn_in_regions(wan, WORKER, 29531, stdin=subprocess.PIPE)
            for p in procs:
                assert p.stdout.readline().strip() == "built"
            before = wan.counters()  # start-up traffic (DDP's broadcast of the model) excluded
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            reports = [json.loads(p.stdout.readline()) for p in procs]
            assert all(p.stdout.readline().strip() == "counted" for p in procs)
            after = wan.counters()  # before any connection closes
            for p in procs:
                p.stdin.write("end\n")
                p.stdin.flush()
            outs = [p.communicate(timeout=240)[0] for p in procs]
            assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    finally:
        teardown(name)
    assert all(r["plain_compressed_steps"] == 0 for r in reports)  # the plain path
    assert all(r["packed_compressed_steps"] == r["steps"] == 12 for r in reports)
    reported = sum(r["plain"] + r["packed"] + r["zipped"] for r in reports)
    crossed = sum(after[g]["tx_bytes"] - before[g]["tx_bytes"] for g in after)
    each = [sum(r[k] for r in reports) for k in ("plain", "packed", "zipped")]
    print(f"stats(): {reported} B (plain, packets, zstd packets: {each}); counters: {crossed} B")
    assert each[0] > 0 and 0 < each[2] < each[1]
    # the counters also see TCP/IP and Ethernet headers and the control traffic: within 10 %
    assert 0.9 * crossed <= reported <= crossed, (reported, crossed)
