"""The native FP8 pass: the bits of torch's passes (the codec's), on every finite bf16 value, scalar and AVX-512."""
from __future__ import annotations

import pytest
import torch

from store.format.precision import Precision, dequantize, quantize
from store.kernels import quantiser
from store.kernels import table
from store.kernels.gather import quantise_blocks

pytestmark = pytest.mark.skipif(not quantiser.native_quantise(), reason="the native module is not built")


def _torch_passes(x: torch.Tensor, monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as m:
        m.setattr(quantiser, "_native", None)
        return quantise_blocks(x, Precision(), 1)


def _same(a, b) -> None:
    (aq, asc, an, ad), (bq, bsc, bn, bd) = a, b
    assert torch.equal(aq.view(torch.uint8), bq.view(torch.uint8))
    for x, y in ((asc, bsc), (an, bn), (ad, bd)):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))


def _every_bf16_up_to(amax: float) -> torch.Tensor:
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    kept = every[torch.isfinite(every) & (every.abs() <= amax)]
    kept = torch.cat([kept, torch.tensor([amax, 0.0, -0.0])])  # the tile's scale is amax / 448
    return torch.cat([kept, torch.zeros((-len(kept)) % 64)]).to(torch.bfloat16).view(1, 1, -1, 64)


@pytest.fixture(params=["best", "scalar"])
def isa(request):
    table.pin_native_isa(request.param)
    yield request.param
    table.pin_native_isa("best")


@pytest.mark.parametrize("amax", [448.0, 3.5, 1.0, 1e-3, 2.0 ** -20])
def test_every_finite_bf16_value_quantises_to_torchs_bits(isa, amax: float, monkeypatch) -> None:
    x = _every_bf16_up_to(amax)
    _same(quantise_blocks(x, Precision(), 1), _torch_passes(x, monkeypatch))


@pytest.mark.parametrize("scale", [1e-30, 1e-6, 0.01, 1.0, 300.0, 1e30])
def test_blocks_of_random_kv_at_any_magnitude_are_torchs_bits(isa, scale: float, monkeypatch) -> None:
    g = torch.Generator().manual_seed(int(abs(torch.log10(torch.tensor(scale)))))
    x = (torch.randn((3, 4, 256, 64), generator=g) * scale).to(torch.bfloat16)
    _same(quantise_blocks(x, Precision(), 1), _torch_passes(x, monkeypatch))


def test_zero_nan_and_odd_sized_tiles_are_torchs_bits(isa, monkeypatch) -> None:
    x = torch.randn((2, 3, 7, 5)).to(torch.bfloat16)  # 35 values a tile: the AVX-512 loop's tail too
    x[0, 1] = 0.0
    x[0, 2] = -0.0
    x[1, 0, 3, 3] = float("nan")
    x[1, 2, 0, 0] = float("inf")
    a, b = quantise_blocks(x, Precision(), 1), _torch_passes(x, monkeypatch)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_each_block_is_what_the_codec_stores_for_it_alone() -> None:
    x = torch.randn((2, 4, 256, 64)).to(torch.bfloat16)
    stored, scale, num, den = quantise_blocks(x, Precision(), 1)
    for i in range(2):
        q, s = quantize(x[i], Precision(), 1)
        assert torch.equal(stored[i].view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale[i], s)
        back = dequantize(q, s, torch.float32)
        assert float(num[i]) == float(torch.linalg.vector_norm(back - x[i].float()))


def test_other_dtypes_devices_and_layouts_keep_torchs_passes() -> None:
    mem = quantiser.Loose("cpu")
    assert quantiser.quantise_heads(torch.zeros((1, 2, 16, 8), dtype=torch.float16), mem) is None
    assert quantiser.quantise_heads(torch.zeros((1, 2, 8, 16), dtype=torch.bfloat16).transpose(2, 3), mem) is None
