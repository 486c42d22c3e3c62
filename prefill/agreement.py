"""The audit's agreement rule: is a snapshot's stored KV the model's KV for its tokens, to within its precision?

Per layer and for K and V apart, ``measured`` is the relative L2 distance between the stored
KV (dequantised) and the KV the model recomputes for the same tokens after the same prefix.
The stored KV is the KV its writer computed, ``x_w``, rounded by the storage precision, whose
relative error the header records (``quant_error``, measured against ``x_w`` when it was
stored). So, by the triangle inequality, with ``x_r`` the recomputed KV::

    ||stored - x_r|| <= ||stored - x_w|| + ||x_w - x_r||

the first term is the recorded error, and the second is how far two implementations of the
same model (vLLM's kernels and transformers; bf16 and fp32) compute the same KV apart. Hence,
for every layer ``l`` and both K and V:

    agrees  iff  measured <= min(recorded, STORAGE_BOUND[dtype]) + tolerance(l)

``tolerance(l)`` (:data:`TOLERANCE`) is the implementation tolerance. Two implementations'
rounding differences add up layer by layer (each layer's input is the last one's output), so
it grows with the layer's depth: ``base + per_layer * l``, at most ``cap``. It must cover what
two correct implementations show, with room, and stay far below what wrong KV shows. The
recorded error is trusted only up to what the storage dtype can introduce at all
(:data:`STORAGE_BOUND`; a missing or non-finite record counts as that bound), so a writer
cannot buy slack by recording a large error. The measurements behind the constants are in
docs/guides/operating-a-store.md (``bench/audit_tolerance.py``).

Pure: tensors in, a :class:`Verdict` out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from store.format.precision import relative_errors


@dataclass(frozen=True)
class Tolerance:
    """The implementation tolerance at each layer (relative L2): ``base + per_layer * layer``, at most ``cap``."""

    base: float
    per_layer: float
    cap: float

    def __post_init__(self) -> None:
        for name in ("base", "per_layer", "cap"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v < 1):
                raise ValueError(f"Tolerance.{name} must be a relative error in [0, 1), got {v!r}")

    def at(self, layer: int) -> float:
        return min(self.cap, self.base + self.per_layer * layer)

    def scaled(self, factor: float) -> Tolerance:
        """This tolerance times ``factor`` (every constant; a factor that would reach 1 is refused)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"a tolerance scale must be positive, got {factor!r}")
        return Tolerance(self.base * factor, self.per_layer * factor, self.cap * factor)


#: Measured (docs/guides/operating-a-store.md): KV that vLLM's CPU kernels computed and wrote back
#: lies at most 0.011 (kvwarm-tiny, 4 layers) and 0.032 (kvwarm-ref, 12 layers) beyond the
#: recorded error from transformers' (bf16 and FP8 storage, recomputed in bf16 or fp32), growing
#: by about 0.002 a layer; at every layer measured that is a third of 0.03 + 0.008 per layer, or
#: less. Wrong KV (after a wrong prefix, at wrong positions, another block's) lies 0.53 or more away
#: in every layer after the first, 8x layer 1's allowance; two wrong tokens of 256 lie 0.09 away.
TOLERANCE = Tolerance(base=0.03, per_layer=0.008, cap=0.25)

#: The largest relative L2 error rounding to each storage dtype can introduce (half a unit in the
#: last place, relatively: e4m3 keeps 3 mantissa bits, bf16 7, fp16 10; fp32 stores the model's
#: bf16/fp16/fp32 KV exactly). FP8's subnormals add at most ~5e-4 at these scales, inside the tolerance.
STORAGE_BOUND: Mapping[str, float] = {"fp8_e4m3": 2.0**-4, "bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 0.0}

KINDS = ("k", "v")


@dataclass(frozen=True)
class LayerCheck:
    """One layer's K or V: the distance measured, the error recorded and as trusted, the tolerance."""

    layer: int
    kind: str
    measured: float
    recorded: float | None
    trusted: float
    tolerance: float

    @property
    def allowed(self) -> float:
        return self.trusted + self.tolerance

    @property
    def agrees(self) -> bool:
        return self.measured <= self.allowed  # a NaN distance never agrees

    @property
    def excess(self) -> float:
        """``measured`` beyond the trusted recorded error: what the tolerance has to cover."""
        return self.measured - self.trusted

    @property
    def tolerance_used(self) -> float:
        """``excess`` as a share of the tolerance (1: at the limit; 0 where the tolerance is 0 and nothing is over)."""
        if self.tolerance > 0:
            return self.excess / self.tolerance
        return 0.0 if self.excess <= 0 else math.inf

    def describe(self) -> str:
        rec = "none" if self.recorded is None else f"{self.recorded:.4f}"
        return (f"layer {self.layer} {self.kind.upper()} is {self.measured:.4f} (relative L2) from the model's KV, "
                f"allowed {self.allowed:.4f} (recorded error {rec})")


@dataclass(frozen=True)
class Verdict:
    """Every layer's checks of one snapshot: it agrees when every one does."""

    checks: tuple[LayerCheck, ...]

    @property
    def agrees(self) -> bool:
        return all(c.agrees for c in self.checks)

    @property
    def worst(self) -> LayerCheck:
        """The check nearest to (or furthest past) its allowance."""
        return max(self.checks, key=lambda c: c.measured - c.allowed if not math.isnan(c.measured) else math.inf)

    def reason(self) -> str:
        """Why it disagrees (the worst check), for the quarantine note; ``""`` when it agrees."""
        if self.agrees:
            return ""
        bad = [c for c in self.checks if not c.agrees]
        return (f"KV differs from the model's recomputation: {self.worst.describe()}"
                f"{f'; {len(bad) - 1} more layer check(s) over' if len(bad) > 1 else ''}")


def trusted_error(recorded: float | None, dtype: str) -> float:
    """The recorded error as the rule trusts it: capped at the storage dtype's bound
    (:data:`STORAGE_BOUND`), which also stands in for a missing, negative or non-finite record."""
    bound = STORAGE_BOUND.get(dtype, STORAGE_BOUND["fp8_e4m3"])
    if recorded is None or not math.isfinite(recorded) or recorded < 0:
        return bound
    return min(recorded, bound)


def judge(stored: Sequence[tuple[torch.Tensor, torch.Tensor]], recomputed: Sequence[tuple[torch.Tensor, torch.Tensor]],
          recorded: Mapping[str, Sequence[float]], dtypes: Sequence[str], *,
          tolerance: Tolerance = TOLERANCE) -> Verdict:
    """Compare one block's stored KV with the model's, layer by layer (see the module doc).

    Args:
        stored: per layer ``(K, V)`` as stored, dequantised (``[kv_heads, block_size, head_dim]``).
        recomputed: the same from the model, in any float dtype.
        recorded: the header's ``quant_error`` (``k_rel_l2``, ``v_rel_l2``: one value per layer).
        dtypes: each layer's storage dtype (``Precision.layer_dtype``).
        tolerance: the implementation tolerance by layer (:data:`TOLERANCE`).

    Raises:
        ValueError: the layer counts or shapes differ.
    """
    if not (len(stored) == len(recomputed) == len(dtypes)):
        raise ValueError(f"{len(stored)} stored layers, {len(recomputed)} recomputed, {len(dtypes)} dtypes")
    checks = []
    for kind_i, kind in enumerate(KINDS):
        ref = torch.stack([r[kind_i].to(torch.float32) for r in recomputed])
        got = torch.stack([s[kind_i].to(torch.float32) for s in stored])
        if ref.shape != got.shape:
            raise ValueError(f"stored {kind.upper()} is {tuple(got.shape)}, recomputed {tuple(ref.shape)}")
        distances = relative_errors(ref, got).tolist()
        values = list(recorded.get(f"{kind}_rel_l2") or ())
        for layer, measured in enumerate(distances):
            rec = float(values[layer]) if layer < len(values) and values[layer] is not None else None
            checks.append(LayerCheck(layer, kind, float(measured), rec, trusted_error(rec, dtypes[layer]),
                                     tolerance.at(layer)))
    return Verdict(tuple(sorted(checks, key=lambda c: (c.layer, c.kind))))
