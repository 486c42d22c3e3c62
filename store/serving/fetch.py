"""Copying a tenant's snapshots from the remote tier (S3) into NVMe, for the loader.

Two ways, as the loader's ``fetch_mode`` says: in the background (an NVMe miss answers
now and the chain is copied for next time; at most one fetch in flight per chain head)
or waiting up to a timeout (and going on in the background past it); a prefetch's
streams copy through :meth:`RemoteFetcher.copy_chain`. After S3 fails, it is not asked
again for ``backoff_s``. Nothing here raises for store trouble: each outcome is a count
of blocks now in NVMe and a reason when fewer than S3 holds. The copying is the store's
own read (:meth:`store.tiers.store.Store.read`): up to ``gets`` blocks of a chain are read
from S3 at once, into memory, and written into NVMe in prefix order (:meth:`Store.land`),
so that a chain's blocks become visible only after their parents. A block that one thread
is copying is not copied by another, which waits for it instead.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from store.errors import StoreError, StoreRecordInvalid, StoreUnavailable, TenantAccessDenied
from store.identity.keys import Block, BlockKey, KeyRoot
from store.identity.tenant import Tenant
from store.miss import MissReason
from store.serving.metrics import LoaderMetrics
from store.tiers.base import object_name
from store.tiers.store import Read, Store

log = logging.getLogger("kvwarm.loader")
#: what store trouble can raise; each is a miss with a reason, never an error to the caller
ERRORS = (StoreError, OSError, sqlite3.Error)
_MAX_INFLIGHT = 4096
#: what a GET thread answers for one block: in NVMe already, S3 not to be asked, or S3's read
_Got = str | Read | None


@dataclass(frozen=True)
class Scope:
    """Where a chain's snapshots live: the key root it is salted with and its namespace."""

    root: KeyRoot
    ns: str

    def names(self, blocks: Sequence[Block | BlockKey]) -> list[str]:
        """The tier object names of ``blocks`` (or bare keys) in this namespace."""
        return [object_name(self.ns, b if isinstance(b, str) else b.key) for b in blocks]


@dataclass(frozen=True)
class Fetched:
    """What :meth:`RemoteFetcher.copy_chain` did: ``count`` leading blocks are in NVMe (from
    ``blocks[0]``); of the blocks it handled, ``fetched`` it copied and ``present`` it found
    there (already, or copied meanwhile by another thread); ``reason`` says why not more."""

    count: int
    fetched: int = 0
    present: int = 0
    reason: MissReason | None = None


class RemoteFetcher:
    """Read-through of chains from the remote tiers of ``store`` into its local one, on ``executor``.

    Args:
        store: all tiers, NVMe first (its ``read`` copies a remote hit into NVMe).
        tenant: whose snapshots (the store checks every namespace against it, and counts refusals).
        metrics: counts what was fetched and present.
        executor: where background fetches run (shared with the loader).
        timeout_s: the most :meth:`fetch_sync` waits.
        backoff_s: after S3 fails, do not ask it again for this long.
        gets: the most S3 GETs one chain's copy has in flight (``loader.chain_gets``); they run
            on threads of the fetcher's own, made as needed.
        get_threads: the most GET threads (default three times ``gets``): bounds the GETs of
            all chains copied at once (the loader gives ``gets`` per background fetch thread,
            plus ``gets``).
    """

    def __init__(self, store: Store, tenant: Tenant, metrics: LoaderMetrics,
                 executor: cf.Executor, *, timeout_s: float, backoff_s: float, gets: int = 8,
                 get_threads: int | None = None) -> None:
        if gets < 1:
            raise ValueError(f"gets must be at least 1, got {gets}")
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
        self._copying: dict[str, threading.Event] = {}  # block name -> set when its copy ends
        self.gets = int(gets)
        self._gets = cf.ThreadPoolExecutor(max_workers=get_threads or 3 * self.gets,
                                           thread_name_prefix="kvwarm-get")
        self._closed = False

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
        done = self.copy_chain(blocks, scope)
        return done.count, done.reason

    def copy_chain(self, blocks: Sequence[Block | BlockKey], scope: Scope, *, start: int = 0,
                   stopped: Callable[[], bool] | None = None, gets: int | None = None) -> Fetched:
        """Copy ``blocks[start:]`` into NVMe in prefix order, up to the first block no tier serves.

        Up to ``gets`` blocks are read from S3 at once (into memory, on the fetcher's own GET
        threads), and written into NVMe one by one in prefix order: a block lands only after
        its parents, so NVMe never holds a block its chain cannot reach. The chain ends at the
        first block no tier serves (or S3 fails on): the GETs already made past it are
        discarded, none written. A block another thread is copying is not asked here: its copy
        is waited for when the chain reaches it.

        Args:
            blocks: the chain's blocks, or bare keys (copied by key: their tokens are checked
                by the lookup that maps them).
            start: how many leading blocks are known to be in NVMe (a probe's count).
            stopped: asked before each block; ``True`` ends the copy there (the loader is closing).
            gets: the most GETs in flight for this chain (default the fetcher's ``gets``; 1: one
                block at a time, as a prefetch stream copies).

        NOTE: S3 is not probed first. A probe is a HEAD per block on top of the GET that
        copies it; the first GET that finds nothing ends the chain just as the probe's count
        would, and a stream copying many chains side by side keeps its requests for GETs.
        """
        width = max(1, self.gets if gets is None else gets)
        names = scope.names(blocks)
        ahead: dict[int, tuple[cf.Future[_Got], threading.Event]] = {}  # GETs this call claimed, by index
        fetched = present = 0
        i = start
        try:
            for i in range(start, len(blocks)):
                if self._closed or (stopped is not None and stopped()):
                    return Fetched(i, fetched, present)
                for j in range(i + 1, min(len(blocks), i + width)):  # the GETs ahead of this block
                    if j not in ahead:
                        self._claim_ahead(j, blocks, names, scope, ahead)
                got = self._take(i, blocks, names, scope, ahead)
                if got == "closed":  # its GET was cancelled: the fetcher is closing
                    return Fetched(i, fetched, present)
                if got == "present":
                    present += 1
                elif got == "fetched":
                    fetched += 1
                else:  # absent in S3 too: the chain ends here; expired, corrupt...: the store counted it
                    return Fetched(i, fetched, present, None if got is MissReason.ABSENT else got)
            return Fetched(len(blocks), fetched, present)
        except StoreUnavailable as exc:
            self.failed(exc)
            return Fetched(i, fetched, present, MissReason.STORE_UNAVAILABLE)
        except TenantAccessDenied as exc:  # counted by the store
            log.warning("fetch refused: %s", exc)
            return Fetched(i, fetched, present, MissReason.TENANT_REFUSED)
        except StoreRecordInvalid as exc:  # counted (and logged once) by the store
            log.debug("fetch: %s", exc)
            return Fetched(i, fetched, present, MissReason.BAD_RECORD)
        except ERRORS as exc:
            log.exception("fetch failed: %s", exc)
            return Fetched(i, fetched, present, MissReason.ERROR)
        finally:
            for j, (fut, mine) in ahead.items():  # past the chain's end (or a stop): nothing of them is kept
                fut.add_done_callback(lambda f, n=names[j], e=mine: self._discard(f, n, e))
                fut.cancel()

    def close(self) -> None:
        """Stop every copy after the block it is landing, and the GET threads (idempotent)."""
        self._closed = True
        self._gets.shutdown(wait=False, cancel_futures=True)

    # -- the copy's steps --------------------------------------------------------
    def _claim(self, name: str) -> tuple[bool, threading.Event]:
        """Take ``name``'s copy (``True``), or the event of the thread that copies it now."""
        mine = threading.Event()
        with self._lock:
            busy = self._copying.setdefault(name, mine)
        return busy is mine, busy

    def _release(self, name: str, mine: threading.Event) -> None:
        with self._lock:
            if self._copying.get(name) is mine:
                del self._copying[name]
        mine.set()

    def _discard(self, fut: cf.Future[_Got], name: str, mine: threading.Event) -> None:
        """A GET past the chain's end completed (or was cancelled): drop what it read, free the block."""
        if not fut.cancelled() and fut.exception() is None:
            got = fut.result()
            if isinstance(got, Read) and got.snapshot is not None:
                got.snapshot.close()
        self._release(name, mine)

    def _claim_ahead(self, j: int, blocks: Sequence[Block | BlockKey], names: list[str], scope: Scope,
                     ahead: dict[int, tuple[cf.Future[_Got], threading.Event]]) -> None:
        """Start the GET of ``blocks[j]`` unless another thread is copying it (then it is waited for
        when the chain reaches it) or the GET threads are shut (the loader is closing)."""
        mine, event = self._claim(names[j])
        if not mine:
            return
        try:
            ahead[j] = (self._gets.submit(self._get, blocks[j], scope), event)
        except RuntimeError:  # shut down: closing
            self._release(names[j], event)

    def _take(self, i: int, blocks: Sequence[Block | BlockKey], names: list[str], scope: Scope,
              ahead: dict[int, tuple[cf.Future[_Got], threading.Event]]) -> str | MissReason:
        """``blocks[i]``, in NVMe now: ``"present"`` (it was), ``"fetched"`` (landed now from S3), ``"closed"``
        (its GET was cancelled: the fetcher is closing) or why neither.

        Raises:
            StoreUnavailable: S3 did not answer (a back-off is answered ``store_unavailable``).
            TenantAccessDenied, StoreError, OSError: as the store's probe and read.
        """
        while True:
            if i in ahead:
                fut, mine = ahead.pop(i)
            else:
                ok, event = self._claim(names[i])
                if not ok:
                    event.wait()  # another thread's copy of it ended: landed (present) or failed (try it here)
                    continue
                fut, mine = cf.Future(), event
                try:
                    fut.set_result(self._get(blocks[i], scope))  # the chain's next block: asked on this thread
                except BaseException as exc:  # noqa: BLE001 - handed on below, as a GET thread's would be
                    fut.set_exception(exc)
            try:
                if fut.cancelled():
                    return "closed"
                return self._landed(blocks[i], scope, fut.result())
            except cf.CancelledError:  # cancelled while waited for (the GET threads shut down)
                return "closed"
            finally:
                self._release(names[i], mine)

    def _get(self, block: Block | BlockKey, scope: Scope) -> _Got:
        """``"present"`` (in NVMe), ``None`` (S3 not to be asked) or the read from S3 (not landed)."""
        if self.store.probe(self.tenant, [block], scope.root, local_only=True).count:
            return "present"
        if self._closed or not self.usable():  # no S3, or in its back-off: not asked (and the back-off not extended)
            return None
        return self.store.read(self.tenant, block, scope.root, read_through=False)

    def _landed(self, block: Block | BlockKey, scope: Scope, got: _Got) -> str | MissReason:
        if got == "present":
            self.metrics.prefetched("present")
            return "present"
        if got is None or isinstance(got, str):
            return MissReason.STORE_UNAVAILABLE if self.has_remote else MissReason.ABSENT
        if got.snapshot is None:
            if isinstance(got.error, StoreUnavailable):
                raise got.error
            return got.miss or MissReason.ABSENT
        if got.tier == self.store.tiers[0].kind:  # landed between the probe and the read
            got.snapshot.close()
            self.metrics.prefetched("present")
            return "present"
        if self._closed:  # the store is closing: nothing more is written
            got.snapshot.close()
            return "closed"
        self.store.land(self.tenant, block, scope.root, got).snapshot.close()  # type: ignore[union-attr]
        self.metrics.prefetched("fetched")
        return "fetched"
