"""``prefill store audit``'s job: recompute stored KV with the model and quarantine what differs.

A store that takes KV written back by engines (:mod:`store.engines.vllm.writeback`) must be
able to prove that KV right. :func:`audit`:

1. reads every snapshot's header (:func:`prefill.audit_catalogue.catalogue`) and picks a sample,
   public snapshots first, then write-back (:func:`prefill.audit_catalogue.select`);
2. refuses, with :class:`AuditModelMismatch`, a model whose fingerprint none of them was made by
   (1 and 2 are :func:`plan_audit`, which needs the model's files, not its weights);
3. recomputes each pick's KV with the model, through the same transformers forward as the
   prefill job, from block 0 of its chain (one forward per chain, however many picks lie on it;
   in chunks of ``max_batch_tokens`` tokens that carry the cache on);
4. compares every copy of every pick (each tier's) with the recomputation by the agreement rule
   (:mod:`prefill.agreement`);
5. then recomputes the stored descendants of every block that differs, picked or not: KV
   computed after a wrong block may be wrong too (the prefill job continues from stored KV,
   and an engine that loaded the block wrote back what followed), and once the block is
   quarantined its descendants could not be recomputed (their prefix gone) until the block is
   stored again, when they would be served again;
6. quarantines each copy that differs (``tier.quarantine``, as ``prefill store verify`` does
   with corrupt files), at the end, so that every chain could still be read;

and starts no forward once ``budget_s`` seconds of compute are spent.

Counts are of copies, by the source their header records (:class:`AuditReport`).
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from prefill.agreement import TOLERANCE, Tolerance, judge
from prefill.audit_catalogue import (
    SOURCE_ORDER,
    AuditPath,
    Catalogue,
    Stored,
    catalogue,
    plan_paths,
    read_stored_header,
    select,
)
from prefill.models import LoadedModel, ModelError, kv_layout
from store.errors import BadInputError, SnapshotError
from store.format.snapshot import read_snapshot
from store.identity.fingerprint import ModelIdentity
from store.identity.tenant import Tenant
from store.tiers.crypto import plaintext
from store.tiers.store import Store

log = logging.getLogger(__name__)


class AuditModelMismatch(ModelError):
    """The snapshots to audit were made by another model than the one given; the message names it."""


@dataclass(frozen=True)
class AuditOptions:
    """What to audit and how.

    Attributes:
        sample: snapshots to audit (public ones first, then write-back); ``None`` for every one.
        sources: the sources to audit (``write-back``, ``unknown``, ``prefill``).
        namespace: one tenant's namespace (or ``public``); ``None`` for all.
        tolerance: the agreement rule's implementation tolerance by layer (:data:`prefill.agreement.TOLERANCE`).
        budget_s: seconds of compute (forward passes) after which no forward starts; ``None``: no limit.
        max_batch_tokens: tokens per forward chunk (bounds activation memory; rounded down to whole blocks).
        quarantine: move the copies that differ to quarantine (``False``: report only).
        seed: the sampling order's seed (``None``: a new order each run).
    """

    sample: int | None = 32
    sources: tuple[str, ...] = SOURCE_ORDER
    namespace: str | None = None
    tolerance: Tolerance = TOLERANCE
    budget_s: float | None = None
    max_batch_tokens: int = 8192
    quarantine: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.sample is not None and self.sample < 1:
            raise BadInputError(f"sample must be at least 1 snapshot (or None for all), got {self.sample}")
        unknown = set(self.sources) - set(SOURCE_ORDER)
        if unknown or not self.sources:
            raise BadInputError(f"sources {list(self.sources)} must be some of {', '.join(SOURCE_ORDER)}")
        if not isinstance(self.tolerance, Tolerance):
            raise BadInputError(f"tolerance must be a prefill.agreement.Tolerance, got {self.tolerance!r}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise BadInputError(f"budget_s {self.budget_s!r} must be positive seconds (or None for no limit)")
        if self.max_batch_tokens < 1:
            raise BadInputError(f"max_batch_tokens must be positive, got {self.max_batch_tokens}")


@dataclass
class SourceCounts:
    """Copies of one source: compared, agreeing, differing, and moved to quarantine."""

    checked: int = 0
    agreed: int = 0
    differed: int = 0
    quarantined: int = 0
    # the largest share of its tolerance a check of an agreeing copy used (distance beyond the trusted
    # recorded error / the tolerance at its layer): how close correct KV came to the limit
    max_tolerance_used: float = 0.0


@dataclass
class AuditReport:
    """What :func:`audit` found (``as_dict`` for JSON; ``clean`` when no copy differed)."""

    by_source: dict[str, SourceCounts] = field(default_factory=lambda: {s: SourceCounts() for s in SOURCE_ORDER})
    differences: list[tuple[str, str]] = field(default_factory=list)  # (location, reason)
    quarantined: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    descendants: int = 0  # blocks after one that differs, judged for that reason (beyond the sample)
    forwards: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    stopped: str | None = None

    @property
    def clean(self) -> bool:
        return not self.differences

    def total(self) -> SourceCounts:
        out = SourceCounts()
        for c in self.by_source.values():
            out.checked += c.checked
            out.agreed += c.agreed
            out.differed += c.differed
            out.quarantined += c.quarantined
            out.max_tolerance_used = max(out.max_tolerance_used, c.max_tolerance_used)
        return out

    def as_dict(self) -> dict[str, Any]:
        total = self.total()
        return {"checked": total.checked, "agreed": total.agreed, "differed": total.differed,
                "quarantined": total.quarantined, "by_source": {s: c.__dict__ for s, c in self.by_source.items()},
                "differences": [list(d) for d in self.differences], "quarantined_to": list(self.quarantined),
                "skipped": dict(self.skipped), "unreadable": len(self.unreadable), "descendants": self.descendants,
                "forwards": self.forwards,
                "tokens": self.tokens, "compute_s": round(self.compute_s, 3), "stopped": self.stopped}


@dataclass(frozen=True)
class AuditPlan:
    """What an audit will recompute (one forward per path, in order), and the report's start:
    what was skipped and what could not be read. Made without the model's weights (:func:`plan_audit`)."""

    paths: tuple[AuditPath, ...]
    skipped: dict[str, int]
    unreadable: tuple[tuple[str, str], ...]
    catalogue: Catalogue = field(default_factory=Catalogue)


def plan_audit(store: Store, identity: ModelIdentity, options: AuditOptions = AuditOptions(), *,
               tenants: Mapping[str, Tenant] = {}, model_name: str = "") -> AuditPlan:
    """Read the store's headers and choose what to audit for the model ``identity`` names (no weights
    needed: a wrong model is refused before it loads). ``tenants``: whose encryption keys open sealed
    snapshots (the others are skipped, counted as ``encrypted``).

    Raises:
        AuditModelMismatch: snapshots of the sources asked for exist, and none was made by this model.
    """
    cat = catalogue(store, namespace=options.namespace, tenants=tenants)
    picked = select(cat, model_fingerprint=identity.model_fingerprint, sources=options.sources,
                    sample=options.sample, now=store.clock(), rng=random.Random(options.seed))
    if picked.other_models and not picked.targets and not picked.skipped["expired"] + picked.skipped["adapter"]:
        raise AuditModelMismatch(_mismatch(model_name or identity.name, identity, picked.other_models))
    paths, orphans = plan_paths(cat, picked.targets)
    skipped = {"other_model": sum(picked.other_models.values()), **picked.skipped, "no_prefix": len(orphans),
               "encrypted": cat.encrypted, "over_budget": 0}
    return AuditPlan(tuple(paths), skipped, tuple(cat.unreadable), cat)


def audit(loaded: LoadedModel | None, store: Store, options: AuditOptions = AuditOptions(), *,
          tenants: Mapping[str, Tenant] = {}, planned: AuditPlan | None = None) -> AuditReport:
    """Audit ``store``'s KV against ``loaded`` (see the module doc), by ``planned`` (default: :func:`plan_audit`
    now). ``loaded`` may be ``None`` only for a plan with nothing to recompute.

    Raises:
        AuditModelMismatch: (planning here) snapshots of the sources asked for exist, none was made by ``loaded``.
    """
    if planned is None:
        if loaded is None:
            raise ValueError("audit needs the loaded model to plan with")
        planned = plan_audit(store, loaded.identity, options, tenants=tenants, model_name=loaded.name)
    report = AuditReport(skipped=dict(planned.skipped), unreadable=list(planned.unreadable))
    if planned.paths and loaded is None:
        raise ValueError("the plan recomputes KV: pass the loaded model")
    differs: list[_Differs] = []
    left = _run(loaded, store, planned.paths, options, tenants, report, differs)  # type: ignore[arg-type]
    judged = {p.chain[n].name for p in planned.paths for n in p.targets} - {s.name for s in left}
    now = store.clock()
    suspects = [s for s in planned.catalogue.descendants({d.stored.name for d in differs})
                if s.name not in judged and s.expires_at > now]
    if suspects:
        paths, _ = plan_paths(planned.catalogue, suspects)
        report.descendants = len(suspects)
        report.skipped["over_budget"] -= len({s.name for s in left} & {s.name for s in suspects})  # counted again
        for s in _run(loaded, store, paths, options, tenants, report, differs):  # type: ignore[arg-type]
            # the budget ran out first: once the wrong block is quarantined these could never be
            # recomputed (their prefix gone), and they would serve again when it is stored again
            differs += [_Differs(i, s, UNJUDGED, None) for i in s.tiers]
    for d in differs:
        _settle(store, d, options, report)
    return report


@dataclass(frozen=True)
class _Differs:
    """A copy that differs, to quarantine once every judgement is made."""

    tier_index: int
    stored: Stored
    reason: str
    counts: SourceCounts | None  # None: not judged (UNJUDGED)


#: why a descendant of a block that differs is quarantined without being recomputed
UNJUDGED = ("not recomputed: its chain runs through a block that differs, and the compute budget was spent "
            "before it was reached")


def _run(loaded: LoadedModel, store: Store, paths: Sequence[AuditPath], options: AuditOptions,
         tenants: Mapping[str, Tenant], report: AuditReport, differs: list[_Differs]) -> list[Stored]:
    """Recompute and judge ``paths`` in order until the budget is spent; returns the targets left (counted)."""
    for i, path in enumerate(paths):
        if options.budget_s is not None and report.compute_s >= options.budget_s:
            report.stopped = "budget"
            left = [p.chain[n] for p in paths[i:] for n in sorted(set(p.targets))]
            report.skipped["over_budget"] += len(left)
            return left
        _audit_path(loaded, store, path, options, tenants, report, differs)
    return []


def _settle(store: Store, d: _Differs, options: AuditOptions, report: AuditReport) -> None:
    """Record a copy that differs, and quarantine it unless only reporting."""
    tier = store.tiers[d.tier_index]
    report.differences.append((tier.describe(d.stored.name), d.reason))
    store.stats.incr("audit_differed")
    log.error("audit: %s %s", tier.describe(d.stored.name), d.reason)
    if options.quarantine:
        where = tier.quarantine(d.stored.name, f"AuditDisagreement: {d.reason}")
        if where:
            if d.counts is not None:
                d.counts.quarantined += 1
            report.quarantined.append(where)
            store.stats.incr("quarantined")


def _mismatch(name: str, identity: ModelIdentity, others: Mapping[str, int]) -> str:
    found = ", ".join(f"{fp} ({n} snapshot{'s' if n != 1 else ''})" for fp, n in
                      sorted(others.items(), key=lambda kv: -kv[1]))
    return (f"model {name!r} has fingerprint {identity.model_fingerprint}, but the snapshots to audit "
            f"were made by {found}: pass --model the directory (or hub id) of that model, the one the engine or "
            f"`prefill warm` computed them with")


def _audit_path(loaded: LoadedModel, store: Store, path: AuditPath, options: AuditOptions,
                tenants: Mapping[str, Tenant], report: AuditReport, differs: list[_Differs]) -> None:
    try:
        headers = [read_stored_header(store, s, tenants) for s in path.chain]
    except SnapshotError as exc:  # a block of the prefix went meanwhile, or went bad: verify's to judge
        report.skipped["no_prefix"] += len(path.targets)
        log.warning("audit: a prefix block cannot be read (%s); %d snapshot(s) not audited", exc, len(path.targets))
        return
    block = headers[0].layout.block_size
    ids = [t for h in headers for t in h.token_ids]
    layers, seconds = _forward(loaded, ids, max(block, options.max_batch_tokens // block * block))
    report.forwards += 1
    report.tokens += len(ids)
    report.compute_s += seconds
    for n in sorted(set(path.targets)):
        sl = slice(n * block, (n + 1) * block)
        recomputed = [(layer.keys[0, :, sl].to("cpu", torch.float32), layer.values[0, :, sl].to("cpu", torch.float32))
                      for layer in layers]
        for i in path.chain[n].tiers:
            _judge_copy(loaded, store, i, path.chain[n], recomputed, options, tenants, report, differs)


def _forward(loaded: LoadedModel, ids: Sequence[int], chunk: int) -> tuple[Sequence[Any], float]:
    """The model's per-layer KV of ``ids`` (one sequence, chunk by chunk), and the compute seconds it took."""
    sync = torch.cuda.synchronize if loaded.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    cache = None
    with torch.inference_mode():
        for lo in range(0, len(ids), chunk):
            x = torch.tensor([list(ids[lo:lo + chunk])], dtype=torch.long, device=loaded.device)
            cache = loaded.model(x, cache=cache, use_cache=True).cache
    sync()
    return cache.layers, time.perf_counter() - t0


def _judge_copy(loaded: LoadedModel, store: Store, tier_index: int, stored: Stored,
                recomputed: list[tuple[torch.Tensor, torch.Tensor]], options: AuditOptions,
                tenants: Mapping[str, Tenant], report: AuditReport, differs: list[_Differs]) -> None:
    tier = store.tiers[tier_index]
    name, location = stored.name, tier.describe(stored.name)
    src = tier.read(name)
    if src is None:
        return  # removed meanwhile: nothing to judge
    try:
        secret = tenants[stored.namespace].encryption_key if stored.namespace in tenants else None
        snap = read_snapshot(plaintext(src, secret, name, location=location), location=location, full=True)
    except SnapshotError as exc:
        report.unreadable.append((location, f"{type(exc).__name__}: {exc}"))
        return
    try:
        h = snap.header
        counts = report.by_source.setdefault(h.origin, SourceCounts())
        counts.checked += 1
        want = kv_layout(loaded.config, h.layout.block_size)
        if h.layout != want:
            reason = f"its layout {h.layout} is not the model's {want}"
        else:
            stored_kv = [snap.layer(i, torch.float32) for i in range(h.layout.num_layers)]
            dtypes = [h.precision.layer_dtype(i) for i in range(h.layout.num_layers)]
            verdict = judge(stored_kv, recomputed, h.quant_error, dtypes, tolerance=options.tolerance)
            reason = verdict.reason()
            if verdict.agrees:
                counts.max_tolerance_used = max(counts.max_tolerance_used,
                                                max(c.tolerance_used for c in verdict.checks))
    finally:
        snap.close()
    if not reason:
        counts.agreed += 1
        return
    counts.differed += 1
    differs.append(_Differs(tier_index, stored, reason, counts))
