"""Load only what beats recomputing: a hit's load time against its tokens' prefill time, as measured here.

A disk hit can be slower than recomputing it (ai-dynamo/dynamo#6101 measured 44x on a fast GPU),
so the scheduler loads a hit only when :meth:`CostModel.worth_loading` says its estimated load
time is below the estimated prefill time of its tokens. Both estimates follow this engine:

- prefill: ``seconds(n, cached) = a * (n - c) + b * (n(n+1)/2 - c(c+1)/2)`` (linear work plus
  causal attention pairs, the shape of ``store.cost.PrefillCost``). ``a`` is the configured
  ``prefill_tokens_per_s``, else the rate the worker measured on steps that were mostly prefill
  (a moving average), else :func:`default_prefill`: the H200 fit of an 8B Llama
  (``bench/calibration/prefill-h200-8b.json``) scaled by this model's work per token, and by
  :data:`CPU_SLOWDOWN` on a CPU engine. ``b`` keeps the fit's ratio to ``a``.
- load, per tier (``pool``, ``nvme``, ``s3``): ``bytes / bytes_per_s + files * s_per_file`` from
  :data:`DEFAULT_LOAD`, until the worker has measured that tier; then its measured seconds per
  stored byte (a moving average over loads, mapping to the last engine write).

Pure: no vLLM, no I/O.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping

#: The fit of an 8B Llama's bare forward on one H200 (seconds per token, per causal attention pair).
H200_8B_S_PER_TOKEN = 2.8402e-5
H200_8B_S_PER_PAIR = 8.664e-10
#: That model's work per token: weights read per token (non-embedding plus the LM head) and
#: attention width (layers x query heads x head dim).
_8B_WEIGHTS = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096
_8B_ATTENTION = 32 * 32 * 128
#: A CPU engine prefills this many times slower than the H200 for the same work per token
#: (kvwarm-ref measured about 1,700x on a 2-core AVX2 host; 2,000 errs towards loading).
CPU_SLOWDOWN = 2000.0
#: Before a tier is measured: bytes per second and seconds per snapshot file.
DEFAULT_LOAD: dict[str, tuple[float, float]] = {"pool": (4e9, 2e-5), "nvme": (1e9, 1e-4), "s3": (1e8, 0.05)}
#: Weight of a new measurement in the moving averages.
ALPHA = 0.2


def model_work(hf_config: Mapping[str, Any]) -> tuple[float, float]:
    """A model's weights read per token and its attention width, from its config's numbers."""
    h = int(hf_config["hidden_size"])
    layers = int(hf_config["num_hidden_layers"])
    heads = int(hf_config["num_attention_heads"])
    kv = int(hf_config.get("num_key_value_heads") or heads)
    dim = int(hf_config.get("head_dim") or h // heads)
    inter = int(hf_config.get("intermediate_size") or 4 * h)
    vocab = int(hf_config.get("vocab_size") or 0)
    weights = layers * (2 * h * heads * dim + 2 * h * kv * dim + 3 * h * inter) + vocab * h
    return float(weights), float(layers * heads * dim)


def default_prefill(hf_config: Mapping[str, Any] | None, *, cpu: bool) -> tuple[float, float]:
    """``(a, b)`` of the prefill estimate for a model nothing was measured for (see the module)."""
    if hf_config is None:
        scale_a = scale_b = 1.0
    else:
        weights, attention = model_work(hf_config)
        scale_a, scale_b = weights / _8B_WEIGHTS, attention / _8B_ATTENTION
    device = CPU_SLOWDOWN if cpu else 1.0
    return H200_8B_S_PER_TOKEN * scale_a * device, H200_8B_S_PER_PAIR * scale_b * device


@dataclass
class _Average:
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - ALPHA) * self.value + ALPHA * x


class CostModel:
    """Estimates of load and prefill time that follow this engine's measurements (thread-safe).

    Args:
        prefill: ``(a, b)`` of the prefill estimate before any measurement (:func:`default_prefill`).
        tokens_per_s: a configured prefill rate: fixes ``a`` (measurements then do not move it).
    """

    def __init__(self, prefill: tuple[float, float], *, tokens_per_s: float | None = None) -> None:
        self._a0, self._b0 = prefill
        self._configured = tokens_per_s
        self._rate = _Average()
        self._per_byte: dict[str, _Average] = {}
        self._lock = threading.Lock()

    def _ab(self) -> tuple[float, float]:
        rate = self._configured or self._rate.value
        if not rate:
            return self._a0, self._b0
        a = 1.0 / rate
        return a, self._b0 * a / self._a0 if self._a0 > 0 else 0.0

    def prefill_seconds(self, n_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``n_tokens`` of which the first ``cached_tokens`` are already computed."""
        with self._lock:
            a, b = self._ab()
        n, c = float(n_tokens), float(cached_tokens)
        return a * (n - c) + b * (n * (n + 1) / 2 - c * (c + 1) / 2)

    def load_seconds(self, tier: str, nbytes: float, files: int) -> float:
        """Seconds to load ``nbytes`` of stored KV in ``files`` snapshots from ``tier`` into the engine."""
        with self._lock:
            measured = self._per_byte.get(tier)
            per_byte = measured.value if measured is not None else None
        if per_byte is not None:
            return nbytes * per_byte
        bytes_per_s, s_per_file = DEFAULT_LOAD.get(tier, DEFAULT_LOAD["nvme"])
        return nbytes / bytes_per_s + files * s_per_file

    def worth_loading(self, tier: str, *, cached_tokens: int, hit_tokens: int, nbytes: float, files: int) -> bool:
        """Whether loading ``hit_tokens`` (after ``cached_tokens`` the engine holds) beats computing them."""
        if hit_tokens <= 0:
            return False
        return self.load_seconds(tier, nbytes, files) < self.prefill_seconds(cached_tokens + hit_tokens, cached_tokens)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load the worker measured: ``nbytes`` stored bytes from ``tier`` in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._per_byte.setdefault(tier, _Average()).add(seconds / nbytes)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step of mostly prefill the worker measured: ``tokens`` computed in ``seconds``."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._rate.add(tokens / seconds)

    def as_dict(self) -> dict[str, Any]:
        """The estimates in use, for ``stats()``."""
        with self._lock:
            a, _ = self._ab()
            source = "configured" if self._configured else "measured" if self._rate.value else "default"
            tiers = {t: 1.0 / m.value for t, m in self._per_byte.items() if m.value}
        return {"prefill_tokens_per_s": 1.0 / a if a > 0 else None, "prefill_rate_source": source,
                "load_bytes_per_s": tiers}
