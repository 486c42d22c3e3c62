"""The live replay's figures (bench/live_replay.py): per-phase TTFT, the saving per request, errors,
the prefill fit of the calibration requests, and LMCache's costs read from its server's log. Pure.
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from bench.lib.engine_parts import S3_ENV
from bench.lib.lmcache_columns import transfers

#: the simulator's policy that stands for each live one
SIM_POLICY = {"lmcache": "reactive-store", "kvwarm": "kvwarm", "vllm": "vllm"}
BLOCK = 256  # kvwarm's block size (the config default) and LMCache's chunk
TENANT = "mooncake"
BUCKET = "live-replay"
ORIGIN = pd.Timestamp("2026-01-01")
#: the SeaweedFS credentials kvwarm's S3 tier reads (from these variables) and LMCache's adapter is given
#: every engine computes on both cores (shared/STACK-NOTES.md: an engine with a connector reserves one less)
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **S3_ENV}
#: cold calibration prompts of the vllm engine (tokens; two of each), and the one warm-up request of every engine
CALIBRATE = (256, 1024, 2048, 3072, 4080)
WARMUP_TOKENS = 64
TARGET_SAVED_ERR = 0.25


def percentile(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def phase_figures(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TTFT (mean, P50, P99), loaded and vLLM-hit tokens, failures of one phase's requests."""
    ok = [r for r in records if r.get("error") is None]
    ttft = [r["ttft_s"] for r in ok]
    tokens = sum(r["prompt_tokens"] for r in records)
    ext = sum(r.get("external_tokens") or 0 for r in ok)
    local = sum(r.get("local_cached_tokens") or 0 for r in ok)
    return {"requests": len(records), "failed": len(records) - len(ok),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "prompt_tokens": tokens, "external_tokens": ext,
            "external_share": ext / tokens if tokens else None, "vllm_hit_tokens": local,
            "errors": sorted({r["error"] for r in records if r.get("error")})[:5]}


def saved_per_request(base: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]], *,
                      median: bool = False) -> float | None:
    """Mean (or ``median``) per-request TTFT ``base - other`` over the requests both served (matched by id).

    The median is kept beside the mean: a few requests queued behind a burst move the mean by more
    than every hit saves, and the simulator models no queueing.
    """
    b = {r["id"]: r["ttft_s"] for r in base if r.get("error") is None}
    diffs = [b[r["id"]] - r["ttft_s"] for r in other if r.get("error") is None and r["id"] in b]
    if not diffs:
        return None
    return statistics.median(diffs) if median else statistics.fmean(diffs)


def rel_err(predicted: float | None, live: float | None) -> float | None:
    if predicted is None or live is None or live == 0:
        return None
    return (predicted - live) / abs(live)


def fit_prefill(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """Least squares of ``seconds = c0 + a*n + b*n(n+1)/2`` over cold ``(tokens, seconds)``.

    ``c0`` is the engine's fixed cost per request (a step's overhead), the same whatever a
    connector loads: ``(a, b)`` are the prefill cost the simulator prices (``b`` and ``c0``
    clamped at 0, refitting the rest).
    """
    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    cols = [np.ones_like(n), n, n * (n + 1) / 2]
    (c0, a, b), *_ = np.linalg.lstsq(np.column_stack(cols), t, rcond=None)
    if b < 0:
        (c0, a), *_ = np.linalg.lstsq(np.column_stack(cols[:2]), t, rcond=None)
        b = 0.0
    if c0 < 0:
        (a, b), *_ = np.linalg.lstsq(np.column_stack(cols[1:]), t, rcond=None)
        c0 = 0.0
    return float(max(c0, 0.0)), float(max(a, 1e-12)), float(max(b, 0.0))


def prefill_from(calibration: dict[str, list[tuple[int, float]]]) -> tuple[Any, float]:
    """The prefill cost fitted to the fastest cold seconds of each calibration length over the engines.

    The fastest, as a timing of fixed work is read: the machine is shared (another session's engines
    run on the same two cores), and what a busy core adds to one engine's calibration is not the
    engine's cost. The simulator models no such contention, so its costs are the work's own; each
    engine's median is kept in the record, to show how busy the machine was. Returns the cost and
    the fixed per-request ``c0``.
    """
    from store.cost import PrefillCost

    points = [(n, min(t for pts in calibration.values() for m, t in pts if m == n)) for n in CALIBRATE]
    c0, a, b = fit_prefill(points)
    return PrefillCost(a, b), c0


_PREFETCH = re.compile(r"Prefetch request completed \(L1\+L2\): (\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\) "
                       r"in ([\d.]+) ms")


def lmcache_costs(log: str) -> dict[str, float]:
    """What LMCache's MP server measured of its own work, from its log.

    ``l2_keys``/``l2_s``: the chunks its lookups fetched from the L2 (S3) and the milliseconds those
    prefetches took (the request waits for them: LMCache's remote hit is synchronous);
    ``retrieved_tokens``/``retrieved_s``: tokens it copied from its L1 into vLLM's cache;
    ``stored_tokens``/``stored_s``: tokens it took from vLLM (write-back).
    """
    out = dict.fromkeys(("l2_keys", "l2_s", "l2_prefetches", "retrieved_tokens", "retrieved_s", "stored_tokens",
                         "stored_s"), 0.0)
    for m in _PREFETCH.finditer(log):
        if int(m.group(4)):
            out["l2_keys"] += int(m.group(4))
            out["l2_s"] += float(m.group(5)) / 1e3
            out["l2_prefetches"] += 1
    for t in transfers(log):  # the engine bench's reading of the same lines
        kind = "retrieved" if t.kind == "Retrieved" else "stored"
        out[f"{kind}_tokens"] += t.tokens
        out[f"{kind}_s"] += t.seconds
    return out


# ---------------------------------------------------------------- engines


#: kvwarm's mean TTFT over vLLM alone's before the event, at most; and its P99 over vLLM alone's after it
TARGET_BEFORE, TARGET_AFTER_P99 = 1.15, 2.0


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def over_vllm(kv: dict[str, Any], base: dict[str, Any], targets: dict[str, Any]) -> dict[str, float | None]:
    """kvwarm's phase figures over vLLM alone's (``phase_figures`` of each): its mean before the event (what
    kvwarm costs a serving engine: write-back, uploads, fleet memory, the node), its mean and P99 after it;
    their targets go into ``targets``."""
    before = _ratio(kv["before"]["ttft_mean_s"], base["before"]["ttft_mean_s"])
    after = _ratio(kv["after"]["ttft_mean_s"], base["after"]["ttft_mean_s"])
    p99 = _ratio(kv["after"]["ttft_p99_s"], base["after"]["ttft_p99_s"])
    targets[f"kvwarm_over_vllm_before_mean_le_{TARGET_BEFORE}"] = before is not None and before <= TARGET_BEFORE
    targets[f"kvwarm_over_vllm_after_p99_le_{TARGET_AFTER_P99}"] = p99 is not None and p99 <= TARGET_AFTER_P99
    targets["kvwarm_below_vllm_after"] = after is not None and after < 1.0
    return {"before_mean": before, "after_mean": after, "after_p99": p99}
