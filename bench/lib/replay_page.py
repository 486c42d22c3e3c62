"""What docs/benchmarks.md shows of the replay bench (``bench/replay_bench.py``): its tables and targets."""
from __future__ import annotations

from bench.lib.tables import Table, pct, verdict

REPLAY_POLICIES = ("vllm", "reactive-store", "kvwarm", "restore", "oracle", "belady")
REPLAY_EVENTS = ("restart", "replacement", "scale-out")


#: what each replay target says, for the benchmarks page
REPLAY_TARGETS = {
    "replacement_gap_closed": "after a replacement: gap from reactive-store to the oracle closed",
    "scale_out_gap_closed": "after a scale-out: gap from reactive-store to the oracle closed",
    "replacement_ttft_below_restore_ms": "after a replacement: mean TTFT below restore's",
    "scale_out_ttft_below_restore_ms": "after a scale-out: mean TTFT below restore's",
    "replacement_first_minute_above_restore_pct": "after a replacement: first-minute hit rate above restore's",
    "scale_out_first_minute_above_restore_pct": "after a scale-out: first-minute hit rate above restore's",
    "replacement_first_minute_vs_oracle": "after a replacement: first-minute hit rate against the oracle's",
    "scale_out_first_minute_vs_oracle": "after a scale-out: first-minute hit rate against the oracle's",
    "steady_ttft_above_reactive_ms": "steady state: mean TTFT above reactive-store's",
    "idle_ttft_above_restore_ms": "after 6 h or more idle (sparse-24h): mean TTFT above restore's",
}


def replay_target(key: str, t: dict) -> tuple[str, str, str, str]:
    """One row of the replay's targets table."""
    if key.endswith(("_ms", "_pct")):
        unit = " ms" if key.endswith("_ms") else " points"
        value = "-" if t["value"] is None else f"{t['value']:+.2f}{unit}"
        want = "≤ 0" if key.startswith(("steady", "idle")) else "> 0"
    else:
        value, want = pct(t["value"]), f"≥ {t['target'] * 100:.0f} %"
    return REPLAY_TARGETS.get(key, key), value, want, verdict(t["met"])


def replay(r: dict) -> list[Table]:
    ev, summary = r["events"], r["summary"]
    points = sorted({int(k.split(e)[1]) for k in ev for e in REPLAY_EVENTS if k.startswith(e) and k[len(e):].isdigit()})
    head = ("mean TTFT, ms", *(f"{e} {p} %" for e in REPLAY_EVENTS for p in points), "steady")
    cols = [f"{e}{p}" for e in REPLAY_EVENTS for p in points] + ["steady"]
    rows = [(pol, *(f"{ev[c]['ttft_mean_ms'][pol]:.1f}" for c in cols)) for pol in REPLAY_POLICIES
            if pol in ev[cols[0]]["ttft_mean_ms"]]
    saved = [(e, f"{summary[e]['ttft_saved_vs_reactive_ms']:+.1f} ms (each {', '.join(f'{v:+.1f}' for v in summary[e]['ttft_saved_vs_reactive_ms_each'])})",
              pct(summary[e]["gap_closed"]), pct(summary[e]["first_minute_vs_no_event"]),
              f"{summary[e]['prefill_gpu_s']:.1f} GPU-s, {summary[e]['prefetched_blocks']:.0f} blocks")
             for e in REPLAY_EVENTS]
    targets = [replay_target(key, t) for key, t in r["targets"].items()]
    sv = lambda x, e: f"{x[e]['ttft_saved_vs_reactive_ms']:+.1f} / {x[e]['restore']['ttft_saved_vs_reactive_ms']:+.1f} ms"  # noqa: E731
    links = [(f"{x['s3_gbps']:g} Gb/s", *(f(x["summary"], e) for e in ("replacement", "scale-out")
                                          for f in (sv, lambda y, e: f"{pct(y[e]['gap_closed'])} / {pct(y[e]['restore']['gap_closed'])}")))
             for x in r.get("per_link", []) if "restore" in x["summary"]["replacement"]]
    k = r["kvwarm"]
    per_link = [Table(("S3 link (kvwarm / restore)", "replacement: saved", "gap closed", "scale-out: saved",
                       "gap closed"), links)] if links else []
    return [Table(head, rows, note=f"kvwarm: {k['plans']} plans at a {r['cadence_s']:g} s cadence "
                  f"({k['fallback_plans']} fell back to recency and frequency), retain share {k['retain_fraction']:g}."),
            Table(("kvwarm against reactive-store (mean of the points)", "TTFT saved per request", "gap closed",
                   "first minute / no event", "spent"), saved),
            Table(("target", "result", "target", ""), targets), *per_link]
