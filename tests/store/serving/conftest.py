"""Fixtures of the serving tests: a SeaweedFS of the test's own, for the tests that kill it."""
from __future__ import annotations

import pytest

from tests.seaweedfs import SeaweedFS


@pytest.fixture
def own_s3(tmp_path, monkeypatch):
    """A SeaweedFS for this test alone (the session's must survive): stopped by pid at the end."""
    monkeypatch.setenv("KVWARM_TEST_KEY", "test")
    monkeypatch.setenv("KVWARM_TEST_SECRET", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = SeaweedFS(workdir=str(tmp_path / "weed")).start()
    try:
        yield server
    finally:
        server.stop()
