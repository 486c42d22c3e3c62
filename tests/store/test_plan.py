"""Publishing the latest plan into the store's metadata area, and reading it back with the store alone."""
from __future__ import annotations

import pytest

from store.errors import StoreUnavailable
from store.plan import PlanError, plan_from_prefixes
from store.published_plan import LATEST_PLAN, PublishedEntry, PublishedPlan, latest_plan, publish_plan
from store.tiers.local import LocalTier


class DownTier(LocalTier):
    """A tier whose metadata area cannot be reached (an S3 outage)."""

    def get_meta(self, name):
        raise StoreUnavailable("down")

    def put_meta(self, name, data):
        raise StoreUnavailable("down")


def keyed(created_at: float = 0.0, n: int = 1) -> PublishedPlan:
    return PublishedPlan(entries=(PublishedEntry("acme", "0" * 32, tuple(f"{i:064x}" for i in range(1, n + 1))),),
                         created_at=created_at)


def test_the_latest_plan_is_read_back_from_the_fastest_tier_that_has_it(tmp_path) -> None:
    fast, slow = LocalTier(tmp_path / "a", cap_bytes=1 << 20), LocalTier(tmp_path / "b", cap_bytes=1 << 20)
    assert latest_plan([fast, slow]) is None
    first = keyed(1.0)
    assert publish_plan(first, [fast, slow]) == 2
    assert latest_plan([fast, slow]) == first
    second = keyed(2.0, n=2)
    publish_plan(second, [slow])
    assert latest_plan([fast, slow]) == first and latest_plan([slow]) == second


def test_an_unreachable_tier_is_passed_over(tmp_path) -> None:
    down, local = DownTier(tmp_path / "d", cap_bytes=1 << 20), LocalTier(tmp_path / "l", cap_bytes=1 << 20)
    plan = keyed()
    assert publish_plan(plan, [down, local]) == 1
    assert latest_plan([down, local]) == plan
    with pytest.raises(StoreUnavailable, match="no tier took the plan"):
        publish_plan(plan, [down])


def test_a_damaged_latest_plan_is_an_error_naming_where(tmp_path) -> None:
    tier = LocalTier(tmp_path / "a", cap_bytes=1 << 20)
    tier.put_meta(LATEST_PLAN, b"{not json")
    with pytest.raises(PlanError, match="plans/latest.json"):
        latest_plan([tier])


def test_a_plan_with_prompts_is_never_published(tmp_path) -> None:
    tier = LocalTier(tmp_path / "a", cap_bytes=1 << 20)
    with pytest.raises(PlanError, match="only a keyed plan is published"):
        publish_plan(plan_from_prefixes("acme", ["a text"]), [tier])  # type: ignore[arg-type]
    assert latest_plan([tier]) is None
