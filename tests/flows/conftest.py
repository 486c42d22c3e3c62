"""One Prefect test harness (a temporary server and database) for the whole session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def small_logs(tmp_path_factory) -> str:
    """Three days of sample logs, small enough for a quick end-to-end run."""
    from bench.lib.sample_logs import SampleSpec, generate, write

    path = tmp_path_factory.mktemp("logs") / "logs.jsonl"
    write(generate(SampleSpec(days=3, requests=900)), path)
    return str(path)
