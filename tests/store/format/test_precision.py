"""FP8 quantisation: scale before the cast, per head or per token group, exact inverses for unquantised."""
from __future__ import annotations

import pytest
import torch

from store.format.precision import FP8_MAX, Precision, dequantize, quantize, relative_error, relative_errors


def test_large_values_do_not_saturate() -> None:
    x = torch.randn(4, 32, 16) * 10_000  # far beyond e4m3's +-448
    q, scale = quantize(x, Precision(), 0)
    assert scale is not None and scale.shape == (4,) and scale.dtype == torch.float32
    assert relative_error(x, dequantize(q, scale, torch.float32)) < 0.05
    assert float(q.to(torch.float32).abs().max()) <= FP8_MAX


def test_per_head_scales_protect_small_heads() -> None:
    x = torch.randn(2, 32, 16)
    x[1] *= 1e-3  # one quiet head next to a loud one
    q, s = quantize(x, Precision(), 0)
    back = dequantize(q, s, torch.float32)
    assert relative_error(x[1], back[1]) < 0.05


@pytest.mark.parametrize("tokens, group", [(32, 8), (30, 8), (9, 4), (5, 16)])
def test_group_scales_round_trip(tokens: int, group: int) -> None:
    p = Precision(granularity="head_group", group_tokens=group)
    x = torch.randn(2, tokens, 16)
    x[:, :2] *= 100  # an outlier group: per-group scales keep the rest precise
    q, s = quantize(x, p, 0)
    assert s is not None and s.shape == (2, -(-tokens // group))
    back = dequantize(q, s, torch.float32, group)
    assert back.shape == x.shape
    assert relative_error(x[:, -1], back[:, -1]) < 0.05


def test_group_scales_beat_head_scales_with_outliers() -> None:
    # e4m3 is floating point: a per-head scale only hurts when an outlier pushes the
    # other values below its normal range (2**-6 after scaling), i.e. a ratio >> 448/2**-6.
    x = torch.randn(2, 64, 16)
    x[:, 0] *= 1e5
    err = {}
    for p in (Precision(), Precision(granularity="head_group", group_tokens=8)):
        q, s = quantize(x, p, 0)
        err[p.granularity] = relative_error(x[:, 8:], dequantize(q, s, torch.float32, p.group_tokens)[:, 8:])
    assert err["head_group"] < err["head"]


def test_unquantised_and_kept_layers() -> None:
    x = torch.randn(2, 8, 4, dtype=torch.bfloat16)
    q, s = quantize(x, Precision(compression="bf16"), 0)
    assert s is None and torch.equal(q, x)
    p = Precision(keep_layers=(3,), keep_dtype="fp16")
    assert p.layer_dtype(3) == "fp16" and p.layer_dtype(2) == "fp8_e4m3"
    q, s = quantize(x, p, 3)
    assert s is None and q.dtype == torch.float16


def test_zero_tensor_and_scheme_ids() -> None:
    q, s = quantize(torch.zeros(2, 4, 4), Precision(), 0)
    assert torch.equal(dequantize(q, s, torch.float32), torch.zeros(2, 4, 4))
    ids = {Precision().scheme_id(), Precision(keep_layers=(0,)).scheme_id(),
           Precision(granularity="head_group", group_tokens=16).scheme_id(), Precision(compression="fp16").scheme_id()}
    assert len(ids) == 4


def test_bad_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8, bf16, fp16"):
        Precision(compression="int4")
    with pytest.raises(ValueError, match="group_tokens"):
        Precision(granularity="head_group")
    with pytest.raises(ValueError, match="distinct"):
        Precision(keep_layers=(1, 1))


@pytest.mark.parametrize("precision", [Precision(), Precision(granularity="head_group", group_tokens=5),
                                       Precision(compression="bf16")])
def test_quantising_blocks_together_gives_each_block_the_bytes_it_gets_alone(precision):
    g = torch.Generator().manual_seed(3)
    blocks = torch.randn((4, 2, 16, 8), generator=g) * torch.tensor([0.1, 1, 10, 300])[:, None, None, None]
    blocks[2] = 0  # an all-zero block keeps scale 1 and error 0
    q, scale = quantize(blocks, precision, 0)
    back = dequantize(q, scale, torch.float32, precision.group_tokens)
    errs = relative_errors(blocks, back)
    for b in range(4):
        q1, s1 = quantize(blocks[b], precision, 0)
        assert torch.equal(q[b].view(torch.uint8), q1.view(torch.uint8))
        assert (s1 is None and scale is None) or torch.equal(scale[b], s1)
        assert torch.equal(back[b], dequantize(q1, s1, torch.float32, precision.group_tokens))
        assert float(errs[b]) == pytest.approx(relative_error(blocks[b], back[b]), rel=1e-5, abs=1e-9)
    assert float(errs[2]) == 0.0
