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
2. the ``warmup`` requests run (not measured);
3. each of ``rounds`` waits for its turn (barrier ``round<j>``, :func:`bench.lib.driver_io.barrier`: the
   bench runs another engine's round meanwhile), then runs closed loop: ``concurrency`` requests are in
   the engine at once, and each one that finishes is replaced by the next prompt at once. A request's
   time to first token runs from its ``add_request`` to the return of the engine step that produced
   its first token (queueing behind the other requests in flight counts, as on a server). With
   kvwarm, the round ends once its write-back has written and uploaded what it queued (``drain_s``),
   so that none of it runs in the other engine's round;
4. at barrier ``end`` the connector's stats are read, the engine is shut down (write-back drains), the
   stats read again.

SPEC (JSON): ``{"engine": {...}, "connector": {"extra": {...}} | null, "max_tokens": M, "node_wait_s": S,
"warmup": {"concurrency": C, "prompts": [[ids]...]}, "rounds": [{"mode": "sequential", "concurrency": 1,
"prompts": [[ids]...]}, ...]}``.
RESULT (JSON): ``startup_s``, ``node_connect_s`` (``None``: no connector, or the node never answered),
``rounds`` (per round: ``mode``, ``ttft_s`` and ``latency_s`` per request in the order added,
``seconds``, ``drain_s``), ``phases`` (per mode, its rounds' requests joined), ``threads_cpu_s`` (CPU
seconds of the busy threads by name, at the end); ``stats`` (the
connector roles' after the phases), ``final_stats`` (after shutdown), ``shutdown_s``, ``error``.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm: the engine core runs in this process

#: the most a round waits for its turn (the other engine's start-up and rounds), and for write-back to drain
BARRIER_S, DRAIN_S = 1800.0, 120.0


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


def run(spec: dict[str, Any], result: dict[str, Any], result_path: str) -> None:
    from bench.lib.driver_io import barrier
    from bench.lib.vllm_driver import build_llm, connectors, read_stats

    t0 = time.perf_counter()
    llm = build_llm({"engine": spec["engine"], "connector": spec.get("connector")})
    result["startup_s"] = time.perf_counter() - t0
    engine = llm.llm_engine
    conns = connectors(llm)
    result["node_connect_s"] = wait_node(conns, float(spec.get("node_wait_s", 60))) if spec.get("connector") else None
    writer = getattr(getattr(conns.get("worker"), "_worker", None), "writer", None)
    max_tokens = int(spec.get("max_tokens", 1))
    warm = spec.get("warmup") or {}
    if warm.get("prompts"):
        result["warmup"] = closed_loop(engine, warm["prompts"], int(warm.get("concurrency", 1)), max_tokens, "warmup")
        result["warmup"]["drain_s"] = drain(writer)
    result["rounds"], result["phases"] = [], {}
    for j, rnd in enumerate(spec["rounds"]):
        barrier(result_path, f"round{j}", timeout_s=BARRIER_S)
        got = closed_loop(engine, rnd["prompts"], int(rnd["concurrency"]), max_tokens, f"r{j}")
        got.update(mode=rnd["mode"], drain_s=drain(writer))
        result["rounds"].append(got)
        phase = result["phases"].setdefault(rnd["mode"], {"ttft_s": [], "latency_s": [], "seconds": 0.0})
        phase["ttft_s"] += got["ttft_s"]
        phase["latency_s"] += got["latency_s"]
        phase["seconds"] += got["seconds"]
    barrier(result_path, "end", timeout_s=BARRIER_S)
    result["threads_cpu_s"] = tasks_cpu()
    result["stats"] = read_stats(conns)
    t0 = time.perf_counter()
    engine.engine_core.shutdown()  # the worker role drains its write-back queue here
    result["shutdown_s"] = time.perf_counter() - t0
    result["final_stats"] = read_stats(conns)


def tasks_cpu() -> dict[str, dict[str, float]]:
    """CPU seconds (user + system) of this process's threads since they started, by name (a Python thread's, else
    the kernel's: OpenMP's workers and vLLM's included), with the niceness: the threads that used 0.5 s or more."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[str, float]] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        seconds = (int(fields[11]) + int(fields[12])) / tick
        if seconds >= 0.5:
            name = names.get(int(task)) or head.split("(", 1)[1]
            slot = out.setdefault(f"{name} (nice {fields[16]})", {"threads": 0, "cpu_s": 0.0})
            slot["threads"] += 1
            slot["cpu_s"] = round(slot["cpu_s"] + seconds, 2)
    return out


def drain(writer: Any) -> float | None:
    """Seconds until kvwarm's write-back has written and uploaded what it queued (``None``: no write-back)."""
    if writer is None:
        return None
    t0 = time.perf_counter()
    writer.drain(DRAIN_S)
    return time.perf_counter() - t0


def main(spec_path: str, result_path: str) -> int:
    from bench.lib.driver_io import drive

    return drive(lambda spec, result: run(spec, result, result_path), spec_path, result_path, {"error": None})


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
