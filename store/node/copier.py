"""The node's copies from the shared tiers (S3) into its own (NVMe), by object name, in order.

``streams`` threads (``loader.prefetch_streams``: S3 gives parallel GETs far more bandwidth than one
stream) copy two queues of chains, a chain each at a time, first to last: the agent's order, which a new order
replaces (the names it no longer wants are dropped), then the clients' hints (an engine's lookup
miss, a loader's prefetch handed to the node), which no order drops: a client may be waiting
for them (:meth:`Copier.pending` says how many of its names are still to come). Each copy reads the
object from the first remote tier that holds it, opens it with its tenant's key where it is
sealed, checks it as ``prefill store verify`` does (checksums, header, the name it sits under,
not expired) and writes it into the node tier atomically; a copy that fails is counted with its
reason and the rest of its chain is skipped (a block is useful only after its parents).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Mapping, Sequence

import pyarrow as pa

from store.errors import SnapshotError, StoreError
from store.format.snapshot import read_snapshot
from store.identity.tenant import Tenant
from store.tiers.base import Tier, parse_object_name
from store.tiers.crypto import plaintext

log = logging.getLogger("kvwarm.node")


class Copier:
    """Copies of object names into ``local`` from ``remotes`` on a thread of its own.

    Args:
        local: the node tier.
        remotes: the shared tiers, first asked first.
        tenants: credentials by namespace, for objects sealed with a tenant's key.
        streams: chains copied at once, each on a thread of its own (block by block, in prefix order).
    """

    def __init__(self, local: Tier, remotes: Sequence[Tier], tenants: Mapping[str, Tenant], *,
                 streams: int = 1) -> None:
        self.local = local
        self.remotes = list(remotes)
        self.tenants = dict(tenants)
        self.counts: Counter[str] = Counter()
        self._plan: deque[tuple[str, ...]] = deque()  # the agent's chains: a failure skips the rest of one
        self._hints: deque[tuple[str, ...]] = deque()  # the clients' chains, behind the agent's
        self._pending: Counter[str] = Counter()  # names queued or being copied (a name may be in both queues)
        self._cv = threading.Condition()
        self._busy = 0  # chains being copied
        self._stop = False
        self._threads = [threading.Thread(target=self._run, name=f"kvwarm-node-copy-{i}", daemon=True)
                         for i in range(max(1, streams))]
        for t in self._threads:
            t.start()

    def replace(self, chains: Sequence[Sequence[str]]) -> None:
        """Copy ``chains`` (each in prefix order) in place of the agent's last order (hints stay queued)."""
        with self._cv:
            dropped = [n for c in self._plan for n in c]
            if dropped:
                self.counts["superseded"] += len(dropped)
                self._forget(dropped)
            self._plan.clear()
            self._plan.extend(tuple(c) for c in chains if c)
            self._pending.update(n for c in self._plan for n in c)
            self._cv.notify_all()

    def add(self, chain: Sequence[str]) -> int:
        """Queue one chain behind the rest, less its names queued already (the agent's order and an
        engine's prefetch often name the same chain: it is copied once); returns the names queued
        (0 without a remote tier)."""
        if not self.remotes or not chain:
            return 0
        with self._cv:
            fresh = tuple(n for n in chain if n not in self._pending)
            if fresh:
                self._hints.append(fresh)
                self._pending.update(fresh)
                self._cv.notify()
        return len(fresh)

    def pending(self, names: Sequence[str]) -> int:
        """How many of ``names`` are still queued or being copied (0: whatever the node tier holds of
        them now is all these copies will bring)."""
        with self._cv:
            return sum(1 for n in names if self._pending.get(n, 0) > 0)

    def _forget(self, names: Sequence[str]) -> None:
        """``names`` are no longer queued (copied, failed or dropped once each); under the lock."""
        for n in names:
            left = self._pending[n] - 1
            if left > 0:
                self._pending[n] = left
            else:
                self._pending.pop(n, None)

    def queued(self) -> int:
        """Chains waiting to be copied."""
        with self._cv:
            return len(self._plan) + len(self._hints)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or copying (tests, shutdown); ``False`` on timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._plan or self._hints or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        """Stop after the current copy."""
        with self._cv:
            self._stop = True
            self._plan.clear()
            self._hints.clear()
            self._pending.clear()
            self._cv.notify_all()
        end = time.monotonic() + 5.0
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._plan and not self._hints and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                chain = (self._plan or self._hints).popleft()
                self._busy += 1
            try:
                for i, name in enumerate(chain):
                    outcome = self.copy(name)
                    failed = outcome not in ("copied", "present")
                    with self._cv:  # this name is done; after a failure, so is the rest of its chain
                        self.counts[outcome] += 1
                        self._forget(chain[i:] if failed else (name,))
                    if failed:
                        break
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def copy(self, name: str) -> str:
        """Copy one object into the node tier; returns ``copied``, ``present`` or why not."""
        try:
            if self.local.exists(name):
                return "present"
            ns, key = parse_object_name(name)
        except (ValueError, OSError):
            return "bad_name"
        for tier in self.remotes:
            try:
                src = tier.read(name)
            except (StoreError, OSError) as exc:
                log.warning("kvwarm node: %s could not be read: %s", tier.describe(name), exc)
                return "unavailable"
            if src is None:
                continue
            return self._land(tier, name, ns, key, src)
        return "absent"

    def _land(self, tier: Tier, name: str, ns: str, key: str, src: pa.Buffer) -> str:
        location = tier.describe(name)
        tenant = self.tenants.get(ns)
        try:
            src = plaintext(src, tenant.encryption_key if tenant is not None else None, name, location=location)
            snap = read_snapshot(src, location=location, full=True)
            header = snap.header
            snap.close()
            if header.key != key or header.tenant != ns:
                log.error("kvwarm node: %s holds %s/%s: not copied", location, header.tenant, header.key)
                return "mismatch"
            if header.expired(time.time()):
                return "expired"
            self.local.write(name, src if isinstance(src, pa.Buffer) else pa.py_buffer(src.read()),
                             expires_at=header.expires_at)
        except SnapshotError as exc:
            log.error("kvwarm node: %s not copied: %s", location, exc)
            return "refused"
        except (StoreError, OSError) as exc:
            log.warning("kvwarm node: %s could not be written into the node tier: %s", name, exc)
            return "write_failed"
        return "copied"
