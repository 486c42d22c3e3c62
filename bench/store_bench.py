"""Store benchmark: the NVMe and S3 tiers against plain file and raw s3fs I/O, side by side.

For each snapshot size (MiB of FP8 payload) it measures, in one process and one run:

* ``nvme_write``: ``LocalTier.write(name, encoded, expires_at=...)`` (Arrow IPC
  serialisation, fsync, rename, directory fsync, index transactions) against a durable
  plain write of the same bytes: ``open(path, 'wb').write(bytes)`` + flush + fsync + close.
* ``nvme_read``: ``LocalTier.read`` + ``read_snapshot`` (every part's xxh3 checked), then
  touching every payload byte (xxh3 over each part) and closing, against
  ``open(path, 'rb').read()`` of the same file followed by the same touch. Both from
  the page cache.
* ``s3_put``: ``S3Tier.write(name, encoded)`` (serialise to bytes + PUT) against
  ``fs.pipe(path, same bytes)``, on one SeaweedFS server started here on 127.0.0.1.
* ``s3_get``: ``S3Tier.read`` + ``read_snapshot`` + touch, against ``fs.cat`` + touch.

Informational rows (no target): ``nvme_read_readinto`` (ours against ``readinto`` a
reused, already-touched buffer: raw without the cost of fresh memory) and
``nvme_read_cold`` (both after dropping the page cache; needs root, measured last
because dropping the cache disturbs memory for whatever runs next).

Snapshots are real: ``store.format.snapshot.build_snapshot`` (FP8, per-head fp32 scales) of a
Llama-3-8B-shaped layout (32 layers, 8 KV heads, head_dim 128: 128 parts), with the
block size chosen so that the payload is N MiB (16 tokens per MiB) plus 2 KiB of
scales. Quantisation is not timed (it is the prefill job's cost). Each timed write is
handed a new EncodedSnapshot object (same header and buffers), so nothing the store
might cache on it carries over between repetitions.

Each measurement is repeated (7 times up to 64 MiB, 5 times above; ``--reps``), after
one untimed warm-up pair, with ours and raw alternating which goes first. Before every
timed operation, untimed: ``os.sync()``, a GC pass, and touching then freeing twice the
snapshot's size of memory (see ``bench.lib.paired.warm_memory``: on this VM,
re-touching memory freed a few seconds ago costs a host fault per page). Figures are medians; the ratio is
ours/raw throughput (= raw median time / ours median time). The last line of stdout
is one JSON object with every figure and the checks (target: ratio >= 0.9 for
snapshots of 16 MiB and more, for nvme_write, nvme_read, s3_put and s3_get).

Usage::

    .venv/bin/python bench/store_bench.py            # full run (3.5-4.5 min on 2 cores)
    .venv/bin/python bench/store_bench.py --quick    # 1, 16, 64 MiB, 3 reps
    .venv/bin/python bench/store_bench.py --sizes 16,64 --reps 7 --no-s3 --no-cold

The snapshots come from ``bench/lib/store_snapshots.py``, the paired timing from
``bench/lib/paired.py``, the operations against their baselines from ``bench/lib/tier_io.py``;
this script runs them by size and phase and reports.

The object is also written, with the command, commit, date and machine, to
``bench/results/store.json`` (``store-quick.json`` for --quick, ``store-partial.json``
for a subset of sizes or no S3; ``--results DIR`` to write elsewhere).
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.paired import Pair, Timer, summarise  # noqa: E402
from bench.lib.results import Run, add_results_option, variant_of  # noqa: E402
from bench.lib.store_snapshots import fresh_name, make_snapshot  # noqa: E402
from bench.lib.tier_io import (  # noqa: E402
    bench_nvme_read,
    bench_nvme_write,
    bench_s3_get,
    bench_s3_put,
    page_cache_dropper,
)
from store.format.encode import EncodedSnapshot, snapshot_bytes  # noqa: E402
from store.tiers.local import LocalTier  # noqa: E402

DEFAULT_SIZES = (1, 4, 16, 64, 256)
QUICK_SIZES = (1, 16, 64)
TARGET_RATIO = 0.9
TARGET_MIN_MIB = 16
CHECKED_OPS = ("nvme_write", "nvme_read", "s3_put", "s3_get")
ALL_OPS = ("nvme_write", "nvme_read", "nvme_read_readinto", "s3_put", "s3_get", "nvme_read_cold")
LABELS = {
    "nvme_write": "nvme write (durable)",
    "nvme_read": "nvme read (page cache)",
    "nvme_read_readinto": "  info: vs readinto reused buffer",
    "s3_put": "s3 put",
    "s3_get": "s3 get",
    "nvme_read_cold": "  info: nvme read, cold",
}
BUCKET_PREFIX = "kvwarm-bench"


def print_table(results: dict, sizes: list[int]) -> None:
    print()
    print(f"{'operation':<34} {'MiB':>5} {'ours MB/s':>10} {'raw MB/s':>10} {'ratio':>7} {'(min)':>7}  target")
    print("-" * 88)
    for op in ALL_OPS:
        for mib in sizes:
            r = results.get(str(mib), {}).get(op)
            if r is None:
                continue
            if op in CHECKED_OPS and mib >= TARGET_MIN_MIB:
                check = "ok" if r["ratio"] >= TARGET_RATIO else f"MISS (<{TARGET_RATIO})"
            else:
                check = "-"
            print(f"{LABELS[op]:<34} {mib:>5} {r['ours_mb_s']:>10.1f} {r['raw_mb_s']:>10.1f} "
                  f"{r['ratio']:>7.3f} {r['ratio_of_min']:>7.3f}  {check}")
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", help="comma-separated snapshot sizes in MiB (default 1,4,16,64,256)")
    ap.add_argument("--quick", action="store_true", help="sizes 1,16,64 and 3 repetitions")
    ap.add_argument("--reps", type=int, help="repetitions per measurement (default 7, 5 above 64 MiB)")
    ap.add_argument("--dir", help="where the NVMe tier and the raw files go (default: a temp dir under /tmp)")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 tier (no SeaweedFS)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-read rows (which drop the page cache)")
    add_results_option(ap)
    args = ap.parse_args(argv)
    run = Run("store", __file__, sys.argv[1:] if argv is None else argv)

    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else DEFAULT_SIZES)

    def reps_for(mib: int) -> int:
        if args.reps:
            return args.reps
        if args.quick:
            return 3
        return 7 if mib <= 64 else 5

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    results: dict[str, dict] = {str(m): {} for m in sizes}
    snaps: dict[int, tuple[EncodedSnapshot, bytes]] = {}
    for mib in sizes:
        t0 = time.perf_counter()
        snap = make_snapshot(mib)
        blob = snapshot_bytes(snap)  # the exact bytes of the tier's file: the raw baselines use these
        snaps[mib] = (snap, blob)
        print(f"[{mib:>3} MiB] payload {snap.header.payload_nbytes} B, file {len(blob)} B, "
              f"{len(snap.header.parts)} parts, block_size {snap.header.layout.block_size}; "
              f"built in {time.perf_counter() - t0:.1f} s; {reps_for(mib)} reps", flush=True)
    gc.collect()

    timer = Timer()

    def size(mib: int) -> int:
        """Sets how much memory is warmed before each timed operation on this size."""
        timer.warm_bytes = 2 * len(snaps[mib][1])
        return mib

    def record(mib: int, op: str, pair: Pair) -> None:
        r = results[str(mib)][op] = summarise(pair, len(snaps[mib][1]))
        print(f"    {mib:>3} MiB {op:<19} ours {r['ours_mb_s']:>8.1f} MB/s   raw {r['raw_mb_s']:>8.1f} MB/s   "
              f"ratio {r['ratio']:.3f}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="kvwarm-bench-", dir=args.dir))
    rawdir = work / "raw"
    rawdir.mkdir()
    tier = LocalTier(work / "nvme", cap_bytes=64 << 30)
    weed = None
    cold_method = None
    try:
        # Phase 1: NVMe tier, page cache warm.
        print("NVMe tier (page cache) ...", flush=True)
        read_names: dict[int, str] = {}
        for mib in map(size, sizes):
            snap, blob = snaps[mib]
            record(mib, "nvme_write", bench_nvme_write(timer, tier, rawdir, snap, blob, reps_for(mib)))
            name = read_names[mib] = fresh_name("r")
            tier.write(name, snap, expires_at=snap.header.expires_at)
            record(mib, "nvme_read", bench_nvme_read(timer, tier, name, reps_for(mib)))
            record(mib, "nvme_read_readinto", bench_nvme_read(timer, tier, name, reps_for(mib), readinto=True))

        # Phase 2: S3 tier against raw s3fs on one SeaweedFS server.
        if not args.no_s3:
            import s3fs

            from store.config import S3Config
            from store.tiers.s3 import S3Tier
            from tests.seaweedfs import SeaweedFS

            print("starting SeaweedFS on 127.0.0.1 ...", flush=True)
            t0 = time.perf_counter()
            weed = SeaweedFS().start()
            os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
            os.environ["KVWARM_BENCH_S3_KEY"] = os.environ["KVWARM_BENCH_S3_SECRET"] = "bench"
            options = S3Config(endpoint_url=weed.endpoint, access_key_env="KVWARM_BENCH_S3_KEY",
                               secret_key_env="KVWARM_BENCH_S3_SECRET", op_timeout_s=300, read_timeout_s=120)
            fs = s3fs.S3FileSystem(key="bench", secret="bench", client_kwargs={"endpoint_url": weed.endpoint},
                                   skip_instance_cache=True, use_listings_cache=False)
            # SeaweedFS reclaims deleted bytes only when a bucket (a collection, with its
            # volumes) is deleted: drop the launcher's probe bucket, and use one bucket per
            # size, deleted after it, so that the run's disk use stays bounded.
            fs.rm(f"ready-{os.getpid()}", recursive=True)
            print(f"SeaweedFS ready at {weed.endpoint} after {time.perf_counter() - t0:.1f} s", flush=True)
            for mib in map(size, sizes):
                snap, blob = snaps[mib]
                bucket = f"{BUCKET_PREFIX}-{mib}"
                s3 = S3Tier(f"s3://{bucket}/ours", options, create_bucket=True)
                record(mib, "s3_put", bench_s3_put(timer, s3, fs, snap, blob, reps_for(mib)))
                name = fresh_name("g")
                s3.write(name, snap, expires_at=snap.header.expires_at)
                record(mib, "s3_get", bench_s3_get(timer, s3, fs, name, reps_for(mib)))
                s3.fs.rm(bucket, recursive=True)
                del s3

        # Phase 3: cold reads (last: dropping the page cache disturbs memory for what follows).
        drop = None if args.no_cold else page_cache_dropper()
        if drop is not None:
            cold_method = "drop_caches"
            print("NVMe tier, cold (echo 3 > /proc/sys/vm/drop_caches before each read) ...", flush=True)
            for mib in map(size, sizes):
                record(mib, "nvme_read_cold", bench_nvme_read(timer, tier, read_names[mib], reps_for(mib), drop=drop))
        elif not args.no_cold:
            print("cold reads skipped: /proc/sys/vm/drop_caches is not writable here", flush=True)
    finally:
        tier.close()
        if weed is not None:
            weed.stop()
        shutil.rmtree(work, ignore_errors=True)

    elapsed = time.perf_counter() - t_start
    load_end = os.getloadavg()
    checks: dict[str, bool] = {}
    for mib in sizes:
        if mib < TARGET_MIN_MIB:
            continue
        for op in CHECKED_OPS:
            r = results[str(mib)].get(op)
            if r is not None:
                checks[f"{op}@{mib}MiB"] = r["ratio"] >= TARGET_RATIO
    print_table(results, sizes)
    print(f"machine: {os.cpu_count()} cpus, {platform.platform()}, python {platform.python_version()}; "
          f"load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end; total {elapsed:.0f} s")
    misses = [k for k, ok in checks.items() if not ok]
    verdict = ("no size of that much was measured" if not checks
               else "all met" if not misses else f"missed: {', '.join(misses)}")
    print(f"target ours/raw >= {TARGET_RATIO} at >= {TARGET_MIN_MIB} MiB: {verdict}", flush=True)
    summary = {
        "bench": "store",
        "units": "MB/s = 1e6 bytes of snapshot file per second, median of reps; ratio = ours/raw "
                 "throughput of medians (ratio_of_min: of the fastest reps)",
        "sizes_mib": sizes,
        "file_bytes": {str(m): len(snaps[m][1]) for m in sizes},
        "reps": {str(m): reps_for(m) for m in sizes},
        "cold_read_method": cold_method,
        "results": results,
        "target": {"ratio": TARGET_RATIO, "min_size_mib": TARGET_MIN_MIB, "ops": list(CHECKED_OPS)},
        "checks": checks,
        "all_pass": all(checks.values()) if checks else None,
        "cpus": os.cpu_count(),
        "loadavg_start": round(load_start[0], 2),
        "loadavg_end": round(load_end[0], 2),
        "elapsed_s": round(elapsed, 1),
    }
    # A subset of sizes or no S3 is a partial run (the cold rows are informational only).
    run.finish(summary, args.results, variant_of(args, partial=args.no_s3 or sizes != list(DEFAULT_SIZES)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
