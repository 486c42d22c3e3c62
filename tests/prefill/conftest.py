"""Fixtures for prefill tests: the tiny model in bf16, and a local store (``tiny``, fp32, is in tests/conftest.py)."""
from __future__ import annotations

import pytest

from prefill.models import load_model
from store.tiers.store import Store
from tests.prefill.factories import config_for


@pytest.fixture(scope="session")
def tiny_bf16():
    return load_model("kvwarm-tiny", dtype="bf16", device="cpu")


@pytest.fixture()
def config():
    return config_for()


@pytest.fixture()
def store(tmp_path, config):
    s = Store.open(f"file://{tmp_path / 'store'}", config)
    yield s
    s.close()
