"""Fixtures shared by the store tests."""
from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.seaweedfs import SeaweedFS, free_port


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server in a thread of this process (started once, stopped at the end)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def numpy_table(monkeypatch):
    """Run as an install without the native gather (``store.kernels._fp8gather`` not built): numpy's take."""
    import store.kernels.table

    monkeypatch.setattr(store.kernels.table, "_native", None)


@pytest.fixture
def own_s3(tmp_path, monkeypatch):
    """A SeaweedFS for this test alone, for tests that kill it (the session's must survive):
    stopped by pid at the end."""
    monkeypatch.setenv("KVWARM_TEST_KEY", "test")
    monkeypatch.setenv("KVWARM_TEST_SECRET", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = SeaweedFS(workdir=str(tmp_path / "weed")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A directory with a short path, for a node's Unix socket (whose path holds at most 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvn", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def node_pids() -> Iterator[list[int]]:
    """Pids of kvwarm node processes the test started (directly or through a client): stopped by pid at the end."""
    from tests.store.node.factories import gone, stop

    pids: list[int] = []
    yield pids
    for pid in pids:
        stop(pid, signal.SIGTERM)
    for pid in pids:
        if not gone(pid, 20.0):
            stop(pid, signal.SIGKILL)
            gone(pid, 5.0)
