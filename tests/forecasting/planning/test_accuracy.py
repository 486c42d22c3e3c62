"""Warm-up precision and recall, on hand-computed cases."""
from __future__ import annotations

import pandas as pd
import pytest

from forecasting.planning.accuracy import warmup_accuracy
from store.plan import Plan, PlanEntry

T0 = pd.Timestamp("2025-01-01 00:00")
T1 = pd.Timestamp("2025-01-01 01:00")


def _observed() -> pd.DataFrame:
    # sys is a system prompt; tpl-a and tpl-b are templates under it (counts include children)
    rows = [("sys", T0, 6.0), ("sys", T1, 4.0), ("tpl-a", T0, 3.0), ("tpl-a", T1, 2.0), ("tpl-b", T0, 0.0),
            ("tpl-b", T1, 1.0), ("other", T0, 0.0), ("other", T1, 0.0)]
    return pd.DataFrame(rows, columns=["unique_id", "ds", "y"])


PARENTS = {"sys": None, "tpl-a": "sys", "tpl-b": "sys", "other": None}


def test_precision_and_recall_by_hand() -> None:
    acc = warmup_accuracy(["tpl-a", "other"], _observed(), total_requests=20.0, parents=PARENTS)
    assert acc.planned == 2 and acc.used == 1 and acc.precision == 0.5
    assert acc.covered == 5.0 and acc.recall == 0.25


def test_nested_planned_prefixes_count_each_request_once() -> None:
    acc = warmup_accuracy(["sys", "tpl-a", "tpl-b"], _observed(), parents=PARENTS)
    assert acc.covered == 10.0 and acc.requests == 10.0 and acc.recall == 1.0 and acc.precision == 1.0


def test_period_limits_and_plans() -> None:
    plan = Plan(entries=(PlanEntry(tenant="acme", text="x", prefix_id="tpl-b"),))
    acc = warmup_accuracy(plan, _observed(), parents=PARENTS, start=T0, end=T1)
    assert acc.used == 0 and acc.precision == 0.0 and acc.requests == 6.0 and acc.recall == 0.0
    empty = warmup_accuracy([], _observed())
    assert empty.precision == 1.0 and empty.recall == 0.0


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="no prefix_id"):
        warmup_accuracy(Plan(entries=(PlanEntry(tenant="acme", text="x"),)), _observed())
    with pytest.raises(ValueError, match="below the requests"):
        warmup_accuracy(["sys"], _observed(), total_requests=3.0, parents=PARENTS)
    with pytest.raises(ValueError, match="lacks column"):
        warmup_accuracy(["sys"], pd.DataFrame({"ds": []}))
