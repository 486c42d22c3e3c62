"""One vLLM engine given prompts that nothing holds, closed loop, its time to first token per request (miss-path bench).

Runs INSIDE the engine venv, started by bench/miss_path_bench.py through
:class:`bench.lib.vllm_engine.EngineProcess`'s way of starting a module (this checkout on ``PYTHONPATH``)::

    .venv-engine/bin/python -m bench.lib.miss_driver SPEC.json RESULT.json

vLLM runs in its one-process mode (:func:`bench.lib.vllm_driver.build_llm`): the engine core, its
scheduler and worker, and kvwarm's connector roles with their threads, all in this process, with
the engine stepped here as a server's engine loop steps it. Per run:

1. the engine is built (kvwarm's ``KvwarmConnector`` or none); with kvwarm, the scheduler role's
   node client is given up to ``node_wait_s`` to connect to the node process (which it starts
   itself when none answers: ``node.autostart``), so that the measured requests meet a running node;
2. the ``warmup`` phase runs (its requests are not measured);
3. each phase of ``phases`` runs closed loop: ``concurrency`` requests are in the engine at once,
   and each one that finishes is replaced by the next prompt at once. A request's time to first
   token runs from its ``add_request`` to the return of the engine step that produced its first
   token (queueing behind the other requests in flight counts, as on a server);
4. the connector's stats are read, the engine is shut down (write-back drains), the stats read again.

SPEC (JSON): ``{"engine": {...}, "connector": {"extra": {...}} | null, "max_tokens": M, "node_wait_s": S,
"warmup": {"concurrency": C, "prompts": [[ids]...]}, "phases": [{"name": "sequential", "concurrency": 1,
"prompts": [[ids]...]}, ...]}``.
RESULT (JSON): ``startup_s``, ``node_connect_s`` (``None``: no connector, or the node never answered),
per phase ``ttft_s`` and ``latency_s`` (per request, in the order added) and ``seconds``; ``stats`` (the
connector roles' after the phases), ``final_stats`` (after shutdown), ``shutdown_s``, ``error``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm: the engine core runs in this process


def closed_loop(engine: Any, prompts: list[list[int]], concurrency: int, max_tokens: int, tag: str) -> dict[str, Any]:
    """Run ``prompts`` with ``concurrency`` in flight; each request's TTFT and latency (seconds), in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    done: dict[str, float] = {}
    nxt, inflight = 0, 0
    t_start = time.perf_counter()
    while nxt < len(prompts) or inflight:
        while nxt < len(prompts) and inflight < concurrency:
            rid = f"{tag}-{nxt}"
            added[rid] = time.perf_counter()
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[nxt]), params)
            nxt += 1
            inflight += 1
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            rid = str(o.request_id)
            if rid not in added:
                continue
            if rid not in ttft and o.outputs and o.outputs[0].token_ids:
                ttft[rid] = now - added[rid]
            if o.finished and rid not in done:
                done[rid] = now - added[rid]
                inflight -= 1
                reason = o.outputs[0].finish_reason if o.outputs else None
                if reason not in ("length", "stop") or rid not in ttft:
                    raise RuntimeError(f"request {rid} ended with finish_reason={reason!r} and no first token"
                                       if rid not in ttft else f"request {rid} ended with finish_reason={reason!r}")
    order = [f"{tag}-{i}" for i in range(len(prompts))]
    return {"concurrency": concurrency, "ttft_s": [ttft[r] for r in order], "latency_s": [done[r] for r in order],
            "seconds": time.perf_counter() - t_start}


def wait_node(conns: dict[str, Any], timeout_s: float) -> float | None:
    """Seconds until the scheduler role's node client is connected (``None``: no node client, or timed out)."""
    role = getattr(conns.get("scheduler"), "_scheduler", None)
    client = getattr(role, "node", None)
    if client is None:
        return None
    t0 = time.perf_counter()
    return time.perf_counter() - t0 if client.wait_connected(timeout_s) else None


def run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    from bench.lib.vllm_driver import build_llm, connectors, read_stats

    t0 = time.perf_counter()
    llm = build_llm({"engine": spec["engine"], "connector": spec.get("connector")})
    result["startup_s"] = time.perf_counter() - t0
    engine = llm.llm_engine
    conns = connectors(llm)
    result["node_connect_s"] = wait_node(conns, float(spec.get("node_wait_s", 60))) if spec.get("connector") else None
    max_tokens = int(spec.get("max_tokens", 1))
    warm = spec.get("warmup") or {}
    if warm.get("prompts"):
        result["warmup"] = closed_loop(engine, warm["prompts"], int(warm.get("concurrency", 1)), max_tokens, "warmup")
    result["phases"] = {}
    for phase in spec["phases"]:
        result["phases"][phase["name"]] = closed_loop(engine, phase["prompts"], int(phase["concurrency"]), max_tokens,
                                                      phase["name"])
    result["stats"] = read_stats(conns)
    t0 = time.perf_counter()
    engine.engine_core.shutdown()  # the worker role drains its write-back queue here
    result["shutdown_s"] = time.perf_counter() - t0
    result["final_stats"] = read_stats(conns)


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict[str, Any] = {"error": None}
    try:
        run(spec, result)
    except BaseException:  # noqa: BLE001 - the result, with the traceback, must still be written
        result["error"] = traceback.format_exc()
        traceback.print_exc()
    finally:
        with open(result_path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(result_path + ".tmp", result_path)
    return 1 if result["error"] else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
