"""Fixtures shared by the test files: a real S3/EC2 protocol server (moto's server mode) on
loopback (support.fake_aws_env points boto3 at it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


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
