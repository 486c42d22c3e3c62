"""Write-back ring micro-benchmark: engine -> node throughput of 8B-shaped FP8 blocks, against memcpy.

One 256-token block of an 8B-shaped model (32 layers x 8 KV heads x head 128, K and V) is
16 MiB of FP8 bytes and 2 KiB of fp32 scales (one per layer, head, K/V). A spawned producer
process (the engine) writes ``--blocks`` such records into a ring under /dev/shm (reserve,
one copy per part, commit; a ``None`` answer is retried and counted); this process (the node)
waits for them (``RingReader.wait``), polls them and releases each one. The figure is GB/s of block bytes from the producer's
first reserve to the consumer's last release, median of ``--repeats`` rounds after one
warm-up round (pages faulted in). The baseline is a plain ``np.copyto`` of the same bytes
into the same number of rotating destination buffers, in one process.

A second figure (``ring_read_gb_s``) has the consumer also read every byte of each record
(a copy out, as the node's checksum pass reads them): informational, no target.

    python bench/ring_bench.py [--blocks 32] [--ring-blocks 8] [--repeats 5] [--results DIR]

Last line: one JSON object with the figures and ``targets`` (ring >= 0.5 x memcpy, the
producer's calls >= 0.8 x its own memcpy), also saved to ``bench/results/ring.json`` with how
it was made (:mod:`bench.lib.results`).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.results import Run, add_results_option, variant_of
from store.node.ring import Ring
from store.node.ring_record import RecordMeta

LAYERS, HEADS, HEAD_DIM, TOKENS = 32, 8, 128, 256
KV_BYTES = LAYERS * HEADS * HEAD_DIM * TOKENS * 2  # FP8: one byte a value, K and V
SCALE_BYTES = LAYERS * HEADS * 2 * 4  # fp32, per layer, head and K/V
TARGET_RING_OVER_MEMCPY = 0.5
TARGET_PRODUCER_OVER_MEMCPY = 0.8  # what the engine's thread pays: the copy into the ring, and little else


def _produce(path: str, rounds: int, blocks: int, ring_blocks: int, barrier, results) -> None:
    writer = Ring.attach(path).writer()
    baseline = MemcpyBaseline(ring_blocks)
    timings = []
    for r in range(rounds):
        barrier.wait()  # the consumer's memcpy round is done
        memcpy_s = baseline.round(blocks)  # this process's own, on the same load, the consumer idle
        barrier.wait()
        calls_s = 0.0  # time in reserve .. commit, not waiting out full answers
        for b in range(blocks):
            slot = writer.reserve(KV_BYTES, SCALE_BYTES)
            while slot is None:  # the bench's producer waits; an engine would count a drop
                time.sleep(0)
                slot = writer.reserve(KV_BYTES, SCALE_BYTES)
            t0 = time.perf_counter()
            slot.write(0, baseline.kv)
            slot.write(1, baseline.scales)
            slot.commit(RecordMeta(namespace="bench", key=f"r{r}-b{b}", token_count=TOKENS, layer_count=LAYERS,
                                   precision_id=1))
            calls_s += time.perf_counter() - t0
        timings.append((memcpy_s, calls_s))
    results.put({"full_answers": writer.full_answers, "timings": timings})
    barrier.wait()


def _round(reader, barrier, blocks: int, sink: np.ndarray | None) -> float:
    barrier.wait()  # the producer's memcpy round is done
    t0 = time.perf_counter()
    got = 0
    while got < blocks:
        before = got
        for rec in reader.poll():
            assert rec.meta.token_count == TOKENS and rec.parts[0].nbytes == KV_BYTES
            if sink is not None:
                np.copyto(sink, rec.array(0))
            reader.release(rec)
            got += 1
        if got == before:
            reader.wait(1.0)  # as the node waits: a backoff, not a spinning core
    return time.perf_counter() - t0


class MemcpyBaseline:
    """A plain ``np.copyto`` of a block's bytes into ``buffers`` rotating buffers (as many as the ring
    holds blocks), in this process."""

    def __init__(self, buffers: int) -> None:
        rng = np.random.default_rng(0)
        self.kv = rng.integers(0, 256, KV_BYTES, dtype=np.uint8)
        self.scales = rng.random(SCALE_BYTES // 4, dtype=np.float32)
        self.dst = [(np.empty(KV_BYTES, np.uint8), np.empty_like(self.scales)) for _ in range(buffers)]

    def round(self, blocks: int) -> float:
        t0 = time.perf_counter()
        for b in range(blocks):
            np.copyto(self.dst[b % len(self.dst)][0], self.kv)
            np.copyto(self.dst[b % len(self.dst)][1], self.scales)
        return time.perf_counter() - t0


def measure(blocks: int, repeats: int, ring_blocks: int, read: bool, baseline: MemcpyBaseline) -> dict:
    """Rounds of ``blocks`` records producer -> consumer, each right after a memcpy round of the
    same bytes (the machine is shared: paired rounds see the same load). Medians, GB/s."""
    path = f"/dev/shm/kvwarm-ring-bench-{uuid.uuid4().hex}.ring"
    ctx = mp.get_context("spawn")
    ring = Ring.create(path, ring_blocks * (KV_BYTES + SCALE_BYTES + 128), slot_count=64)
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    rounds = repeats + 1
    proc = ctx.Process(target=_produce, args=(path, rounds, blocks, ring_blocks, barrier, results), daemon=True)
    ring_s, memcpy_s = [], []
    try:
        reader = Ring.attach(path).reader()
        proc.start()
        sink = np.empty(KV_BYTES, np.uint8) if read else None
        for _ in range(rounds):
            memcpy_s.append(baseline.round(blocks))
            barrier.wait()
            ring_s.append(_round(reader, barrier, blocks, sink))
        producer = results.get(timeout=120)
        barrier.wait()
        proc.join(60)
        if proc.exitcode != 0:
            raise RuntimeError(f"the producer exited with {proc.exitcode}")
    finally:
        if proc.is_alive():
            proc.kill()
        ring.close()
        os.unlink(path)
    nbytes = blocks * (KV_BYTES + SCALE_BYTES)
    ring_s, memcpy_s = ring_s[1:], memcpy_s[1:]  # the first round faults the pages in
    own = producer["timings"][1:]
    return {"ring_gb_s": nbytes / statistics.median(ring_s) / 1e9,
            "memcpy_gb_s": nbytes / statistics.median(memcpy_s) / 1e9,
            "ring_over_memcpy": statistics.median(m / r for m, r in zip(memcpy_s, ring_s)),
            "producer_gb_s": nbytes / statistics.median(c for _, c in own) / 1e9,
            "producer_over_memcpy": statistics.median(m / c for m, c in own),
            "full_answers": producer["full_answers"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=32, help="blocks per round")
    ap.add_argument("--ring-blocks", type=int, default=8, help="blocks the ring's arena holds at once")
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds (after one warm-up)")
    add_results_option(ap)
    args = ap.parse_args(argv)
    run = Run("ring", __file__, argv)
    baseline = MemcpyBaseline(args.ring_blocks)
    plain = measure(args.blocks, args.repeats, args.ring_blocks, read=False, baseline=baseline)
    print(f"ring (consumer releases): {plain['ring_gb_s']:.2f} GB/s against memcpy {plain['memcpy_gb_s']:.2f} GB/s "
          f"(x{plain['ring_over_memcpy']:.2f}), {plain['full_answers']} full answers retried", flush=True)
    print(f"producer's calls (reserve, write, commit): {plain['producer_gb_s']:.2f} GB/s, "
          f"x{plain['producer_over_memcpy']:.2f} its own memcpy", flush=True)
    read = measure(args.blocks, args.repeats, args.ring_blocks, read=True, baseline=baseline)
    print(f"ring (consumer reads every byte): {read['ring_gb_s']:.2f} GB/s against memcpy "
          f"{read['memcpy_gb_s']:.2f} GB/s (x{read['ring_over_memcpy']:.2f})", flush=True)
    out = {
        "bench": "ring",
        "block": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "tokens": TOKENS,
                  "kv_bytes": KV_BYTES, "scale_bytes": SCALE_BYTES},
        "blocks_per_round": args.blocks, "repeats": args.repeats, "ring_blocks": args.ring_blocks,
        "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
        "memcpy_gb_s": round(plain["memcpy_gb_s"], 3),
        "ring_gb_s": round(plain["ring_gb_s"], 3),
        "ring_over_memcpy": round(plain["ring_over_memcpy"], 3),
        "producer_gb_s": round(plain["producer_gb_s"], 3),
        "producer_over_memcpy": round(plain["producer_over_memcpy"], 3),
        "ring_read_gb_s": round(read["ring_gb_s"], 3),
        "ring_read_over_memcpy": round(read["ring_over_memcpy"], 3),
        "full_answers": {"release": plain["full_answers"], "read": read["full_answers"]},
        "targets": {
            "ring_over_memcpy_ge_0.5": {"value": round(plain["ring_over_memcpy"], 3), "target": TARGET_RING_OVER_MEMCPY,
                                        "met": plain["ring_over_memcpy"] >= TARGET_RING_OVER_MEMCPY},
            "producer_over_memcpy_ge_0.8": {"value": round(plain["producer_over_memcpy"], 3),
                                            "target": TARGET_PRODUCER_OVER_MEMCPY,
                                            "met": plain["producer_over_memcpy"] >= TARGET_PRODUCER_OVER_MEMCPY}},
    }
    run.finish(out, args.results, variant_of(args, partial=(args.blocks, args.ring_blocks, args.repeats) != (32, 8, 5)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
