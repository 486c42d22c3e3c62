"""The engine-loop bench's parts that run without vLLM: its sizes, engines, figures, record names and hook clock."""
from __future__ import annotations

import argparse
import json

import pytest

from bench import engine_loop_bench as bench
from bench.lib.hook_clock import HookClock


def test_sizes_parse_and_refuse_what_is_not_requests_x_tokens() -> None:
    assert bench.parse_sizes("64x2048,256X8192") == [(64, 2048), (256, 8192)]
    for bad in ("64", "64x", "x2048", "0x2048", "64x8"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_sizes(bad)


def test_a_short_run_never_takes_the_full_runs_record() -> None:
    def variant(**changed) -> str | None:
        full = {"quick": False, "variant": None, "window": bench.WINDOW, "model": "kvwarm-tiny",
                "quiet_s": bench.QUIET_S}
        args = argparse.Namespace(**{**full, **changed})
        return bench.record_variant(args, changed.pop("sizes", bench.parse_sizes(bench.SIZES)))

    assert variant() is None
    assert variant(sizes=[(64, 2048)]) == "partial"
    assert variant(window=8) == "partial"
    assert variant(model="kvwarm-ref") == "partial"
    assert variant(quiet_s=0.0) == "partial"
    assert variant(quick=True, sizes=[(64, 2048)]) == "quick"
    assert variant(variant="mine") == "mine"


def test_the_engine_holds_every_request_past_its_prefill_and_window(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    engine, gib = bench.engine_spec(tmp_path, 256, 8192, 128)
    prefill_steps = -(-256 * 8192 // (bench.BATCHED_TOKENS - 256))
    assert engine["max_model_len"] >= 8192 + prefill_steps + 128
    assert engine["hf_overrides"] == {"max_position_embeddings": engine["max_model_len"]}
    assert engine["max_num_seqs"] == 256
    assert gib * 2**30 >= 256 * engine["max_model_len"] * bench.TINY_KV_BYTES_PER_TOKEN
    small, small_gib = bench.engine_spec(tmp_path, 64, 2048, 128)
    assert "hf_overrides" not in small and isinstance(small_gib, int) and small_gib >= 1


def test_figures_are_the_window_steps_in_milliseconds() -> None:
    steps = [{"wall_s": 0.010 + i * 1e-4, "hook_s": 0.001 * (i + 1)} for i in range(100)]
    res = {"steps": steps, "probe": [0.0001] * 98 + [0.004, 0.009], "timer_overhead_s": 1e-6,
           "hooks": {"wait_for_save": {"calls": 100, "seconds": 0.3, "max_s": 0.02},
                     "take_events": {"calls": 100, "seconds": 0.0, "max_s": 0.0}},
           "stats": {"worker": {"written_back_blocks": 4, "estimates": {"x": 1}, "none": 0}}}
    out = bench.summarize(res)
    assert out["steps"] == 100
    assert out["hook_ms_median"] == pytest.approx(50.5)
    assert out["hook_ms_p99"] == pytest.approx(99.0)
    assert out["probe_late_ms_p99"] == pytest.approx(4.0) and out["probe_late_ms_max"] == pytest.approx(9.0)
    assert out["hook_calls_per_step"] == 2 and out["timer_overhead_ms_per_step"] == pytest.approx(0.002)
    assert list(out["hooks_ms_per_step"]) == ["wait_for_save", "take_events"]
    assert out["hooks_ms_longest_call"]["wait_for_save"] == pytest.approx(20.0)
    assert out["connector_stats"] == {"worker": {"written_back_blocks": 4}}


def test_the_hook_clock_counts_each_outer_call_once_even_when_it_raises() -> None:
    clock = HookClock()
    inner = clock.timed("inner", lambda x: x + 1)
    outer = clock.timed("outer", lambda x: inner(x) * 2)

    def fails() -> None:
        raise ValueError("the hook's own error")

    failing = clock.timed("fails", fails)
    assert outer(1) == 4 and inner(1) == 2
    with pytest.raises(ValueError):
        failing()
    snap = clock.snapshot()
    assert all(0 <= v["max_s"] <= v["seconds"] for v in snap["by_hook"].values())
    clock.reset_peaks()
    assert all(v["max_s"] == 0 for v in clock.snapshot()["by_hook"].values())
    assert {k: v["calls"] for k, v in snap["by_hook"].items()} == {"fails": 1, "inner": 1, "outer": 1}
    assert snap["calls"] == 3
    assert snap["total_s"] == pytest.approx(sum(v["seconds"] for v in snap["by_hook"].values()))
    assert outer.__name__ == "<lambda>" and outer.__wrapped__ is not None


def test_repeats_pool_their_windows_and_add_their_hooks() -> None:
    def one(hook_s: float, late: float, max_s: float) -> dict:
        return {"steps": [{"wall_s": 0.01, "hook_s": hook_s}] * 3, "probe": [late] * 5, "prefill_s": 2.0,
                "window_s": 1.0, "startup_s": 1.0, "shutdown_s": 1.0, "timer_overhead_s": 1e-6,
                "threads_cpu_s": {"main": 1.0, "kvwarm-writeback": 0.5},
                "hooks": {"wait_for_save": {"calls": 3, "seconds": 3 * hook_s, "max_s": max_s}}, "stats": {}}

    pooled = bench.pool([one(0.001, 0.0001, 0.002), one(0.003, 0.0002, 0.004)])
    assert len(pooled["steps"]) == 6 and len(pooled["probe"]) == 10
    assert pooled["threads_cpu_s"] == {"main": 2.0, "kvwarm-writeback": 1.0}
    assert pooled["hooks"]["wait_for_save"] == {"calls": 6, "seconds": pytest.approx(0.012), "max_s": 0.004}
    assert pooled["prefill_s"] == 2.0
    assert bench.summarize(pooled)["hook_ms_median"] == pytest.approx(2.0)
    single = one(0.001, 0.0001, 0.002)
    assert bench.pool([single]) is single
