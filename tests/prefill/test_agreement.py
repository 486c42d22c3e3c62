"""The agreement rule on hand-made tensors: the recorded error plus the tolerance, the record trusted up to its dtype's bound."""
from __future__ import annotations

import math

import pytest
import torch

from prefill.agreement import STORAGE_BOUND, TOLERANCE, Tolerance, judge, trusted_error

SHAPE = (2, 16, 8)
FLAT = Tolerance(0.05, 0.0, 0.05)  # the same at every layer: each check below is about one term


def _kv(seed: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)) for _ in range(layers)]


def _off_by(kv, rel: float, seed: int = 9):
    """``kv`` moved by exactly ``rel`` relative L2 in every layer, K and V."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, v in kv:
        pair = []
        for x in (k, v):
            noise = torch.randn(x.shape, generator=g)
            pair.append(x + noise * (rel * x.norm() / noise.norm()))
        out.append(tuple(pair))
    return out


def _recorded(value: float | None, layers: int = 2) -> dict[str, list[float | None]]:
    return {"k_rel_l2": [value] * layers, "v_rel_l2": [value] * layers}


def test_kv_within_the_recorded_error_plus_the_tolerance_agrees_and_beyond_it_differs() -> None:
    ref = _kv(0)
    for rel, agrees in ((0.02 + 0.05 * 0.9, True), (0.02 + 0.05 * 1.1, False)):
        verdict = judge(_off_by(ref, rel), ref, _recorded(0.02), ["fp8_e4m3"] * 2, tolerance=FLAT)
        assert verdict.agrees is agrees
        assert all(c.measured == pytest.approx(rel, rel=1e-4) for c in verdict.checks)
    assert len(verdict.checks) == 4 and {(c.layer, c.kind) for c in verdict.checks} == {(0, "k"), (0, "v"), (1, "k"),
                                                                                        (1, "v")}


def test_one_layer_off_is_enough_to_differ_and_the_reason_names_it() -> None:
    ref = _kv(1)
    stored = [ref[0], (ref[1][0], _off_by(ref, 0.5)[1][1])]  # layer 1's V only
    verdict = judge(stored, ref, _recorded(0.0), ["bf16"] * 2, tolerance=FLAT)
    assert not verdict.agrees and verdict.worst.layer == 1 and verdict.worst.kind == "v"
    assert verdict.reason().startswith("KV differs from the model's recomputation: layer 1 V is 0.5000 (relative L2)")
    assert judge(ref, ref, _recorded(0.0), ["bf16"] * 2).reason() == ""


def test_a_large_recorded_error_buys_no_more_than_its_dtype_can_introduce() -> None:
    ref = _kv(2)
    wrong = _off_by(ref, 0.3)
    for dtype in ("fp8_e4m3", "bf16"):
        verdict = judge(wrong, ref, _recorded(5.0), [dtype] * 2, tolerance=FLAT)
        assert not verdict.agrees
        assert all(c.allowed == pytest.approx(STORAGE_BOUND[dtype] + 0.05) for c in verdict.checks)


@pytest.mark.parametrize("recorded", [None, float("nan"), float("inf"), -1.0])
def test_a_missing_or_impossible_record_counts_as_the_dtypes_bound(recorded) -> None:
    assert trusted_error(recorded, "fp8_e4m3") == 2.0**-4 and trusted_error(recorded, "bf16") == 2.0**-8
    ref = _kv(3)
    assert judge(_off_by(ref, 2.0**-4 + 0.025), ref, _recorded(recorded), ["fp8_e4m3"] * 2, tolerance=FLAT).agrees


def test_a_short_record_and_a_nan_distance() -> None:
    ref = _kv(4)
    short = {"k_rel_l2": [0.0], "v_rel_l2": []}  # layer 1 K and both V: no record, the bound stands in
    verdict = judge(ref, ref, short, ["bf16"] * 2)
    assert verdict.agrees and [c.recorded for c in verdict.checks] == [0.0, None, None, None]
    broken = [(ref[0][0], ref[0][1] * math.nan), ref[1]]
    assert not judge(broken, ref, _recorded(0.0), ["bf16"] * 2).agrees  # NaN never agrees


def test_the_tolerance_grows_with_depth_up_to_its_cap_and_scales() -> None:
    assert [TOLERANCE.at(layer) for layer in (0, 1, 11)] == pytest.approx([0.03, 0.038, 0.118])
    assert TOLERANCE.at(100) == TOLERANCE.cap == 0.25
    ref = _kv(6, layers=12)
    verdict = judge(_off_by(ref, 0.058), ref, _recorded(0.0, layers=12), ["fp32"] * 12)  # over until layer 4
    assert [c.agrees for c in verdict.checks if c.kind == "k"] == [False] * 4 + [True] * 8
    assert TOLERANCE.scaled(2).at(1) == pytest.approx(0.076)
    check = next(c for c in verdict.checks if c.layer == 10)
    assert check.tolerance_used == pytest.approx(0.058 / TOLERANCE.at(10), rel=1e-3)


def test_bad_arguments_are_refused() -> None:
    ref = _kv(5)
    for bad in (dict(base=-0.1, per_layer=0.0, cap=0.1), dict(base=0.1, per_layer=0.0, cap=1.0)):
        with pytest.raises(ValueError, match="must be a relative error in \\[0, 1\\)"):
            Tolerance(**bad)
    with pytest.raises(ValueError, match="must be a relative error"):
        TOLERANCE.scaled(4.0)  # its cap would reach 1
    with pytest.raises(ValueError, match="2 stored layers, 1 recomputed"):
        judge(ref, ref[:1], _recorded(0.0), ["bf16"] * 2)
    with pytest.raises(ValueError, match="stored K is"):
        judge([(k[:, :8], v) for k, v in ref], ref, _recorded(0.0), ["bf16"] * 2)
