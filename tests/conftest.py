"""Fixtures shared by the test files: a real S3/EC2 protocol server (moto's server mode) on
loopback, and `aws`, an environment in which boto3 reaches it and no real AWS
(support.fake_aws_env).

Also the rule that keeps the suite from going green by skipping: CLOUDTRAIN_REQUIRE (set by
`make test` to what the machine supports) names the parts that must work here - native (the
cloudtrain._C ops load), netem (the WAN emulator can be built: root, ip, tc), horovod (horovodrun
and horovod.torch) - and the run stops with an error when one does not, instead of skipping every
test that needs it. A machine with a CUDA device must also have the CUDA kernels built, whatever
CLOUDTRAIN_REQUIRE says. Only what the machine truly lacks (a GPU) is left to skips.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import REQUIRE_ENV, fake_aws_env, required_parts, run_python

_NATIVE_PROBE = """
import json
import torch
from cloudtrain.compress import ops
print(json.dumps({"native": ops.NATIVE, "gpu": torch.cuda.is_available(),
                  "cuda_kernels": ("ef_topk_select", "cuda") in ops.KERNELS}))
"""


def _native_state() -> tuple[dict, str]:
    """What the native library gives in a fresh interpreter, and the warning that says why not."""
    res = run_python(_NATIVE_PROBE.replace('warnings.simplefilter("ignore")', ""))
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"native": False, "gpu": False, "cuda_kernels": False}, res.stderr[-2000:]
    return json.loads(lines[-1]), res.stderr.strip()[-2000:]


def missing_parts(parts: set[str]) -> list[str]:
    """Why each required part (and the CUDA kernels, where a GPU is) does not work here."""
    problems = []
    import torch

    if "native" in parts or torch.cuda.is_available():
        state, why = _native_state()
        if "native" in parts and not state["native"]:
            problems.append(f"native: cloudtrain._C does not load: {why or 'no reason given'}")
        if "native" in parts and os.environ.get("CLOUDTRAIN_NO_NATIVE") == "1":
            problems.append(
                "native: CLOUDTRAIN_NO_NATIVE=1 turns the native ops off in this run, so their "
                "tests would skip; unset it, or leave native out of CLOUDTRAIN_REQUIRE"
            )
        if state["gpu"] and not state["cuda_kernels"]:
            problems.append(
                "cuda: this machine has a CUDA device but the CUDA kernels are not built: "
                "build with `pip install --no-build-isolation -e .` where nvcc is (scripts/gpu-check)"
            )
    if "netem" in parts:
        from cloudtrain.tools import netem

        ok, why = netem.available()
        if not ok:
            problems.append(f"netem: the WAN emulator cannot be built: {why}")
    if "horovod" in parts:
        horovodrun = Path(sys.executable).with_name("horovodrun")
        res = run_python("import horovod.torch")
        if not horovodrun.exists() or res.returncode != 0:
            why = res.stderr.strip().splitlines()[-1:] or [f"{horovodrun} is missing"]
            problems.append(f"horovod: {why[0]}; scripts/install-horovod builds it")
    return problems


_CHECKED_ENV = "CLOUDTRAIN_REQUIRE_CHECKED"
"""Set once the parts were found working, so that pytest runs started by tests (which inherit
the environment) do not check the same machine again."""


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller checked already
        return
    try:
        parts = required_parts()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    key = ",".join(sorted(parts))
    if os.environ.get(_CHECKED_ENV) == key:
        return
    problems = missing_parts(parts)
    if not problems:
        os.environ[_CHECKED_ENV] = key
    else:
        raise pytest.UsageError(
            f"parts this machine must test are missing ({REQUIRE_ENV}={','.join(sorted(parts))}); "
            "the run fails instead of skipping them:\n  " + "\n  ".join(problems)
        )


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    """moto's server (real HTTP, any AWS service) on a free loopback port, for the session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws(monkeypatch, moto_url: str) -> str:
    """moto's URL, in an environment of dummy credentials with config files and instance
    metadata off, so that no real AWS is reachable. EC2 is moto's server (boto3 reads
    AWS_ENDPOINT_URL_EC2: there is no endpoint option in `cloudtrain hosts`); S3 is not set, nor
    any profile: S3 tests name the endpoint themselves (S3Config, or AWS_ENDPOINT_URL_S3)."""
    for name, value in fake_aws_env(moto_url, "EC2").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    return moto_url
