"""S3 -> NVMe for the scheduler, which never waits on the network itself.

A prompt whose chain the NVMe tier holds only in part may have the rest in S3. The loader's
``fetch_mode`` (docs/reference/config.md) decides what a request does about it:

- ``background``: it is answered with what NVMe holds now; the rest of the chain is copied for
  the next request (at most one copy in flight per chain head).
- ``sync``: when fetching is estimated to beat recomputing, the request waits for the copy, up
  to ``sync_fetch_timeout_s``: the scheduler answers vLLM "ask again" (``None``) meanwhile, so
  other requests run, and then loads the NVMe hit like any other. Each ask waits up to
  :data:`PAUSE_S` on the copy first (:meth:`Pending.pause`), or vLLM's loop, asking again at
  once, keeps the GIL from the copy's threads. A fetch that would not beat
  recomputing goes to the background.

The copies are :class:`store.serving.fetch.RemoteFetcher`'s (read-through, back-off after S3
fails); they run on this module's threads. With the machine's node process connected, a
``background`` copy is handed to the node's copier instead (one local round trip, made on this
module's threads, not the scheduler's): the GETs then run in the node process, off vLLM's GIL,
and a block the node's agent has queued already is not queued twice. A node that is away takes
nothing: the copy runs here, as without one. A ``sync`` copy, which a request waits for, runs here.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from store.engines.vllm.tenancy import TenantBook
from store.identity.keys import Block
from store.serving.fetch import RemoteFetcher, Scope
from store.serving.metrics import LoaderMetrics
from store.serving.node_link import NodeLink
from store.tiers.store import Store

#: Most chains copied at once for waiting requests (others go to the background).
MAX_WAITED = 256
#: The most one scheduler call waits for a copy before answering "ask again" (:meth:`Pending.pause`).
PAUSE_S = 0.002


@dataclass
class Pending:
    """A copy a request waits for: done when ``future`` is, abandoned at ``deadline`` (monotonic)."""

    future: "cf.Future[tuple[int, str | None]]"
    deadline: float

    def waiting(self, now: float) -> bool:
        """Whether the request should still wait."""
        return not self.future.done() and now < self.deadline

    def pause(self, seconds: float | None = None) -> None:
        """Give the copy up to ``seconds`` before the scheduler says "ask again".

        vLLM asks again at its next step; with nothing else to run, its loop comes straight
        back, and between two asks it holds the GIL the copy's threads need (in vLLM's
        one-process mode on two cores, a sync fetch of 8 blocks took over a second that way).
        Waiting on the future releases it.
        """
        cf.wait([self.future], timeout=PAUSE_S if seconds is None else seconds)


class RemoteFetches:
    """The scheduler's copies from the remote tier.

    Args:
        store: every tier, NVMe first.
        tenants: whose credentials each copy runs under.
        mode: ``background`` or ``sync``.
        timeout_s: the most a ``sync`` request waits.
        backoff_s: after S3 fails, it is not asked again for this long.
        workers: copy threads.
        gets: S3 GETs one chain's copy has in flight (``loader.chain_gets``; each tenant's
            fetcher has at most ``gets`` x (``workers`` + 1) GET threads, made as needed).
        node: the machine's node process (a :class:`store.node.client.NodeClient`), which takes
            the ``background`` copies while it is connected; ``None``: every copy runs here.
        clock: monotonic time (deadlines).

    Attributes:
        handed: blocks whose background copy the node took.
    """

    def __init__(self, store: Store, tenants: TenantBook, *, mode: str, timeout_s: float, backoff_s: float,
                 workers: int = 2, gets: int = 8, node: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.tenants = tenants
        self.mode = mode
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.has_remote = len(store.tiers) > 1
        self.clock = clock
        self.gets = gets
        self.workers = workers
        self._executor = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvwarm-s3")
        self._metrics = LoaderMetrics(store=store.stats)
        self._lock = threading.Lock()
        self._fetchers: dict[str, RemoteFetcher] = {}
        self._waited: dict[str, Pending] = {}
        self._node = NodeLink(node)
        self.handed = 0

    def _fetcher(self, tenant: str) -> RemoteFetcher:
        with self._lock:
            f = self._fetchers.get(tenant)
        if f is None:
            f = RemoteFetcher(self.store, self.tenants.credentials(tenant), self._metrics, self._executor,
                              timeout_s=self.timeout_s, backoff_s=self.backoff_s, gets=self.gets,
                              get_threads=self.gets * (self.workers + 1))
            with self._lock:
                f = self._fetchers.setdefault(tenant, f)
        return f

    def usable(self, tenant: str) -> bool:
        """Whether S3 may be asked now for ``tenant`` (there is one, and it is not in its back-off)."""
        return self.has_remote and self._fetcher(tenant).usable()

    def background(self, tenant: str, scope: Scope, blocks: Sequence[Block]) -> None:
        """Copy ``blocks`` (the part of a chain NVMe lacks) for next time: by the node where it is connected."""
        client = self._node.client
        if client is not None and client.connected:
            self._executor.submit(self._hand, tenant, scope, list(blocks))
            return
        self._fetcher(tenant).schedule(scope, blocks)

    def _hand(self, tenant: str, scope: Scope, blocks: list[Block]) -> None:
        if not self._node.hand(scope, blocks):  # gone since: the copy runs here
            self._fetcher(tenant).schedule(scope, blocks)
            return
        with self._lock:
            self.handed += len(blocks)

    def wait_for(self, tenant: str, scope: Scope, blocks: Sequence[Block]) -> Pending | None:
        """Start (or join) a copy of the chain ``blocks`` that a request will wait for.

        Returns ``None`` when too many copies are already waited for (the caller goes on in the background).
        """
        head = scope.names(blocks[:1])[0]
        with self._lock:
            have = self._waited.get(head)
            if have is not None and not have.future.done():
                return have
            if len(self._waited) >= MAX_WAITED:
                self._waited = {k: p for k, p in self._waited.items() if not p.future.done()}
                if len(self._waited) >= MAX_WAITED:
                    return None
        future = self._executor.submit(self._fetcher(tenant).fetch_chain, list(blocks), scope)
        pending = Pending(future, self.clock() + self.timeout_s)
        with self._lock:
            self._waited[head] = pending
        future.add_done_callback(lambda _: self._forget(head, pending))
        return pending

    def _forget(self, head: str, pending: Pending) -> None:
        with self._lock:
            if self._waited.get(head) is pending:
                del self._waited[head]

    def close(self) -> None:
        """Stop the copy threads (a copy in flight finishes; queued ones are dropped)."""
        with self._lock:
            fetchers = list(self._fetchers.values())
        for f in fetchers:
            f.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.store.close()
