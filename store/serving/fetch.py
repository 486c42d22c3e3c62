"""Copying a tenant's snapshots from the remote tier (S3) into NVMe, for the loader.

Two ways, as the loader's ``fetch_mode`` says: in the background (an NVMe miss answers
now and the chain is copied for next time; at most one fetch in flight per chain head)
or waiting up to a timeout (and going on in the background past it). After S3 fails,
it is not asked again for ``backoff_s``. Nothing here raises for store trouble: each
outcome is a count of blocks now in NVMe and a reason when fewer than S3 holds. The
copying is the store's own read-through (:meth:`store.tiers.store.Store.read`).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from store.errors import StoreError, StoreUnavailable, TenantAccessDenied
from store.identity.keys import Block, KeyRoot
from store.identity.tenant import Tenant
from store.miss import MissReason
from store.serving.metrics import LoaderMetrics
from store.tiers.base import object_name
from store.tiers.store import Store

log = logging.getLogger("kvwarm.loader")
#: what store trouble can raise; each is a miss with a reason, never an error to the caller
ERRORS = (StoreError, OSError, sqlite3.Error)
_MAX_INFLIGHT = 4096


@dataclass(frozen=True)
class Scope:
    """Where a chain's snapshots live: the key root it is salted with and its namespace."""

    root: KeyRoot
    ns: str

    def names(self, blocks: Sequence[Block]) -> list[str]:
        """The tier object names of ``blocks`` in this namespace."""
        return [object_name(self.ns, b.key) for b in blocks]


class RemoteFetcher:
    """Read-through of chains from the remote tiers of ``store`` into its local one, on ``executor``.

    Args:
        store: all tiers, NVMe first (its ``read`` copies a remote hit into NVMe).
        tenant: whose snapshots (the store checks every namespace against it, and counts refusals).
        metrics: counts what was fetched and present.
        executor: where background fetches run (shared with the loader).
        timeout_s: the most :meth:`fetch_sync` waits.
        backoff_s: after S3 fails, do not ask it again for this long.
    """

    def __init__(self, store: Store, tenant: Tenant, metrics: LoaderMetrics,
                 executor: cf.Executor, *, timeout_s: float, backoff_s: float) -> None:
        self.store = store
        self.tenant = tenant
        self.metrics = metrics
        self.timeout_s = float(timeout_s)
        self.backoff_s = float(backoff_s)
        remote = [t.kind for t in store.tiers if t.remote]
        self.has_remote = bool(remote)
        self.remote_kind = remote[0] if remote else ""  # where a fetched hit came from
        self._executor = executor
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._inflight: set[str] = set()

    def usable(self) -> bool:
        """Whether there is a remote tier and it is not in its backoff after a failure."""
        return self.has_remote and time.monotonic() >= self._down_until

    def failed(self, exc: Exception) -> None:
        """S3 failed: back off for ``backoff_s``."""
        self._down_until = time.monotonic() + self.backoff_s
        log.warning("S3 tier unavailable, not asked again for %g s: %s", self.backoff_s, exc)

    def fetch_sync(self, scope: Scope, blocks: list[Block],
                   have: int) -> tuple[int, MissReason | None]:
        """Wait up to ``timeout_s`` for S3; returns blocks now in NVMe and why not more."""
        fut = self._executor.submit(self.fetch_chain, blocks, scope)
        try:
            got, reason = fut.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            return have, MissReason.FETCH_TIMEOUT  # it goes on in the background: next time it is local
        return max(got, have), reason

    def schedule(self, scope: Scope, blocks: Sequence[Block]) -> None:
        """Fetch ``blocks`` in the background, unless their head is already being fetched."""
        names = scope.names(blocks)
        with self._lock:
            if not names or names[0] in self._inflight or len(self._inflight) > _MAX_INFLIGHT:
                return
            self._inflight.update(names)
        fut = self._executor.submit(self.fetch_chain, list(blocks), scope)
        fut.add_done_callback(lambda _: self._done(names))

    def _done(self, names: list[str]) -> None:
        with self._lock:
            self._inflight.difference_update(names)

    def fetch_chain(self, blocks: list[Block], scope: Scope) -> tuple[int, MissReason | None]:
        """Copy the leading stored blocks of a chain from S3 into NVMe (read-through).

        Returns how many leading blocks are now in NVMe (counting from ``blocks[0]``) and a
        reason when fewer than the remote tier holds.
        """
        try:
            # Store.probe counts an unreachable tier and answers from the others; a fetch
            # that S3 did not answer backs off.
            probe = self.store.probe(self.tenant, blocks, scope.root)
            if probe.unavailable:
                raise StoreUnavailable(f"the {', '.join(probe.unavailable)} tier did not answer a probe of "
                                       f"{len(blocks)} blocks")
            for i, block in enumerate(blocks[: probe.count]):
                if self.store.probe(self.tenant, [block], scope.root, local_only=True).count:
                    self.metrics.prefetched("present")
                    continue
                found = self.store.read(self.tenant, block, scope.root)
                if found.snapshot is None:
                    if isinstance(found.error, StoreUnavailable):
                        raise found.error
                    return i, found.miss  # expired, corrupt...: the store counted (and quarantined) it
                found.snapshot.close()
                self.metrics.prefetched("fetched")
            return probe.count, None
        except StoreUnavailable as exc:
            self.failed(exc)
            return 0, MissReason.STORE_UNAVAILABLE
        except TenantAccessDenied as exc:  # counted by the store
            log.warning("fetch refused: %s", exc)
            return 0, MissReason.TENANT_REFUSED
        except ERRORS as exc:
            log.exception("background fetch failed: %s", exc)
            return 0, MissReason.ERROR
