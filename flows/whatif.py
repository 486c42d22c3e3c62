"""The demo's what-if: a restart and a replacement at the prefill window's end, through ``prefill simulate``'s replay.

The demo's own logs are replayed through the deployment-shaped replay
(:mod:`forecasting.simulate.simulation`: vLLM's prefix cache over kvwarm's node tier over
S3, at the calibrated costs) under ``vllm`` (the engine alone), ``reactive-store``
(write-back and lazy loads), ``restore`` (the last hour's access log replayed at the event)
and ``kvwarm`` (the shipped node agent following the plans the cadence flow makes every
5 minutes from the logs before each plan's time, with the run's off-peak plan's prefill
entries stored at its window's end, and warming a new node from the fleet's memory). :func:`whatif` returns each policy's figures per
event, writes one plot per event, and gives the ``prefill simulate`` command that reruns
the replacement from the logs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

#: vLLM's prefix cache in the what-if, in blocks (a small engine: the sample's prompts are short)
WHATIF_BLOCKS = 256
#: kvwarm's node tier in the what-if, in blocks
WHATIF_NODE_BLOCKS = 1024
#: the policies the demo shows
WHATIF_POLICIES = ("vllm", "reactive-store", "restore", "kvwarm")
#: the what-if's bucket (its "first minute"): the sample's traffic is tens of requests an hour
WHATIF_BUCKET_S = 1800.0


def whatif(requests: pd.DataFrame, tokenizer: Any, plan_path: Path, *, logs: str, block_size: int,
           start: pd.Timestamp, end: pd.Timestamp, plot_dir: Path) -> dict[str, Any]:
    """Replay ``requests`` with a restart and a replacement at ``start``, each measured to ``end``.

    Returns, per event (``restart``, ``replacement``), each policy's token hit rate, mean
    TTFT and first-bucket hit rate, with the no-event reference; ``plots`` (one PNG per
    event under ``plot_dir``) and the ``prefill simulate`` command of the replacement.
    """
    from forecasting.ingest.log_trace import trace_from_requests
    from forecasting.ingest.traces import simulation_root
    from forecasting.mining.prefix_tree import tokenize_requests
    from forecasting.planning.cadence import CADENCE_MINUTES
    from forecasting.simulate.kvwarm_policy import planner_for, retain_spec
    from forecasting.simulate.replay import BlockIndex
    from forecasting.simulate.simulation import (
        ENGINE_KV_BYTES_PER_TOKEN,
        Deployment,
        Scenario,
        plot,
        simulate,
        stored_bytes_per_token,
    )
    from store.plan import read_plan

    rows = tokenize_requests(requests, tokenizer)
    trace = trace_from_requests(rows, block_size=block_size, source=logs)
    roots = {str(t): simulation_root(str(t), block_size) for t in set(rows["tenant"])}
    gpu_bytes = WHATIF_BLOCKS * block_size * ENGINE_KV_BYTES_PER_TOKEN
    node_bytes = WHATIF_NODE_BLOCKS * block_size * stored_bytes_per_token(block_size)
    deployment = Deployment.default(block_size, gpu_kv_bytes=gpu_bytes, node_bytes=node_bytes)
    cadence_s = 60.0 * CADENCE_MINUTES
    planner = planner_for(trace, rows, retain_spec(deployment), deployment, cadence_s=cadence_s, roots=roots,
                          base=read_plan(plan_path))
    at = start.timestamp() - trace.start_s
    window = (end - start).total_seconds()
    scenarios = [Scenario(kind, at_s=at, window_s=window, bucket_s=WHATIF_BUCKET_S) for kind in ("restart", "replacement")]
    results = simulate(BlockIndex.build(trace), deployment, scenarios, WHATIF_POLICIES, planner=planner)
    out: dict[str, Any] = {"gpu_blocks": deployment.shape.gpu_blocks, "node_blocks": deployment.shape.node_blocks,
                           "cadence_s": cadence_s, "plots": {}}
    for sc, res in zip(scenarios, results):
        out[sc.kind] = {r.policy: {"hit_rate": r.hit_rate, "ttft_mean_ms": 1e3 * r.ttft_mean_s,
                                   "first_bucket_hit_rate": r.first_minute_hit_rate_excl_root,
                                   "prefetched_blocks": r.prefetched_blocks, "prefill_gpu_s": r.prefill_gpu_s,
                                   "warmup_blocks": r.warmup_blocks, "warmup_precision": r.warmup_precision,
                                   "warmup_recall": r.warmup_recall}
                        for r in res.rows}
        out[sc.kind]["no-event"] = {"hit_rate": res.reference["kvwarm"].hit_rate,
                                    "ttft_mean_ms": 1e3 * res.reference["kvwarm"].ttft_mean_s}
        out["plots"][sc.kind] = str(plot(res, plot_dir / f"whatif-{sc.kind}.png",
                                         title=f"{sc.kind} at the prefill window's end (prefill simulate)"))
    out["command"] = (f"prefill simulate --trace {logs} --format logs --block-size {block_size} --gpu-kv-bytes "
                      f"{float(gpu_bytes)!r} --node-bytes {float(node_bytes)!r} --scenario replacement --at {at!r} "
                      f"--window {window!r} --plan {plan_path}")
    return out
