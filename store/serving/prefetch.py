"""Prefetch: a plan's prefixes copied S3 -> NVMe and mapped into the node's pool ahead of need.

:meth:`store.serving.loader.KVLoader.prefetch` turns what it is given (a plan, a plan file, or
prefixes as token ids) into block chains with :func:`plan_chains`, and hands them to its
:class:`Prefetcher`: ``streams`` threads of its own (apart from the loader's background
fetches, which a long prefetch must not hold up) that take the chains in the plan's
priority order, one chain per stream at a time, each copied block by block in prefix
order (a chain is usable only up to its first missing block). Chains that share a head
(a common system prompt) do not copy it twice: a block one stream is copying is waited
for by the others (:meth:`store.serving.fetch.RemoteFetcher.copy_chain`). A loader linked
to the machine's node process makes no copy itself: a stream hands the chain's missing
blocks to the node (:meth:`store.serving.node_link.NodeLink.hand`: the node's copier, which
queues no name twice, so a chain the node's own agent queued costs one round trip), waits on
its own thread until the node has nothing of them left to copy, then maps what the node tier
holds; it copies alone only while the node is away. The steps that
touch the loader's state (probing the local tier, mapping and pinning) are passed in, so
this module holds only the order of things and the accounting; it never raises for store
trouble.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from store.errors import TenantAccessDenied
from store.identity.keys import Block, BlockKey, block_chain
from store.miss import MissReason
from store.plan import Plan, PlanEntry, read_plan
from store.serving.fetch import ERRORS, RemoteFetcher, Scope
from store.serving.metrics import LoaderMetrics
from store.serving.node_link import NodeLink
from store.serving.priority import lower_this_thread

log = logging.getLogger("kvwarm.loader")

#: a prefix's blocks (or bare keys, copied by key and never mapped ahead), its plan score
#: (``None`` for bare token ids) and where it lives
PrefixChain = tuple[list[Block] | list[BlockKey], float | None, Scope]


@dataclass
class PrefetchResult:
    """What a :meth:`store.serving.loader.KVLoader.prefetch` did: per-block outcomes and per-reason failures."""

    prefixes: int = 0
    fetched: int = 0  # copied S3 -> NVMe by this process
    handed: int = 0  # handed to the node process to copy S3 -> NVMe
    present: int = 0  # already in NVMe
    mapped: int = 0  # mapped into this process and admitted to the pool
    skipped: int = 0  # plan entries for other tenants, or text without a tokenizer
    failed: dict[str, int] = field(default_factory=dict)  # by miss reason (its label value)
    superseded: int = 0  # chains never started because a newer prefetch replaced this one

    def fail(self, reason: MissReason) -> None:
        self.failed[reason.value] = self.failed.get(reason.value, 0) + 1

    def add(self, other: "PrefetchResult") -> None:
        """Count ``other``'s blocks and failures in this one (one chain's into the plan's)."""
        self.fetched += other.fetched
        self.handed += other.handed
        self.present += other.present
        self.mapped += other.mapped
        for reason, n in other.failed.items():
            self.failed[reason] = self.failed.get(reason, 0) + n


def plan_chains(items: Plan | str | os.PathLike[str] | Iterable[Sequence[int]], own: Scope,
                scopes: dict[str, Scope], tokenizer: Callable[[str], Sequence[int]] | None
                ) -> tuple[list[PrefixChain], int]:
    """The chains to prefetch, and how many plan entries were skipped.

    A plan (or plan file) gives its entries for the tenants in ``scopes`` (``prefill`` and
    ``retain`` alike), each with its score; an entry with only ``text`` needs ``tokenizer``,
    and one named by ``hash_ids`` is skipped. Anything else is prefixes as
    token ids, in ``own`` scope, without a score.
    """
    if isinstance(items, (str, os.PathLike)):
        items = read_plan(items)
    if isinstance(items, Plan):
        found, skipped = plan_prefixes(items, scopes, tokenizer)
        return [(chain, float(e.score), scope) for e, chain, scope in found], skipped
    return [(block_chain(own.root, np.asarray(p)), None, own) for p in items], 0


def plan_prefixes(plan: Plan, scopes: dict[str, Scope], tokenizer: Callable[[str], Sequence[int]] | None
                  ) -> tuple[list[tuple[PlanEntry, list[Block], Scope]], int]:
    """A plan's entries for the tenants in ``scopes``, each with its block chain and scope, in
    the plan's order; and how many entries were skipped (another tenant's, ``hash_ids`` only,
    or ``text`` without a ``tokenizer``)."""
    out: list[tuple[PlanEntry, list[Block], Scope]] = []
    skipped = 0
    for e in plan.entries:
        # A loader keys token ids: an entry named by hash ids only (logs in the Mooncake format) is skipped.
        if e.tenant not in scopes or (e.token_ids is None and (e.text is None or tokenizer is None)):
            skipped += 1
            continue
        ids = e.token_ids if e.token_ids is not None else tokenizer(e.text or "")  # type: ignore[misc]
        scope = scopes[e.tenant]
        out.append((e, block_chain(scope.root, np.asarray(ids)), scope))
    return out, skipped


class Prefetcher:
    """Prefetches on ``streams`` threads of their own, for one loader.

    Args:
        streams: chains copied at once (parallel S3 GETs); each stream copies one chain at a time.
        probe: leading blocks of a chain in the local tier (raises ``TenantAccessDenied`` for
            another tenant's namespace).
        fetcher: copies S3 -> NVMe (and backs off after S3 fails).
        metrics: counts present, fetched, handed and mapped blocks.
        node: the loader's link to the node process, which then makes the copies (default: none).
        poll_s: the first pause between a stream's questions to the node while it copies a
            chain (doubling up to 1 s).
    """

    def __init__(self, streams: int, *, probe: Callable[[list[Block], Scope], int], fetcher: RemoteFetcher,
                 metrics: LoaderMetrics, node: NodeLink | None = None, poll_s: float = 0.02) -> None:
        if streams < 1:
            raise ValueError(f"streams must be at least 1, got {streams}")
        self.streams = streams
        self.probe = probe
        self.fetcher = fetcher
        self.metrics = metrics
        self.node = node
        self.poll_s = poll_s
        self._executor = cf.ThreadPoolExecutor(max_workers=streams, thread_name_prefix="kvwarm-prefetch",
                                               initializer=lower_this_thread)  # copies yield to the forward
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._runs: set[_Run] = set()
        self._threads: set[int] = set()  # the streams' thread ids (close from one of them must not join it)

    def run(self, chains: list[PrefixChain], skipped: int, *,
            map_ahead: Callable[[list[Block], Scope], int] | None,
            replace: bool = False) -> "cf.Future[PrefetchResult]":
        """Start prefetching ``chains`` (in their order); a future of the whole plan's result.

        For each chain: count what NVMe has (``probe``), copy the rest from S3 where it is
        usable, then (``map_ahead``, which returns the blocks it mapped) map what NVMe has
        (the loader's ``map_ahead`` maps chains of blocks; a chain of bare keys is the caller's
        ``map_ahead`` to map or not). With ``replace``, every prefetch still
        running is superseded first: each stops after the block its streams are copying, and
        its result counts the chains it never started (``superseded``).
        """
        if replace:
            self.supersede()
        run = _Run(self, chains, skipped, map_ahead)
        n = min(self.streams, sum(1 for c, _, _ in chains if c))
        if n == 0:
            run.future.set_result(run.result)
            return run.future
        with self._lock:
            self._runs.add(run)
        run.left = n
        for _ in range(n):
            self._executor.submit(self._stream, run).add_done_callback(run.stream_ended)
        return run.future

    def _stream(self, run: "_Run") -> None:
        with self._lock:
            self._threads.add(threading.get_ident())
        while (item := run.take()) is not None:
            run.add(self._chain(item, run))

    def _chain(self, item: PrefixChain, run: "_Run") -> PrefetchResult:
        chain, _, scope = item
        res = PrefetchResult()
        try:
            have = self.probe(chain, scope)
        except TenantAccessDenied:  # counted by the store
            res.fail(MissReason.TENANT_REFUSED)
            return res
        except ERRORS as exc:
            log.exception("prefetch probe failed: %s", exc)
            res.fail(MissReason.ERROR)
            return res
        res.present += have
        if have:
            self.metrics.prefetched("present", have)
        by_node = self._by_node(chain, scope, have, run, res) if have < len(chain) else None
        if by_node is not None:
            have = by_node
        elif have < len(chain) and self.fetcher.usable():
            # one GET at a time per stream: the streams are the prefetch's parallel GETs (bounded by their number)
            done = self.fetcher.copy_chain(chain, scope, start=have, stopped=run.stopped.is_set, gets=1)
            res.fetched += done.fetched
            res.present += done.present
            have = max(have, done.count)
            if done.reason:
                res.fail(done.reason)
        # a chain of bare keys reaches map_ahead too: the node agent's maps a published plan's
        # chains (their tokens read from NVMe), and leaves the fleet's keys to the lookup
        if run.map_ahead is not None and have and not run.stopped.is_set():
            try:
                mapped = run.map_ahead(chain[:have], scope)
            except ERRORS as exc:
                log.exception("prefetch mapping failed: %s", exc)
                mapped = 0
            if mapped:
                res.mapped += mapped
                self.metrics.prefetched("mapped", mapped)
        return res

    def _by_node(self, chain: list[Block] | list[BlockKey], scope: Scope, have: int, run: _Run,
                 res: PrefetchResult) -> int | None:
        """Hand ``chain[have:]`` to the node and wait (on this stream) until it has nothing of them
        left to copy; the leading blocks the node tier then holds. ``None``: no node took them, or
        it went away meanwhile (the stream copies alone)."""
        if self.node is None or not self.fetcher.has_remote:
            return None
        rest = chain[have:]
        if not self.node.hand(scope, rest):
            return None
        res.handed += len(rest)
        self.metrics.prefetched("handed", len(rest))
        pause = self.poll_s
        while (left := self.node.pending(scope, rest)) != 0:
            if left is None:
                return None
            if run.stopped.wait(pause):  # superseded or closed: the node copies on, unwatched
                break
            pause = min(2 * pause, 1.0)
        try:
            return max(have, self.probe(chain, scope))  # type: ignore[arg-type]
        except ERRORS as exc:
            log.warning("prefetch: the node tier could not be probed after the node's copies: %s", exc)
            return have

    def supersede(self) -> int:
        """Stop every prefetch still running (a newer one replaces them); returns how many were stopped.
        Their futures resolve with what was done, once their streams end."""
        with self._lock:
            runs = list(self._runs)
        for run in runs:
            run.stop(superseded=True)
        return len(runs)

    def running(self) -> int:
        """Prefetches not yet finished."""
        with self._lock:
            return len(self._runs)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no prefetch is running (at most ``timeout`` seconds); whether none is."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._runs, timeout)

    def ended(self, run: "_Run") -> None:
        with self._idle:
            self._runs.discard(run)
            self._idle.notify_all()

    def close(self) -> None:
        """Stop every prefetch after the block each stream is copying; their futures resolve
        with what was done. Waits for the streams, unless called from one of them."""
        with self._lock:
            runs = list(self._runs)
            inside = threading.get_ident() in self._threads
        for run in runs:
            run.stopped.set()
        self._executor.shutdown(wait=not inside, cancel_futures=True)


class _Run:
    """One prefetch: its chains in priority order, handed out to the streams, and its result."""

    def __init__(self, owner: Prefetcher, chains: list[PrefixChain], skipped: int,
                 map_ahead: Callable[[list[Block], Scope], int] | None) -> None:
        self.owner = owner
        self.map_ahead = map_ahead
        self.result = PrefetchResult(prefixes=len(chains), skipped=skipped)
        self.future: cf.Future[PrefetchResult] = cf.Future()
        self.stopped = threading.Event()
        self.left = 0  # streams not yet ended
        self._chains = iter([c for c in chains if c[0]])
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def take(self) -> PrefixChain | None:
        """The next chain to copy, in the plan's order; ``None`` when none is left or the run stopped."""
        with self._lock:
            return None if self.stopped.is_set() else next(self._chains, None)

    def stop(self, *, superseded: bool = False) -> None:
        """Hand out no more chains; with ``superseded``, count those never started."""
        with self._lock:
            if self.stopped.is_set():
                return
            self.stopped.set()
            if superseded:
                left = [len(c) for c, _, _ in self._chains]
                self.result.superseded += len(left)
                if left:
                    self.owner.metrics.prefetched("superseded", sum(left))

    def add(self, res: PrefetchResult) -> None:
        with self._lock:
            self.result.add(res)

    def stream_ended(self, fut: "cf.Future[None]") -> None:
        """A stream's task is done (finished, failed on a bug, or cancelled by a close)."""
        error = None if fut.cancelled() else fut.exception()
        with self._lock:
            self._error = self._error or error
            self.left -= 1
            last = self.left == 0
        if not last:
            return
        self.owner.ended(self)
        if self._error is not None:
            self.future.set_exception(self._error)
        else:
            self.future.set_result(self.result)
