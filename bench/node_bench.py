"""The node process's lookup: one local round trip, against the probe an engine makes in its own process.

A chain of ``--blocks`` blocks is stored in a node tier (small synthetic snapshots: a lookup
asks only whether files exist). A `prefill node` started for the bench answers lookups of the
whole chain, and of a chain it does not hold, over its Unix socket (:class:`store.node.NodeClient`);
the same chains are probed in this process through the store (``Store.probe(local_only=True)``,
what ``store/engines/vllm/probe.py`` does without a node). Reported per way: the median and the
99th percentile of ``--n`` lookups, in microseconds, and the node's time to start (spawned by a
client, until its hello). The last line is one JSON object; ``targets``: a lookup's p99 through
the node within the 0.3 ms the issue gives kvwarm's whole step inside vLLM's process.

    python bench/node_bench.py [--blocks 64] [--n 2000] [--results DIR]
"""
from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.results import Run, add_results_option, variant_of
from store.config import parse_config
from store.identity.keys import block_chain
from store.node import NodeClient
from store.tiers.store import Store
from tests.store.node.factories import gone, stop
from tests.store.pool_workers import ACME, TINY, prompt, synthetic_prefix

TARGET_P99_US = 300.0


def _times(fn, n: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    out.sort()
    return statistics.median(out) * 1e6, out[min(len(out) - 1, int(0.99 * len(out)))] * 1e6


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per chain asked")
    ap.add_argument("--n", type=int, default=2000, help="lookups per way")
    add_results_option(ap)
    args = ap.parse_args(argv)
    run = Run("node", __file__, argv)
    bs = 16
    with tempfile.TemporaryDirectory(prefix="kvnb", dir="/tmp") as tmp:
        cfg = parse_config({"store": {"url": f"file://{tmp}/nvme"}, "kv_cache": {"block_size": bs},
                            "node": {"socket": f"{tmp}/n.sock", "metrics_port": None, "agent": False}})
        ids = prompt(args.blocks * bs + 1, seed=1)
        store = Store.open(cfg.store.url, cfg)
        synthetic_prefix(store, cfg, ids[:-1], layers=2, heads=2, head_dim=16)
        root = TINY.key_root(cfg.kv_cache.precision(), bs, ACME.salt)
        held, absent = block_chain(root, ids), block_chain(root, prompt(args.blocks * bs, seed=2))
        client = NodeClient(cfg)
        t0 = time.perf_counter()
        pid = client.connect()["pid"]
        start_s = time.perf_counter() - t0
        try:
            figures = {}
            for label, chain in (("held", held), ("absent", absent)):
                keys = [b.key for b in chain]
                expect = len(chain) if label == "held" else 0
                assert client.lookup("acme", keys).count == expect == store.probe(ACME, chain, root,
                                                                                  local_only=True).count
                figures[f"node_{label}"] = _times(lambda: client.lookup("acme", keys), args.n)
                figures[f"in_process_{label}"] = _times(
                    lambda: store.probe(ACME, chain, root, local_only=True), args.n)
                for way in ("node", "in_process"):
                    p50, p99 = figures[f"{way}_{label}"]
                    print(f"{label} chain of {args.blocks}, {way}: p50 {p50:.1f} us, p99 {p99:.1f} us", flush=True)
        finally:
            client.close()
            store.close()
            stop(pid, signal.SIGTERM)
            gone(pid, 30.0)
    worst = max(figures["node_held"][1], figures["node_absent"][1])
    run.finish({
        "blocks": args.blocks, "lookups": args.n, "node_start_s": round(start_s, 3),
        **{f"{k}_p50_us": round(v[0], 1) for k, v in figures.items()},
        **{f"{k}_p99_us": round(v[1], 1) for k, v in figures.items()},
        "targets": {"node_lookup_p99_le_300us": {"target_us": TARGET_P99_US, "value_us": round(worst, 1),
                                                 "met": worst <= TARGET_P99_US}}},
               args.results, variant_of(args, partial=(args.blocks, args.n) != (64, 2000)))


if __name__ == "__main__":
    main()
