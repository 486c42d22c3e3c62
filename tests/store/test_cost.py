"""The one prefill cost model and the load cost beside it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from store.cost import LoadCost, PrefillCost, load_beats_prefill

CALIBRATION = Path(__file__).resolve().parents[2] / "bench" / "calibration" / "prefill-h200-8b.json"


def test_prefill_is_linear_tokens_plus_causal_attention_pairs() -> None:
    cost = PrefillCost(s_per_token=1e-3, s_per_token_pair=1e-6)
    assert cost.seconds(0) == 0.0
    assert cost.seconds(100) == pytest.approx(0.1 + 1e-6 * 100 * 101 / 2)
    # The uncached rest of a prompt: its own tokens, attending to the cached ones as well.
    assert cost.seconds(100, 40) == pytest.approx(60e-3 + 1e-6 * (100 * 101 / 2 - 40 * 41 / 2))
    assert cost.seconds(100, 40) + cost.seconds(40) == pytest.approx(cost.seconds(100))
    # Elementwise over arrays, ints included (no overflow of n * (n + 1)).
    n = np.array([0, 100, 3_000_000_000])
    assert cost.seconds(n).tolist() == pytest.approx([cost.seconds(float(x)) for x in n])
    with pytest.raises(ValueError, match="s_per_token must be"):
        PrefillCost(s_per_token=-1.0)
    with pytest.raises(ValueError, match="s_per_token_pair must be"):
        PrefillCost(s_per_token_pair=float("nan"))


def test_a_measured_rate_is_linear_or_keeps_the_shape() -> None:
    linear = PrefillCost.from_rate(200.0)
    assert linear.seconds(4656) == pytest.approx(4656 / 200.0) and linear.s_per_token_pair == 0.0
    h200 = PrefillCost()
    slow = h200.scaled(1000.0)
    assert slow.s_per_token == pytest.approx(1e-3)
    # Same shape: every length takes the same multiple of the H200's time.
    ratio = slow.seconds(np.array([16.0, 2048.0, 65536.0])) / h200.seconds(np.array([16.0, 2048.0, 65536.0]))
    assert ratio == pytest.approx(np.full(3, 1e-3 / h200.s_per_token))
    for bad in (0.0, -5.0, float("inf")):
        with pytest.raises(ValueError, match="tokens_per_s"):
            PrefillCost.from_rate(bad)
        with pytest.raises(ValueError, match="tokens_per_s"):
            h200.scaled(bad)
    with pytest.raises(ValueError, match="no linear term"):
        PrefillCost(0.0, 1e-9).scaled(100.0)


def test_the_model_is_fitted_to_the_prefill_bench() -> None:
    # Exact on lengths generated from a model: t = a n + b n (n + 1) / 2.
    truth = PrefillCost(2e-5, 1e-9)
    fitted = PrefillCost.fit([(n, truth.seconds(n)) for n in (1024, 4096, 16384)])
    assert fitted.s_per_token == pytest.approx(2e-5) and fitted.s_per_token_pair == pytest.approx(1e-9)
    # One length cannot separate the terms: all of it goes to the linear one.
    assert PrefillCost.fit([(1000, 0.05)]) == PrefillCost(5e-5, 0.0)
    # Time per token falling with length would need a negative attention term: linear only.
    assert PrefillCost.fit([(1000, 0.05), (4000, 0.1)]).s_per_token_pair == 0.0
    with pytest.raises(ValueError, match="all positive"):
        PrefillCost.fit([(0, 1.0)])
    # The defaults are the fit of the H200 run that ships with the bench.
    h200 = PrefillCost.from_prefill_bench(json.loads(CALIBRATION.read_text()))
    assert h200.s_per_token == pytest.approx(PrefillCost().s_per_token, rel=1e-3)
    assert h200.s_per_token_pair == pytest.approx(PrefillCost().s_per_token_pair, rel=1e-3)
    assert 8192 / h200.seconds(8192) == pytest.approx(31298, rel=1e-3)
    with pytest.raises(ValueError, match="no by_tokens figures"):
        PrefillCost.from_prefill_bench({"prefill": {"forward_tokens_per_s": 400.0}})
    with pytest.raises(ValueError, match="not a prefill benchmark result"):
        PrefillCost.from_prefill_bench({"by_tokens": {"2048": {"prefill": {}}}})


def test_loading_costs_bytes_at_the_tier_throughput_plus_a_latency_per_file() -> None:
    nvme = LoadCost(bytes_per_s=2e9, s_per_file=1e-4)
    assert nvme.seconds(4e9, files=100) == pytest.approx(2.0 + 0.01)
    assert nvme.seconds(np.array([0.0, 2e9]), np.array([0, 1])).tolist() == pytest.approx([0.0, 1.0001])
    with pytest.raises(ValueError, match="bytes_per_s must be"):
        LoadCost(bytes_per_s=0.0)
    with pytest.raises(ValueError, match="s_per_file must be"):
        LoadCost(bytes_per_s=1.0, s_per_file=-1.0)


def test_a_hit_is_worth_loading_only_when_it_beats_recomputing_it() -> None:
    prefill = PrefillCost(1e-4, 0.0)  # 10,000 tokens/s
    hit = {"hit_tokens": 1000, "n_bytes": 1e8, "files": 10}  # 0.1 s of prefill
    assert load_beats_prefill(prefill, LoadCost(2e9, 1e-3), cached_tokens=0, **hit)  # 0.05 + 0.01 s
    assert not load_beats_prefill(prefill, LoadCost(5e8, 1e-3), cached_tokens=0, **hit)  # 0.2 + 0.01 s
    # Behind a long cached context the same tokens cost more to prefill (they attend to it):
    # a load too slow at the start of a prompt beats recomputing them there.
    attention = PrefillCost(1e-4, 1e-8)
    slow = LoadCost(5e8, 1e-3)
    assert not load_beats_prefill(attention, slow, cached_tokens=0, **hit)
    assert load_beats_prefill(attention, slow, cached_tokens=20_000, **hit)


def test_a_load_cost_is_fitted_to_measured_reads() -> None:
    truth = LoadCost(bytes_per_s=250e6, s_per_file=0.01)
    points = [(b, float(truth.seconds(b))) for b in (1e6, 16e6, 256e6)]
    fitted = LoadCost.fit(points)
    assert fitted.bytes_per_s == pytest.approx(250e6) and fitted.s_per_file == pytest.approx(0.01)
    one = LoadCost.fit([(538509120, 0.0721)])  # one size: all of it is throughput
    assert one.s_per_file == 0.0 and one.seconds(538509120) == pytest.approx(0.0721)
    with pytest.raises(ValueError, match="all positive"):
        LoadCost.fit([(1e6, 0.0)])
