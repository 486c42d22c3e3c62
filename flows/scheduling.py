"""Schedule the off-peak prefill at the start of the chosen window.

The plan stage knows when the load will be low (``window.json``, written by
:func:`flows.tasks.window_task`); :func:`schedule_prefill` asks the Prefect server to
run the prefill deployment (``prefect.yaml``: ``prefill-plan/prefill-offpeak``, on the
GPU pool) at that window's start, with the plan's run target (:class:`flows.spec.RunTarget`)
and a deadline at the window's end. Nothing waits for the prefill: the scheduled run is
left to a worker.

Scheduling is best effort. With no Prefect server (ephemeral mode, the demo, the
tests), or when the deployment is not registered or the API cannot be reached, the
prefill deployment's cron schedule in ``prefect.yaml`` is the fallback: the function
logs so and returns ``None``; it never fails the plan flow. A malformed window is a
bug upstream and raises :class:`flows.tasks.FlowInputError`.
"""
from __future__ import annotations

import hashlib
import logging
from datetime import datetime, timezone
from typing import Any, Mapping

import httpx
import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError, ObjectNotFound

from flows.spec import RunTarget
from flows.tasks import FlowInputError

#: the prefill deployment in prefect.yaml (flow name / deployment name)
DEFAULT_PREFILL_DEPLOYMENT = "prefill-plan/prefill-offpeak"

_log = logging.getLogger(__name__)


def _logger() -> Any:
    """The run logger inside a flow or task run (so the message shows in the UI), else the module logger."""
    from prefect import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return _log


def _utc(value: Any, what: str) -> datetime:
    """``value`` (ISO string, datetime or Timestamp) as an aware UTC datetime; naive means UTC."""
    try:
        ts = pd.Timestamp(value)
    except (TypeError, ValueError) as exc:
        raise FlowInputError(f"window {what} {value!r} is not a timestamp ({exc}): pass the window.json that "
                             f"forecast_demand wrote") from None
    if ts is pd.NaT:
        raise FlowInputError(f"window {what} is missing (NaT): pass the window.json that forecast_demand wrote")
    ts = ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")
    return ts.to_pydatetime()


def window_bounds(window: Mapping[str, Any]) -> tuple[datetime, datetime]:
    """The chosen window's ``(start, end)`` as aware UTC datetimes.

    ``window`` is what :func:`flows.tasks.window_task` returns (``{"chosen": {"start",
    "end", ...}, ...}``) or its ``chosen`` entry alone. Naive timestamps are UTC.
    """
    chosen = window.get("chosen", window) if isinstance(window, Mapping) else None
    if not isinstance(chosen, Mapping) or "start" not in chosen or "end" not in chosen:
        raise FlowInputError(f"window {window!r} has no chosen start and end: pass the dict in window.json "
                             f"(written by forecast_demand) or its 'chosen' entry")
    start, end = _utc(chosen["start"], "start"), _utc(chosen["end"], "end")
    if end <= start:
        raise FlowInputError(f"window ends ({end.isoformat()}) at or before it starts ({start.isoformat()})")
    return start, end


def prefill_time(window: Mapping[str, Any], now: datetime | None = None) -> datetime:
    """When to start the prefill: the window's start, or ``now`` if the window has already started (UTC;
    a naive ``now`` is UTC)."""
    start, _ = window_bounds(window)
    current = now or datetime.now(timezone.utc)
    current = current.replace(tzinfo=timezone.utc) if current.tzinfo is None else current.astimezone(timezone.utc)
    return max(start, current)


def _api_configured() -> bool:
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


def schedule_prefill(target: RunTarget, window: Mapping[str, Any], deployment: str = DEFAULT_PREFILL_DEPLOYMENT,
                     *, now: datetime | None = None) -> str | None:
    """Schedule the prefill deployment at the window's start; return the flow run id, or ``None``.

    The run gets the plan's ``target`` whole (store, run, config, model and block size:
    the prefill must use the block size the plan was made for) and ``deadline`` (the
    window's end, Unix seconds); the deployment's own ``prefill`` section fills the rest
    (``device``, ``dtype``). A window that has already started is scheduled now. Calling
    it again for the same store, run and window returns the same flow run (an
    idempotency key), so a rerun of the plan schedules no second prefill.

    Returns ``None``, after logging that the cron schedule in ``prefect.yaml`` will
    run the prefill, when no Prefect API is configured (ephemeral mode: no worker
    could pick the run up), the deployment does not exist, or the API cannot be
    reached. Raises :class:`flows.tasks.FlowInputError` only for a malformed window,
    or a target that names no run.
    """
    start, end = window_bounds(window)
    when = prefill_time(window, now)
    store, run = target.store, target.run
    if run is None:
        raise FlowInputError("the prefill to schedule needs target.run: the run whose plan it prefills")
    params: dict[str, Any] = {"target": target.model_dump(mode="json"), "deadline": end.timestamp()}
    log = _logger()
    fallback = (f"the prefill of run {run!r} for the window {start.isoformat()} to {end.isoformat()} is left to "
                f"the cron schedule of {deployment!r} in prefect.yaml")
    if not _api_configured():
        log.info("no Prefect server configured (PREFECT_API_URL unset): %s", fallback)
        return None
    key = hashlib.sha256(f"{deployment}\n{store}\n{run}\n{start.isoformat()}".encode()).hexdigest()[:32]
    from prefect.deployments import run_deployment

    try:
        flow_run = run_deployment(deployment, parameters=params, scheduled_time=when, timeout=0, as_subflow=False,
                                  idempotency_key=f"kvwarm-prefill-{key}", tags=["kvwarm", "prefill"])
    except ObjectNotFound:
        log.warning("deployment %r is not registered on the Prefect server (prefect deploy --all): %s",
                    deployment, fallback)
        return None
    except httpx.HTTPStatusError as exc:  # PrefectHTTPStatusError: e.g. parameters the deployment refuses
        log.warning("the Prefect API refused to schedule %r (%s): %s", deployment, exc, fallback)
        return None
    except (httpx.HTTPError, OSError) as exc:
        log.warning("could not reach the Prefect API to schedule %r (%s: %s): %s", deployment,
                    type(exc).__name__, exc, fallback)
        return None
    log.info("scheduled %r at %s for run %r (deadline %s): flow run %s", deployment, when.isoformat(), run,
             end.isoformat(), flow_run.id)
    return str(flow_run.id)


#: :func:`schedule_prefill` as a task, for use inside the plan flow (shows in the run graph).
schedule_prefill_task = task(schedule_prefill, name="schedule-prefill", cache_policy=NO_CACHE)

