"""What ``prefill store verify`` checks in a store's metadata beside the snapshots: the fleet's records
and the published plan, with the same checks their readers apply (a file a reader would skip or refuse
is reported here with why). Owner records are :func:`store.tiers.maintenance.check_owner_records`'s.
"""
from __future__ import annotations

import logging

from store.config import KvwarmConfig
from store.errors import StoreError
from store.plan import PlanError
from store.published_plan import LATEST_PLAN, latest_plan
from store.serving.fleet_file import check_fleet_files
from store.tiers.store import Store

log = logging.getLogger("kvwarm.store")


def bad_metadata(store: Store, config: KvwarmConfig, *, namespace: str | None = None) -> list[tuple[str, str]]:
    """Every fleet record (of ``namespace``, or of all) and every tier's published plan that its reader
    would refuse, as ``(location, reason)``; each counted as ``bad_record`` in ``store.stats``. A tier
    that cannot be listed or read is reported too (its reason says so)."""
    bad: list[tuple[str, str]] = []
    for tier in store.tiers:
        try:
            for meta, reason in check_fleet_files(tier, max_file_bytes=config.fleet_memory.max_file_bytes):
                if namespace is None or meta.startswith(f"fleet/{namespace}/"):
                    bad.append((f"{tier.url} meta/{meta}", reason))
        except StoreError as exc:
            bad.append((f"{tier.url} meta/fleet/", f"cannot be listed: {exc}"))
        if namespace is None:
            try:
                latest_plan([tier])
            except PlanError as exc:
                bad.append((tier.describe(LATEST_PLAN), str(exc)))
    for location, reason in bad:
        store.stats.incr("bad_record")
        log.error("bad metadata file %s: %s", location, reason)
    return bad
