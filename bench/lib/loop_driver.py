"""One vLLM engine stepped with N requests of L tokens each, its steady decode steps measured (engine-loop bench).

Runs INSIDE the engine venv, started by bench/engine_loop_bench.py through
:class:`bench.lib.vllm_engine.EngineProcess`'s way of starting a module (this checkout on ``PYTHONPATH``)::

    .venv-engine/bin/python -m bench.lib.loop_driver SPEC.json RESULT.json

vLLM runs in its one-process mode (as :mod:`bench.lib.vllm_driver`): the engine core, its
scheduler and its worker, and so both connector roles, run in this process, which is the
process the figures are about. Per run:

1. the engine is built (kvwarm's connector timed by :mod:`bench.lib.timed_connector`, another connector
   named by ``class`` and ``module`` as it is, or none);
2. a GIL probe starts (:class:`GilProbe`: a thread that sleeps 1 ms and records how late it wakes);
3. ``requests`` prompts of ``context`` distinct random token ids are added at once, with a
   ``max_tokens`` that outlasts the measurement; the engine is stepped (chunked prefill, then decode);
4. once every request is running and decoding, ``window`` steps are the steady window: per step
   its wall time and the seconds spent in the connector's hooks (the clock's difference around
   the engine core's ``step_fn``); the probe's samples inside the window are kept;
5. the requests are aborted, the engine shut down (write-back drains), the result written.

SPEC (JSON): ``{"engine": {...}, "connector": {"extra": {...}} | null, "requests": N, "context": L,
"window": W, "seed": S, "vocab": V, "timeout_s": T, "quiet_s": Q}``. With ``quiet_s``, between 3 and 4 the
engine is not stepped until the machine's other processes are quiet (:func:`wait_quiet`, at most Q seconds).
RESULT (JSON): ``steps`` (per steady step: ``wall_s``, ``hook_s``), ``probe`` (delays of the window's
samples, seconds), ``hooks`` (per-hook totals over the window), ``threads_cpu_s`` (CPU seconds per thread
name over the window), ``others_cpu_s`` (the other processes' over the window), ``quiet_wait_s``,
``prefill_s``, ``startup_s``, ``stats`` (the connector's, after shutdown), ``timer_overhead_s`` (one
timed call of an empty hook), ``gc`` (Python's collections in the window: count and seconds per
generation), ``error``. With ``$KVWARM_LOOP_PROFILE`` set to a path, the window's main thread is profiled
(cProfile) into ``PATH.<connector class>`` (``PATH.none`` without one).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from array import array
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm: the engine core runs in this process

from bench.lib.machine_idle import machine_cpu, others_cpu_s, wait_quiet

TIMED_CLASS, TIMED_MODULE = "TimedKvwarmConnector", "bench.lib.timed_connector"
PROBE_SLEEP_S = 0.001
#: a path: the window's main thread profiled (cProfile) into PATH.<connector class, or none>
PROFILE_ENV = "KVWARM_LOOP_PROFILE"


class GilProbe:
    """A daemon thread: sleep 1 ms, record how late it woke (``perf_counter`` stamps and delays)."""

    def __init__(self) -> None:
        self.at = array("d")
        self.late = array("d")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def start(self) -> GilProbe:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(PROBE_SLEEP_S)
            t1 = time.perf_counter()
            self.at.append(t1)
            self.late.append(t1 - t0 - PROBE_SLEEP_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def between(self, t0: float, t1: float) -> list[float]:
        return [late for at, late in zip(self.at, self.late) if t0 <= at <= t1]


def threads_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each Python thread of this process, by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        name = "main" if t is threading.main_thread() else t.name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class GcClock:
    """Python's cyclic collections while on: their count and seconds, per generation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.on = False
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0
        import gc

        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.on:
            gen = int(info.get("generation", 0))
            self.count[gen] += 1
            self.seconds[gen] += time.perf_counter() - self._t0


def timer_overhead_s(reps: int = 20000) -> float:
    """Seconds one timed call of an empty hook adds (what the clock itself puts in each hook's figure)."""
    from bench.lib.hook_clock import HookClock

    clock = HookClock()
    hook = clock.timed("noop", lambda: None)
    t0 = time.perf_counter()
    for _ in range(reps):
        hook()
    timed = time.perf_counter() - t0

    def plain() -> None:
        return None

    t0 = time.perf_counter()
    for _ in range(reps):
        plain()
    return max(0.0, (timed - (time.perf_counter() - t0)) / reps)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.lib.vllm_driver import build_llm, connectors, read_stats

    conn = spec.get("connector")
    timed = conn is not None and "class" not in conn  # kvwarm's, timed; another (the empty arm's) as it is
    if timed:
        conn = {**conn, "class": TIMED_CLASS, "module": TIMED_MODULE}
    t0 = time.perf_counter()
    llm = build_llm({"engine": spec["engine"], "connector": conn})
    result["startup_s"] = time.perf_counter() - t0
    clock = None
    if timed:
        from bench.lib.timed_connector import CLOCK as clock
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    sched = core.scheduler
    n, length, window = int(spec["requests"]), int(spec["context"]), int(spec["window"])
    ids = prompts(n, length, int(spec["vocab"]), int(spec.get("seed", 0)))
    max_tokens = int(spec["engine"]["max_model_len"]) - length
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    steady: list[dict[str, float]] = []
    state = {"steady": False}
    plain_step = core.step_fn

    def step_fn() -> Any:
        state["steady"] = _all_decoding(sched, n)
        h0 = clock.total_s if clock is not None else 0.0
        t = time.perf_counter()
        out = plain_step()
        wall = time.perf_counter() - t
        if state["steady"]:
            steady.append({"t0": t, "wall_s": wall, "hook_s": (clock.total_s - h0) if clock is not None else 0.0})
        return out

    core.step_fn = step_fn
    probe = GilProbe().start()
    collections = GcClock()
    t_add = time.perf_counter()
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), params)
    deadline = t_add + float(spec.get("timeout_s", 1800))
    hooks0 = cpu0 = None
    t_window = None
    while len(steady) < window:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(steady)} of {window} steady steps after {spec.get('timeout_s')} s")
        if not engine.has_unfinished_requests():
            raise RuntimeError("every request finished before the window: raise max_model_len")
        if hooks0 is None and len(steady) == 0 and _all_decoding(sched, n):
            result["prefill_s"] = time.perf_counter() - t_add
            result["quiet_wait_s"] = wait_quiet(float(spec.get("quiet_s", 0.0))) if spec.get("quiet_s") else 0.0
            hooks0 = clock.snapshot() if clock is not None else None
            if clock is not None:
                clock.reset_peaks()
            cpu0 = threads_cpu()
            machine0 = machine_cpu()
            collections.on = True
            if os.environ.get(PROFILE_ENV):
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t_window = time.perf_counter()
        engine.step()
    t_end = time.perf_counter()
    cpu1 = threads_cpu()
    collections.on = False
    if os.environ.get(PROFILE_ENV) and t_window is not None:
        prof.disable()
        prof.dump_stats(f"{os.environ[PROFILE_ENV]}.{'none' if conn is None else conn['class']}")
    if t_window is not None:
        result["others_cpu_s"] = round(others_cpu_s(machine0, machine_cpu()), 3)
        result["gc"] = {"collections": collections.count, "seconds": [round(x, 4) for x in collections.seconds]}
    hooks1 = clock.snapshot() if clock is not None else None
    result["window_s"] = t_end - (t_window or t_end)
    result["probe"] = probe.between(t_window or t_end, t_end)
    result["probe_all_n"] = len(probe.late)
    probe.stop()
    result["steps"] = [{"wall_s": s["wall_s"], "hook_s": s["hook_s"]} for s in steady]
    result["threads_cpu_s"] = {k: round(v - (cpu0 or {}).get(k, 0.0), 3) for k, v in cpu1.items()}
    if hooks0 is not None and hooks1 is not None:
        result["hooks"] = {k: {"calls": v["calls"] - hooks0["by_hook"].get(k, {}).get("calls", 0),
                               "seconds": v["seconds"] - hooks0["by_hook"].get(k, {}).get("seconds", 0.0),
                               "max_s": v["max_s"]}
                           for k, v in hooks1["by_hook"].items()}
    core.step_fn = plain_step
    engine.abort_request([f"r{i}" for i in range(n)])
    while engine.has_unfinished_requests():
        engine.step()
    conns = connectors(llm)
    t0 = time.perf_counter()
    engine.engine_core.shutdown()  # the worker role drains its write-back queue here
    result["shutdown_s"] = time.perf_counter() - t0
    result["stats"] = read_stats(conns)


def _all_decoding(sched: Any, n: int) -> bool:
    running = sched.running
    return (not sched.waiting and len(running) == n
            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running))


def main(spec_path: str, result_path: str) -> int:
    from bench.lib.driver_io import drive

    return drive(run, spec_path, result_path, {"error": None, "timer_overhead_s": timer_overhead_s()})


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
