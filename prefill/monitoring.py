"""The four monitoring families of the SageMaker write-up, computed from what a run leaves behind.

The write-up asks for four families of figures; here each is a frozen dataclass:

- :class:`CacheEfficiency` (hit rate, memory saved),
- :class:`ServiceQuality` (load latency p99, throughput),
- :class:`SecurityAudit` (refused accesses),
- :class:`Economics` (prefill GPU-seconds saved, cost per 1,000 requests at a configured price).

Inputs, already read (this module does no I/O; :mod:`prefill.run_results` reads them):

- a run's stage results (the JSON files of :class:`prefill.rundir.RunDir`): ``prefill``
  (the prefill job: tokens computed, seconds, tokens/s), ``plan`` (the KV bytes per
  token the planner priced storage at: ``extra.kv_bytes_per_token``), and optionally
  ``mine``, ``gc``, ``audit`` (the KV audit's counts), ``report`` (its ``replay`` section,
  written by the demo, stands in for loader stats when none are given);
- zero or more loader stats dumps: the dict :meth:`store.serving.loader.KVLoader.stats` returns,
  saved as JSON, optionally with two keys the dumping process adds: ``elapsed_s`` (the
  seconds the loader served: gives throughput) and ``prompt_tokens`` (the prompt tokens
  it looked up: gives the token hit rate);
- :class:`Prices` (a GPU price per hour, from a flag or the environment).

A figure that cannot be computed from what was given is ``None`` and
:attr:`Monitoring.notes` says what would provide it.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from store.cost import PrefillCost
from store.errors import BadInputError

#: environment variable holding the GPU price per hour when no flag gives one
PRICE_ENV = "KVWARM_GPU_PRICE_PER_HOUR"
#: miss/shortened reasons that are a refused access to another tenant's namespace
TENANT_REASONS = ("tenant_refused",)
#: miss/shortened reasons that are a snapshot refused (and quarantined) for its content
INTEGRITY_REASONS = ("corrupt", "mismatch", "unknown_version")


class MonitoringError(BadInputError):
    """A run directory or a stats dump is missing or malformed; the message says which and what to do."""


@dataclass(frozen=True)
class Prices:
    """What compute costs.

    Args:
        gpu_per_hour: price of one GPU-hour (any currency; the figures are in the same unit).
        prefill_tokens_per_s: the prefill rate to value saved tokens at; ``None``: the rate
            the run's prefill job measured (``prefill.json``'s ``tokens_per_s``).
    """

    gpu_per_hour: float | None = None
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("gpu_per_hour", "prefill_tokens_per_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise MonitoringError(f"{name} must be a non-negative number, got {v!r}")
        if self.prefill_tokens_per_s == 0:
            raise MonitoringError("prefill_tokens_per_s must be positive: saved tokens are valued at that rate")

    @classmethod
    def from_env(cls, gpu_per_hour: float | None = None, prefill_tokens_per_s: float | None = None,
                 environ: Mapping[str, str] | None = None) -> Prices:
        """Prices from arguments, the GPU price falling back to ``$KVWARM_GPU_PRICE_PER_HOUR``."""
        env = os.environ if environ is None else environ
        if gpu_per_hour is None and env.get(PRICE_ENV):
            try:
                gpu_per_hour = float(env[PRICE_ENV])
            except ValueError:
                raise MonitoringError(f"${PRICE_ENV} = {env[PRICE_ENV]!r} is not a number (price per GPU-hour)") from None
        return cls(gpu_per_hour, prefill_tokens_per_s)


@dataclass(frozen=True)
class CacheEfficiency:
    """Hit rate and memory saved.

    - ``request_hit_rate`` = ``hits / lookups``: lookups answered with at least one block.
    - ``token_hit_rate`` = ``tokens_served / prompt_tokens``: the share of looked-up prompt
      tokens whose KV came from the cache (needs ``prompt_tokens``).
    - ``kv_bytes_served`` = ``tokens_served * kv_bytes_per_token``: the KV the hits
      delivered, in the stored format.
    - ``memory_saved_bytes`` = ``kv_bytes_served - bytes_mapped``: without sharing, every
      hit would hold its own copy of that KV; with kvwarm the node mapped each snapshot
      once (``bytes_mapped``, summed over the loaders) and every hit shares it.
    - ``memory_saving_ratio`` = ``kv_bytes_served / bytes_mapped`` (the write-up's "4.2x").
    """

    source: str
    lookups: int | None = None
    hits: int | None = None
    request_hit_rate: float | None = None
    tokens_served: int | None = None
    prompt_tokens: int | None = None
    token_hit_rate: float | None = None
    kv_bytes_per_token: float | None = None
    kv_bytes_served: float | None = None
    bytes_mapped: int | None = None
    memory_saved_bytes: float | None = None
    memory_saving_ratio: float | None = None


@dataclass(frozen=True)
class ServiceQuality:
    """Load latency and throughput.

    - ``lookup_p50_s``/``lookup_p99_s``: over several dumps, the largest of their
      percentiles: an upper bound of the pooled percentile (at most 1% of each dump's
      samples lie above its own p99, so at most 1% of all lie above the largest).
    - ``latency_p99_s``: the same bound for every stage the loaders timed (``lookup``,
      ``to_dynamic_cache``, ``copy_into_paged``).
    - ``lookups_per_s`` = ``lookups / elapsed_s`` summed over dumps (needs ``elapsed_s``).
    - ``prefill_tokens_per_s``: the prefill job's measured rate (``prefill.json``).
    """

    lookup_p50_s: float | None = None
    lookup_p99_s: float | None = None
    latency_p99_s: dict[str, float] = field(default_factory=dict)
    latency_samples: int = 0
    lookups_per_s: float | None = None
    elapsed_s: float | None = None
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True)
class SecurityAudit:
    """Refused accesses.

    - ``refused_cross_tenant``: attempts to reach another tenant's namespace (the
      loaders' ``refused_cross_tenant`` counter: lookups, fetches and prefetches).
    - ``integrity_refusals``: snapshots refused and quarantined as corrupt, mismatched or
      of an unknown format version (misses plus hits cut short).
    - ``by_reason``: every refusal reason with its count (zeros kept: they are the audit).
    - ``kv_audit_checked``, ``kv_audit_differed``, ``kv_audit_quarantined``: stored copies the
      KV audit (``audit.json``: ``prefill store audit``'s job, run by the maintenance flow)
      recomputed with the model, found to differ from it, and moved to quarantine;
      ``kv_audit_checked_by_source``, ``kv_audit_quarantined_by_source``: the same by the
      source the headers record (``write-back``, ``unknown``, ``prefill``).
    """

    refused_cross_tenant: int | None = None
    integrity_refusals: int | None = None
    by_reason: dict[str, int] = field(default_factory=dict)
    kv_audit_checked: int | None = None
    kv_audit_differed: int | None = None
    kv_audit_quarantined: int | None = None
    kv_audit_checked_by_source: dict[str, int] = field(default_factory=dict)
    kv_audit_quarantined_by_source: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Economics:
    """Prefill GPU-seconds saved and what they are worth.

    - ``gpu_seconds_saved`` = ``tokens_served / prefill_tokens_per_s``: the prefill the
      serving GPUs did not do because the KV came from the cache, at the measured rate
      (:meth:`store.cost.PrefillCost.from_rate`: token counts summed over many prompts).
    - ``gpu_seconds_spent``: the prefill job's own compute (``prefill.json`` ``seconds``).
    - ``net_gpu_seconds_saved`` = saved - spent.
    - costs = GPU-seconds x ``gpu_price_per_hour`` / 3600.
    - ``cost_per_1k_requests_cold`` = cost of prefilling every looked-up prompt token,
      per 1,000 lookups; ``cost_per_1k_requests_warm`` = cost of the tokens not served
      from cache plus the prefill job, per 1,000 lookups (both need ``prompt_tokens``);
      ``saving_per_1k_requests`` = net cost saved per 1,000 lookups. Prefill only:
      decoding costs the same either way and is not counted.
    """

    prefill_tokens_per_s: float | None = None
    gpu_seconds_saved: float | None = None
    gpu_seconds_spent: float | None = None
    net_gpu_seconds_saved: float | None = None
    gpu_price_per_hour: float | None = None
    cost_saved: float | None = None
    cost_spent: float | None = None
    cost_per_1k_requests_cold: float | None = None
    cost_per_1k_requests_warm: float | None = None
    saving_per_1k_requests: float | None = None


@dataclass(frozen=True)
class Monitoring:
    """The four families of one run, and notes on what could not be computed."""

    run: str
    cache: CacheEfficiency
    service: ServiceQuality
    security: SecurityAudit
    economics: Economics
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON: ``run``, one dict per family (``cache_efficiency``, ...), ``notes``."""
        return {"run": self.run, "cache_efficiency": asdict(self.cache), "service_quality": asdict(self.service),
                "security_audit": asdict(self.security), "economics": asdict(self.economics),
                "notes": list(self.notes)}


# ---------------------------------------------------------------- the figures (pure)

def compute(run: str, files: Mapping[str, Mapping[str, Any]], stats: Sequence[Mapping[str, Any]],
            prices: Prices = Prices()) -> Monitoring:
    """The four families from a run's results (:func:`prefill.run_results.read_run`), loader stats dumps and prices.

    With stats dumps, the cache, latency and security figures are theirs (summed over the
    dumps); without, the demo's ``report.json`` ``replay`` section gives the cache figures.
    """
    notes: list[str] = []
    cache = _cache(files, stats, notes)
    prefill = files.get("prefill")
    if prefill is None:
        notes.append("no prefill.json: the prefill-plan flow writes it (prefill rate and job seconds)")
    measured = _num(prefill, "tokens_per_s") if prefill else None
    rate = prices.prefill_tokens_per_s or (measured if measured else None)
    if rate is None and prefill is not None:
        notes.append("prefill.json has no measured rate (nothing was computed, e.g. a rerun): pass "
                     "--prefill-tokens-per-s to value the saved tokens")
    service = _service(stats, measured, notes)
    security = _security(stats, files.get("audit"))
    economics = _economics(cache, rate, _num(prefill, "seconds") if prefill else None, prices, notes)
    return Monitoring(run, cache, service, security, economics, tuple(notes))


def _num(d: Mapping[str, Any] | None, key: str) -> float | None:
    v = None if d is None else d.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def kv_bytes_per_token(plan: Mapping[str, Any] | None) -> float | None:
    """Stored KV bytes per token, as the plan recorded them (``extra.kv_bytes_per_token``: the
    snapshot layout's, :func:`store.format.payload.kv_bytes_per_token`)."""
    return _num(plan.get("extra"), "kv_bytes_per_token") if plan else None


def _cache(files: Mapping[str, Mapping[str, Any]], stats: Sequence[Mapping[str, Any]],
           notes: list[str]) -> CacheEfficiency:
    bpt = kv_bytes_per_token(files.get("plan"))
    if bpt is None:
        notes.append("no plan.json with extra.kv_bytes_per_token (the plan-prewarm flow records it): memory saved "
                     "needs the KV bytes per token")
    if stats:
        lookups = int(sum(s["lookups"] for s in stats))
        hits = int(sum(s["hits"] for s in stats))
        served = int(sum(s["tokens_served"] for s in stats))
        prompts = [_num(s, "prompt_tokens") for s in stats]
        prompt = int(sum(p for p in prompts if p is not None)) if all(p is not None for p in prompts) else None
        if prompt is None:
            notes.append("token hit rate needs 'prompt_tokens' in every loader stats dump (the loader does not count "
                          "looked-up tokens)")
        mapped = int(sum(_num(s, "bytes_mapped") or 0 for s in stats))
        source = f"loader stats ({len(stats)} dump{'s' if len(stats) != 1 else ''})"
    else:
        replay = (files.get("report") or {}).get("replay")
        if not isinstance(replay, Mapping):
            notes.append("no loader stats and no replay in report.json: hit rates need `--loader-stats FILE` "
                         "(KVLoader.stats() saved as JSON)")
            return CacheEfficiency(source="none", kv_bytes_per_token=bpt)
        lookups, hits = int(replay["requests"]), int(replay["requests_hit"])
        served, prompt, mapped = int(replay["cached_tokens"]), int(replay["prompt_tokens"]), None
        source = "report.json replay"
        notes.append("memory saved needs the loaders' bytes_mapped: pass --loader-stats")
    served_bytes = served * bpt if bpt is not None else None
    return CacheEfficiency(
        source=source, lookups=lookups, hits=hits, request_hit_rate=_ratio(hits, lookups), tokens_served=served,
        prompt_tokens=prompt, token_hit_rate=_ratio(served, prompt), kv_bytes_per_token=bpt,
        kv_bytes_served=served_bytes, bytes_mapped=mapped,
        memory_saved_bytes=None if served_bytes is None or mapped is None else served_bytes - mapped,
        memory_saving_ratio=_ratio(served_bytes, mapped))


def _service(stats: Sequence[Mapping[str, Any]], prefill_rate: float | None, notes: list[str]) -> ServiceQuality:
    p99: dict[str, float] = {}
    p50: dict[str, float] = {}
    samples = 0
    for s in stats:
        for stage, lat in (s.get("latency") or {}).items():
            if not isinstance(lat, Mapping) or not lat.get("count"):
                continue
            p99[stage] = max(p99.get(stage, 0.0), float(lat["p99_s"]))
            p50[stage] = max(p50.get(stage, 0.0), float(lat["p50_s"]))
            if stage == "lookup":
                samples += int(lat["count"])
    elapsed = [_num(s, "elapsed_s") for s in stats]
    total = sum(e for e in elapsed if e is not None) if stats and all(e is not None for e in elapsed) else None
    lookups = sum(s["lookups"] for s in stats)
    if stats and total is None:
        notes.append("throughput needs 'elapsed_s' (seconds served) in every loader stats dump")
    return ServiceQuality(lookup_p50_s=p50.get("lookup"), lookup_p99_s=p99.get("lookup"), latency_p99_s=p99,
                          latency_samples=samples, lookups_per_s=_ratio(float(lookups), total) if total else None,
                          elapsed_s=total, prefill_tokens_per_s=prefill_rate)


def _security(stats: Sequence[Mapping[str, Any]], audit: Mapping[str, Any] | None) -> SecurityAudit:
    kv: dict[str, Any] = {}
    if audit is not None:
        by = audit.get("by_source") or {}
        kv = {"kv_audit_checked": _int(audit, "checked"), "kv_audit_differed": _int(audit, "differed"),
              "kv_audit_quarantined": _int(audit, "quarantined"),
              "kv_audit_checked_by_source": {s: int(c.get("checked", 0)) for s, c in by.items()},
              "kv_audit_quarantined_by_source": {s: int(c.get("quarantined", 0)) for s, c in by.items()}}
    if not stats:
        return SecurityAudit(**kv)
    reasons = {r: 0 for r in (*TENANT_REASONS, *INTEGRITY_REASONS)}
    for s in stats:
        for section in ("misses_by_reason", "shortened_by_reason"):
            for r, n in (s.get(section) or {}).items():
                if r in reasons:
                    reasons[r] += int(n)
    refused = int(sum(_num(s, "refused_cross_tenant") or 0 for s in stats))
    return SecurityAudit(refused_cross_tenant=refused,
                         integrity_refusals=sum(reasons[r] for r in INTEGRITY_REASONS), by_reason=reasons, **kv)


def _int(d: Mapping[str, Any], key: str) -> int | None:
    v = _num(d, key)
    return None if v is None else int(v)


def _economics(cache: CacheEfficiency, rate: float | None, spent: float | None, prices: Prices,
               notes: list[str]) -> Economics:
    prefill = PrefillCost.from_rate(rate) if rate else None
    saved = prefill.seconds(cache.tokens_served) if prefill and cache.tokens_served is not None else None
    net = None if saved is None or spent is None else saved - spent
    price = prices.gpu_per_hour
    if price is None:
        notes.append(f"costs need a GPU price: pass --gpu-price-per-hour or set ${PRICE_ENV}")
        return Economics(rate, saved, spent, net)
    per_s = price / 3600.0
    cost = lambda s: None if s is None else s * per_s  # noqa: E731
    per_1k = lambda c: None if c is None or not cache.lookups else c / cache.lookups * 1000.0  # noqa: E731
    cold = warm = None
    if cache.prompt_tokens is not None and prefill and spent is not None and cache.tokens_served is not None:
        cold = per_1k(cost(prefill.seconds(cache.prompt_tokens)))
        warm = per_1k(cost(prefill.seconds(cache.prompt_tokens - cache.tokens_served) + spent))
    return Economics(rate, saved, spent, net, price, cost(saved), cost(spent), cold, warm, per_1k(cost(net)))


