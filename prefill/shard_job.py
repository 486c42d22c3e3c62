"""Running one shard of a plan (:mod:`prefill.shards`): its shared prefixes first, then its entries
in priority order, waiting through the store's probe for the prefixes other shards compute.

:func:`run_shard` is the job one prefill worker runs for its :class:`prefill.shards.Shard`:

1. the shared prefixes the shard owns (``computes``) are prefilled first, so the shards
   that wait for them start soon;
2. then its entries, most valuable first, in *steps* of about ``step_tokens`` new
   tokens each: the runner orders a step's batches by priority, and steps run in plan
   order, so a deadline cuts the least valuable part of the shard;
3. before the first entry that begins with a prefix another shard owns (``waits``), the
   job probes the store until that prefix is stored, logging the wait, and then goes
   on: the runner finds the blocks stored and continues from the stored KV. A prefix
   still missing after ``wait_timeout_s`` (its owner died) is computed here instead:
   a shard never fails because another one did.

The job stops ``stop_margin_s`` before the deadline (time to report and exit). It is
resumable like every prefill: the runner probes the store, so a rerun of a shard that
died computes only the blocks it had not written. The report names the entries the
deadline cut (those not fully stored at the end), found by probing the store.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from prefill.inputs import requests_from_plan
from prefill.models import LoadedModel
from prefill.runner import DeadlinePassed, Prefiller, PrefillOptions, PrefillReport, PrefixRequest, check_deadline
from prefill.shards import Shard, SharedPrefix
from store.config import KvwarmConfig
from store.format.precision import Precision
from store.identity.keys import block_chain
from store.plan import PlanEntry
from store.tiers.store import Store

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardOptions:
    """How a shard runs beside the others.

    Attributes:
        wait_timeout_s: how long to wait for another shard's prefix before computing it here.
        poll_s: how often the store is probed while waiting.
        step_tokens: new tokens per step (the granularity at which plan order is kept).
        stop_margin_s: the job stops this long before the deadline.
        max_batch_tokens: padded tokens per forward batch (bounds activation memory, and how
            finely the deadline cuts).
    """

    wait_timeout_s: float = 600.0
    poll_s: float = 0.5
    step_tokens: int = 32768
    stop_margin_s: float = 2.0
    max_batch_tokens: int = 8192


@dataclass
class Wait:
    """One wait for a prefix another shard computes."""

    entry: int
    blocks: int
    owner: int
    waited_s: float = 0.0
    found: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ShardReport:
    """What one shard did: the runner's report summed over its steps, its waits and what was cut.

    ``prefill.prefixes`` counts the shard's plan entries, and its block counts are those of
    the entries (probed before and after the job); :meth:`as_dict` writes it all as one flat
    record, the prefill's keys beside the shard's (``entries`` for ``prefixes``).
    """

    shard: int
    shards: int
    est_gpu_s: float
    prefill: PrefillReport
    cut: list[int] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    finished_at: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        counts = self.prefill.as_dict()
        return {"shard": self.shard, "shards": self.shards, "entries": counts.pop("prefixes"),
                "est_gpu_s": self.est_gpu_s, **counts, "cut": list(self.cut),
                "waits": [w.as_dict() for w in self.waits], "finished_at": self.finished_at}


@dataclass(frozen=True)
class _Work:
    request: PrefixRequest
    wait: SharedPrefix | None   # the deepest foreign prefix it begins with


def _begins_with(req: PrefixRequest, prefix: PrefixRequest, tokens: int) -> bool:
    return (req.tenant.name == prefix.tenant.name and req.chat == prefix.chat and len(req.token_ids) >= tokens
            and req.token_ids[:tokens] == prefix.token_ids[:tokens])


def run_shard(shard: Shard, entries: Sequence[PlanEntry], *, loaded: LoadedModel, store: Store,
              config: KvwarmConfig, precision: Precision, deadline: float | None = None,
              options: ShardOptions = ShardOptions(), log: Any = _log,
              clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> ShardReport:
    """Compute ``shard`` of the plan whose entries are ``entries`` (see the module doc).

    ``log`` is a :class:`logging.Logger` (the flow's run logger, so the waits show in the UI).

    Raises :class:`prefill.runner.DeadlinePassed` when the deadline leaves time for no
    batch at all (nothing written), the runner's errors otherwise.
    """
    bs = config.kv_cache.block_size
    check_deadline(deadline, clock())
    wanted = sorted(set(shard.entries) | {p.entry for p in shard.computes + shard.waits})
    tokenised = requests_from_plan([entries[i] for i in wanted], loaded, config)
    req = {i: replace(r, order=i) for i, r in zip(wanted, tokenised)}
    work = [_Work(replace(req[p.entry], token_ids=req[p.entry].token_ids[:p.blocks * bs]), None)
            for p in shard.computes]
    work += [_Work(req[i], None) for i in shard.entries]
    work = [replace(w, wait=_deepest_wait(w.request, shard.waits, req, bs)) for w in work]
    counts = PrefillReport(prefixes=len(shard.entries))
    report = ShardReport(shard=shard.index, shards=shard.count, est_gpu_s=shard.est_gpu_s, prefill=counts)
    total, missing, _ = _missing(shard, req, loaded, store, precision, bs)
    counts.blocks_stored_before = total - missing
    stop_at = None if deadline is None else deadline - options.stop_margin_s
    prefiller = Prefiller(loaded, store, PrefillOptions(precision=precision, block_size=bs, deadline=stop_at,
                                                        max_batch_tokens=options.max_batch_tokens), clock=clock)
    done_waits: set[tuple[int, int]] = set()
    step: list[PrefixRequest] = []
    nothing_fits: DeadlinePassed | None = None

    def flush() -> None:
        nonlocal nothing_fits
        if step and counts.stopped is None:
            try:
                counts.add(prefiller.run(list(step)))
            except DeadlinePassed as exc:
                counts.stopped, nothing_fits = "deadline", exc
        step.clear()

    for n, w in enumerate(work):
        if n == len(shard.computes):
            flush()  # the shared prefixes others wait for go first, alone
        if w.wait is not None and (w.wait.entry, w.wait.blocks) not in done_waits:
            flush()
            if counts.stopped is not None:
                break
            done_waits.add((w.wait.entry, w.wait.blocks))
            report.waits.append(_wait_for(w.wait, req[w.wait.entry], shard, loaded, store, precision, bs, stop_at,
                                          options, log, clock, sleep))
        step.append(w.request)
        if sum(len(r.token_ids) for r in step) >= options.step_tokens:
            flush()
    flush()
    _count_cut(report, shard, req, loaded, store, precision, bs)
    report.finished_at = clock()
    if nothing_fits is not None and counts.blocks_written == 0 and counts.blocks_left:
        raise nothing_fits
    return report


def _deepest_wait(r: PrefixRequest, waits: Sequence[SharedPrefix], req: dict[int, PrefixRequest],
                  bs: int) -> SharedPrefix | None:
    found = [p for p in waits if _begins_with(r, req[p.entry], p.blocks * bs)]
    return max(found, key=lambda p: p.blocks, default=None)


def _chain(r: PrefixRequest, loaded: LoadedModel, precision: Precision, bs: int, n_tokens: int | None = None):
    root = loaded.key_root(precision, bs, r.tenant.salt, chat=r.chat)
    ids = r.token_ids if n_tokens is None else r.token_ids[:n_tokens]
    return root, block_chain(root, ids)


def _wait_for(p: SharedPrefix, r: PrefixRequest, shard: Shard, loaded: LoadedModel, store: Store,
              precision: Precision, bs: int, stop_at: float | None, options: ShardOptions, log: Any,
              clock: Callable[[], float], sleep: Callable[[float], None]) -> Wait:
    """Probe the store until the first ``p.blocks`` blocks of entry ``p.entry`` are stored, or give up."""
    root, blocks = _chain(r, loaded, precision, bs, p.blocks * bs)
    wait = Wait(p.entry, p.blocks, p.owner)
    start = clock()
    limit = start + options.wait_timeout_s if stop_at is None else min(stop_at, start + options.wait_timeout_s)
    what = f"the shared prefix of plan entry {p.entry} ({p.blocks} block(s), {p.blocks * bs} tokens)"
    log.info("shard %d/%d: waiting for %s, which shard %d computes", shard.index, shard.count, what, p.owner)
    while True:
        if store.probe(r.tenant, blocks, root).count >= len(blocks):
            wait.found = True
            break
        if clock() >= limit:
            break
        sleep(options.poll_s)
    wait.waited_s = round(clock() - start, 3)
    if wait.found:
        log.info("shard %d/%d: %s is stored after %.1f s of waiting: continuing from the stored KV", shard.index,
                 shard.count, what, wait.waited_s)
    else:
        log.warning("shard %d/%d: %s is still not stored after %.1f s (shard %d may have failed): computing it here",
                    shard.index, shard.count, what, wait.waited_s, p.owner)
    return wait


def _missing(shard: Shard, req: dict[int, PrefixRequest], loaded: LoadedModel, store: Store, precision: Precision,
             bs: int) -> tuple[int, int, list[int]]:
    """The distinct blocks of the shard's entries, how many are not stored, and the entries not fully stored."""
    total: set[str] = set()
    missing: set[str] = set()
    partial = []
    for i in shard.entries:
        r = req[i]
        root, blocks = _chain(r, loaded, precision, bs)
        total.update(b.key for b in blocks)
        stored = store.probe(r.tenant, blocks, root).count if blocks else 0
        if stored < len(blocks):
            partial.append(i)
            missing.update(b.key for b in blocks[stored:])
    return len(total), len(missing), partial


def _count_cut(report: ShardReport, shard: Shard, req: dict[int, PrefixRequest], loaded: LoadedModel, store: Store,
               precision: Precision, bs: int) -> None:
    """The shard's entries not fully stored now (what the deadline cut), and their missing blocks."""
    report.prefill.blocks_total, report.prefill.blocks_left, report.cut = _missing(shard, req, loaded, store,
                                                                                    precision, bs)
