"""Fixtures of the node tests: a short socket directory, and every node a test started stopped by pid."""
from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.store.node.factories import gone, stop


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket's path holds at most 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvn", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def node_pids() -> Iterator[list[int]]:
    """Pids of node processes the test started (directly or through a client): stopped at the end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        stop(pid, signal.SIGTERM)
    for pid in pids:
        if not gone(pid, 20.0):
            stop(pid, signal.SIGKILL)
            gone(pid, 5.0)
