"""What the replay reports for one policy over an evaluation window.

Token hit rates per level (vLLM's cache, the node tier, S3), overall and without each
request's first block (on Mooncake every request shares it, which hides the
differences), the first minute after the event, time to first token (the load of what
hit plus the prefill of the rest: :class:`store.cost.PrefillCost`, :class:`store.cost.LoadCost`;
no queueing), the prefill GPU-seconds kvwarm's plans spent, and the warm-up precision and
recall of what the node held or had queued when the event came.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from forecasting.simulate.prewarm import occurrences
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.tiers import Served

LEVELS = ("gpu", "node", "s3")


@dataclass(frozen=True)
class PolicyResult:
    """One policy over the window (rates in [0, 1], times in seconds).

    ``level_excl_root`` holds the hit rate excluding the root per level (:data:`LEVELS`);
    ``per_bucket`` is ``(minutes since the event, hit rate excluding the root)``;
    ``prefetched_blocks`` the blocks a plan's (or the oracle's) prefetch copied from S3.
    """

    policy: str
    requests: int
    tokens: int
    hit_tokens: int
    hit_rate: float
    hit_rate_excl_root: float
    level_excl_root: dict[str, float]
    first_minute_hit_rate_excl_root: float
    ttft_mean_s: float
    ttft_p99_s: float
    first_minute_ttft_mean_s: float
    prefill_gpu_s: float
    warmup_blocks: int | None
    warmup_precision: float | None
    warmup_recall: float | None
    per_bucket: tuple[tuple[float, float], ...]
    seconds: float
    prefetched_blocks: int = 0


def measure(policy: str, index: BlockIndex, rows: np.ndarray, served: list[Served], *, start_s: float,
            bucket_s: float = 60.0, warm: set[int] | None = None, stored_by: int | None = None,
            prefill_gpu_s: float = 0.0, seconds: float = 0.0, prefetched_blocks: int = 0) -> PolicyResult:
    """Metrics of ``served`` (one per row of ``rows``, in order) from ``start_s`` on.

    ``warm``: the blocks the node held or had queued at the event; ``stored_by``: the
    event's first request (what was stored before it is what a warm-up could have known).
    """
    tr = index.trace
    rows = np.asarray(rows, dtype=np.int64)
    n = len(rows)
    lv = np.array([[s.gpu, s.node, s.s3] for s in served], dtype=np.int64).reshape(n, 3)
    ttft = np.array([s.ttft_s for s in served], dtype=np.float64)
    cum = np.concatenate([[0], np.cumsum(index.tokens)])
    a = tr.offsets[rows]
    ends = np.cumsum(lv, axis=1)
    tok = cum[a[:, None] + ends] - cum[a][:, None]  # tokens cached through each level
    per_level = np.diff(np.concatenate([np.zeros((n, 1), dtype=np.int64), tok], axis=1), axis=1)
    has_root = tr.offsets[rows + 1] > a
    root = np.where(has_root, index.tokens[np.minimum(a, len(index.tokens) - 1)], 0)
    first_level = np.argmax(lv > 0, axis=1)  # the level that served the root, where it hit
    hit_any = ends[:, -1] > 0
    x_level = per_level.copy()
    x_level[np.arange(n)[hit_any], first_level[hit_any]] -= root[hit_any]
    total = tr.input_tokens[rows]
    hit = tok[:, -1] if n else np.zeros(0, dtype=np.int64)
    total_x = total - root
    den_x = max(int(total_x.sum()), 1)
    first = tr.timestamps_s[rows] < start_s + bucket_s
    bucket = np.floor((tr.timestamps_s[rows] - start_s) / bucket_s).astype(np.int64)
    nb = int(bucket.max(initial=-1)) + 1
    num = np.bincount(bucket, weights=x_level.sum(axis=1), minlength=nb) if n else np.zeros(0)
    den = np.bincount(bucket, weights=total_x, minlength=nb) if n else np.zeros(0)
    rates = np.divide(num, den, out=np.zeros(nb), where=den > 0)
    precision = recall = None
    if warm is not None and stored_by is not None:
        used = np.zeros(index.n_unique, dtype=bool)
        used[index.ids[occurrences(index, rows)]] = True
        seen = np.zeros(index.n_unique, dtype=bool)
        seen[index.ids[: tr.offsets[stored_by]]] = True
        held = np.fromiter((b for b in warm if b < index.n_unique), dtype=np.int64)
        good = int(used[held].sum())
        precision = good / len(warm) if warm else None
        possible = int((used & seen).sum())
        recall = good / possible if possible else 0.0
    return PolicyResult(
        policy=policy, requests=n, tokens=int(total.sum()), hit_tokens=int(hit.sum()),
        hit_rate=float(hit.sum() / max(int(total.sum()), 1)),
        hit_rate_excl_root=float(x_level.sum() / den_x),
        level_excl_root={name: float(x_level[:, k].sum() / den_x) for k, name in enumerate(LEVELS)},
        first_minute_hit_rate_excl_root=float(x_level[first].sum() / max(int(total_x[first].sum()), 1)),
        ttft_mean_s=float(ttft.mean()) if n else 0.0,
        ttft_p99_s=float(np.percentile(ttft, 99)) if n else 0.0,
        first_minute_ttft_mean_s=float(ttft[first].mean()) if first.any() else 0.0,
        prefill_gpu_s=float(prefill_gpu_s), warmup_blocks=None if warm is None else len(warm),
        warmup_precision=precision, warmup_recall=recall,
        per_bucket=tuple((float(k * bucket_s / 60.0), float(r)) for k, r in enumerate(rates)), seconds=seconds,
        prefetched_blocks=int(prefetched_blocks))
