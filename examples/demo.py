"""The smallest run of cloudtrain: two processes training examples/train_digits.py data-parallel
over gloo on this machine, on real data, and the accuracy they reach (`make demo` runs the bench
on the emulated WAN instead: README).

    python examples/demo.py [--nproc 2] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    script = Path(__file__).with_name("train_digits.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        str(script),
        f"--steps={args.steps}",
    ]
    print("demo:", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    print(out, end="")
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    print(
        f"demo: {result['world_size']} processes reached {100 * result['accuracy']:.1f}% test "
        f"accuracy on held-out digits in {result['steps']} steps"
    )


if __name__ == "__main__":
    main()
