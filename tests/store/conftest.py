"""Fixtures shared by the store tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def numpy_table(monkeypatch):
    """Run as an install without the native gather (``store.kernels._fp8gather`` not built): numpy's take."""
    import store.kernels.table

    monkeypatch.setattr(store.kernels.table, "_native", None)
