"""Write-back's uploads: encoded snapshots PUT to the remote tiers (S3) on several threads, bounded in bytes.

:class:`store.engines.vllm.writeback.WriteBack` writes each block to NVMe on its own thread
and hands the encoded snapshot here; ``streams`` threads PUT them, first come first served
(S3 gives parallel requests far more bandwidth than one stream). At most ``max_bytes`` of
encoded snapshots wait or are in flight: a block that finds no room stays on NVMe only
(``written_back_nvme_only``), so the writer, and behind it the copy queue, never slow to what
the remote tier takes: the node's own tier gets every block it computed, and S3 what its
link carries. After a remote tier fails
(:class:`store.errors.StoreUnavailable`) nothing is sent to it for ``backoff_s``: what waits
stays on NVMe only, and :meth:`put` refuses new uploads until then.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from store.engines.vllm.stats import Counters
from store.errors import StoreError, StoreUnavailable
from store.format.encode import EncodedSnapshot
from store.identity.tenant import Tenant
from store.serving.priority import lower_this_thread
from store.tiers.store import Store

log = logging.getLogger("kvwarm.vllm")


class Uploads:
    """The upload threads of one writer.

    Args:
        remote: the remote tiers (a store of them alone: NVMe has the blocks already).
        streams: upload threads (PUTs at once).
        max_bytes: the most encoded bytes that wait or are in flight (one snapshot larger than
            this is still sent, alone).
        backoff_s: after a remote tier fails, nothing is sent for this long.
        counters: where ``written_back_uploads`` and upload errors (``write_back_dropped:error``) are counted.
    """

    def __init__(self, remote: Store, *, streams: int, max_bytes: int, backoff_s: float, counters: Counters) -> None:
        if not (isinstance(streams, int) and streams >= 1):
            raise ValueError(f"write-back needs at least one upload stream (set loader.write_back_streams to 1 or "
                             f"more), got {streams!r}")
        self.remote = remote
        self.max_bytes = max_bytes
        self.backoff_s = backoff_s
        self.counters = counters
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Tenant, EncodedSnapshot, int]] = deque()
        self._bytes = 0  # waiting and in flight
        self._busy = 0  # in flight
        self._peak = 0
        self._after = 0.0  # monotonic time from which the remote tiers are asked again
        self._closing = False
        self._threads = [threading.Thread(target=self._run, name=f"kvwarm-upload-{i}", daemon=True)
                         for i in range(streams)]
        for t in self._threads:
            t.start()

    @property
    def queued_bytes(self) -> int:
        """Encoded bytes waiting or in flight now."""
        with self._cond:
            return self._bytes

    @property
    def peak_bytes(self) -> int:
        """The most encoded bytes that have waited or been in flight at once."""
        with self._cond:
            return self._peak

    def resting(self) -> bool:
        """Whether the remote tiers are left alone now (a failure less than ``backoff_s`` ago)."""
        return time.monotonic() < self._after

    def put(self, tenant: Tenant, snap: EncodedSnapshot) -> bool:
        """Queue one snapshot's upload; ``False`` (not queued: the block stays on NVMe only) when
        ``max_bytes`` are taken, while the remote tiers rest after a failure, or once closed.
        Never waits: the writer goes on to the next block's NVMe write."""
        n = snap.file_size
        with self._cond:
            if self._closing or self.resting() or (self._bytes and self._bytes + n > self.max_bytes):
                return False
            self._bytes += n
            self._peak = max(self._peak, self._bytes)
            self._jobs.append((tenant, snap, n))
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        lower_this_thread()
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                tenant, snap, n = self._jobs.popleft()
                self._busy += 1
            try:
                if not self.resting():  # a failure since it was queued: it stays on NVMe only
                    self._send(tenant, snap)
            except Exception:  # noqa: BLE001 - an upload thread must outlive any one bad upload
                log.exception("kvwarm write-back: the upload of a block failed")
                self.counters.add("write_back_dropped", reason="error")
            finally:
                del snap
                with self._cond:
                    self._bytes -= n
                    self._busy -= 1
                    self._cond.notify_all()

    def _send(self, tenant: Tenant, snap: EncodedSnapshot) -> None:
        try:
            if self.remote.put(tenant, snap):
                self.counters.add("written_back_uploads")
        except StoreUnavailable as exc:  # the remote tier rests a while; the block is on NVMe
            with self._cond:
                first = not self.resting()
                self._after = time.monotonic() + self.backoff_s
                self._cond.notify_all()
            if first:
                log.warning("kvwarm write-back: the remote tier failed (%s); NVMe only for %g s", exc, self.backoff_s)
        except StoreError as exc:  # refused: this block is on NVMe only
            log.warning("kvwarm write-back: the upload of a block failed: %s", exc)
            self.counters.add("write_back_dropped", reason="error")

    def drain(self, deadline: float) -> bool:
        """Wait until every queued upload is done (or the monotonic ``deadline`` passed); whether they are."""
        with self._cond:
            while self._bytes or self._jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 1.0))
        return True

    def stop(self) -> None:
        """Take no more uploads (:meth:`put` refuses: the writer's last blocks stay on NVMe only): the
        threads send what is queued, then end."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """:meth:`stop`, then wait for each thread to end (at most ``timeout_s`` each)."""
        self.stop()
        for t in self._threads:
            t.join(timeout=timeout_s)
