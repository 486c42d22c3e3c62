"""One request-log row: the schema every reader checks rows against (docs/logs.md).

:func:`check_row` turns a JSONL line or a Parquet row into the normalised dict that
:func:`forecasting.ingest.logs.read_logs` collects, or raises :class:`RowError` whose
``reason`` (one of :data:`REASONS`) names the bad field; the reader quarantines the
row with it. Pure: no I/O.
"""
from __future__ import annotations

import calendar
import datetime as dt
import json
import math
from typing import Any

import numpy as np

from store.errors import BadInputError
from store.identity.tenant import check_tenant_name

#: Columns of :attr:`forecasting.ingest.logs.RequestLog.requests`, in order.
COLUMNS = ("timestamp", "tenant", "model", "prompt", "token_ids", "hash_ids", "prompt_tokens",
           "output_tokens", "cached_tokens", "latency_ms", "request_id")
PROMPT_FIELDS = ("prompt", "token_ids", "hash_ids")
COUNT_FIELDS = ("prompt_tokens", "output_tokens", "cached_tokens")
#: Why a row or file was quarantined (the ``reason`` field of a quarantine entry).
REASONS = ("invalid_json", "not_an_object", "bad_timestamp", "bad_tenant", "bad_model", "bad_prompt",
           "bad_token_ids", "bad_hash_ids", "bad_count", "bad_latency", "bad_request_id", "no_prompt",
           "unreadable_file")
_MAX_TOKEN = 2**32 - 1
_MAX_HASH = 2**63 - 1
# Times kvwarm can hold as datetime64[ns] (pandas' widest common unit).
_MIN_US, _MAX_US = 0, 9_000_000_000 * 1_000_000


class RowError(BadInputError):
    """One row is malformed; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def check_row(raw: Any) -> dict[str, Any]:
    """Validate one row (a JSONL line's text or a dict) into the normalised form.

    Returns a dict with :data:`COLUMNS`; ``timestamp`` as int microseconds since the epoch.

    Raises:
        RowError: the row is malformed (the reason names the field).
    """
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise RowError("invalid_json", str(exc)[:200]) from None
    if not isinstance(raw, dict):
        raise RowError("not_an_object", f"each row must be a JSON object, got {type(raw).__name__}")
    tenant = raw.get("tenant")
    if not isinstance(tenant, str) or not _utf8(tenant):
        raise RowError("bad_tenant", f"'tenant' must be a string, got {_short(tenant)}")
    try:
        check_tenant_name(tenant)
    except ValueError as exc:
        raise RowError("bad_tenant", str(exc)) from None
    model = raw.get("model")
    if not isinstance(model, str) or not model or len(model) > 512 or not _utf8(model):
        raise RowError("bad_model", f"'model' must be a non-empty string of at most 512 characters, got {_short(model)}")
    out: dict[str, Any] = {"timestamp": _timestamp_us(raw.get("timestamp")), "tenant": tenant, "model": model}
    prompt = raw.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not _utf8(prompt)):
        raise RowError("bad_prompt", f"'prompt' must be UTF-8 text, got {_short(prompt)}")
    out["prompt"] = prompt or None
    out["token_ids"] = _int_list(raw.get("token_ids"), "token_ids", _MAX_TOKEN)
    out["hash_ids"] = _int_list(raw.get("hash_ids"), "hash_ids", _MAX_HASH)
    if all(out[f] is None for f in PROMPT_FIELDS):
        raise RowError("no_prompt", "a row needs a non-empty 'prompt', 'token_ids' or 'hash_ids'")
    for name in COUNT_FIELDS:
        value = raw.get(name)
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # some writers give counts as 3.0
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                  or not 0 <= value <= _MAX_HASH):
            raise RowError("bad_count", f"'{name}' must be an integer >= 0, got {_short(value)}")
        out[name] = None if value is None else int(value)
    latency = raw.get("latency_ms")
    if latency is not None and (isinstance(latency, bool) or not isinstance(latency, (int, float, np.number))
                                or not math.isfinite(latency) or latency < 0):
        raise RowError("bad_latency", f"'latency_ms' must be a finite number >= 0, got {_short(latency)}")
    out["latency_ms"] = math.nan if latency is None else float(latency)
    rid = raw.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not _utf8(rid)):
        raise RowError("bad_request_id", f"'request_id' must be a string, got {_short(rid)}")
    out["request_id"] = rid
    return out


def _timestamp_us(value: Any) -> int:
    if isinstance(value, bool) or value is None:
        raise RowError("bad_timestamp", f"'timestamp' is required (seconds since the epoch or ISO 8601), got {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        if not math.isfinite(value):
            raise RowError("bad_timestamp", f"'timestamp' must be finite, got {value!r}")
        us = round(float(value) * 1_000_000) if isinstance(value, (float, np.floating)) else int(value) * 1_000_000
    elif isinstance(value, (str, dt.datetime)):
        try:
            when = dt.datetime.fromisoformat(value) if isinstance(value, str) else value
        except ValueError:
            raise RowError("bad_timestamp", f"'timestamp' is not ISO 8601: {_short(value)}") from None
        if when.tzinfo is not None:
            when = when.astimezone(dt.timezone.utc).replace(tzinfo=None)
        us = calendar.timegm(when.timetuple()) * 1_000_000 + when.microsecond
    else:
        raise RowError("bad_timestamp", f"'timestamp' must be a number or an ISO 8601 string, got {_short(value)}")
    if not _MIN_US <= us < _MAX_US:
        raise RowError("bad_timestamp", f"'timestamp' {value!r} is outside 1970-01-01 .. 2255 (seconds since the epoch?)")
    return us


def _int_list(value: Any, name: str, maximum: int) -> np.ndarray | None:
    reason = f"bad_{name}"
    if value is None:
        return None
    if not isinstance(value, (list, np.ndarray)):
        raise RowError(reason, f"'{name}' must be a list of integers, got {_short(value)}")
    if len(value) == 0:
        return None
    if isinstance(value, list) and any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise RowError(reason, f"'{name}' must hold integers only")
    try:
        arr = np.asarray(value)
    except (OverflowError, ValueError):
        arr = np.asarray([], dtype=object)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise RowError(reason, f"'{name}' must be integers in [0, {maximum}]")
    if int(arr.min()) < 0 or int(arr.max()) > maximum:
        raise RowError(reason, f"'{name}' must be integers in [0, {maximum}], got {int(arr.min())}..{int(arr.max())}")
    return arr.astype(np.int64)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
