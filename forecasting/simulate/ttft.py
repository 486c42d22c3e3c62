"""Time to first token: what prefilling a prompt costs, and what a cached prefix saves.

``prefill simulate`` and the replay bench turn cached tokens into seconds with
:class:`CostModel`, fitted to the prefill benchmark (:meth:`CostModel.from_prefill_bench`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Prefill time of a prompt: ``a * new_tokens + b * attention pairs of the new tokens``.

    Saved TTFT for a request of ``n`` tokens with ``c`` cached: ``a*c + b*c*(c+1)/2``.
    The defaults are fitted (:meth:`from_prefill_bench`) to the prefill benchmark of an
    8B Llama in bf16 on one H200 (``bench/calibration/prefill-h200-8b.json``: 34,142
    tokens/s at 2,048 tokens, 31,298 at 8,192); fit your own GPU's run the same way
    (``prefill simulate --cost-from``).
    """

    s_per_token: float = 2.8402e-5
    s_per_token_pair: float = 8.664e-10

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> CostModel:
        """Least squares of ``seconds = a*n + b*n*(n+1)/2`` over measured ``(n tokens, seconds)``.

        With one length (or when the fit makes ``b`` negative) attention is folded into
        ``a`` (``b = 0``).

        Raises:
            ValueError: no points, or a token count or time that is not positive.
        """
        pts = [(float(n), float(t)) for n, t in points]
        if not pts or any(not (n > 0 and t > 0 and math.isfinite(n) and math.isfinite(t)) for n, t in pts):
            raise ValueError(f"a prefill cost fit needs (tokens, seconds) pairs, all positive; got {points!r}")
        n = np.array([p[0] for p in pts])
        t = np.array([p[1] for p in pts])
        if len(set(n.tolist())) > 1:
            (a, b), *_ = np.linalg.lstsq(np.column_stack([n, n * (n + 1) / 2]), t, rcond=None)
            if a >= 0 and b >= 0:
                return cls(float(a), float(b))
            if a < 0:  # all of the time grows with context: attention only
                pairs = n * (n + 1) / 2
                return cls(0.0, float((pairs * t).sum() / (pairs * pairs).sum()))
        return cls(float((n * t).sum() / (n * n).sum()), 0.0)

    @classmethod
    def from_prefill_bench(cls, doc: Mapping[str, Any]) -> CostModel:
        """Fit to ``bench/prefill_bench.py --shape ...``'s JSON: the bare forward's tokens/s at each length.

        Raises:
            ValueError: ``doc`` has no ``by_tokens`` figures (the shaped run writes them).
        """
        runs = doc.get("by_tokens") if isinstance(doc, Mapping) else None
        try:
            points = [(float(length), float(length) / float(r["prefill"]["forward_tokens_per_s"]))
                      for length, r in (runs or {}).items()]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise ValueError(f"not a prefill benchmark result: by_tokens.*.prefill.forward_tokens_per_s ({exc})") from None
        if not points:
            raise ValueError("the prefill benchmark result has no by_tokens figures: run bench/prefill_bench.py "
                             "--shape 8b --tokens 2048,8192 (the shaped run writes them)")
        return cls.fit(points)

    def __post_init__(self) -> None:
        if self.s_per_token < 0 or self.s_per_token_pair < 0:
            raise ValueError("CostModel constants must be >= 0")

    def prefill_s(self, n_tokens: np.ndarray) -> np.ndarray:
        """Seconds to prefill ``n_tokens`` from scratch."""
        n = np.asarray(n_tokens, dtype=np.float64)
        return self.s_per_token * n + self.s_per_token_pair * n * (n + 1) / 2

    def saved_s(self, cached_tokens: np.ndarray) -> np.ndarray:
        """Seconds saved when the first ``cached_tokens`` come from the cache."""
        return self.prefill_s(cached_tokens)
