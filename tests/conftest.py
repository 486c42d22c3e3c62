"""Shared fixtures: one real SeaweedFS S3 server for the whole session, and the tiny model.

Tests that need S3 are marked ``pytest.mark.s3``. Every test gets its own prefix in
one session bucket: SeaweedFS gives each bucket its own collection of volumes, and a
test server can run short of volumes when every test makes buckets.
"""
from __future__ import annotations

import uuid

import pytest

from prefill.models import load_model
from store.config import S3Config
from tests.seaweedfs import SeaweedFS

#: credentials are read from the env vars an S3Config names; SeaweedFS accepts any key
KEY_ENV, SECRET_ENV = "KVWARM_TEST_KEY", "KVWARM_TEST_SECRET"
BUCKET = "kvwarm-tests"


@pytest.fixture(scope="session")
def tiny():
    """The built-in ``kvwarm-tiny`` model in fp32 on the CPU (built once per machine, then cached)."""
    return load_model("kvwarm-tiny", dtype="fp32", device="cpu")


@pytest.fixture(scope="session")
def seaweed():
    """The session's SeaweedFS (started once, stopped by pid at the end)."""
    server = SeaweedFS().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_credentials(monkeypatch) -> dict[str, str]:
    """Sets the credential env vars; returns the S3Config fields naming them."""
    monkeypatch.setenv(KEY_ENV, "test")
    monkeypatch.setenv(SECRET_ENV, "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return {"access_key_env": KEY_ENV, "secret_key_env": SECRET_ENV}


@pytest.fixture
def s3_config(seaweed, s3_credentials) -> S3Config:
    """An S3Config for the session server, with a hard deadline per call that only a hang
    reaches (a loaded machine can make a healthy server slow; the outage tests set their own)."""
    return S3Config(endpoint_url=seaweed.endpoint, op_timeout_s=60, connect_timeout_s=10,
                    read_timeout_s=30, retries=1, **s3_credentials)


@pytest.fixture
def s3_url(s3_config) -> str:
    """A fresh, unique ``s3://bucket/prefix`` for this test."""
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def raw_s3(seaweed, s3_credentials):
    """A plain s3fs client on the session server, to inspect or tamper with objects."""
    import s3fs

    return s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": seaweed.endpoint},
                             skip_instance_cache=True, use_listings_cache=False)


@pytest.fixture(scope="session", autouse=True)
def node_runtime_dir():
    """The session's ``$XDG_RUNTIME_DIR``: where a kvwarm node a client starts on its own (the connector's
    ``node.autostart``) puts its socket, instead of the user's; such nodes are stopped at the end."""
    import os
    import shutil
    import signal
    import tempfile
    import time
    from pathlib import Path

    old = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(tempfile.mkdtemp(prefix="kvrt", dir="/tmp"))
    os.environ["XDG_RUNTIME_DIR"] = str(d)
    try:
        yield d
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
        for lock in d.rglob("*.node.lock"):
            try:
                pid = int(lock.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (ValueError, IndexError, OSError):
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)
