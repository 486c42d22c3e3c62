"""Precision loss: what storing KV at a precision costs, measured as the model sees it.

*Precision loss* (the figure the SageMaker write-up quotes as "under 0.5 %") is defined
here as the relative L2 change of the next-token log-probabilities when the model
continues from KV restored from storage at ``precision`` instead of at a lossless
reference (bf16 by default): ``||lp - lp_ref|| / ||lp_ref||``, with *top-1 agreement*
(the most likely next token is the same) alongside. Both are computed per prompt; the
report gives the median, the 90th percentile and the agreement rate.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from prefill.models import LoadedModel
from store.format.precision import Precision, dequantize, quantize


@dataclass(frozen=True)
class PrecisionLoss:
    """Precision loss of one storage precision over a set of prompts."""

    precision: str
    loss_median: float
    loss_p90: float
    top1_agreement: float
    prompts: int


def round_trip(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], precision: Precision, dtype: torch.dtype
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(K, V)`` (``[heads, tokens, dim]``) quantised and dequantised as a store round trip does."""
    out = []
    for i, (k, v) in enumerate(layers):
        out.append(tuple(dequantize(*quantize(t, precision, i), dtype, precision.group_tokens) for t in (k, v)))
    return out  # type: ignore[return-value]


def _next_logprobs(loaded: LoadedModel, kv, rest: torch.Tensor) -> torch.Tensor:
    from transformers import DynamicCache

    cache = DynamicCache(config=loaded.config)
    for i, (k, v) in enumerate(kv):
        cache.update(k[None], v[None], layer_idx=i)
    with torch.inference_mode():
        logits = loaded.model(rest, cache=cache).logits[0, -1].float()
    return torch.log_softmax(logits, -1)


def precision_loss(loaded: LoadedModel, prompts: Sequence[Sequence[int]], prefix_tokens: int,
                   precisions: dict[str, Precision], reference: Precision = Precision(compression="bf16")
                   ) -> dict[str, PrecisionLoss]:
    """Precision loss of each of ``precisions`` against ``reference``.

    Each prompt's first ``prefix_tokens`` tokens play the stored prefix; the model
    continues over the rest (at least one token) from the restored KV.
    """
    losses: dict[str, list[float]] = {k: [] for k in precisions}
    agree: dict[str, list[bool]] = {k: [] for k in precisions}
    for ids in prompts:
        if len(ids) <= prefix_tokens:
            raise ValueError(f"a prompt of {len(ids)} tokens leaves nothing after a {prefix_tokens}-token prefix")
        x = torch.tensor([list(ids)], device=loaded.device)
        with torch.inference_mode():
            full = loaded.model(x[:, :prefix_tokens], use_cache=True).cache
        layers = [(layer.keys[0], layer.values[0]) for layer in full.layers]
        rest = x[:, prefix_tokens:]
        ref = _next_logprobs(loaded, round_trip(layers, reference, loaded.dtype), rest)
        for name, prec in precisions.items():
            lp = _next_logprobs(loaded, round_trip(layers, prec, loaded.dtype), rest)
            losses[name].append(float((lp - ref).norm() / ref.norm()))
            agree[name].append(bool(lp.argmax() == ref.argmax()))
    out = {}
    for name, prec in precisions.items():
        xs = sorted(losses[name])
        out[name] = PrecisionLoss(precision=prec.scheme_id(), loss_median=statistics.median(xs),
                                  loss_p90=xs[int(0.9 * (len(xs) - 1))],
                                  top1_agreement=sum(agree[name]) / len(agree[name]), prompts=len(xs))
    return out
