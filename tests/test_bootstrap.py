"""cloudtrain.init() on real processes: a script that ends right after its last collective (a
result all-reduced, the group destroyed, as the examples end) exits cleanly. torch's gloo worker
thread can still need the GIL then, and without init's exit drain such exits abort (SIGABRT,
"terminate called without an active exception") in 2-5 of 10 launches here (one at a time;
launches side by side abort less often)."""

from __future__ import annotations

import os
import subprocess
import sys

from distributed import free_port

SCRIPT = """
import torch, torch.distributed as dist
import cloudtrain

cloudtrain.init()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    opt.zero_grad()
    model(torch.randn(8, 64)).sum().backward()
    opt.step()

def result():  # its tensor goes out of scope with the function, as in the examples' main()
    done = torch.ones(1)
    dist.all_reduce(done)
    return done.item()

print("RESULT", result(), flush=True)
dist.destroy_process_group()
"""


def test_scripts_that_end_right_after_a_collective_exit_cleanly() -> None:
    failures = []
    for _ in range(8):
        port, procs = free_port(), []
        for rank in range(2):
            env = {
                **os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            }  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", SCRIPT],
                    env=env,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        try:
            for p in procs:
                out, err = p.communicate(timeout=120)
                assert "RESULT 2.0" in out, err[-2000:]
                if p.returncode != 0:
                    failures.append((p.returncode, err[-500:]))
        finally:
            for p in procs:
                p.kill()  # a launch that hung or failed leaves no process behind
                p.wait()
    assert not failures, failures


def test_a_rendezvous_that_cannot_be_reached_is_named_at_once() -> None:
    """A MASTER_ADDR that does not resolve (torch retried it until the 300 s timeout), a port
    that is not one, and a rendezvous nobody listens at: an error naming it, and `cloudtrain
    probe` says it in one line."""
    cases = [
        ("nohost.invalid", "29555", "MASTER_ADDR='nohost.invalid' does not resolve"),
        ("127.0.0.1", "x", "MASTER_PORT='x' is not a TCP port"),
        (
            "127.0.0.1",
            "1",
            "could not reach the rendezvous at 127.0.0.1:1 (MASTER_ADDR:MASTER_PORT)",
        ),
    ]
    for addr, port, message in cases:
        env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": addr,
               "MASTER_PORT": port, "CLOUDTRAIN_TIMEOUT": "2"}  # fmt: skip
        init = subprocess.run([sys.executable, "-c", "import cloudtrain; cloudtrain.init()"],
                              env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert init.returncode != 0 and message in init.stderr, init.stderr[-1000:]
    probe = subprocess.run([sys.executable, "-m", "cloudtrain.cli", "probe"], env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert probe.returncode == 2 and "Traceback" not in probe.stderr, probe.stderr
    last = probe.stderr.strip().splitlines()[-1]  # after torch's own log line
    assert last.startswith("cloudtrain probe: cloudtrain.init: rank 1 could not reach"), last
