"""The rule that keeps `make test` from going green by skipping (conftest.py): a part named in
CLOUDTRAIN_REQUIRE that does not work here fails the whole run, before any test, naming it."""

from __future__ import annotations

import subprocess

from support import run_python


def pytest_run(**env: str) -> subprocess.CompletedProcess:
    """A pytest run (collection only: the rule acts before any test) in a fresh interpreter,
    requiring only what `env` says (the parts this run found working are not passed on)."""
    code = (
        "import sys, pytest\n"
        "sys.exit(pytest.main(['--collect-only', '-q', 'tests/test_topology.py']))"
    )
    return run_python(code, **{"CLOUDTRAIN_REQUIRE": "", "CLOUDTRAIN_REQUIRE_CHECKED": "", **env})


def test_native_ops_turned_off_fail_a_run_that_requires_them():
    run = pytest_run(CLOUDTRAIN_REQUIRE="native", CLOUDTRAIN_NO_NATIVE="1")
    assert run.returncode != 0
    assert "CLOUDTRAIN_NO_NATIVE=1 turns the native ops off" in run.stdout + run.stderr


def test_a_missing_tool_fails_a_run_that_requires_the_emulator():
    run = pytest_run(CLOUDTRAIN_REQUIRE="netem", PATH="/nonexistent")
    assert run.returncode != 0
    assert "netem: the WAN emulator cannot be built" in run.stdout + run.stderr


def test_an_unknown_part_is_a_usage_error():
    run = pytest_run(CLOUDTRAIN_REQUIRE="native,warp-drive")
    assert run.returncode != 0
    assert "warp-drive" in run.stdout + run.stderr


def test_nothing_required_collects_normally():
    run = pytest_run()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
