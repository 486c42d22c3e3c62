"""Fixtures shared by the node tests."""
from __future__ import annotations

import glob
import os
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture
def ring_path() -> Iterator[str]:
    """A fresh ring file name under /dev/shm (where rings live), removed at the end."""
    path = f"/dev/shm/kvwarm-test-{uuid.uuid4().hex}.ring"
    yield path
    for leftover in [path, *glob.glob(f"{path}.*.tmp")]:
        try:
            os.unlink(leftover)
        except FileNotFoundError:
            pass
