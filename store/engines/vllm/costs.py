"""Load only what beats recomputing: a hit's load time against its tokens' prefill time, as measured here.

A disk hit can be slower than recomputing it (ai-dynamo/dynamo#6101 measured 44x on a fast GPU),
so the scheduler loads a hit only when :meth:`CostModel.worth_loading` says its estimated load
time is below the estimated prefill time of its tokens (:func:`store.cost.load_beats_prefill`,
kvwarm's one cost model). Both estimates follow this engine:

- prefill (:class:`store.cost.PrefillCost`): the configured ``prefill_tokens_per_s``, else the rate
  the worker measured on steps that were mostly prefill (a moving average), else
  :func:`default_prefill`: the H200 fit of an 8B Llama (``PrefillCost()``'s defaults, from
  ``bench/calibration/prefill-h200-8b.json``) scaled by this model's work per token, and by
  :data:`CPU_SLOWDOWN` on a CPU engine. A rate keeps the model's shape (``PrefillCost.scaled``):
  tokens after a long context cost more.
- load, per tier (``pool``, ``nvme``, ``s3``; :class:`store.cost.LoadCost`): :data:`DEFAULT_LOAD`
  until the worker has measured that tier, then its measured bytes per second (a moving
  average over loads, from mapping the snapshots to the last write into the engine's blocks).

Pure: no vLLM, no I/O.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping

from store.cost import LoadCost, PrefillCost, load_beats_prefill

#: The 8B Llama of ``PrefillCost()``'s fit: weights read per token (non-embedding plus the LM head)
#: and attention width (layers x query heads x head dim).
_8B_WEIGHTS = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096
_8B_ATTENTION = 32 * 32 * 128
#: A CPU engine prefills this many times slower than the H200 for the same work per token
#: (kvwarm-ref measured about 1,700x on a 2-core AVX2 host; 2,000 errs towards loading).
CPU_SLOWDOWN = 2000.0
#: Before a tier is measured: its bytes per second and seconds per snapshot file.
DEFAULT_LOAD: dict[str, LoadCost] = {"pool": LoadCost(4e9, 2e-5), "nvme": LoadCost(1e9, 1e-4),
                                     "s3": LoadCost(1e8, 0.05)}
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


def default_prefill(hf_config: Mapping[str, Any] | None, *, cpu: bool) -> PrefillCost:
    """The prefill estimate for a model nothing was measured for (see the module)."""
    base = PrefillCost()
    scale_a = scale_b = 1.0
    if hf_config is not None:
        weights, attention = model_work(hf_config)
        scale_a, scale_b = weights / _8B_WEIGHTS, attention / _8B_ATTENTION
    device = CPU_SLOWDOWN if cpu else 1.0
    return PrefillCost(base.s_per_token * scale_a * device, base.s_per_token_pair * scale_b * device)


@dataclass
class _Average:
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - ALPHA) * self.value + ALPHA * x


class CostModel:
    """Estimates of load and prefill time that follow this engine's measurements (thread-safe).

    Args:
        prefill: the prefill estimate before any measurement (:func:`default_prefill`).
        tokens_per_s: a configured prefill rate (measurements then do not move the estimate).
    """

    def __init__(self, prefill: PrefillCost, *, tokens_per_s: float | None = None) -> None:
        self._base = prefill
        self._configured = tokens_per_s
        self._rate = _Average()
        self._bytes_per_s: dict[str, _Average] = {}
        self._lock = threading.Lock()

    def prefill(self) -> PrefillCost:
        """The prefill estimate in use."""
        with self._lock:
            rate = self._configured or self._rate.value
        return self._base.scaled(rate) if rate and self._base.s_per_token > 0 else self._base

    def load(self, tier: str) -> LoadCost:
        """The load estimate of ``tier`` in use."""
        with self._lock:
            measured = self._bytes_per_s.get(tier)
            rate = measured.value if measured is not None else None
        return LoadCost(rate) if rate else DEFAULT_LOAD.get(tier, DEFAULT_LOAD["nvme"])

    def prefill_seconds(self, n_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``n_tokens`` of which the first ``cached_tokens`` are already computed."""
        return float(self.prefill().seconds(n_tokens, cached_tokens))

    def load_seconds(self, tier: str, nbytes: float, files: int) -> float:
        """Seconds to load ``nbytes`` of stored KV in ``files`` snapshots from ``tier`` into the engine."""
        return float(self.load(tier).seconds(nbytes, files))

    def worth_loading(self, tier: str, *, cached_tokens: int, hit_tokens: int, nbytes: float, files: int) -> bool:
        """Whether loading ``hit_tokens`` (after ``cached_tokens`` the engine holds) beats computing them."""
        return hit_tokens > 0 and load_beats_prefill(self.prefill(), self.load(tier), cached_tokens=cached_tokens,
                                                     hit_tokens=hit_tokens, n_bytes=nbytes, files=files)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load the worker measured: ``nbytes`` stored bytes from ``tier`` in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._bytes_per_s.setdefault(tier, _Average()).add(nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step of mostly prefill the worker measured: ``tokens`` computed in ``seconds``."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._rate.add(tokens / seconds)

    def as_dict(self) -> dict[str, Any]:
        """The estimates in use, for ``stats()``."""
        a = self.prefill().s_per_token
        with self._lock:
            source = "configured" if self._configured else "measured" if self._rate.value else "default"
            tiers = {t: m.value for t, m in self._bytes_per_s.items() if m.value}
        return {"prefill_tokens_per_s": 1.0 / a if a > 0 else None, "prefill_rate_source": source,
                "load_bytes_per_s": tiers}
