"""The live replay's engines (bench/live_replay.py): driver specs and steps, kvwarm's node config,
the calibration requests, and what the engines report.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.bench_node import node_section
from bench.lib.live_figures import BLOCK, BUCKET, CALIBRATE, ENGINE_ENV, WARMUP_TOKENS


def engine_spec(model_dir: Path, max_len: int, steps: list[dict[str, Any]],
                connector: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"engine": {"model": str(model_dir), "max_model_len": max_len,
                                       "enable_prefix_caching": True}, "steps": steps}
    if connector is not None:
        spec["connector"] = connector
    return spec


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng([977, seed]).integers(1, vocab, n).tolist()


def warmup_step(vocab: int, seed: int) -> dict[str, Any]:
    return {"name": "warmup", "requests": [{"ids": random_prompt(WARMUP_TOKENS, vocab, seed), "max_tokens": 1}]}


def calibrate_requests(vocab: int, salt: int) -> list[dict[str, Any]]:
    """Cold prompts of :data:`CALIBRATE` lengths (two each), distinct from the trace's and per engine (``salt``)."""
    return [{"ids": random_prompt(n, vocab, 100_000 * salt + 10 * n + k), "max_tokens": 1}
            for n in CALIBRATE for k in range(2)]


def calibrate_step(vocab: int, salt: int) -> dict[str, Any]:
    return {"name": "calibrate", "requests": calibrate_requests(vocab, salt)}


def calibration_points(run: Any) -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of an engine's cold calibration requests."""
    step = next(s for s in run.result["steps"] if s["name"] == "calibrate")
    calls = sorted(step["calls"], key=lambda c: c["index"])
    lengths = [n for n in CALIBRATE for _ in range(2)]
    return [(n, c["seconds"]) for n, c in zip(lengths, calls)]


def replay_step(name: str, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "replay": reqs}


def kvwarm_config(path: Path, *, nvme: Path, endpoint: str, node_id: str, speedup: float) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "kv_cache": {"block_size": BLOCK},
        "store": {"url": f"file://{nvme},s3://{BUCKET}/kvwarm",
                  "s3": {"endpoint_url": endpoint, "access_key_env": "KVWARM_BENCH_S3_KEY",
                         "secret_key_env": "KVWARM_BENCH_S3_SECRET"}},
        "loader": {"pool_dir": str(path.parent / f"pool-{node_id}"), "pool_bytes": "2GiB"},
        # the trace's clock runs --speedup times faster: the node's periods shrink with it
        "fleet_memory": {"node_id": node_id, "flush_s": max(0.5, 30.0 / speedup)},
        "agent": {"poll_s": max(0.5, 30.0 / speedup)},
        "node": node_section(path.parent / f"node-{node_id}"),
    }))
    return path


def run_phases(name: str, work: Path, specs: list[dict[str, Any]], *, python: Path | None = None,
               between: Any = None, timeout_s: float = 900) -> list[Any]:
    """Run each spec's engine to its end, one after the other (``between(i)`` after engine ``i``)."""
    from bench.lib.vllm_engine import run_engine

    runs = []
    for i, spec in enumerate(specs):
        kw = {"python": python} if python is not None else {}
        t0 = time.perf_counter()
        run = run_engine(spec, work / f"{name}-{i}", timeout_s=timeout_s, env=ENGINE_ENV, **kw)
        print(f"  {name} engine {i}: {time.perf_counter() - t0:.0f} s (start {run.result['startup_s']:.1f} s)",
              flush=True)
        runs.append(run)
        if between is not None:
            between(i)
    return runs


def replay_records(run: Any, step: str) -> list[dict[str, Any]]:
    return run.step(step)["requests"]


# ---------------------------------------------------------------- plan and simulation


def stored_bytes_per_token(model_dir: Path, config_path: Path) -> float:
    from store.config import load_config
    from store.format.header import Layout
    from store.format.payload import kv_bytes_per_token

    geo = json.loads((model_dir / "config.json").read_text())
    dim = geo.get("head_dim") or geo["hidden_size"] // geo["num_attention_heads"]
    layout = Layout(num_layers=geo["num_hidden_layers"], num_kv_heads=geo["num_key_value_heads"], head_dim=dim,
                    block_size=BLOCK)
    return kv_bytes_per_token(layout, load_config(config_path).kv_cache.precision())
