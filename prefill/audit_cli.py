"""``prefill store audit``: recompute stored KV with the model, quarantine what differs, print the counts.

    prefill store audit --store URL --model M [--tenant T] [--sample N | --all]
                        [--source write-back|prefill|unknown|all] [--json]

It lives in ``prefill`` (it needs the model; ``store`` may not import ``prefill``) and is
registered under ``prefill store`` by :func:`store.cli.add_store_commands`' ``extra``. Exit
status as ``prefill store verify``: 1 when any copy differs (quarantined, or reported only
with ``--no-quarantine``), else 0. See :mod:`prefill.audit` and docs/guides/operating-a-store.md.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from prefill.agreement import TOLERANCE
from prefill.audit import AuditOptions, AuditReport, audit, plan_audit
from prefill.audit_catalogue import SOURCE_ORDER
from prefill.models import load_model, pick_device, pick_dtype, resolve
from prefill.warm import positive_int
from store.cli import add_location_options, configured_tenants
from store.config import load_config
from store.identity.fingerprint import identity_from_dir
from store.identity.tenant import check_tenant_name
from store.tiers.store import Store

SOURCES = ("write-back", "prefill", "unknown", "all")
#: the tolerance scale must stay below this: the tolerance's cap times it stays below 1
MAX_SCALE = 1.0 / TOLERANCE.cap


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < MAX_SCALE:
        raise argparse.ArgumentTypeError(f"expected a factor above 0 and below {MAX_SCALE:g}, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected positive seconds, got {text!r}")
    return value


def add_audit_command(ss: Any) -> None:
    """Register ``audit`` on the ``prefill store`` subcommands."""
    a = ss.add_parser("audit", help="recompute stored KV with the model; quarantine what differs; exit 1 if any",
                      description="Recompute the KV of sampled snapshots (public ones first, then write-back, "
                                  "then those of unknown source, then the prefill job's) with the model, from the "
                                  "whole prefix of each, and compare every stored copy with it: a copy agrees when "
                                  "each layer's K and V lie "
                                  "within the error its header records plus the implementation tolerance. Copies "
                                  "that differ are moved to quarantine. Exit 1 when any copy differs.")
    a.add_argument("--model", required=True, metavar="NAME",
                   help="the model the snapshots were computed with: built-in name, local directory or Hugging "
                        "Face id (its fingerprint must be the one in their keys)")
    add_location_options(a)
    a.add_argument("--tenant", metavar="NAME",
                   help="only this tenant's namespace ('public' for the shared prefixes; default: every namespace)")
    how_many = a.add_mutually_exclusive_group()
    how_many.add_argument("--sample", type=positive_int, default=32, metavar="N",
                          help="snapshots to audit, public ones first, then write-back (default: 32)")
    how_many.add_argument("--all", action="store_true", help="audit every snapshot")
    a.add_argument("--source", choices=SOURCES, default="all",
                   help="only snapshots of this source; 'unknown': written before headers recorded one (default: all)")
    a.add_argument("--tolerance-scale", type=_scale, default=1.0, metavar="FACTOR",
                   help=f"multiply the implementation tolerance ({TOLERANCE.base:g} + {TOLERANCE.per_layer:g} per layer, "
                        f"at most {TOLERANCE.cap:g}, relative L2 beyond the recorded error) by FACTOR (default: 1)")
    a.add_argument("--budget-s", type=_seconds, metavar="SECONDS",
                   help="compute seconds after which no further forward starts (default: no limit)")
    a.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="model compute dtype (default: fp32)")
    a.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present, else cpu)")
    a.add_argument("--max-batch-tokens", type=positive_int, default=8192, metavar="TOKENS",
                   help="tokens per forward chunk; bounds activation memory (default: 8192)")
    a.add_argument("--seed", type=int, help="seed of the sampling order (default: a new order each run)")
    a.add_argument("--no-quarantine", action="store_true", help="report only; leave the copies that differ in place")
    a.add_argument("--json", action="store_true", help="print the report as one JSON object")
    a.set_defaults(func=_cmd_audit)


def options_from(args: argparse.Namespace) -> AuditOptions:
    """The audit's options from the parsed command line (checked before the model loads)."""
    return AuditOptions(sample=None if args.all else args.sample,
                        sources=SOURCE_ORDER if args.source == "all" else (args.source,),
                        namespace=None if args.tenant is None else check_tenant_name(args.tenant),
                        tolerance=TOLERANCE.scaled(args.tolerance_scale), budget_s=args.budget_s, max_batch_tokens=args.max_batch_tokens,
                        quarantine=not args.no_quarantine, seed=args.seed)


def _cmd_audit(args: argparse.Namespace) -> int:
    # As for `prefill warm`, everything that can be checked without the weights is checked before
    # they load (minutes for a large model): the options, the store, and that the snapshots to
    # audit were made by this model (its fingerprint is computed from its files).
    config = load_config(args.config)
    options = options_from(args)
    dtype, device = pick_dtype(args.dtype), pick_device(args.device)
    tenants = configured_tenants(config)
    store = Store.open(args.store or config.store.url, config)
    try:
        planned = plan_audit(store, identity_from_dir(resolve(args.model)), options, tenants=tenants,
                             model_name=args.model)
        loaded = load_model(args.model, dtype=dtype, device=args.device) if planned.paths else None
        report = audit(loaded, store, options, tenants=tenants, planned=planned)
    finally:
        store.close()
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(format_report(report, f"model {args.model} ({dtype}, {device}), tolerance x{args.tolerance_scale:g}"))
    return 0 if report.clean else 1


def format_report(report: AuditReport, title: str) -> str:
    """The counts as a table by source, then each difference, where it went, what was skipped, the compute."""
    lines = [f"audit: {title}", f"{'source':<12}{'checked':>9}{'agreed':>9}{'differed':>10}{'quarantined':>13}"]
    rows = [*report.by_source.items(), ("all", report.total())]
    for source, c in rows:
        lines.append(f"{source:<12}{c.checked:>9}{c.agreed:>9}{c.differed:>10}{c.quarantined:>13}")
    lines += [f"DIFFERS {where}: {why}" for where, why in report.differences]
    lines += [f"quarantined -> {where}" for where in report.quarantined]
    skipped = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in report.skipped.items() if n)
    if skipped:
        lines.append(f"not audited: {skipped}")
    if report.unreadable:
        lines.append(f"{len(report.unreadable)} cop(ies) unreadable: run `prefill store verify`")
    lines.append(f"{report.forwards} forward(s), {report.tokens:,} tokens, {report.compute_s:.2f} s of compute"
                 + ("; stopped: the compute budget is spent" if report.stopped == "budget" else ""))
    return "\n".join(lines)
