"""What prefilling tokens costs, and what loading their stored KV costs instead.

One model of each, for everyone who turns tokens or bytes into seconds: the planner
(the GPU-seconds a prefix costs and saves), ``prefill simulate`` and the replay bench
(time to first token), the demo and ``prefill report`` (prefill seconds saved), and a
serving engine deciding whether a stored hit is worth loading (:func:`load_beats_prefill`).

Prefill. A forward pass over new tokens costs a part linear in their number (the
weights: projections and MLP) and attention, linear in the (query, key) pairs: causal
attention over tokens ``c+1 .. n``, after ``c`` cached ones, scores ``n(n+1)/2 - c(c+1)/2``
pairs. So :meth:`PrefillCost.seconds` is

    seconds(n, cached=c) = s_per_token * (n - c) + s_per_token_pair * (n(n+1)/2 - c(c+1)/2)

The defaults are the fit (:meth:`PrefillCost.from_prefill_bench`) of an 8B Llama in bf16
on one H200 (``bench/calibration/prefill-h200-8b.json``: 34,142 tokens/s at 2,048 tokens,
31,298 at 8,192). A rate measured on another device gives :meth:`PrefillCost.from_rate`
(every token at that rate: what a count of tokens summed over many prompts is worth) or
:meth:`PrefillCost.scaled` (this model's shape at that speed, where each prompt's length
matters).

Loading. Reading stored KV from a tier costs its bytes at the tier's measured
throughput plus a fixed latency per file (open and verify a snapshot; an S3 request):
:class:`LoadCost`, fitted to measured reads with :meth:`LoadCost.fit`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import numpy as np

#: a token or byte count: a number, or a numpy array of them (a result has its shape)
Count = Union[float, np.ndarray]


def _finite_at_least(value: Any, low: float, name: str, *, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")


@dataclass(frozen=True)
class PrefillCost:
    """Seconds to prefill: ``s_per_token`` per new token plus ``s_per_token_pair`` per attention pair.

    Attributes:
        s_per_token: the linear term, seconds per token.
        s_per_token_pair: the attention term, seconds per (query, key) pair of causal attention.
    """

    s_per_token: float = 2.8402e-5
    s_per_token_pair: float = 8.664e-10

    def __post_init__(self) -> None:
        _finite_at_least(self.s_per_token, 0.0, "PrefillCost.s_per_token")
        _finite_at_least(self.s_per_token_pair, 0.0, "PrefillCost.s_per_token_pair")

    @classmethod
    def from_rate(cls, tokens_per_s: float) -> PrefillCost:
        """Every token at a measured rate (no attention term).

        Right for a count of tokens summed over many prompts, valued at the rate a job
        measured over prompts like them; a prompt's own length matters in :meth:`scaled`.

        Raises:
            ValueError: the rate is not a positive number.
        """
        _finite_at_least(tokens_per_s, 0.0, "tokens_per_s", strict=True)
        return cls(1.0 / tokens_per_s, 0.0)

    def scaled(self, tokens_per_s: float) -> PrefillCost:
        """This model's shape at another speed: short prompts at ``tokens_per_s``, and the
        attention term in the same proportion to the linear one.

        Raises:
            ValueError: the rate is not a positive number, or this model has no linear term to scale.
        """
        _finite_at_least(tokens_per_s, 0.0, "tokens_per_s", strict=True)
        if self.s_per_token <= 0:
            raise ValueError("a prefill cost with no linear term cannot be scaled to a rate in tokens/s")
        a = 1.0 / tokens_per_s
        return PrefillCost(a, self.s_per_token_pair * a / self.s_per_token)

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> PrefillCost:
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
    def from_prefill_bench(cls, doc: Mapping[str, Any]) -> PrefillCost:
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

    def _from_zero(self, n: Count) -> Count:
        n = n * 1.0  # ints (and int arrays) to floats: n * (n + 1) must not overflow
        return self.s_per_token * n + self.s_per_token_pair * n * (n + 1) / 2

    def seconds(self, n_tokens: Count, cached_tokens: Count = 0) -> Count:
        """Seconds to prefill a prompt of ``n_tokens`` whose first ``cached_tokens`` are cached.

        What a hit of the first ``c`` tokens saves is ``seconds(c)``; what the rest of the
        prompt still costs, ``seconds(n, c)``. Numbers or numpy arrays (elementwise).
        """
        return self._from_zero(n_tokens) - self._from_zero(cached_tokens)


@dataclass(frozen=True)
class LoadCost:
    """Seconds to load stored KV from one tier: ``bytes / bytes_per_s + files * s_per_file``.

    Attributes:
        bytes_per_s: the tier's measured read throughput into the engine's memory.
        s_per_file: the fixed cost of each snapshot file (open, verify; an S3 request's latency).
    """

    bytes_per_s: float
    s_per_file: float = 0.0

    def __post_init__(self) -> None:
        _finite_at_least(self.bytes_per_s, 0.0, "LoadCost.bytes_per_s", strict=True)
        _finite_at_least(self.s_per_file, 0.0, "LoadCost.s_per_file")

    def seconds(self, n_bytes: Count, files: Count = 1) -> Count:
        """Seconds to load ``n_bytes`` kept in ``files`` snapshot files."""
        return n_bytes / self.bytes_per_s + files * self.s_per_file

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> LoadCost:
        """Fit ``seconds = s_per_file + bytes / bytes_per_s`` to measured ``(bytes, seconds)`` reads of one file each.

        Least squares on the relative error, so that small and large reads weigh alike.
        With one size (or a fit that makes the latency negative) the time is all throughput.

        Raises:
            ValueError: no points, or a size or time that is not positive.
        """
        pts = [(float(b), float(t)) for b, t in points]
        if not pts or any(not (b > 0 and t > 0 and math.isfinite(b) and math.isfinite(t)) for b, t in pts):
            raise ValueError(f"a load cost fit needs (bytes, seconds) pairs, all positive; got {points!r}")
        b = np.array([p[0] for p in pts])
        t = np.array([p[1] for p in pts])
        if len(set(b.tolist())) > 1:
            (latency, inverse), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(b), b]) / t[:, None],
                                                     np.ones_like(t), rcond=None)
            if latency >= 0 and inverse > 0:
                return cls(float(1.0 / inverse), float(latency))
        return cls(float(b.sum() / t.sum()), 0.0)


def load_beats_prefill(prefill: PrefillCost, load: LoadCost, *, cached_tokens: int, hit_tokens: int,
                       n_bytes: float, files: int) -> bool:
    """Whether loading a stored hit is faster than prefilling its tokens.

    The hit is the ``hit_tokens`` after the ``cached_tokens`` the engine already holds
    (their attention looks back over those too), stored as ``files`` snapshots of
    ``n_bytes`` in all. A hit that would be slower to load than to recompute is not worth it.
    """
    return load.seconds(n_bytes, files) < prefill.seconds(cached_tokens + hit_tokens, cached_tokens)
