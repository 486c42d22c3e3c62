"""The cost decision: load only what beats recomputing, by estimates that follow this engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from store.cost import PrefillCost
from store.engines.vllm.costs import CPU_SLOWDOWN, DEFAULT_LOAD, CostModel, default_prefill, model_work
from store.engines.vllm.planning import stored_block_bytes
from store.engines.vllm.stats import Counters, labelled, merge, reduce
from store.format.precision import Precision

LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=14336, vocab_size=128256)
REPO = Path(__file__).resolve().parents[4]


def test_the_default_is_the_h200_fit_for_an_8b_and_scales_with_the_work_per_token() -> None:
    fit = json.loads((REPO / "bench" / "calibration" / "prefill-h200-8b.json").read_text())
    eight = default_prefill(LLAMA_8B, cpu=False)
    rate = fit["by_tokens"]["2048"]["prefill"]["forward_tokens_per_s"]
    assert CostModel(eight).prefill_seconds(2048) == pytest.approx(2048 / rate, rel=0.05)
    tiny = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=384, vocab_size=4096)
    small = default_prefill(tiny, cpu=False)
    assert small.s_per_token / eight.s_per_token == pytest.approx(model_work(tiny)[0] / model_work(LLAMA_8B)[0])
    assert small.s_per_token_pair < eight.s_per_token_pair
    assert default_prefill(tiny, cpu=True).s_per_token == pytest.approx(small.s_per_token * CPU_SLOWDOWN)


def test_worth_loading_compares_load_and_prefill_and_follows_measurements() -> None:
    m = CostModel(PrefillCost(1e-3, 0.0))  # 1,000 tokens/s
    nbytes = 1 << 20
    default = DEFAULT_LOAD["nvme"]
    assert m.load_seconds("nvme", nbytes, 4) == pytest.approx(nbytes / default.bytes_per_s + 4 * default.s_per_file)
    assert m.worth_loading("nvme", cached_tokens=0, hit_tokens=256, nbytes=nbytes, files=1)
    assert not m.worth_loading("nvme", cached_tokens=0, hit_tokens=0, nbytes=nbytes, files=1)
    m.observe_load("nvme", nbytes, seconds=1.0)  # a very slow disk, measured
    assert not m.worth_loading("nvme", cached_tokens=0, hit_tokens=256, nbytes=nbytes, files=1)
    m.observe_prefill(tokens=10, seconds=100.0)  # and a slower engine
    assert m.worth_loading("nvme", cached_tokens=0, hit_tokens=256, nbytes=nbytes, files=1)
    assert CostModel(PrefillCost(1e-3, 0.0), tokens_per_s=1e9).as_dict()["prefill_rate_source"] == "configured"


def test_attention_makes_tokens_after_a_long_context_dearer() -> None:
    m = CostModel(PrefillCost(1e-5, 1e-9))
    assert m.prefill_seconds(8192, 8192 - 256) > m.prefill_seconds(256)


def test_stored_block_bytes_follow_the_precision() -> None:
    fp8 = stored_block_bytes(Precision(keep_layers=(0,)), layers=4, kv_heads=2, head_dim=32, kv_block=256)
    bf16 = stored_block_bytes(Precision("bf16"), layers=4, kv_heads=2, head_dim=32, kv_block=256)
    assert fp8 < bf16 and bf16 - 4096 == 4 * 2 * 2 * 256 * 32 * 2  # the payload and a header


def test_counters_take_an_interval_and_keep_totals() -> None:
    c = Counters()
    c.add("lookups")
    c.add("misses", reason="absent")
    c.sample(0.5)
    first = c.take()
    assert first == {"lookups": 1, "misses:absent": 1, "load_latencies": [0.5]}
    assert c.take() == {} and c.totals() == {"lookups": 1, "misses:absent": 1}
    both = merge(dict(first), {"lookups": 2, "load_latencies": [0.1]})
    assert both["lookups"] == 3 and reduce(both)["load_seconds_p50"] == 0.5 and "load_latencies" not in reduce(both)
    assert labelled(both, "misses") == {"absent": 1}
