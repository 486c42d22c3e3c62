"""The remote tier's start on a serving node: its client built before the node serves, its
namespaces' owners read ahead of a waited-for fetch.

Built on first use, an S3 client's tens of milliseconds of Python would run beside the first
request's load (the node agent's first read of the fleet's memory, or a first fetch), which
waits for the GIL meanwhile. Both steps are best effort: what fails here is tried again on
first use.
"""
from __future__ import annotations

import logging
from typing import Sequence

from store.identity.tenant import Tenant
from store.serving.fetch import ERRORS
from store.tiers.base import Tier
from store.tiers.store import Store

log = logging.getLogger("kvwarm.loader")


def open_clients(tiers: Sequence[Tier]) -> None:
    """Build every remote tier's client now (no request is made)."""
    for t in tiers:
        if t.remote:
            try:
                t.open_client()
            except ERRORS as exc:
                log.warning("the remote tier %s: its client could not be built now (%s); on first use", t.url, exc)


def warm_up(store: Store, tenant: Tenant, namespaces: Sequence[str]) -> None:
    """Connect to S3 ahead of the first fetch and read the namespaces' owners (a few ms, mostly the network)."""
    try:
        store.warm_up(tenant, list(namespaces))
    except ERRORS as exc:
        log.warning("warming up the remote tier failed (the first fetch will try again): %s", exc)
