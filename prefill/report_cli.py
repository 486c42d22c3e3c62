"""``prefill report``: the four monitoring families of a run, as a table or JSON.

    prefill report --store file:///var/cache/kvwarm --run nightly \\
        --loader-stats node1.json node2.json --gpu-price-per-hour 2.5 [--json]

Without ``--loader-stats``, the dumps the run keeps under ``<run>/loader_stats/*.json``
(the demo writes them) are used. See :mod:`prefill.monitoring` and docs/monitoring.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Mapping

from prefill.monitoring import Monitoring, Prices, compute
from prefill.run_results import read_loader_stats, read_run
from prefill.rundir import RunDir
from store.cli import CONFIG_HELP, add_location_options
from store.config import load_config
from store.errors import BadInputError


def rows_of(families: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """``(family, figure, value)`` rows of :meth:`Monitoring.as_dict` output; nested dicts flattened as ``figure.key``."""
    out: list[tuple[str, str, Any]] = []
    for family, body in families.items():
        if not isinstance(body, Mapping):
            continue
        for key, value in body.items():
            if isinstance(value, Mapping):
                out += [(family, f"{key}.{k}", v) for k, v in value.items()]
            else:
                out.append((family, key, value))
    return out


def format_value(key: str, v: Any) -> str:
    """One figure for people: rates in %, latencies in ms, bytes with MiB, ``n/a`` for ``None``."""
    if v is None:
        return "n/a"
    if isinstance(v, (bool, str)):
        return str(v)
    if "p50" in key or "p99" in key:
        return f"{v * 1000:.3f} ms"
    if key.endswith("hit_rate"):
        return f"{v:.1%}"
    if key.endswith("_ratio"):
        return f"{v:.2f}x"
    if "bytes" in key and "per_token" not in key:
        return f"{v:,.0f} B ({v / 2**20:,.2f} MiB)"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.2f}" if abs(v) >= 100 else f"{v:.4g}"


def format_table(m: Monitoring) -> str:
    """The families as an aligned text table (``n/a`` where a figure is missing), then the notes."""
    rows = [(f, k, format_value(k, v)) for f, k, v in rows_of(m.as_dict())]
    w1 = max(len(r[0]) for r in rows)
    w2 = max(len(r[1]) for r in rows)
    lines = [f"kvwarm monitoring: run {m.run}", ""]
    last = None
    for family, key, value in rows:
        lines.append(f"{family if family != last else '':<{w1}}  {key:<{w2}}  {value}")
        last = family
    if m.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in m.notes]
    return "\n".join(lines)


def stats_files(run: RunDir, given: list[str] | None) -> list[Path]:
    """The dumps to read: those given, else the run's own (``<run>/loader_stats/*.json``, sorted)."""
    if given:
        return [Path(p) for p in given]
    return run.loader_stats_files()


def _report(args: argparse.Namespace) -> int:
    if args.store is None:
        raise BadInputError("prefill report needs --store URL: the store whose local tier holds the run")
    configured = load_config(args.config).monitoring  # the arguments first, then the run's files
    prices = Prices.from_env(configured.gpu_price_per_hour if args.gpu_price_per_hour is None else args.gpu_price_per_hour,
                             configured.prefill_tokens_per_s if args.prefill_tokens_per_s is None
                             else args.prefill_tokens_per_s)
    directory = RunDir.of(args.store, args.run)
    files = read_run(directory)
    m = compute(args.run, files, read_loader_stats(stats_files(directory, args.loader_stats)), prices)
    if args.json:
        print(json.dumps(m.as_dict(), indent=None if args.compact else 2))
    else:
        print(format_table(m))
    return 0


def add_report_command(sub: Any) -> None:
    """Register ``prefill report``."""
    p = sub.add_parser("report", help="monitoring families of a run: cache efficiency, service quality, security, "
                                      "economics",
                       description="Compute the four monitoring families of the SageMaker write-up for a run of the "
                                   "kvwarm pipeline, from the run's results under <store>/_flows/<run>/ and the "
                                   "serving loaders' stats dumps (KVLoader.stats() saved as JSON).")
    add_location_options(p, store_help="store URL whose local tier holds the run: file:///DIR[,s3://...] (required)",
                         config_help=f"{CONFIG_HELP}; its monitoring: section gives gpu_price_per_hour and "
                                     f"prefill_tokens_per_s")
    p.add_argument("--run", required=True, metavar="NAME", help="run name (results under <local tier>/_flows/<run>/)")
    p.add_argument("--loader-stats", nargs="+", metavar="FILE",
                   help="loader stats dumps (default: <run>/loader_stats/*.json if any)")
    p.add_argument("--gpu-price-per-hour", type=float, default=None, metavar="PRICE",
                   help="price of one GPU-hour for the economics (default: the config's monitoring.gpu_price_per_hour, "
                        "else $KVWARM_GPU_PRICE_PER_HOUR)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=None, metavar="RATE",
                   help="prefill rate to value saved tokens at (default: the config's "
                        "monitoring.prefill_tokens_per_s, else the rate the run's prefill job measured)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--compact", action="store_true", help="with --json: one line instead of indented JSON")
    p.set_defaults(func=_report)
