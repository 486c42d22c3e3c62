"""kvwarm and LMCache on one vLLM: the engine bench's LMCache columns (bench/engine_bench.py).

Cold, restart, replacement and announced, each system's engines interleaved on the same
prompts, every engine from LMCache's venv (see the bench's docstring).
"""
from __future__ import annotations

import os
import re
import statistics
import time
from pathlib import Path

from bench.lib.bench_node import node_section
from bench.lib.engine_parts import (BLOCK, S3_ENV, SETTLE, engine_bytes_per_token, prefill_prefixes, prompts, rounded,
                                    ttft_step)
from bench.lib.vllm_engine import run_engine

#: The LMCache comparison's kvwarm side: a named tenant (``public`` requests are not written
#: back), FP8 snapshots (kvwarm's default), and a replacement node that waits for S3
#: (``fetch_mode: sync``; the default, ``background``, answers an NVMe miss at once and fetches
#: for the next request, so a new node's first request would always be computed)
KVWARM_TENANT, KVWARM_PRECISION, KVWARM_FETCH_MODE = "bench", "fp8", "sync"
#: the SeaweedFS credentials, as kvwarm's engines and this process read them (``store.s3`` names the variables)
KVWARM_BUCKET, LMCACHE_BUCKET = "kvwarm", "lmcache"
L2_WAIT_S = 180.0


def node_config(node: Path, s3_url: str, endpoint: str, *, fleet_memory: bool = True) -> Path:
    """A kvwarm node's config: its local tier under ``node``, then the shared S3 tier at ``s3_url``.

    ``fleet_memory`` off: the node's agent does not copy what the fleet served at start, so a
    replacement's first request finds its prefix in S3 only.
    """
    import yaml

    node.mkdir(parents=True, exist_ok=True)
    path = node / "kvwarm.yaml"
    path.write_text(yaml.safe_dump({
        **({} if fleet_memory else {"fleet_memory": {"enabled": False}}),
        "kv_cache": {"compression": KVWARM_PRECISION, "block_size": BLOCK},
        "store": {"url": f"file://{node / 'nvme'},{s3_url}",
                  "s3": {"endpoint_url": endpoint, "access_key_env": "KVWARM_BENCH_S3_KEY",
                         "secret_key_env": "KVWARM_BENCH_S3_SECRET"}},
        "loader": {"pool_dir": str(node / "pool"), "pool_bytes": "8GiB", "fetch_mode": KVWARM_FETCH_MODE},
        "tenants": {KVWARM_TENANT: {}},  # the default tenant: it may list no cache_salts
        "node": node_section(node),
    }))
    return path


def block_names(model_dir: Path, config: Path, prefixes: list[list[int]]) -> list[str]:
    """Object names of the prefixes' full kvwarm blocks under the bench tenant."""
    from store.config import load_config
    from store.identity.fingerprint import identity_from_dir
    from store.identity.keys import block_chain
    from store.tiers.base import object_name

    cfg = load_config(config)
    root = identity_from_dir(model_dir).key_root(cfg.kv_cache.precision(), BLOCK, cfg.tenant(KVWARM_TENANT).salt)
    return [object_name(KVWARM_TENANT, b.key) for ids in prefixes for b in block_chain(root, ids)]


def kvwarm_tiers(config: Path) -> list:
    """The node's tiers (local, then S3), opened in this process."""
    from store.config import load_config
    from store.tiers.registry import tiers_from_url

    cfg = load_config(config)
    return tiers_from_url(cfg.store.url, cfg.store)


def wait_until(what: str, done, timeout_s: float = L2_WAIT_S) -> float:
    """Poll ``done()`` until it holds; the seconds it took. Raises RuntimeError after ``timeout_s``."""
    t0 = time.monotonic()
    while not done():
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.5)
    return time.monotonic() - t0


def files_under(path: Path, suffix: str) -> list[int]:
    """Sizes of the files named ``*suffix`` under ``path`` (none when it does not exist)."""
    return [f.stat().st_size for f in path.rglob(f"*{suffix}")] if path.exists() else []


def vs_lmcache(model_dir: Path, engine: dict, reps: int, prefix: int, new: int, vocab: int, work: Path) -> dict:
    """kvwarm and LMCache on the same vLLM (LMCache's venv for every engine), the same prompts, four scenarios.

    Phases, each one engine per system, the systems alternating ABBA: **fill** (each repeat's
    prompt cold; both systems store it: kvwarm writes it back to its local tier and S3, LMCache
    to its L1, ``fs`` disk and S3 bucket); **restart** (a new engine, and a new LMCache server,
    on the same disks: each prompt again, then each announced prompt, whose prefix kvwarm's
    prefill job stored before anything ran); **replacement** (a new node: an empty local tier
    and a new LMCache server with an empty L1 and disk; the buckets are the only copy). Every
    measured request is the first the engine sees of its prompt.
    """
    import s3fs

    from bench.lib import lmcache_columns as lc
    from bench.lib.lmcache_server import S3_DOMAIN, LMCacheServer, fs_l2, lmcache_python, s3_l2
    from tests.seaweedfs import SeaweedFS

    python = lmcache_python()
    os.environ.update(S3_ENV)  # this process's prefill job and tier checks read them too
    same = prompts(reps, prefix, new, vocab, seed=10)  # cold, restart and replacement: the same prompt per repeat
    announced = prompts(reps, prefix, new, vocab, seed=11)
    bpt = engine_bytes_per_token(model_dir)
    engines = iter(range(100))

    def steps(**named: list[list[int]]) -> list[dict]:
        out = [ttft_step(prompts(1, 256, 8, vocab, seed=20 + next(engines)), "warmup"), SETTLE]  # its own: never a hit
        for i in range(reps):
            out += [ttft_step([ids[i]], f"{name}{i}") for name, ids in named.items()]
        return out

    def measured(run, name: str) -> tuple[list[float], list[int]]:
        calls = [run.calls(f"{name}{i}")[0] for i in range(reps)]
        return [c["seconds"] for c in calls], [int(c["num_cached_tokens"] or 0) for c in calls]

    out: dict = {"venv": str(python), "kvwarm": {"precision": KVWARM_PRECISION, "fetch_mode": KVWARM_FETCH_MODE,
                                                 "tenant": KVWARM_TENANT},
                 "lmcache": {"chunk_size": 256, "l2": ["fs", "s3"]}, "startup_s": {}, "order": []}
    ttft: dict = {s: {} for s in lc.SYSTEMS}
    cached: dict = {s: {} for s in lc.SYSTEMS}
    load: dict = {"kvwarm": {}, "lmcache": {}}
    with SeaweedFS(str(work / "weed"), domain=S3_DOMAIN) as weed:
        fs = s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": weed.endpoint},
                               skip_instance_cache=True)
        fs.mkdir(KVWARM_BUCKET)
        fs.mkdir(LMCACHE_BUCKET)
        s3_url = f"s3://{KVWARM_BUCKET}/bench"
        node1 = node_config(work / "kv-node1", s3_url, weed.endpoint)
        node2 = node_config(work / "kv-node2", s3_url, weed.endpoint, fleet_memory=False)
        node3 = node_config(work / "kv-node3", s3_url, weed.endpoint)  # as shipped: warms from the fleet's memory
        lmc_disk1, lmc_disk2 = work / "lmc-node1" / "disk", work / "lmc-node2" / "disk"
        lmc_l2 = lambda disk: [fs_l2(disk), s3_l2(weed.endpoint, LMCACHE_BUCKET)]
        # the plan's prefill job, ahead of time: the announced prefixes into node 1's tiers (local and S3)
        out["kvwarm"]["announced_stored"] = prefill_prefixes(model_dir, node1, [q[:prefix] for q in announced], "cpu",
                                                             tenant=KVWARM_TENANT)

        def bucket_sizes(bucket: str) -> list[int]:
            fs.invalidate_cache()
            found = fs.find(bucket, detail=True).values()
            return [int(i.get("size") or 0) for i in found if i.get("type") != "directory"]

        def kvwarm(phase: str, config: Path, spec_steps: list[dict]):
            out["order"].append(f"kvwarm:{phase}")
            run = run_engine({"engine": engine, "steps": spec_steps,
                              "connector": {"extra": {"config": str(config), "tenant": KVWARM_TENANT}}},
                             work / f"kv-{phase}", python=python, env=S3_ENV)
            out["startup_s"][f"kvwarm_{phase}"] = run.result["startup_s"]
            return run

        def lmcache(phase: str, disk: Path, spec_steps: list[dict], after=None):
            out["order"].append(f"lmcache:{phase}")
            with LMCacheServer(work / f"lmc-{phase}", l2=lmc_l2(disk)) as server:
                run = run_engine({"engine": engine, "connector": server.connector(), "steps": spec_steps},
                                 work / f"lmc-{phase}" / "engine", python=python)
                waited = after(server) if after else None
            log = server.log_text()
            out["lmcache"].setdefault("errors_in_log", {})[phase] = sorted(
                {ln.split("] ", 1)[-1][:200] for ln in log.splitlines()
                 if " ERROR" in ln or re.match(r"\w+Error: ", ln)})
            out["startup_s"][f"lmcache_{phase}"] = run.result["startup_s"]
            out["startup_s"][f"lmcache_server_{phase}"] = server.ready_s
            return run, log, waited

        # fill: kvwarm, then LMCache
        run = kvwarm("fill", node1, steps(cold=same))
        ttft["kvwarm"]["cold"], cached["kvwarm"]["cold"] = measured(run, "cold")
        worker = run.stats(None, "worker")
        out["kvwarm"]["fill_write_back"] = {k: v for k, v in worker.items() if k.startswith(("written_back",
                                                                                             "write_back"))}
        names = block_names(model_dir, node1, [q[:prefix] for q in same])
        tiers = kvwarm_tiers(node1)
        try:
            missing = [n for n in names if not tiers[-1].exists(n)]
            if missing:  # the engine's shutdown drains write-back: all of it must be in S3 now
                raise RuntimeError(f"kvwarm's S3 copy is incomplete after the fill engine's shutdown: {len(missing)} "
                                   f"of {len(names)} blocks missing; write-back stats "
                                   f"{out['kvwarm']['fill_write_back']}")
            kv_local = [e.size for e in tiers[0].entries()]
            kv_bucket = [e.size for e in tiers[-1].entries()]
        finally:
            for t in tiers:
                t.close()

        def l2_complete(server) -> dict:
            stored = sum(t.tokens for t in lc.transfers(server.log_text()) if t.kind == "Stored")
            chunks = stored // 256
            s = wait_until(f"LMCache's L2 copies of {chunks} stored chunks (disk and bucket)",
                           lambda: len(files_under(lmc_disk1, ".data")) >= chunks
                           and len(bucket_sizes(LMCACHE_BUCKET)) >= chunks)
            return {"stored_chunks": chunks, "waited_s": s}

        run, log, out["lmcache"]["fill_l2"] = lmcache("fill", lmc_disk1, steps(cold=same), after=l2_complete)
        ttft["lmcache"]["cold"], cached["lmcache"]["cold"] = measured(run, "cold")
        out["bytes_per_token"] = {
            "engine_bf16": bpt,
            "kvwarm": {"disk": lc.bytes_per_token(kv_local, BLOCK), "bucket": lc.bytes_per_token(kv_bucket, BLOCK)},
            "lmcache": {"disk": lc.bytes_per_token(files_under(lmc_disk1, ".data"), 256),
                        "bucket": lc.bytes_per_token(bucket_sizes(LMCACHE_BUCKET), 256)}}

        # restart, same disks: LMCache, then kvwarm
        for system in ("lmcache", "kvwarm"):
            if system == "lmcache":
                run, log, _ = lmcache("restart", lmc_disk1, steps(restart=same, announced=announced))
                load["lmcache"]["restart"] = lc.retrieved_GBps(lc.transfers(log), bpt)
            else:
                run = kvwarm("restart", node1, steps(restart=same, announced=announced))
                load["kvwarm"]["restart"] = kvwarm_load(run, bpt)
            for name in ("restart", "announced"):
                ttft[system][name], cached[system][name] = measured(run, name)

        # replacement, a new node with empty local state, the buckets as the only copy: kvwarm, then LMCache
        for left in (work / "kv-node2" / "nvme", work / "kv-node3" / "nvme", lmc_disk2):
            if files_under(left, ""):
                raise RuntimeError(f"the replacement node's local state is not empty: {left}")
        # the fleet's memory off: S3 is asked at the request
        run = kvwarm("replacement", node2, steps(replacement=same))
        ttft["kvwarm"]["replacement"], cached["kvwarm"]["replacement"] = measured(run, "replacement")
        load["kvwarm"]["replacement"] = kvwarm_load(run, bpt)
        run, log, _ = lmcache("replacement", lmc_disk2, steps(replacement=same))
        ttft["lmcache"]["replacement"], cached["lmcache"]["replacement"] = measured(run, "replacement")
        load["lmcache"]["replacement"] = lc.retrieved_GBps(lc.transfers(log), bpt)
        out["lmcache"]["replacement_prefetch_lines"] = [ln.split("] ", 1)[-1] for ln in log.splitlines()
                                                        if "retained keys" in ln][:reps + 1]
        # kvwarm as it ships on a new node: its agent copies what the fleet served (S3 -> NVMe) from start-up,
        # during the engine's warm-up here, before the first request
        run = kvwarm("replacement_fleet", node3, steps(replacement=same))
        fleet_s, fleet_cached = measured(run, "replacement")
        worker = run.stats(None, "worker")
        out["kvwarm"]["replacement_fleet_memory"] = {
            "ttft_s": statistics.median(fleet_s), "each_s": rounded(fleet_s), "cached_tokens": fleet_cached,
            "over_cold": lc.median_ratio(fleet_s, ttft["kvwarm"]["cold"]),
            "over_lmcache_replacement": lc.median_ratio(fleet_s, ttft["lmcache"]["replacement"]),
            "prefetch_copied_blocks": worker.get("prefetch_copied_blocks", 0), "load": kvwarm_load(run, bpt)}
    rows = lc.table(ttft, cached)
    out["scenarios"] = rows
    out["each_s"] = {s: {k: rounded(v) for k, v in ttft[s].items()} for s in lc.SYSTEMS}
    out["load"] = {**load, "how": {
        "kvwarm": "the connector's worker stats: tokens_loaded x engine bytes per token / load_seconds (copies "
                  "from its pool into the paged cache)",
        "lmcache": "its server log's 'Retrieved N tokens in X seconds' lines: N x engine bytes per token / X "
                   "(copies from its L1 into the paged cache; an L2 read comes before, at lookup)"}}
    out["targets"] = lc.targets(rows)
    return out


def kvwarm_load(run, bpt: int) -> dict:
    """kvwarm's load throughput in one engine, from its connector's stats (worker role)."""
    from bench.lib.lmcache_columns import throughput_GBps

    stats = {**run.stats(None), **run.stats(None, "worker")}
    tokens, seconds = int(stats.get("tokens_loaded", 0)), float(stats.get("load_seconds", 0.0))
    return {"loads": stats.get("loads", 0), "tokens": tokens, "seconds": seconds,
            "GBps": throughput_GBps(tokens, seconds, bpt),
            "misses": {k: v for k, v in stats.items() if k.startswith("misses:") and v},
            "load_failures": {k: v for k, v in stats.items() if k.startswith("load_failures:") and v}}
