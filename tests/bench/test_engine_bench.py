"""The engine bench's record names: only the full CPU run takes bench/results/engine.json."""
from __future__ import annotations

import argparse

import pytest

from bench import engine_bench
from bench.lib import lmcache_columns as lc

FULL = dict(device="cpu", shape=None, model="kvwarm-ref", prefix=2048, new=64, quick=False, variant=None,
            no_lmcache=False)


def _variant(reps: int = 5, precisions: tuple[str, ...] = ("fp8", "bf16"), **changed) -> str | None:
    return engine_bench.record_variant(argparse.Namespace(**{**FULL, **changed}), reps, list(precisions))


def test_a_short_run_never_takes_the_full_runs_record() -> None:
    assert _variant() is None
    assert _variant(reps=1) == "partial"
    assert _variant(precisions=("fp8",)) == "partial"
    assert _variant(prefix=256) == "partial" and _variant(new=16) == "partial"
    assert _variant(reps=3, precisions=("fp8",), quick=True) == "quick"
    assert _variant(reps=1, variant="mine") == "mine"


def test_a_cuda_run_is_named_gpu() -> None:
    assert _variant(device="cuda", shape="8b", prefix=8192) == "gpu"
    assert _variant(device="cuda", quick=True) == "gpu-quick"


def test_lmcache_runs_are_partial_without_their_columns() -> None:
    assert _variant(no_lmcache=True) == "partial"
    assert _variant(no_lmcache=False) is None


# the LMCache columns' figures (bench/lib/lmcache_columns.py)

LOG = """\x1b[32;20m[2026-12-03 16:22:45,687] LMCache INFO:\x1b[0m Stored 2048 tokens in 0.021 seconds (x.py:1)
[..] LMCache INFO: Retrieved 1792 tokens in 0.102 seconds (lmcache_driven_transfer.py:1101)
[..] LMCache INFO: Prefetch request completed (L1+L2): 7/7 retained keys (0 L1, 7 L2) in 273.1 ms
[..] LMCache INFO: Retrieved 256 tokens in 0.010 seconds
"""


def test_lmcache_log_lines_give_what_it_stored_and_retrieved() -> None:
    found = lc.transfers(LOG)
    assert found == [lc.Transfer("Stored", 2048, 0.021), lc.Transfer("Retrieved", 1792, 0.102),
                     lc.Transfer("Retrieved", 256, 0.010)]
    got = lc.retrieved_GBps(found, bytes_per_token=1000)
    assert (got["retrieves"], got["tokens"]) == (2, 2048)
    assert got["GBps"] == pytest.approx(2048 * 1000 / 0.112 / 1e9)
    assert lc.retrieved_GBps(lc.transfers("nothing here"), 1000)["GBps"] is None


def test_bytes_per_token_counts_each_object_as_one_chunk() -> None:
    assert lc.bytes_per_token([3000, 3000], 256) == {"objects": 2, "bytes": 6000, "bytes_per_token": 6000 / 512}
    assert lc.bytes_per_token([], 256)["bytes_per_token"] is None


def _times(kv: dict, lm: dict) -> dict:
    return {"kvwarm": kv, "lmcache": lm}


def test_the_table_pairs_repeats_and_the_targets_need_both_to_hit() -> None:
    ttft = _times({"cold": [2.0, 4.0], "restart": [0.2, 0.4], "replacement": [0.3, 0.3], "announced": [0.1, 0.1]},
                  {"cold": [2.0, 2.0], "restart": [0.4, 0.4], "replacement": [0.2, 0.2], "announced": [2.0, 2.0]})
    full, none = [2048, 2048], [0, 0]
    cached = _times({"cold": none, "restart": full, "replacement": full, "announced": full},
                    {"cold": none, "restart": full, "replacement": [2048, 0], "announced": none})
    rows = lc.table(ttft, cached)
    assert rows["restart"]["kvwarm"]["over_cold"] == pytest.approx(0.1)  # per repeat: 0.2/2 and 0.4/4
    assert rows["restart"]["kvwarm_over_lmcache"] == pytest.approx(0.75)  # median of 0.5 and 1.0
    assert rows["restart"]["both_hit"] and not rows["replacement"]["both_hit"] and not rows["cold"]["both_hit"]
    got = lc.targets(rows)
    # LMCache's replacement missed once: that scenario is not compared, though kvwarm is slower there
    assert got["kvwarm_le_lmcache_where_both_hit"] == {"restart": True}
    assert got["kvwarm_le_lmcache_where_both_hit_met"] is True
    assert got["announced_le_0.1x_lmcache_met"] is True  # 0.1 / 2.0
    assert len(lc.lines(rows)) == len(lc.SCENARIOS)


def test_a_target_is_missed_when_kvwarm_is_slower_or_misses_the_announced_prefix() -> None:
    ttft = _times({s: [1.0] for s in lc.SCENARIOS}, {s: [0.5] for s in lc.SCENARIOS})
    cached = _times({s: [256] for s in lc.SCENARIOS}, {s: [256] for s in lc.SCENARIOS})
    got = lc.targets(lc.table(ttft, cached))
    assert got["kvwarm_le_lmcache_where_both_hit_met"] is False
    assert got["announced_le_0.1x_lmcache_met"] is False
    cached["kvwarm"]["announced"] = [0]
    ttft["kvwarm"]["announced"] = [0.01]  # fast, but computed: not the plan's prefix
    assert lc.targets(lc.table(ttft, cached))["announced_le_0.1x_lmcache_met"] is False
    nobody = _times({s: [0] for s in lc.SCENARIOS}, {s: [0] for s in lc.SCENARIOS})
    assert lc.targets(lc.table(ttft, nobody))["kvwarm_le_lmcache_where_both_hit_met"] is False


def test_unpaired_repeats_are_refused() -> None:
    with pytest.raises(ValueError, match="paired"):
        lc.median_ratio([1.0], [1.0, 2.0])
