"""The engine bench's record names: only the full CPU run takes bench/results/engine.json."""
from __future__ import annotations

import argparse

from bench import engine_bench

FULL = dict(device="cpu", shape=None, model="kvwarm-ref", prefix=2048, new=64, quick=False, variant=None)


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
