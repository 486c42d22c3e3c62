"""Gather micro-benchmark: copying many snapshot parts into one pinned buffer and on to a device.

What the loader does for a hit bound for a GPU (``store.kernels.staging.gather_to_device``):
``--parts`` parts of ``[8, 256, 128]`` bytes (one 8B-shaped FP8 block's K or V of one layer)
are copied into a (pinned) host buffer by T threads, each sending its slice on to the
device as soon as it is copied. Side by side for T in ``--threads``: numpy copies (one
thread per copy, GIL released) against ``torch.stack`` (whose copy may start an OpenMP
team inside each thread). Medians of 5 after 2 warm-ups. Last line: one JSON object.

    python bench/gather_micro.py                 # CUDA when present, else the CPU (unpinned)
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=2048)
    ap.add_argument("--threads", default="4,8,16")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    n = args.parts
    raw = [torch.randint(0, 255, (8, 256, 128), dtype=torch.uint8) for _ in range(n)]
    host = torch.empty((n, 8, 256, 128), dtype=torch.uint8, pin_memory=cuda)
    host_np = host.numpy()
    dst = torch.empty_like(host, device=dev)
    nbytes = host.numel()
    out: dict = {"bench": "gather_micro", "device": str(dev), "mib": nbytes / 2**20, "gb_s": {}}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for t in [int(x) for x in args.threads.split(",")]:
        step = -(-n // t)

        def with_numpy(lo: int) -> None:
            hi = min(lo + step, n)
            for i in range(lo, hi):
                np.copyto(host_np[i], raw[i].numpy())
            dst[lo:hi].copy_(host[lo:hi], non_blocking=True)

        def with_torch(lo: int) -> None:
            hi = min(lo + step, n)
            torch.stack(raw[lo:hi], out=host[lo:hi])
            dst[lo:hi].copy_(host[lo:hi], non_blocking=True)

        with cf.ThreadPoolExecutor(t) as ex:
            for name, fn in (("numpy", with_numpy), ("torch", with_torch)):
                times = []
                for rep in range(7):
                    t0 = time.perf_counter()
                    list(ex.map(fn, range(0, n, step)))
                    sync()
                    if rep >= 2:
                        times.append(time.perf_counter() - t0)
                gbs = nbytes / statistics.median(times) / 1e9
                out["gb_s"][f"{name}_{t}"] = round(gbs, 2)
                print(f"threads {t:2d} {name}: {gbs:.1f} GB/s", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
