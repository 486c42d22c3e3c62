"""A new node's first sync lookup: the chain fetched from S3 (a local SeaweedFS) one GET at a time, or in parallel.

A chain of ``--blocks`` blocks of about ``--block-mib`` MiB each (random KV; the size of
kvwarm-ref's blocks by default) is written to S3; each repeat opens loaders in
``fetch_mode: sync`` over an empty NVMe directory and times one lookup of the whole chain,
with ``loader.chain_gets`` 1 (one GET at a time, as before) and ``--gets`` (the default),
side by side (each first in every other repeat), ``--settle-s`` after the loader started (a restarted engine's first
request comes seconds after its start). The last line is one JSON object: the median lookup per setting and
their ratio.

    PYTHONPATH=$PWD python bench/sync_fetch_bench.py --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from store.config import parse_config
from store.config_sections import LoaderConfig
from store.serving.loader import KVLoader
from store.tiers.store import Store
from tests.seaweedfs import SeaweedFS
from tests.store.pool_workers import ACME, TINY, prompt, synthetic_prefix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-mib", type=float, default=1.7)
    ap.add_argument("--gets", type=int, default=8, help="loader.chain_gets of the parallel setting")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="between the loader's start and its lookup (an engine restart takes seconds)")
    args = ap.parse_args()
    bs, layers, heads = 64, 12, 12
    head_dim = max(8, int(args.block_mib * (1 << 20) / (layers * 2 * heads * bs * 2)))
    for k, v in (("KVWARM_TEST_KEY", "test"), ("KVWARM_TEST_SECRET", "test"), ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    with tempfile.TemporaryDirectory() as tmp, SeaweedFS(workdir=f"{tmp}/weed") as weed:
        s3 = {"endpoint_url": weed.endpoint, "access_key_env": "KVWARM_TEST_KEY",
              "secret_key_env": "KVWARM_TEST_SECRET", "op_timeout_s": 60, "retries": 1}

        def cfg(gets: int):  # type: ignore[no-untyped-def]
            loader = {"fetch_mode": "sync", "sync_fetch_timeout_s": 60}
            if "chain_gets" in LoaderConfig.model_fields:  # (absent before it: the same code twice, for reference)
                loader["chain_gets"] = gets
            return parse_config({"kv_cache": {"block_size": bs, "compression": "bf16"}, "store": {"s3": s3},
                                 "fleet_memory": {"enabled": False}, "loader": loader})

        url = f"s3://kvwarm-bench/{uuid.uuid4().hex[:8]}"
        ids = prompt(args.blocks * bs + 1, seed=1)
        writer = Store.open(f"file://{tmp}/writer,{url}", cfg(1), create_bucket=True)
        synthetic_prefix(writer, cfg(1), ids[:-1], layers=layers, heads=heads, head_dim=head_dim)
        sizes = [e.size for e in writer.tiers[0].entries()]
        writer.close()
        times: dict[int, list[float]] = {1: [], args.gets: []}
        for r in range(args.repeats):
            for gets in (list(times) if r % 2 == 0 else list(times)[::-1]):  # each first in turn: S3 serves
                # an object read again faster, so the setting read second would gain
                sub = f"{tmp}/n{r}-{gets}"
                with KVLoader(f"file://{sub},{url}", tenant=ACME, model=TINY, config=cfg(gets),
                              pool_bytes=1 << 30, pool_dir=Path(f"{sub}-pool")) as ld:
                    time.sleep(args.settle_s)
                    t0 = time.perf_counter()
                    hit = ld.lookup(ids)
                    dt = time.perf_counter() - t0
                    assert hit is not None and len(hit.blocks) == args.blocks, "the chain was not fetched whole"
                    hit.release()
                times[gets].append(dt)
                print(f"repeat {r} chain_gets={gets}: first sync lookup {dt * 1e3:.1f} ms", flush=True)
    seq, par = (statistics.median(times[g]) for g in times)
    print(json.dumps({"blocks": args.blocks, "block_bytes": int(statistics.mean(sizes)), "repeats": args.repeats,
                      "settle_s": args.settle_s, "chain_gets_key": "chain_gets" in LoaderConfig.model_fields,
                      "sync_lookup_s_one_get": round(seq, 4), f"sync_lookup_s_{args.gets}_gets": round(par, 4),
                      "speedup": round(seq / par, 2)}))


if __name__ == "__main__":
    main()
