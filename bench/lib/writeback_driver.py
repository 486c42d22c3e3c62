"""One vLLM engine kept saturated with distinct prompts for a while, kvwarm writing back (write-back bench).

Runs INSIDE the engine venv, started by bench/writeback_bench.py through
:class:`bench.lib.vllm_engine.EngineProcess` (this checkout on ``PYTHONPATH``)::

    .venv-engine/bin/python -m bench.lib.writeback_driver SPEC.json RESULT.json

vLLM runs in its one-process mode (as :mod:`bench.lib.vllm_driver`): the engine core, its scheduler
and its worker, and so both connector roles and write-back's threads, run in this process. Per run:

1. the engine is built with kvwarm's shipped ``KvwarmConnector`` (the spec's connector config);
2. the burst: for ``seconds``, the engine always holds ``depth`` unfinished requests, each a new prompt
   of ``prompt_tokens`` random token ids (``max_tokens`` 1), so it prefills back to back; then no more
   are added and the engine runs until every request is done (the burst's end);
3. ``RESULT.burst.json`` says what the burst did (requests, prompt tokens, its start and end on the
   wall clock, the connector's counters then) and ``RESULT.drain.reached`` is written; the engine
   idles while write-back's threads go on writing and uploading, the counters sampled every
   ``sample_s``, until the bench writes ``RESULT.drain.go`` (it has watched S3 fill meanwhile);
4. the engine is shut down (write-back drains what is left) and the result written.

SPEC (JSON): ``{"engine": {...}, "connector": {"extra": {...}}, "seconds": S, "prompt_tokens": P,
"depth": D, "vocab": V, "seed": N, "sample_s": X, "drain_timeout_s": T}``.
RESULT (JSON): ``burst`` (as ``RESULT.burst.json``), ``samples`` (wall time and the counters, through
the burst and the drain), ``final_stats`` (each role's, after shutdown), ``startup_s``, ``error``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm: the engine core runs in this process


def burst(llm: Any, conns: dict[str, Any], spec: dict[str, Any], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Keep ``depth`` requests in the engine for ``seconds``, then run it dry; what it prefilled."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.lib.vllm_driver import read_stats
    from bench.lib.writeback_store import counters

    engine = llm.llm_engine
    n_tokens, depth = int(spec["prompt_tokens"]), int(spec["depth"])
    gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    vocab = int(spec["vocab"])
    params = SamplingParams(temperature=0.0, max_tokens=1, min_tokens=1, ignore_eos=True)
    sample_s = float(spec.get("sample_s", 1.0))
    added = finished = steps = 0
    t0 = time.time()
    stop_at = t0 + float(spec["seconds"])
    next_sample = t0
    while True:
        now = time.time()
        if now >= next_sample:
            samples.append({"t": now, "phase": "burst", "counters": counters(read_stats(conns))})
            next_sample = now + sample_s
        if now < stop_at:
            while added - finished < depth:
                ids = torch.randint(1, vocab, (n_tokens,), generator=gen).tolist()
                engine.add_request(f"w{added}", TokensPrompt(prompt_token_ids=ids), params)
                added += 1
        elif not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                finished += 1
        steps += 1
    t1 = time.time()
    return {"start": t0, "end": t1, "added_until": stop_at, "seconds": t1 - t0, "requests": added,
            "finished": finished, "steps": steps, "prompt_tokens": added * n_tokens,
            "counters": counters(read_stats(conns))}


def run(spec: dict[str, Any], result: dict[str, Any], result_path: str) -> None:
    from bench.lib.vllm_driver import build_llm, connectors, read_stats
    from bench.lib.writeback_store import counters

    t0 = time.perf_counter()
    llm = build_llm({"engine": spec["engine"], "connector": spec["connector"]})
    result["startup_s"] = time.perf_counter() - t0
    conns = connectors(llm)
    result["roles"] = sorted(conns)
    samples: list[dict[str, Any]] = []
    result["samples"] = samples
    result["burst"] = b = burst(llm, conns, spec, samples)
    with open(result_path + ".burst.json.tmp", "w") as f:
        json.dump(b, f)
    os.replace(result_path + ".burst.json.tmp", result_path + ".burst.json")
    open(f"{result_path}.drain.reached", "w").close()
    deadline = time.monotonic() + float(spec.get("drain_timeout_s", 1800))
    sample_s = float(spec.get("sample_s", 1.0))
    while not os.path.exists(f"{result_path}.drain.go"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go after the drain within {spec.get('drain_timeout_s')} s")
        samples.append({"t": time.time(), "phase": "drain", "counters": counters(read_stats(conns))})
        time.sleep(sample_s)
    t0 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()  # the worker role drains its write-back queue here
    result["shutdown_s"] = time.perf_counter() - t0
    result["final_stats"] = read_stats(conns)


def main(spec_path: str, result_path: str) -> int:
    from bench.lib.driver_io import drive

    return drive(lambda spec, result: run(spec, result, result_path), spec_path, result_path, {"error": None})


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
