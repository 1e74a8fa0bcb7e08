"""Horovod (built by scripts/install-horovod) launches a 2-process gloo job that allreduces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import skip_or_fail

HOROVODRUN = Path(sys.executable).parent / "horovodrun"

SCRIPT = """
import torch, horovod.torch as hvd
hvd.init()
t = torch.tensor([float(hvd.rank() + 1)] * 4)
s = hvd.allreduce(t, op=hvd.Sum)
print(f"rank {hvd.rank()}/{hvd.size()} sum {s.tolist()}", flush=True)
"""


def test_horovodrun_gloo_allreduce(tmp_path):
    if not HOROVODRUN.exists():
        skip_or_fail("horovod", "horovodrun is missing: `make install` builds it")
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    cmd = [str(HOROVODRUN), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, str(script)]
    env = {**os.environ, "PATH": f"{HOROVODRUN.parent}:{os.environ.get('PATH', '')}"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in (0, 1):
        assert f"rank {rank}/2 sum [3.0, 3.0, 3.0, 3.0]" in res.stdout
