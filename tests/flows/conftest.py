"""Fixtures for the flow tests: one Prefect test harness (a temporary server and database) for
the whole session, sample logs, and a live Prefect server with the repository's deployments
and a process worker (tests/flows/prefect_server.py runs them).

The live server is started once for the package (each start is tens of seconds on two busy
cores) and lent to each module that needs one: a module's workers are stopped and its flow
runs deleted when it ends, so the next module finds no worker and no run, as on a new server.
"""
from __future__ import annotations

import os
from typing import Iterator

import pytest

from tests.flows.prefect_server import ROOT, Managed, PrefectServer

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    # a hang guard: on a loaded two-core machine the server took over 60 s to answer
    with prefect_test_harness(server_startup_timeout=300):
        yield


@pytest.fixture(scope="session")
def small_logs(tmp_path_factory) -> str:
    """Three days of sample logs, small enough for a quick end-to-end run."""
    from bench.lib.sample_logs import SampleSpec, generate, write

    path = tmp_path_factory.mktemp("logs") / "logs.jsonl"
    write(generate(SampleSpec(days=3, requests=900)), path)
    return str(path)


@pytest.fixture(scope="package")
def live_prefect_server(tmp_path_factory) -> Iterator[PrefectServer]:
    """The package's live Prefect server; stopped (with its workers) by pid even when a test fails."""
    server = PrefectServer(tmp_path_factory.mktemp("prefect-live"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prefect_server(live_prefect_server: PrefectServer) -> Iterator[PrefectServer]:
    """The live server for one module: at its end the module's workers are stopped (by pid) and its
    flow runs deleted (a run left scheduled would otherwise go to the next module's workers)."""
    try:
        yield live_prefect_server
    finally:
        live_prefect_server.reset()


@pytest.fixture(scope="module")
def kvwarm_deployments(prefect_server: PrefectServer) -> PrefectServer:
    """The work pools prefect.yaml names, created with the CLI, and ``prefect deploy --all`` from the repo.

    A process worker on kvwarm-cpu starts while the deployments register (it needs only
    its pool), so it is polling by the time a test runs one; see :func:`cpu_worker`.
    """
    prefect_server.create_pools()
    prefect_server.start_worker("kvwarm-cpu")
    prefect_server.cli("--no-prompt", "deploy", "--all", KVWARM_REPO=str(ROOT))
    return prefect_server


@pytest.fixture(scope="module")
def cpu_worker(kvwarm_deployments: PrefectServer) -> Managed:
    """The process worker on the kvwarm-cpu pool, started from a scratch directory without ``KVWARM_REPO``:
    ``prefect deploy`` fixed the pull step's directory at deploy time."""
    worker = next(w for w in kvwarm_deployments.workers if w.name == "worker kvwarm-cpu")
    if not worker.alive():
        raise RuntimeError(f"the kvwarm-cpu worker exited:\n{worker.tail()}")
    return worker
