"""Scheduling the prefill at the window's start: the window arithmetic, and the cron fallback
when there is no server, no deployment or no reachable API (never a failed plan flow).

The run it schedules on a real server is checked in tests/flows/test_deploy_live.py.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from flows.scheduling import prefill_time, schedule_prefill, schedule_prefill_task, window_bounds
from flows.spec import RunTarget
from flows.tasks import FlowInputError
from tests.flows.prefect_server import free_port

UTC = timezone.utc
TARGET = RunTarget(store="file:///tmp/kvwarm-x", run="r")
WINDOW = {"chosen": {"start": "2026-12-01 02:00:00", "end": "2026-12-01 05:00:00", "mean_load": 3.0,
                     "max_load": 4.0}, "offpeak": [], "fraction": 0.6}


def test_window_bounds_read_naive_timestamps_as_utc_and_convert_aware_ones() -> None:
    assert window_bounds(WINDOW) == (datetime(2026, 12, 1, 2, tzinfo=UTC), datetime(2026, 12, 1, 5, tzinfo=UTC))
    start, end = window_bounds({"start": "2026-12-01T04:00:00+02:00", "end": "2026-12-01T07:30:00+02:00"})
    assert (start, end) == (datetime(2026, 12, 1, 2, tzinfo=UTC), datetime(2026, 12, 1, 5, 30, tzinfo=UTC))
    assert start.tzinfo is not None and start.utcoffset() == timedelta(0)


@pytest.mark.parametrize("window, says", [
    ({"offpeak": []}, "no chosen start and end"),
    ({"chosen": {"start": "2026-12-01 02:00:00"}}, "no chosen start and end"),
    ({"chosen": {"start": "tomorrow-ish", "end": "2026-12-01 05:00:00"}}, "is not a timestamp"),
    ({"chosen": {"start": None, "end": "2026-12-01 05:00:00"}}, "start is missing"),
    ({"chosen": {"start": "2026-12-01 05:00:00", "end": "2026-12-01 05:00:00"}}, "at or before it starts"),
])
def test_a_malformed_window_is_a_clear_input_error(window, says) -> None:
    with pytest.raises(FlowInputError, match=says):
        window_bounds(window)
    with pytest.raises(FlowInputError, match=says):
        schedule_prefill(TARGET, window)


def test_the_prefill_starts_at_the_window_start_or_now_if_it_has_begun() -> None:
    start = datetime(2026, 12, 1, 2, tzinfo=UTC)
    assert prefill_time(WINDOW, now=start - timedelta(hours=6)) == start
    assert prefill_time(WINDOW, now=start) == start
    late = start + timedelta(minutes=40)
    assert prefill_time(WINDOW, now=late) == late
    assert prefill_time(WINDOW, now=late.replace(tzinfo=None)) == late  # naive now is UTC
    assert prefill_time(WINDOW, now=late.astimezone(timezone(timedelta(hours=-5)))) == late
    before = datetime.now(UTC)
    now = prefill_time({"start": "2000-01-01", "end": "2000-01-02"})  # no now given: the clock's
    assert before <= now <= datetime.now(UTC)


def test_without_a_configured_server_it_leaves_the_prefill_to_cron_at_once(caplog, monkeypatch) -> None:
    import prefect.deployments
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    def refuse(*args, **kwargs):
        raise AssertionError("it must not start an ephemeral server (or ask any API) just to give up")

    monkeypatch.setattr(SubprocessASGIServer, "start", refuse)  # how a client starts an ephemeral server
    monkeypatch.setattr(prefect.deployments, "run_deployment", refuse)
    with temporary_settings(restore_defaults={PREFECT_API_URL}), caplog.at_level("INFO", logger="flows.scheduling"):
        assert schedule_prefill(TARGET, WINDOW) is None
    assert "no Prefect server configured" in caplog.text and "cron schedule" in caplog.text


def test_an_unreachable_api_leaves_the_prefill_to_cron(caplog) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    dead = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    with temporary_settings(updates={PREFECT_API_URL: dead}), caplog.at_level("WARNING", logger="flows.scheduling"):
        assert schedule_prefill(TARGET, WINDOW) is None
    assert "could not reach the Prefect API" in caplog.text and "cron schedule" in caplog.text


def test_a_missing_deployment_returns_none_and_the_calling_flow_completes(prefect_harness, caplog) -> None:
    from prefect import flow

    with caplog.at_level("WARNING", logger="flows.scheduling"):
        assert schedule_prefill(TARGET, WINDOW) is None
    assert "is not registered" in caplog.text

    @flow(name="plan-like")
    def plan_like() -> str | None:
        return schedule_prefill_task(TARGET, WINDOW)

    state = plan_like(return_state=True)
    assert state.is_completed(), state
    assert state.result() is None
