"""How KV is stored: FP8 (e4m3) with fp32 scales, or unquantised bf16/fp16 (fp32 for exactness checks).

The prefill job quantises and the serving-side loader dequantises with these same
functions, so they live in ``store`` (which every other package may import).
Scales are computed in fp32 per layer and kv head (``head``), or per kv head and
group of ``group_tokens`` tokens (``head_group``); values are divided by the scale
*before* the cast, because casts to e4m3 saturate at +-448.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from store.errors import ConfigError

Compression = Literal["fp8", "bf16", "fp16", "fp32"]
COMPRESSIONS: tuple[str, ...] = ("fp8", "bf16", "fp16", "fp32")
GRANULARITIES: tuple[str, ...] = ("head", "head_group")
FP8_MAX = 448.0

#: storage dtype name (as written in headers) -> torch dtype
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_KV_DTYPE = {"fp8": "fp8_e4m3", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass(frozen=True)
class Precision:
    """Storage precision of a snapshot.

    Attributes:
        compression: ``fp8`` (default), ``bf16`` or ``fp16``.
        granularity: ``head`` (one scale per layer and kv head) or ``head_group``.
        group_tokens: tokens per scale group when ``granularity == "head_group"``.
        keep_layers: layers stored unquantised (mixed precision, where FP8 hurts).
        keep_dtype: dtype for ``keep_layers`` (``bf16`` or ``fp16``).
    """

    compression: str = "fp8"
    granularity: str = "head"
    group_tokens: int = 0
    keep_layers: tuple[int, ...] = ()
    keep_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression {self.compression!r} is not allowed; choose one of {', '.join(COMPRESSIONS)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity {self.granularity!r} is not allowed; choose one of {', '.join(GRANULARITIES)}")
        if self.granularity == "head_group" and self.group_tokens < 1:
            raise ValueError("granularity 'head_group' needs group_tokens >= 1")
        if self.keep_dtype not in ("bf16", "fp16"):
            raise ValueError(f"keep_dtype {self.keep_dtype!r} is not allowed; choose bf16 or fp16")
        if any(i < 0 for i in self.keep_layers) or len(set(self.keep_layers)) != len(self.keep_layers):
            raise ValueError(f"keep_layers must be distinct non-negative layer indices, got {self.keep_layers}")
        object.__setattr__(self, "keep_layers", tuple(sorted(self.keep_layers)))

    @property
    def kv_dtype(self) -> str:
        """The storage dtype of quantised layers, as recorded in keys and headers."""
        return _KV_DTYPE[self.compression]

    def layer_dtype(self, layer: int) -> str:
        """Storage dtype of one layer, after per-layer overrides."""
        if self.compression == "fp8" and layer in self.keep_layers:
            return self.keep_dtype
        return self.kv_dtype

    def check_layers(self, num_layers: int, *, model: str = "the model") -> None:
        """Refuse ``keep_layers`` that a model of ``num_layers`` layers does not have (a layer past the
        last would silently keep nothing in full precision). Called where the model becomes known: the
        prefill job once it has loaded the model, the vLLM connector once it sees the engine's layers.

        Raises:
            ConfigError: naming ``kv_cache.keep_layers`` and the model's layer count.
        """
        outside = [i for i in self.keep_layers if i >= num_layers]
        if outside:
            raise ConfigError(
                f"kv_cache.keep_layers = {list(self.keep_layers)}: layer {outside[0]} is outside {model}, which has "
                f"{num_layers} layer{'s' if num_layers != 1 else ''} (0 to {num_layers - 1}); list only layers "
                f"below {num_layers}, e.g. [0] or [0, {num_layers - 1}]")

    def scheme_id(self) -> str:
        """Canonical string of everything here that changes stored bytes (goes into keys)."""
        if self.compression != "fp8":
            return f"{self.kv_dtype}/none"
        gran = "head" if self.granularity == "head" else f"head_group{self.group_tokens}"
        keep = ",".join(str(i) for i in self.keep_layers)
        return f"fp8_e4m3/scale=fp32:{gran}/keep={keep}:{self.keep_dtype}"


def quantize(x: torch.Tensor, precision: Precision, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantise one layer's K or V, shaped ``[kv_heads, tokens, head_dim]``.

    Leading dimensions are allowed (``[..., kv_heads, tokens, head_dim]``: several blocks
    at once, each quantised exactly as it would be alone).

    Returns the stored tensor and its fp32 scales (``[..., kv_heads]`` or
    ``[..., kv_heads, groups]``), or ``None`` for unquantised layers.
    """
    dtype = precision.layer_dtype(layer)
    if dtype != "fp8_e4m3":
        return x.to(STORAGE_DTYPES[dtype]).contiguous(), None
    xf = x.to(torch.float32)
    *lead, heads, tokens, dim = xf.shape
    if precision.granularity == "head":
        amax = xf.abs().amax(dim=(-2, -1))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (xf / scale[..., None, None]).clamp_(-FP8_MAX, FP8_MAX)
    else:
        g = precision.group_tokens
        groups = -(-tokens // g)
        pad = groups * g - tokens
        xp = torch.nn.functional.pad(xf, (0, 0, 0, pad)).view(*lead, heads, groups, g, dim)
        amax = xp.abs().amax(dim=(-2, -1))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (xp / scale[..., None, None]).clamp_(-FP8_MAX, FP8_MAX).view(*lead, heads, groups * g, dim)[..., :tokens, :]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize(
    stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, group_tokens: int = 0
) -> torch.Tensor:
    """Inverse of :func:`quantize`: back to ``dtype`` (the model's compute dtype).

    ``group_tokens`` is the precision's group size when the scales are per group.
    """
    if scale is None:
        return stored.to(dtype)
    xf = stored.to(torch.float32)
    if scale.dim() == xf.dim() - 2:  # per head (leading dimensions allowed, as in quantize)
        return (xf * scale[..., None, None]).to(dtype)
    if group_tokens < 1:
        raise ValueError("per-group scales need group_tokens >= 1")
    tokens = xf.shape[-2]
    expanded = scale.repeat_interleave(group_tokens, dim=-1)[..., :tokens]
    return (xf * expanded[..., None]).to(dtype)


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Relative L2 error ``||approx - reference|| / ||reference||`` in fp32 (0 when both are 0)."""
    ref = reference.to(torch.float32)
    denom = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(approx.to(torch.float32) - ref))
    return num / denom if denom > 0 else num


def relative_errors(reference: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """:func:`relative_error` of each item along the first dimension, computed where the
    tensors are (one result tensor, no synchronisation per item)."""
    ref = reference.to(torch.float32).flatten(1)
    denom = torch.linalg.vector_norm(ref, dim=1)
    num = torch.linalg.vector_norm(approx.to(torch.float32).flatten(1) - ref, dim=1)
    return torch.where(denom > 0, num / torch.where(denom > 0, denom, torch.ones_like(denom)), num)
