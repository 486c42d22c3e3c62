"""Prefetch: a plan's prefixes copied S3 -> NVMe and mapped into the node's pool ahead of need.

:meth:`store.serving.loader.KVLoader.prefetch` turns what it is given (a plan, a plan file, or
prefixes as token ids) into block chains with :func:`plan_chains`, and runs
:func:`run_prefetch` on its background executor. The steps that touch the loader's
state (probing the local tier, mapping and pinning) are passed in, so this module holds
only the order of things and the accounting; it never raises for store trouble.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from store.errors import TenantAccessDenied
from store.identity.keys import Block, block_chain
from store.miss import MissReason
from store.plan import Plan, read_plan
from store.serving.fetch import ERRORS, RemoteFetcher, Scope
from store.serving.metrics import LoaderMetrics

log = logging.getLogger("kvwarm.loader")

#: a prefix's blocks, its plan score (``None`` for bare token ids) and where it lives
PrefixChain = tuple[list[Block], float | None, Scope]


@dataclass
class PrefetchResult:
    """What a :meth:`store.serving.loader.KVLoader.prefetch` did: per-block outcomes and per-reason failures."""

    prefixes: int = 0
    fetched: int = 0  # copied S3 -> NVMe
    present: int = 0  # already in NVMe
    mapped: int = 0  # mapped into this process and admitted to the pool
    skipped: int = 0  # plan entries for other tenants, or text without a tokenizer
    failed: dict[str, int] = field(default_factory=dict)  # by miss reason (its label value)

    def fail(self, reason: MissReason) -> None:
        self.failed[reason.value] = self.failed.get(reason.value, 0) + 1


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
    prefixes: list[tuple[np.ndarray, float | None, Scope]] = []
    skipped = 0
    if isinstance(items, Plan):
        for e in items.entries:
            # A loader keys token ids: an entry named by hash ids only (logs in the Mooncake format) is skipped.
            if e.tenant not in scopes or (e.token_ids is None and (e.text is None or tokenizer is None)):
                skipped += 1
                continue
            ids = e.token_ids if e.token_ids is not None else tokenizer(e.text or "")  # type: ignore[misc]
            prefixes.append((np.asarray(ids), float(e.score), scopes[e.tenant]))
    else:
        prefixes = [(np.asarray(p), None, own) for p in items]
    return [(block_chain(scope.root, ids), score, scope) for ids, score, scope in prefixes], skipped


def run_prefetch(chains: list[PrefixChain], skipped: int, *, probe: Callable[[list[Block], Scope], int],
                 fetcher: RemoteFetcher, map_ahead: Callable[[list[Block], Scope], int] | None,
                 metrics: LoaderMetrics) -> PrefetchResult:
    """For each chain: count what NVMe has (``probe``), fetch the rest from S3 where it is
    usable, then (``map_ahead``, which returns the blocks it mapped) map what NVMe has."""
    res = PrefetchResult(prefixes=len(chains), skipped=skipped)
    for chain, _, scope in chains:
        if not chain:
            continue
        try:
            have = probe(chain, scope)
        except TenantAccessDenied:  # counted by the store
            res.fail(MissReason.TENANT_REFUSED)
            continue
        except ERRORS as exc:
            log.exception("prefetch probe failed: %s", exc)
            res.fail(MissReason.ERROR)
            continue
        res.present += have
        if have < len(chain) and fetcher.usable():
            got, reason = fetcher.fetch_chain(chain, scope)
            res.fetched += max(0, got - have)
            have = max(have, got)
            if reason:
                res.fail(reason)
        if map_ahead is not None and have:
            try:
                mapped = map_ahead(chain[:have], scope)
            except ERRORS as exc:
                log.exception("prefetch mapping failed: %s", exc)
                mapped = 0
            if mapped:
                res.mapped += mapped
                metrics.prefetched("mapped", mapped)
    return res
