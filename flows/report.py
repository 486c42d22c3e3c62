"""Run reports: the JSON summary, a markdown rendering, and PNG plots (matplotlib, Agg backend).

Plots:

- :func:`plot_forecast`: total load observed (history, and the actual future when
  known) against the forecast with its prediction interval; optionally the same for
  the most-requested planned prefix in a second panel;
- :func:`plot_offpeak`: the load curve (history + forecast) with the off-peak windows
  under the threshold shaded and the chosen prefill window marked;
- :func:`plot_replay`: per bucket of a replayed window (:func:`replay_buckets`), the token
  hit rate of the prewarmed store against a cold one, and the warm-up accuracy.

Monitoring (the four families of :mod:`prefill.monitoring`): :func:`monitoring_summary`
computes them for a run directory, :func:`publish_monitoring` publishes them as a Prefect
table artifact, and :func:`markdown` renders them as a table.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from prefill.monitoring import Prices, compute
from prefill.report_cli import format_value, rows_of
from prefill.run_results import read_loader_stats, read_run
from prefill.rundir import RunDir

#: a nested field of the report up to this long is shown inline in the markdown artifact
MARKDOWN_INLINE_CHARS = 200
#: columns of the per-request replay outcomes :func:`replay_buckets` reads
OUTCOME_COLUMNS = ("timestamp", "tenant", "prompt_tokens", "cached_tokens", "cold_cached_tokens", "planned")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_forecast(history: pd.DataFrame, forecast: pd.DataFrame, path: str | Path, *,
                  actual: pd.DataFrame | None = None, prefix: tuple[str, pd.DataFrame, pd.DataFrame,
                                                                    pd.DataFrame | None] | None = None) -> Path:
    """Forecast vs actual with the interval. ``history``/``actual``: ``(ds, y)``; ``forecast``: ``ds, y_hat, lower, upper``.

    ``prefix``: ``(label, history, forecast, actual)`` of one prefix for a second panel.
    """
    plt = _plt()
    panels = [("total requests per bucket", history, forecast, actual)]
    if prefix is not None:
        panels.append((f"requests under prefix {prefix[0]}", prefix[1], prefix[2], prefix[3]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for ax, (title, hist, fc, act) in zip(axes[:, 0], panels):
        ax.plot(hist["ds"], hist["y"], color="0.3", lw=1.2, label="observed (training)")
        if act is not None and len(act):
            ax.plot(act["ds"], act["y"], color="tab:green", lw=1.5, label="actual (held out)")
        ax.fill_between(fc["ds"], fc["lower"], fc["upper"], color="tab:blue", alpha=0.2, label="80% interval")
        ax.plot(fc["ds"], fc["y_hat"], color="tab:blue", lw=1.5, ls="--", label="forecast")
        ax.set_title(title)
        ax.set_ylabel("requests / bucket")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time (UTC)")
    return _save(fig, path)


def plot_offpeak(history: pd.DataFrame, forecast: pd.DataFrame, window: Mapping[str, Any], path: str | Path) -> Path:
    """The load curve with off-peak windows shaded and the chosen prefill window marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.8))
    ax.plot(history["ds"], history["y"], color="0.3", lw=1.2, label="observed load")
    ax.plot(forecast["ds"], forecast["y_hat"], color="tab:blue", lw=1.5, ls="--", label="forecast load")
    peak = float(forecast["y_hat"].max()) if len(forecast) else 0.0
    frac = float(window.get("fraction", 0.0))
    if peak > 0 and frac:
        ax.axhline(peak * frac, color="tab:orange", lw=1, ls=":", label=f"off-peak threshold ({frac:.0%} of peak)")
    for i, w in enumerate(window.get("offpeak", [])):
        ax.axvspan(pd.Timestamp(w["start"]), pd.Timestamp(w["end"]), color="tab:orange", alpha=0.12,
                   label="off-peak windows" if i == 0 else None)
    c = window["chosen"]
    ax.axvspan(pd.Timestamp(c["start"]), pd.Timestamp(c["end"]), color="tab:red", alpha=0.3,
               label=f"prefill window {pd.Timestamp(c['start']):%m-%d %H:%M}-{pd.Timestamp(c['end']):%H:%M}")
    ax.set_title("load curve and the off-peak prefill window")
    ax.set_ylabel("requests / bucket")
    ax.set_xlabel("time (UTC)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def replay_buckets(outcomes: pd.DataFrame, bucket: str | pd.Timedelta, planned: Sequence[str], *,
                   start: Any = None, end: Any = None) -> pd.DataFrame:
    """Per-bucket figures of a replay, one row per bucket of ``[start, end)`` (empty buckets kept).

    ``outcomes``: one row per request (:data:`OUTCOME_COLUMNS`): its time, prompt tokens,
    tokens served from the prewarmed store (``cached_tokens``) and from a cold one
    (``cold_cached_tokens``), and ``planned``: the comma-separated ids of the planned
    prefixes the request begins with (empty when none). ``planned``: every planned prefix id.

    Columns: ``ds`` (bucket start), ``requests``, ``prompt_tokens``, ``cached_tokens``,
    ``cold_cached_tokens``, ``token_hit_rate`` and ``cold_token_hit_rate`` (served / prompt
    tokens; NaN for an empty bucket), ``covered`` (requests beginning with a planned prefix),
    ``recall`` (covered / requests), ``used_so_far`` (planned prefixes used since ``start``)
    and ``precision_so_far`` (used_so_far / planned; 1.0 for an empty plan).

    Raises:
        ValueError: a column is missing, or ``bucket`` is not a positive duration.
    """
    missing = set(OUTCOME_COLUMNS) - set(outcomes.columns)
    if missing:
        raise ValueError(f"replay outcomes lack column(s) {sorted(missing)}; expected {list(OUTCOME_COLUMNS)}")
    step = pd.Timedelta(bucket)
    if step <= pd.Timedelta(0):
        raise ValueError(f"bucket must be a positive duration, got {bucket!r}")
    o = outcomes.sort_values("timestamp").reset_index(drop=True)
    ts = pd.to_datetime(o["timestamp"])
    if o.empty and (start is None or end is None):
        raise ValueError("no replay outcomes: give start and end to lay out empty buckets")
    lo = pd.Timestamp(start) if start is not None else ts.min()
    hi = pd.Timestamp(end) if end is not None else ts.max().floor(step) + step
    o = o[(ts >= lo) & (ts < hi)]
    ts = pd.to_datetime(o["timestamp"])
    first = lo.floor(step)
    n = max(1, int(np.ceil((hi - first) / step)))
    edges = pd.date_range(first, periods=n + 1, freq=step)
    which = np.searchsorted(edges.values, ts.values, side="right") - 1
    ids = set(planned)
    used: set[str] = set()
    rows = []
    for i, ds in enumerate(edges[:-1]):
        b = o[which == i]
        matched = [set(filter(None, str(p).split(","))) for p in b["planned"]]
        for m in matched:
            used |= m & ids
        covered = sum(1 for m in matched if m & ids)
        rows.append({"ds": ds, "requests": len(b), "prompt_tokens": float(b["prompt_tokens"].sum()), "cached_tokens": float(b["cached_tokens"].sum()),
                     "cold_cached_tokens": float(b["cold_cached_tokens"].sum()), "covered": covered,
                     "used_so_far": len(used)})
    frame = pd.DataFrame(rows, columns=["ds", "requests", "prompt_tokens", "cached_tokens", "cold_cached_tokens",
                                        "covered", "used_so_far"])
    tokens = frame["prompt_tokens"].where(frame["prompt_tokens"] > 0)
    frame["token_hit_rate"] = frame["cached_tokens"] / tokens
    frame["cold_token_hit_rate"] = frame["cold_cached_tokens"] / tokens
    frame["recall"] = frame["covered"] / frame["requests"].where(frame["requests"] > 0)
    frame["precision_so_far"] = frame["used_so_far"] / len(ids) if ids else 1.0
    return frame


def plot_replay(buckets: pd.DataFrame, path: str | Path, *, bucket: str | pd.Timedelta,
                cold_label: str = "cold store") -> Path:
    """Hit rate and warm-up accuracy over the replayed window, from :func:`replay_buckets`.

    Top: token hit rate per bucket, prewarmed vs cold (requests per bucket as grey bars).
    Bottom: recall per bucket (share of its requests beginning with a planned prefix) and
    precision so far (share of planned prefixes used since the window began).
    """
    plt = _plt()
    step = pd.Timedelta(bucket)
    x = buckets["ds"] + step / 2
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.4), sharex=True)
    width = step / pd.Timedelta(days=1) * 0.8  # bar width in days (matplotlib date units)
    bars = top.twinx()
    bars.bar(x, buckets["requests"], width=width, color="0.85", zorder=0, label="requests per bucket")
    bars.set_ylabel("requests / bucket", color="0.45")
    top.set_zorder(bars.get_zorder() + 1)
    top.patch.set_visible(False)

    def overall(col: str) -> float:
        tokens = buckets["prompt_tokens"].sum()
        return float(buckets[col].sum() / tokens) if tokens else float("nan")

    top.plot(x, buckets["token_hit_rate"] * 100, marker="o", color="tab:red", lw=1.8,
             label=f"prewarmed by the plan (overall {overall('cached_tokens'):.0%})")
    top.plot(x, buckets["cold_token_hit_rate"] * 100, marker="s", color="tab:blue", lw=1.5, ls="--",
             label=f"{cold_label} (overall {overall('cold_cached_tokens'):.0%})")
    top.set_ylim(-3, 140)  # the headroom above 100% holds the legend, clear of the data
    top.set_yticks(range(0, 101, 20))
    bars.set_ylim(0, max(1.0, float(buckets["requests"].max() or 0)) * 1.4)
    top.set_ylabel("prompt tokens served from cache (%)")
    top.set_title(f"token hit rate per {_span(step)} of the replayed window")
    handles = top.get_legend_handles_labels()
    extra = bars.get_legend_handles_labels()
    top.legend(handles[0] + extra[0], handles[1] + extra[1], loc="upper center", fontsize=8, ncol=2)
    top.grid(alpha=0.3)

    requests = buckets["requests"].sum()
    recall = float(buckets["covered"].sum() / requests) if requests else float("nan")
    final_precision = float(buckets["precision_so_far"].iloc[-1]) if len(buckets) else float("nan")
    bottom.plot(x, buckets["recall"] * 100, marker="o", color="tab:green", lw=1.8,
                label=f"recall: requests in the bucket that began with a planned prefix (overall {recall:.0%})")
    bottom.step(list(buckets["ds"]) + [buckets["ds"].iloc[-1] + step] if len(buckets) else [],
                list(buckets["precision_so_far"] * 100) + [final_precision * 100] if len(buckets) else [],
                where="post", color="tab:purple", lw=1.8,
                label=f"precision so far: planned prefixes used since the window began (final {final_precision:.0%})")
    bottom.set_ylim(-3, 130)
    bottom.set_yticks(range(0, 101, 20))
    bottom.set_ylabel("warm-up accuracy (%)")
    bottom.set_xlabel("time (UTC)")
    bottom.set_title("warm-up accuracy of the plan")
    bottom.legend(loc="upper center", fontsize=8, ncol=1)
    bottom.grid(alpha=0.3)
    if len(buckets):
        bottom.set_xlim(buckets["ds"].iloc[0], buckets["ds"].iloc[-1] + step)
    from matplotlib.dates import DateFormatter

    bottom.xaxis.set_major_formatter(DateFormatter("%m-%d %H:%M"))
    return _save(fig, path)


def _span(step: pd.Timedelta) -> str:
    minutes = int(step.total_seconds() // 60)
    return f"{minutes // 60} h" if minutes % 60 == 0 else f"{minutes} min"


def monitoring_summary(run: RunDir, summary: Mapping[str, Any] | None = None, *,
                       gpu_price_per_hour: float | None = None,
                       prefill_tokens_per_s: float | None = None) -> dict[str, Any]:
    """The four monitoring families of run ``run`` (``Monitoring.as_dict()``).

    Reads the run's JSON results and the loader stats dumps kept with it (``loader_stats/``);
    ``summary``, the report being built, stands in for ``report.json`` (it is fresher:
    its ``replay`` section is used when no dumps exist). The GPU price falls back to
    ``$KVWARM_GPU_PRICE_PER_HOUR``; without one the costs are ``None``.

    Raises:
        prefill.monitoring.MonitoringError: the run directory does not exist or a file is malformed.
    """
    files = read_run(run)
    if summary is not None:
        files["report"] = dict(summary)
    stats = read_loader_stats(run.loader_stats_files())
    name = str((summary or {}).get("run") or run.name)
    return compute(name, files, stats, Prices.from_env(gpu_price_per_hour, prefill_tokens_per_s)).as_dict()


def monitoring_table(monitoring: Mapping[str, Any]) -> list[dict[str, str]]:
    """Rows ``{family, figure, value}`` (values formatted for people) of :func:`monitoring_summary`'s result."""
    return [{"family": f, "figure": k, "value": format_value(k, v)} for f, k, v in rows_of(monitoring)]


def publish_monitoring(monitoring: Mapping[str, Any], run: str) -> Any:
    """Publish the families as a Prefect table artifact (key ``kvwarm-<run>-monitoring``); returns its id.

    Call it inside a flow or task run.
    """
    from prefect.artifacts import create_table_artifact

    notes = "; ".join(monitoring.get("notes") or []) or "all figures computed"
    return create_table_artifact(table=monitoring_table(monitoring),
                                 key=f"kvwarm-{run}-monitoring".lower().replace("_", "-"),
                                 description=f"kvwarm monitoring families of run {run}: {notes}")


def markdown(summary: Mapping[str, Any]) -> str:
    """A short markdown rendering of a run summary (for the Prefect artifact); monitoring as one table."""
    lines = [f"# kvwarm run `{summary.get('run', '?')}`", ""]
    for section, body in summary.items():
        if not isinstance(body, Mapping):
            continue
        if section == "monitoring":
            lines += ["## monitoring", "", "| family | figure | value |", "|---|---|---|"]
            lines += [f"| {r['family']} | {r['figure']} | {r['value']} |" for r in monitoring_table(body)]
            lines += [""] + [f"- {n}" for n in body.get("notes") or []] + [""]
            continue
        lines += [f"## {section}", "", "| key | value |", "|---|---|"]
        for key, value in body.items():
            if isinstance(value, (list, dict)):
                text = json.dumps(value, default=str, separators=(", ", ": "))
                value = f"`{text}`" if len(text) <= MARKDOWN_INLINE_CHARS else f"{len(value)} item(s)"
            lines.append(f"| {key} | {value} |")
        lines.append("")
    return "\n".join(lines)


def _save(fig, path) -> Path:  # type: ignore[no-untyped-def]
    """Lay out dates, write the PNG and free the figure."""
    fig.autofmt_xdate()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=90)
    _plt().close(fig)
    return out
