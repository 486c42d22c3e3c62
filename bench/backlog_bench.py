"""Upload backlog bench: what the persistent backlog costs the writer and the uploads.

Measured in one process, on the machine's disk (a temporary directory):

* ``put_ms``: :meth:`store.tiers.backlog.UploadBacklog.add` of one row (one SQLite transaction,
  WAL, ``synchronous = NORMAL``): what each written-back block pays on the writer's thread, against
  the ~274 ms the writer spends encoding a block of the 8B shape (issue 32).
* ``claim_ms``: a claim and a done (two transactions: what each upload pays) with ``--rows``
  waiting, a tenth of them ranked: the drain order's index at depth.
* ``read_back_mb_s``: :func:`store.engines.vllm.uploads.read_back` of a Llama-3-8B-shaped block
  (32 layers, 8 KV heads, head_dim 128, 256 tokens, FP8: 16 MiB), every payload checksum
  checked, then the bytes the S3 tier sends (``snapshot_bytes``), from the page cache: what an
  upload stream spends before its PUT.

Targets: ``put_ms`` median <= 1; ``claim_ms`` median <= 2 at 100,000 rows; ``read_back_mb_s``
>= 1000 (one stream; four streams read back far more than a 10 Gb/s link carries). Medians
and p99 of ``--reps``. The last line of stdout is one JSON object with the figures and ``targets``
met or not, also saved to ``bench/results/backlog.json`` with how it was made (:mod:`bench.lib.results`).

Usage::

    .venv/bin/python bench/backlog_bench.py [--rows 100000] [--reps 500] [--results DIR]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.results import Run, add_results_option, variant_of
from store.engines.vllm.uploads import read_back
from store.format.encode import EncodedSnapshot, build_snapshot, snapshot_bytes
from store.format.precision import Precision
from store.identity.keys import KeyRoot, block_chain
from store.identity.tenant import Tenant
from store.tiers.backlog import UploadBacklog
from store.tiers.base import Entry, object_name
from store.tiers.local import LocalTier
from store.tiers.store import Store

TARGETS = {"put_ms_p50": 1.0, "claim_ms_p50": 2.0, "read_back_mb_s": 1000.0}


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": round(statistics.median(xs), 4), "p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 4)}


def _name(i: int) -> str:
    return object_name("acme", f"{i:064x}")


def bench_put(d: Path, reps: int) -> dict[str, float]:
    backlog = UploadBacklog(d / "put.sqlite")
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        backlog.add(_name(i), "acme", 16 << 20)
        times.append((time.perf_counter() - t0) * 1e3)
    backlog.close()
    return _quantiles(times)


def bench_claim(d: Path, rows: int, reps: int) -> dict[str, float]:
    backlog = UploadBacklog(d / "claim.sqlite")
    rng = random.Random(0)
    backlog.rescan((Entry(_name(i), 16 << 20, float(i)) for i in range(rows)), lambda name: "acme")
    backlog.rerank({_name(i): rng.random() for i in rng.sample(range(rows), rows // 10)})
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        row = backlog.claim({"acme"})
        assert row is not None
        backlog.done(row.name)
        times.append((time.perf_counter() - t0) * 1e3)
    backlog.close()
    return _quantiles(times)


def bench_read_back(d: Path, reps: int) -> tuple[dict[str, float], int]:
    tenant = Tenant.derive("acme", "bench-secret")
    precision = Precision()
    root = KeyRoot("bench-8b@1", "tok", precision.kv_dtype, precision.scheme_id(), 256, tenant.salt)
    block = block_chain(root, list(range(256)))[0]
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(8, 256, 128, generator=g, dtype=torch.float32).to(torch.bfloat16),
           torch.randn(8, 256, 128, generator=g, dtype=torch.float32).to(torch.bfloat16)) for _ in range(32)]
    snap = build_snapshot(root=root, block=block, tenant="acme", kv=kv, precision=precision,
                          created_at=time.time(), ttl_s=3600.0)
    tier = LocalTier(d / "nvme", cap_bytes=1 << 30)
    Store([tier]).put(tenant, snap)
    name = object_name("acme", block.key)
    size = tier.path(name).stat().st_size
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        got, why = read_back(tier, name, time.time())
        assert got is not None, why
        payload = got.payload
        assert payload is not None
        data = snapshot_bytes(EncodedSnapshot(got.header, payload[0]))
        elapsed = time.perf_counter() - t0
        got.close()
        assert len(data) == size
        rates.append(size / elapsed / 1e6)
    tier.close()
    rates.sort()
    return {"p50": round(statistics.median(rates), 1), "p1": round(rates[int(0.01 * len(rates))], 1)}, size


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000, help="rows waiting while claims are timed")
    ap.add_argument("--reps", type=int, default=500, help="timed puts and claims (read-backs: a tenth)")
    add_results_option(ap)
    args = ap.parse_args(argv)
    run = Run("backlog", __file__, argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvwarm-backlog-bench-") as tmp:
        d = Path(tmp)
        put = bench_put(d, args.reps)
        claim = bench_claim(d, args.rows, args.reps)
        read, size = bench_read_back(d, max(5, args.reps // 10))
    print(f"put: {put['p50']:.3f} ms median, {put['p99']:.3f} ms p99 (one SQLite transaction per block)")
    print(f"claim + done at {args.rows} rows: {claim['p50']:.3f} ms median, {claim['p99']:.3f} ms p99")
    print(f"read back a {size / 2**20:.1f} MiB block, checked, as S3 is sent it: {read['p50']:.0f} MB/s median")
    values = {"put_ms_p50": put["p50"], "claim_ms_p50": claim["p50"], "read_back_mb_s": read["p50"]}
    targets = {k: {"value": v, "target": TARGETS[k],
                   "met": v >= TARGETS[k] if k == "read_back_mb_s" else v <= TARGETS[k]} for k, v in values.items()}
    run.finish({"bench": "backlog", "rows": args.rows, "reps": args.reps, "block_bytes": size,
                "put_ms": put, "claim_ms": claim, "read_back_mb_s": read, "targets": targets,
                "all_pass": all(t["met"] for t in targets.values()), "cpus": os.cpu_count(),
                "loadavg_start": round(load, 2), "loadavg_end": round(os.getloadavg()[0], 2)},
               args.results, variant_of(args, partial=(args.rows, args.reps) != (100_000, 500)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
