"""The write-back bench's view of the store and its figures (bench/writeback_bench.py).

What the bench reads from the store itself (snapshot files on the node tier, objects in S3), the
link's PUT rate, and the summary of one run against issue 32's done-when 3. ``counters`` is also
used by :mod:`bench.lib.writeback_driver` inside the engine venv: stdlib only at import.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SUFFIX = ".kvw"


def counters(stats: dict[str, Any]) -> dict[str, float]:
    """One set of numeric counters from every role's stats: per key, the largest any role reports
    (the scheduler role's include what the worker reported; the worker's are its own totals)."""
    out: dict[str, float] = {}
    for figs in (stats or {}).values():
        for k, v in (figs or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = max(out.get(k, 0), v)
    return out


def kv_bytes_per_token(geo: dict[str, Any], dtype_bytes: int) -> int:
    """The engine's K and V bytes per token of a model config (``config.json``), at ``dtype_bytes``."""
    dim = geo.get("head_dim") or geo["hidden_size"] // geo["num_attention_heads"]
    return geo["num_hidden_layers"] * 2 * geo["num_key_value_heads"] * dim * dtype_bytes


def write_config(path: Path, *, nvme: Path, bucket: str, endpoint: str, tenant: str) -> Path:
    """kvwarm's config: the defaults (write-back, FP8) over a local tier and the bucket, and a tenant."""
    import yaml

    from bench.lib.bench_node import node_section

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "kv_cache": {"block_size": 256},
        "store": {"url": f"file://{nvme},s3://{bucket}/kvwarm",
                  "s3": {"endpoint_url": endpoint, "access_key_env": "KVWARM_BENCH_S3_KEY",
                         "secret_key_env": "KVWARM_BENCH_S3_SECRET"}},
        "loader": {"pool_dir": str(path.parent / "pool"), "pool_bytes": "2GiB"},
        "tenants": {tenant: {}},  # kvwarm writes back no request of tenant 'public'
        "node": node_section(path.parent),  # the engine's own node, stopped with the run (not the default socket's)
    }))
    return path


class StoreWatch:
    """The tenant's snapshots on the node tier (files under ``objects/<tenant>/``) and in S3."""

    def __init__(self, nvme: Path, endpoint: str, base: str, tenant: str) -> None:
        import s3fs

        self.objects = Path(nvme) / "objects" / tenant
        self.base, self.tenant = base, tenant
        self.fs = s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": endpoint},
                                    use_listings_cache=False)

    def nvme(self) -> dict[str, Any]:
        """Snapshot files of the tenant on the node tier: how many, their bytes, each file's size."""
        sizes = []
        for dirpath, _, files in os.walk(self.objects):
            for f in files:
                if f.endswith(SUFFIX):
                    try:
                        sizes.append(os.stat(os.path.join(dirpath, f)).st_size)
                    except FileNotFoundError:
                        pass
        return {"blocks": len(sizes), "bytes": sum(sizes), "sizes": sizes, "dir": str(self.objects)}

    def s3(self) -> dict[str, Any]:
        """The tenant's snapshot objects in S3: how many, and their bytes."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(f"{self.base}/{self.tenant}", detail=True)
        except FileNotFoundError:
            found = {}
        sizes = [int(v.get("size") or 0) for k, v in found.items() if k.endswith(SUFFIX)]
        return {"blocks": len(sizes), "bytes": sum(sizes)}

    def wait_for(self, expected: int, since: float, limit_s: float, poll_s: float,
                 still_s: float = 30.0) -> tuple[float | None, list[list[float]]]:
        """List S3 every ``poll_s`` until it holds ``expected`` blocks: the wall time it did (``None``
        if it did not within ``limit_s`` of ``since``, or S3 and NVMe stopped changing for ``still_s``
        short of it) and the listings ``[seconds after since, objects in S3, files on NVMe]``."""
        listings: list[list[float]] = []
        last, last_change = None, time.time()
        while True:
            count = self.s3()["blocks"]
            now = time.time()
            on_nvme = self.nvme()["blocks"]
            listings.append([round(now - since, 2), count, on_nvme])
            if count >= expected:
                return now, listings
            if (count, on_nvme) != last:
                last, last_change = (count, on_nvme), now
            if now - since > limit_s or (count >= on_nvme and now - last_change > still_s):
                return None, listings
            time.sleep(poll_s)


def link_put_rate(watch: StoreWatch, nvme: dict[str, Any], streams: int, min_s: float = 3.0,
                  min_puts: int = 32) -> dict[str, Any]:
    """S3 PUT throughput of this SeaweedFS: one of the run's snapshots (the median size), PUT again
    and again under ``linktest/``, ``streams`` at once (raw s3fs), for ``min_s`` and ``min_puts``."""
    sizes = sorted(nvme["sizes"])
    if not sizes:
        return {"bytes_per_s": None, "puts": 0, "object_bytes": 0, "streams": streams}
    target = sizes[len(sizes) // 2]
    path = next(os.path.join(d, f) for d, _, fs in os.walk(watch.objects) for f in fs
                if f.endswith(SUFFIX) and os.stat(os.path.join(d, f)).st_size == target)
    data = Path(path).read_bytes()
    base = watch.base.split("/")[0] + "/linktest"
    watch.fs.pipe(f"{base}/warm", data)  # the connection and the bucket's first write apart
    puts = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        while time.perf_counter() - t0 < min_s or puts < min_puts:
            list(pool.map(lambda i: watch.fs.pipe(f"{base}/{i}", data), range(puts, puts + streams)))
            puts += streams
    dt = time.perf_counter() - t0
    return {"bytes_per_s": puts * len(data) / dt, "puts": puts, "object_bytes": len(data), "streams": streams,
            "seconds": dt}


def first_at(samples: list[dict[str, Any]], test) -> float | None:
    """The wall time of the first counter sample that passes ``test``."""
    return next((s["t"] for s in samples if test(s["counters"])), None)


def by_prefix(c: dict[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: v for k, v in c.items() if k.startswith(prefix) and v}


def thin(points: list, most: int = 60) -> list:
    """At most ``most`` of ``points``, evenly, the last kept."""
    if len(points) <= most:
        return points
    step = len(points) / most
    return [points[int(i * step)] for i in range(most - 1)] + [points[-1]]


def summarize(*, burst: dict, result: dict, expected: int, nvme: dict, s3: dict, s3_done_at: float | None,
              listings: list, link: dict, geo: dict, prompt_blocks: int, slack: tuple[float, float]) -> dict:
    """The run's figures and targets (see bench/writeback_bench.py)."""
    final = counters(result.get("final_stats") or {})
    at_end = burst["counters"]
    samples = result.get("samples") or []
    end, burst_s = burst["end"], burst["seconds"]
    dropped = {**{f"write_back:{k}": v for k, v in by_prefix(final, "write_back_dropped:").items()},
               **{f"upload:{k}": v for k, v in by_prefix(final, "upload_dropped:").items()}}
    blocks = {"full": expected, "requests": burst["requests"], "per_prompt": prompt_blocks,
              "on_nvme": nvme["blocks"], "in_s3": s3["blocks"], "dropped": dropped,
              "dropped_total": sum(dropped.values()),
              "skipped": by_prefix(final, "write_back_skipped:"),
              "counters": {k: final.get(k, 0) for k in ("written_back_blocks", "written_back_bytes",
                                                         "written_back_uploads", "upload_present",
                                                         "upload_backlog_resumed", "upload_backlog_rescanned")},
              "written_back_by_burst_end": at_end.get("written_back_blocks", 0),
              "uploaded_by_burst_end": at_end.get("written_back_uploads", 0) + at_end.get("upload_present", 0)}
    rate = link.get("bytes_per_s")
    link_s = s3["bytes"] / rate if rate else None
    limit_s = slack[0] * link_s + slack[1] if link_s is not None else None
    after_s = round(s3_done_at - end, 2) if s3_done_at is not None else None
    up_done = first_at(samples, lambda c: c.get("written_back_uploads", 0) + c.get("upload_present", 0) >= expected)
    wb_done = first_at(samples, lambda c: c.get("written_back_blocks", 0) >= final.get("written_back_blocks", 0))
    s3_out = {"after_burst_s": after_s, "after_burst_s_counters": round(up_done - end, 2) if up_done else None,
              "bytes": s3["bytes"], "link_mb_s": rate / 1e6 if rate else None, "link_s": link_s,
              "limit_s": limit_s, "limit": f"{slack[0]:g} x link_s + {slack[1]:g} s", "link_put": link,
              "listings": thin(listings)}
    tok_s = burst["prompt_tokens"] / burst_s
    stored_per_token = nvme["bytes"] / max(1, nvme["blocks"]) / 256 if nvme["blocks"] else None
    wb_bytes = final.get("written_back_bytes", 0)
    wb_span = (wb_done - burst["start"]) if wb_done else None
    rates = {"burst_s": burst_s, "prompt_tokens": burst["prompt_tokens"], "prefill_tokens_per_s": tok_s,
             "engine_kv_bytes_per_token": kv_bytes_per_token(geo, 2), "stored_bytes_per_token": stored_per_token,
             "prefill_kv_mb_s": tok_s * kv_bytes_per_token(geo, 2) / 1e6,
             "prefill_kv_fp8_mb_s": tok_s * stored_per_token / 1e6 if stored_per_token else None,
             "writeback_mb_s_burst": at_end.get("written_back_bytes", 0) / burst_s / 1e6,
             "writeback_mb_s_to_last_write": wb_bytes / wb_span / 1e6 if wb_span else None,
             "last_write_after_burst_s": round(wb_done - end, 2) if wb_done else None}
    if rates["prefill_kv_fp8_mb_s"]:
        rates["writeback_over_prefill_fp8_burst"] = rates["writeback_mb_s_burst"] / rates["prefill_kv_fp8_mb_s"]
    targets = {
        "zero_dropped": {"value": blocks["dropped_total"], "target": 0, "met": blocks["dropped_total"] == 0},
        "every_full_block_on_nvme": {"value": nvme["blocks"], "target": expected, "met": nvme["blocks"] >= expected},
        "s3_within_link_time": {"value_s": after_s, "target_s": limit_s,
                                "met": after_s is not None and limit_s is not None and after_s <= limit_s},
    }
    return {"blocks": blocks, "s3": s3_out, "rates": rates, "targets": targets}
