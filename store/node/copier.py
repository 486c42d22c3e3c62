"""The node's copies from the shared tiers (S3) into its own (NVMe), by object name, in order.

One thread copies a queue of names, first to last; a new agent order replaces the queue (the
names it no longer wants are dropped), a client's hint is queued behind it. Each copy reads the
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
    """

    def __init__(self, local: Tier, remotes: Sequence[Tier], tenants: Mapping[str, Tenant]) -> None:
        self.local = local
        self.remotes = list(remotes)
        self.tenants = dict(tenants)
        self.counts: Counter[str] = Counter()
        self._queue: deque[tuple[str, ...]] = deque()  # chains: a failure skips the rest of one
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvwarm-node-copy", daemon=True)
        self._thread.start()

    def replace(self, chains: Sequence[Sequence[str]]) -> None:
        """Copy ``chains`` (each in prefix order) in place of what is queued."""
        with self._cv:
            dropped = sum(len(c) for c in self._queue)
            if dropped:
                self.counts["superseded"] += dropped
            self._queue.clear()
            self._queue.extend(tuple(c) for c in chains if c)
            self._cv.notify()

    def add(self, chain: Sequence[str]) -> int:
        """Queue one chain behind the rest; returns the names queued (0 without a remote tier)."""
        if not self.remotes or not chain:
            return 0
        with self._cv:
            self._queue.append(tuple(chain))
            self._cv.notify()
        return len(chain)

    def queued(self) -> int:
        """Chains waiting to be copied."""
        with self._cv:
            return len(self._queue)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or copying (tests, shutdown); ``False`` on timeout."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        """Stop after the current copy."""
        with self._cv:
            self._stop = True
            self._queue.clear()
            self._cv.notify_all()
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait()
                if self._stop:
                    self._busy = False
                    self._cv.notify_all()
                    return
                chain = self._queue.popleft()
                self._busy = True
            for name in chain:
                outcome = self.copy(name)
                self.counts[outcome] += 1
                if outcome not in ("copied", "present"):
                    break

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
