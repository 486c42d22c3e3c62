"""Run reports: the JSON summary, a markdown rendering, and PNG plots (matplotlib, Agg backend).

Plots:

- :func:`plot_forecast`: total load observed (history, and the actual future when
  known) against the forecast with its prediction interval; optionally the same for
  the most-requested planned prefix in a second panel;
- :func:`plot_offpeak`: the load curve (history + forecast) with the off-peak windows
  under the threshold shaded and the chosen prefill window marked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pandas as pd


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


def markdown(summary: Mapping[str, Any]) -> str:
    """A short markdown rendering of a run summary (for the Prefect artifact)."""
    lines = [f"# kvwarm run `{summary.get('run', '?')}`", ""]
    for section, body in summary.items():
        if not isinstance(body, Mapping):
            continue
        lines += [f"## {section}", "", "| key | value |", "|---|---|"]
        for key, value in body.items():
            if isinstance(value, (list, dict)):
                value = f"{len(value)} item(s)"
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
