"""Write-back's uploads: the node's upload backlog, drained to the remote tiers (S3) on several threads.

:class:`store.engines.vllm.writeback.WriteBack` writes each block to NVMe on its own thread and
enqueues it here (:meth:`Uploads.put`: one row in the node's persistent upload backlog,
:mod:`store.tiers.backlog`), which never waits for S3: the node's own tier gets every block it
computed, and S3 what its link carries, in the order that matters. ``streams`` threads drain
the backlog, most valuable first (:mod:`store.serving.upload_rank`: the node agents' ranking of
each block, from the plan and the fleet's memory, then the oldest): each claims the first row,
reads its object back from NVMe (checksums checked: a corrupt copy is never uploaded) and PUTs
it (S3 gives parallel requests far more bandwidth than one stream). At most ``max_bytes`` of
read-back snapshots are in flight at once (one larger than that is still sent, alone).

A row goes once its object is in S3 (``written_back_uploads``; ``upload_present`` where S3 had
it already) or never can be, counted ``upload_dropped`` with its reason: ``evicted`` (gone from
NVMe before its turn), ``expired``, ``corrupt`` (the NVMe copy fails its checks; quarantined),
``error`` (refused ``max_attempts`` times), ``no_space`` and ``unrecorded`` (its row could not be
written: the disk full, the database unusable). After a remote tier fails
(:class:`store.errors.StoreUnavailable`) nothing is sent for ``backoff_s``: the rows wait. An
upload refused otherwise waits ``backoff_s`` doubled at each attempt. The backlog outlives the
process: a writer that starts drains what an earlier one left (``upload_backlog_resumed``), and
after a damaged backlog file every object on NVMe is enqueued again (``upload_backlog_rescanned``;
those S3 holds are found there and skipped).
"""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
from typing import Callable, Collection, Mapping

from store.engines.vllm.stats import Counters
from store.errors import ConfigError, SnapshotError, StoreError, StoreFull, StoreUnavailable
from store.format.encode import EncodedSnapshot
from store.format.payload import map_file
from store.format.snapshot import Snapshot, read_snapshot
from store.identity.tenant import Tenant
from store.serving.priority import lower_this_thread
from store.serving.upload_rank import merged_rank
from store.tiers.backlog import Pending, UploadBacklog
from store.tiers.base import Tier, object_name, parse_object_name
from store.tiers.store import Store

log = logging.getLogger("kvwarm.vllm")
#: failed uploads (other than an unreachable S3) after which a row is dropped (``upload_dropped:error``)
MAX_ATTEMPTS = 5
#: how often an idle upload thread looks at the backlog for rows no put announced
POLL_S = 1.0
#: how often the claims of dead processes on this node are released
SWEEP_S = 30.0


def read_back(tier: Tier, name: str, now: float) -> tuple[Snapshot | None, str | None]:
    """The snapshot ``name`` read back from the node tier for its upload, checked whole
    (payload checksums too), or ``None`` and why not: ``evicted`` (no such file), ``corrupt``
    (it fails its checks: quarantined on the tier), ``expired`` (at ``now``). Its access is not
    recorded: an upload is no use of the block, and must not keep it from the tier's LRU."""
    try:
        mapped = map_file(tier.path(name))
    except FileNotFoundError:
        return None, "evicted"
    try:
        snap = read_snapshot(mapped, location=tier.describe(name), verify_payload=True)
    except SnapshotError as exc:
        del mapped
        tier.quarantine(name, f"{type(exc).__name__}: {exc} (read back for its upload)")
        return None, "corrupt"
    if snap.header.expired(now):
        snap.close()
        return None, "expired"
    return snap, None


class Uploads:
    """The upload threads of one writer, and the backlog they drain.

    Args:
        remote: the remote tiers (a store of them alone: NVMe has the blocks already).
        local: the node tier the blocks are read back from (its metadata area holds the backlog).
        streams: upload threads (PUTs at once).
        max_bytes: the most read-back bytes in flight (one snapshot larger than this is still
            sent, alone).
        backoff_s: after a remote tier fails, nothing is sent for this long.
        counters: where uploads, drops and the backlog's figures are counted.
        credentials: a tenant's credentials by name (the upload is made with them).
        tenants: the tenants whose rows this process uploads (a node's other engines upload theirs).
        backlog: the backlog (default: the local tier's, or one in memory where it has no directory).
        max_attempts: refused uploads after which a row is dropped.
        poll_s: how often an idle thread looks for rows no :meth:`put` announced.
        clock: wall time (enqueue times, expiry, per-row back-off).

    Raises:
        ValueError: ``streams`` is not at least 1.
    """

    def __init__(self, remote: Store, local: Tier, *, streams: int, max_bytes: int, backoff_s: float,
                 counters: Counters, credentials: Callable[[str], Tenant], tenants: Collection[str],
                 backlog: UploadBacklog | None = None, max_attempts: int = MAX_ATTEMPTS, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if not (isinstance(streams, int) and streams >= 1):
            raise ValueError(f"write-back needs at least one upload stream (set loader.write_back_streams to 1 or "
                             f"more), got {streams!r}")
        self.remote = remote
        self.local = local
        self.max_bytes = max_bytes
        self.backoff_s = backoff_s
        self.counters = counters
        self.credentials = credentials
        self.tenants = frozenset(tenants)
        self.max_attempts = max_attempts
        self.poll_s = poll_s
        self.clock = clock
        if backlog is None:
            root = getattr(local, "root", None)
            backlog = UploadBacklog(None, clock=clock) if root is None else UploadBacklog.of_tier(root, clock=clock)
        self.backlog = backlog
        if self.backlog.resumed:
            counters.add("upload_backlog_resumed", self.backlog.resumed)
            log.info("kvwarm write-back: %d block(s) wait in the upload backlog from before; drained most valuable "
                     "first", self.backlog.resumed)
        self._rank_lock = threading.Lock()
        self._rankings: dict[str, dict[str, float]] = {}
        self._cond = threading.Condition()
        self._bytes = 0  # read back and in flight
        self._busy = 0  # in flight (or claimed and waiting for room)
        self._claims = 0  # bumped by each look for a row: drain's reads of the backlog were not raced
        self._peak = 0
        self._after = 0.0  # monotonic time from which the remote tiers are asked again
        self._gen = 0  # bumped by each put: a thread that found nothing looks again
        self._next_sweep = time.monotonic() + SWEEP_S
        self._closing = False
        self._threads = [threading.Thread(target=self._run, args=(i == 0,), name=f"kvwarm-upload-{i}", daemon=True)
                         for i in range(streams)]
        for t in self._threads:
            t.start()

    @property
    def queued_bytes(self) -> int:
        """Read-back bytes in flight now."""
        with self._cond:
            return self._bytes

    @property
    def peak_bytes(self) -> int:
        """The most read-back bytes that have been in flight at once."""
        with self._cond:
            return self._peak

    def resting(self) -> bool:
        """Whether the remote tiers are left alone now (a failure less than ``backoff_s`` ago)."""
        return time.monotonic() < self._after

    def waiting(self) -> int:
        """Blocks in the backlog that this process uploads (in flight ones too)."""
        return self.backlog.count(self.tenants)

    def add_tenants(self, names: Collection[str]) -> None:
        """Upload these tenants' rows too (the node, as engines announce theirs)."""
        self.tenants = self.tenants | frozenset(names)

    # -- the writer's side ---------------------------------------------------
    def put(self, tenant: Tenant, snap: EncodedSnapshot) -> bool:
        """Enqueue one snapshot the writer has just put on NVMe: it waits in the backlog until an
        upload thread takes it. Never waits for S3 (one SQLite insert); also while S3 rests and
        after :meth:`stop` (a later writer drains it). ``False`` (counted ``upload_dropped``) when
        its row cannot be written: the block is then on NVMe only."""
        name = object_name(snap.header.tenant, snap.key)
        try:
            self.backlog.add(name, tenant.name, snap.file_size, rank=self.rank_of(name))
        except (StoreError, sqlite3.Error) as exc:
            log.warning("kvwarm write-back: the upload backlog could not record %s (%s); it stays on NVMe only",
                        name, exc)
            self.counters.add("upload_dropped", reason="no_space" if isinstance(exc, StoreFull) else "unrecorded")
            return False
        with self._cond:
            self._gen += 1
            self._cond.notify_all()  # an idle thread among those waiting for room
        return True

    # -- the ranking ---------------------------------------------------------
    def set_ranking(self, source: str, ranks: Mapping[str, float]) -> int:
        """Make ``ranks`` (object name: value, :func:`store.serving.upload_rank.upload_ranks`) the
        ranking from ``source`` (one node agent), in place of its last; a block takes the highest
        value any source gives it. Rows waiting are reordered; how many changed."""
        with self._rank_lock:
            old = self._rankings.get(source, {})
            self._rankings[source] = dict(ranks)
            names = set(old) | set(ranks)
            merged = {n: merged_rank(self._rankings.values(), n) for n in names}
        try:
            return self.backlog.rerank(merged)
        except (StoreError, sqlite3.Error) as exc:  # the next ranking tries again; new rows get theirs
            log.warning("kvwarm write-back: the upload backlog could not be reordered (%s)", exc)
            return 0

    def rank_of(self, name: str) -> float:
        """A block's value in the drain order now (0: no ranking names it)."""
        with self._rank_lock:
            return merged_rank(self._rankings.values(), name)

    # -- the upload threads --------------------------------------------------
    def _run(self, first: bool) -> None:
        lower_this_thread()
        if first:  # the PUTs themselves (signing, checksums, sockets) run on the S3 client's loop thread
            for tier in self.remote.tiers:
                tier.call_on_io_thread(lower_this_thread)
        try:
            if first and self.backlog.damaged:
                self._rescan()
            while True:
                row = self._take()
                if row is None:
                    return
                try:
                    self._upload(row)
                except Exception:  # noqa: BLE001 - an upload thread must outlive any one bad upload
                    log.exception("kvwarm write-back: the upload of %s failed", row.name)
                    try:
                        self._refused(row)
                    except (StoreError, sqlite3.Error) as exc:  # its claim goes with this process
                        log.warning("kvwarm write-back: the backlog could not record the failure (%s)", exc)
                finally:
                    with self._cond:
                        self._bytes -= row.size
                        self._busy -= 1
                        self._cond.notify_all()
        except Exception:  # noqa: BLE001 - the backlog unusable (locked, gone): the rows wait for a restart
            log.exception("kvwarm write-back: an upload thread stopped; the backlog waits for the next writer")
        finally:
            self.backlog.close_thread()

    def _rescan(self) -> None:
        def tenant_of(name: str) -> str | None:
            ns = parse_object_name(name)[0]
            return ns if ns in self.tenants else None

        try:
            added = self.backlog.rescan(self.local.entries(), tenant_of)
        except (StoreError, sqlite3.Error, OSError) as exc:
            log.error("kvwarm write-back: the upload backlog was damaged and could not be rebuilt (%s); blocks "
                      "on NVMe only stay there", exc)
            return
        self.counters.add("upload_backlog_rescanned", added)
        log.warning("kvwarm write-back: the upload backlog was damaged (%s); %d object(s) on NVMe enqueued again "
                    "(those already in S3 are skipped)", self.backlog.repair, added)

    def _take(self) -> Pending | None:
        """The next row to upload, claimed and with room in the byte bound; ``None`` once closing."""
        while True:
            with self._cond:
                if self._closing:
                    return None
                rest = self._after - time.monotonic()
                if rest > 0:
                    self._cond.wait(timeout=rest)
                    continue
                gen = self._gen
                self._claims += 1
                self._busy += 1  # counted from before the claim: drain never sees a claimed row unowned
            row = None
            try:
                self._sweep()
                row = self.backlog.claim(self.tenants)
            except (StoreError, sqlite3.Error) as exc:  # locked past its timeout, the disk full: look again later
                log.warning("kvwarm write-back: the upload backlog could not be read (%s); trying again", exc)
            finally:
                if row is None:  # no notify: the other idle threads would wake, find nothing and wake this one
                    with self._cond:  # again, a ping-pong that kept a core busy (drain() polls every 50 ms)
                        self._busy -= 1
            if row is None:
                with self._cond:
                    if not self._closing and self._gen == gen:
                        self._cond.wait(timeout=self.poll_s)
                continue
            with self._cond:
                while self._bytes and self._bytes + row.size > self.max_bytes and not self._closing:
                    self._cond.wait()
                if not self._closing:
                    self._bytes += row.size
                    self._peak = max(self._peak, self._bytes)
                    return row
                self._busy -= 1
            self.backlog.release(row.name)
            return None

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._cond:
            due, self._next_sweep = now >= self._next_sweep, max(self._next_sweep, now + SWEEP_S)
        if due:
            self.backlog.release_dead()

    def _upload(self, row: Pending) -> None:
        try:
            tenant = self.credentials(row.tenant)
        except ConfigError as exc:  # this process cannot upload for that tenant: another may
            log.error("kvwarm write-back: no credentials for tenant %r here (%s); its uploads are left to "
                      "another writer", row.tenant, exc)
            self.tenants = self.tenants - {row.tenant}
            self.backlog.release(row.name)
            return
        snap, reason = read_back(self.local, row.name, self.clock())
        if snap is None:
            return self._drop(row, reason or "evicted")
        try:
            payload = snap.payload
            assert payload is not None
            wrote = self._send(tenant, EncodedSnapshot(snap.header, payload[0]), row)
        finally:
            snap.close()
        if wrote is None:
            return
        self.backlog.done(row.name)
        self.counters.add("written_back_uploads" if wrote else "upload_present")

    def _send(self, tenant: Tenant, snap: EncodedSnapshot, row: Pending) -> bool | None:
        """PUT ``snap``: whether it was written (``False``: the remote tiers had it), ``None``: it waits."""
        try:
            return self.remote.put(tenant, snap)
        except StoreUnavailable as exc:  # the remote tier rests a while; the row waits
            with self._cond:
                first = not self.resting()
                self._after = time.monotonic() + self.backoff_s
                self._cond.notify_all()
            if first:
                log.warning("kvwarm write-back: the remote tier failed (%s); uploads wait %g s in the backlog",
                            exc, self.backoff_s)
            self.backlog.release(row.name)
        except StoreError as exc:  # refused: tried again later, then dropped
            log.warning("kvwarm write-back: the upload of %s was refused: %s", row.name, exc)
            self._refused(row)
        return None

    def _refused(self, row: Pending) -> None:
        wait = self.backoff_s * (2 ** min(row.attempts, 20))
        if self.backlog.failed(row.name, retry_at=self.clock() + wait) >= self.max_attempts:
            self._drop(row, "error")

    def _drop(self, row: Pending, reason: str) -> None:
        if self.backlog.done(row.name):
            self.counters.add("upload_dropped", reason=reason)
            log.warning("kvwarm write-back: %s leaves the upload backlog without reaching S3 (%s)", row.name, reason)

    # -- waiting and stopping ------------------------------------------------
    def drain(self, deadline: float) -> bool:
        """Wait until the backlog holds nothing of this process's tenants (or the monotonic
        ``deadline`` passed, or nothing more can be sent now: the remote tiers rest, every row
        left backs off or is another process's); whether it is empty."""
        while True:
            with self._cond:
                busy, claims = self._busy, self._claims
            if not busy:
                left_rows = self.waiting()
                due = self.backlog.next_due(self.tenants) if left_rows else None
                with self._cond:  # a thread that claimed a row between those reads: look again
                    raced = self._busy or self._claims != claims
                if not raced:
                    if left_rows == 0:
                        return True
                    if self.resting() or self._closing or due is None or due > self.clock():
                        return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._cond:
                self._cond.wait(timeout=min(left, 0.05))

    def stop(self) -> None:
        """Stop uploading: each thread ends after the upload it is making. What waits stays in the
        backlog (a later writer drains it); :meth:`put` still enqueues."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """:meth:`stop`, wait for each thread to end (at most ``timeout_s`` each), give back this
        process's claims and close the backlog."""
        self.stop()
        for t in self._threads:
            t.join(timeout=timeout_s)
        try:
            self.backlog.release()
        except (StoreError, sqlite3.Error) as exc:  # the next writer releases them (this pid is gone by then)
            log.warning("kvwarm write-back: the upload backlog's claims could not be given back (%s)", exc)
        self.backlog.close()
