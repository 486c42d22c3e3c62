"""A hand-built flow run and two loader stats dumps, from which the monitoring tests compute figures by hand.

Used by tests/prefill/test_monitoring.py, tests/prefill/test_report_cli.py and
tests/flows/test_report.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Two loaders (two serving nodes) over one run. Every figure below is computed by hand from these.
DUMP_A: dict[str, Any] = {
    "lookups": 10, "hits": 6, "tokens_served": 3000, "bytes_mapped": 100_000, "refused_cross_tenant": 2,
    "misses": 4, "misses_by_reason": {"absent": 2, "tenant_refused": 2}, "shortened_by_reason": {"corrupt": 1},
    "latency": {"lookup": {"count": 10, "p50_s": 0.001, "p99_s": 0.004},
                "to_dynamic_cache": {"count": 6, "p50_s": 0.01, "p99_s": 0.02}},
    "pool_bytes_in_use": 100_000, "attached": True, "fetch_mode": "background", "store": {},
    "elapsed_s": 5.0, "prompt_tokens": 5000,
}
DUMP_B: dict[str, Any] = {
    "lookups": 30, "hits": 24, "tokens_served": 9000, "bytes_mapped": 50_000, "refused_cross_tenant": 0,
    "misses": 6, "misses_by_reason": {"absent": 5, "mismatch": 1}, "shortened_by_reason": {},
    "latency": {"lookup": {"count": 30, "p50_s": 0.002, "p99_s": 0.003}},
    "elapsed_s": 15.0, "prompt_tokens": 11000,
}
# 48 planned tokens at 100 KV bytes per token
PLAN = {"kvwarm_plan": 1, "block_size": 16, "model": "m",
        "extra": {"planned_store_bytes": 4800.0, "kv_bytes_per_token": 100.0},
        "entries": [{"tenant": "acme", "token_ids": list(range(32)), "prefix_id": "p1"},
                    {"tenant": "acme", "token_ids": list(range(16)), "prefix_id": "p2"}]}
PREFILL = {"prefixes": 2, "blocks_written": 3, "tokens_computed": 2000, "seconds": 2.0, "tokens_per_s": 1000.0}
REPLAY = {"requests": 20, "requests_hit": 15, "cached_tokens": 4000, "prompt_tokens": 8000}


def build_run(root: Path, run: str = "r1", *, dumps: bool = True, report: bool = True) -> tuple[str, list[Path]]:
    """A store with run ``run``'s files under ``_flows/<run>`` and the two dumps next to it; returns (url, dumps)."""
    out = root / "store" / "_flows" / run
    out.mkdir(parents=True)
    (out / "plan.json").write_text(json.dumps(PLAN))
    (out / "prefill.json").write_text(json.dumps(PREFILL))
    (out / "mine.json").write_text(json.dumps({"rows_used": 100}))
    (out / "gc.json").write_text(json.dumps({"expired_removed": 0}))
    if report:
        (out / "report.json").write_text(json.dumps({"run": run, "replay": REPLAY}))
    paths = []
    if dumps:
        for name, d in (("a", DUMP_A), ("b", DUMP_B)):
            p = root / f"{name}.json"
            p.write_text(json.dumps(d))
            paths.append(p)
    return f"file://{root / 'store'}", paths
