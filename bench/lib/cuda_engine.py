"""vLLM's CUDA settings for the benches and the engine tests: full CUDA graphs and async scheduling, explicitly.

vLLM's defaults on CUDA are ``cudagraph_mode`` ``FULL_AND_PIECEWISE`` and async scheduling on; the benches
name them anyway (``--cudagraph-mode``, ``--async-scheduling``), so a record says what ran and a change of
vLLM's defaults cannot change what a GPU check measures. The engine tests take no flags: a JSON object of
engine arguments in ``$KVWARM_ENGINE_ARGS`` (bench/gpu_check.sh sets it) is the default of every engine
:mod:`bench.lib.vllm_driver` builds, below what a test's spec names (so a test that turns async scheduling
off keeps it off). Only the standard library here: the driver imports this in the engine's venv.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

ENGINE_ARGS_ENV = "KVWARM_ENGINE_ARGS"
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL", "PIECEWISE", "FULL_DECODE_ONLY", "NONE")


def engine_defaults() -> dict[str, Any]:
    """The engine arguments of ``$KVWARM_ENGINE_ARGS`` (a JSON object; ``{}`` when unset).

    Raises:
        ValueError: the variable is not a JSON object.
    """
    raw = os.environ.get(ENGINE_ARGS_ENV, "").strip()
    if not raw:
        return {}
    try:
        got = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"${ENGINE_ARGS_ENV} must be a JSON object of vLLM engine arguments: {exc}") from None
    if not isinstance(got, dict):
        raise ValueError(f"${ENGINE_ARGS_ENV} must be a JSON object of vLLM engine arguments, got {raw!r}")
    return got


def add_cuda_options(p: argparse.ArgumentParser) -> None:
    """``--cudagraph-mode``, ``--async-scheduling`` / ``--no-async-scheduling`` and
    ``--gpu-memory-utilization``, for ``--device cuda``."""
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE", choices=CUDAGRAPH_MODES,
                   help="on CUDA: vLLM's compilation_config.cudagraph_mode (default FULL_AND_PIECEWISE, vLLM's own)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA: vLLM's async scheduling (default on, vLLM's own)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on CUDA: vLLM's share of the GPU (default vLLM's 0.9); kvwarm's "
                        "loader.device_scratch_bytes comes out of the rest (docs/guides/engines.md)")


def cuda_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments :func:`add_cuda_options` asked for: bf16, CUDA graphs (not eager), the graph mode
    and async scheduling named."""
    out: dict[str, Any] = {"dtype": "bfloat16", "enforce_eager": False,
                           "compilation_config": {"cudagraph_mode": args.cudagraph_mode},
                           "async_scheduling": bool(args.async_scheduling)}
    if args.gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = args.gpu_memory_utilization
    return out
