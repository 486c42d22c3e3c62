"""``prefill store ...``: operate a snapshot store by hand.

    prefill store ls     --tenant T [--namespace public] [--long]
    prefill store stat   KEY --tenant T [--namespace public]
    prefill store verify [--namespace NS] [--no-quarantine]   (exit 1 when anything is bad)
    prefill store gc     [--verify]
    prefill store rm     KEY --tenant T [--namespace public]
    prefill store audit  --model M ...   (registered by prefill.audit_cli: it needs the model)

The store and tenants' secrets come from the config file (``--config`` or
``$KVWARM_CONFIG``); ``--store`` overrides ``store.url``. Both may be given before the
command name or after it (:func:`add_location_options`, shared by every ``prefill``
command that reads a store or the config).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any, Callable, Sequence

from store.config import CONFIG_ENV, KvwarmConfig, StoreConfig, load_config
from store.errors import StoreError
from store.metadata_checks import bad_metadata
from store.tiers.maintenance import check_owner_records, gc, verify
from store.tiers.store import Store

CONFIG_HELP = f"kvwarm config file, YAML, JSON or TOML (default: ${CONFIG_ENV}, else the built-in defaults)"
STORE_HELP = (f"store URL, overriding the config's store.url: file:///DIR, s3://BUCKET/PREFIX, or both "
              f"comma-separated, local first (default: store.url; built in: {StoreConfig.model_fields['url'].default})")
_SUBCOMMAND = "uses_store_options"


def add_location_options(parser: argparse.ArgumentParser, *, store_help: str = STORE_HELP,
                         config_help: str = CONFIG_HELP, command: bool = True) -> None:
    """Add ``--config`` and ``--store`` to one parser of the ``prefill`` command tree.

    They are added to ``prefill`` itself, to a command group (``prefill store``) and to
    each command that uses them (``command=True``), so that they are accepted before or
    after the command name; the one given last, the command's own, wins. One not given
    is left out of the namespace (argparse would otherwise let a command's ``None``
    overwrite a value given before it): read them with :func:`location_options`.
    """
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE", help=config_help)
    parser.add_argument("--store", default=argparse.SUPPRESS, metavar="URL", help=store_help)
    if command:
        parser.set_defaults(**{_SUBCOMMAND: True})


def location_options(args: argparse.Namespace) -> tuple[bool, bool]:
    """Fill in ``args.config`` and ``args.store`` (``None`` when not given); returns whether
    any was given, and whether the chosen command takes them."""
    given = hasattr(args, "config") or hasattr(args, "store")
    for name in ("config", "store"):
        if not hasattr(args, name):
            setattr(args, name, None)
    return given, bool(getattr(args, _SUBCOMMAND, False))


def add_store_commands(sub: Any, extra: Sequence[Callable[[Any], None]] = ()) -> None:
    """Register ``store`` and its subcommands on an argparse subparsers object.

    ``extra``: functions that each register one more ``prefill store`` command on the
    ``store`` subparsers (with its own ``func`` default), for commands that need what
    ``store`` may not import (``audit`` needs the model: :mod:`prefill.audit_cli`).
    """
    p = sub.add_parser("store", help="inspect and maintain a snapshot store",
                       description="Inspect and maintain a snapshot store: list, show, verify, collect garbage, "
                                   "remove, and audit its KV against the model. Tenants' secrets come from the "
                                   "config file.")
    add_location_options(p, command=False)
    ss = p.add_subparsers(dest="store_cmd", required=True, metavar="{ls,stat,verify,gc,rm}")

    ls = ss.add_parser("ls", help="list a tenant's snapshots", description="List a tenant's snapshots: key, bytes, tiers.")
    ls.add_argument("--tenant", required=True, metavar="NAME", help="the tenant whose snapshots to list (its secret from the config)")
    ls.add_argument("--namespace", metavar="NAME", help="'public' to list the shared prefixes (default: the tenant's own)")
    ls.add_argument("--long", action="store_true", help="also read each header: tokens, model, expiry")

    st = ss.add_parser("stat", help="show one snapshot's header", description="Print one snapshot's header as JSON.")
    st.add_argument("key", help="the block key: 64 lower-case hex characters")
    st.add_argument("--tenant", required=True, metavar="NAME", help="the tenant the snapshot belongs to")
    st.add_argument("--namespace", metavar="NAME", help="'public' for a shared prefix (default: the tenant's own)")

    ve = ss.add_parser("verify", help="check every snapshot; exit 1 and list what is corrupt",
                       description="Read and check every namespace owner record and every snapshot (checksums, "
                                   "headers); move corrupt snapshots to quarantine (a damaged owner record is "
                                   "reported and left in place). Exit 1 when anything is bad.")
    ve.add_argument("--namespace", metavar="NAME", help="only this namespace (default: all)")
    ve.add_argument("--no-quarantine", action="store_true", help="report only; leave bad files in place")

    g = ss.add_parser("gc", help="remove expired, over-cap and crash leftovers; quarantine corrupt",
                      description="Collect garbage: on the local tier, crash leftovers, index drift, expired "
                                  "snapshots and anything over the cap (LRU first); on S3, objects older than "
                                  "kv_cache.ttl_max_hours. Prints a JSON report; exit 1 when --verify finds a bad "
                                  "snapshot.")
    g.add_argument("--verify", action="store_true", help="also verify every snapshot (reads everything)")

    rm = ss.add_parser("rm", help="delete a snapshot from every tier",
                       description="Delete one snapshot from every tier. Exit 1 when no tier held it, or when "
                                   "refused: a tenant deletes only in its own namespace; public snapshots only "
                                   "the public writer (--tenant public, with tenants.public.writer_secret_env's "
                                   "credential where a tier records one).")
    rm.add_argument("key", help="the block key: 64 lower-case hex characters")
    rm.add_argument("--tenant", required=True, metavar="NAME", help="the tenant the snapshot belongs to")
    rm.add_argument("--namespace", metavar="NAME",
                    help="'public' for a shared prefix, with --tenant public (default: the tenant's own)")
    for command in (ls, st, ve, g, rm):
        add_location_options(command)
    for register in extra:
        register(ss)
    ss.metavar = "{" + ",".join(ss.choices) + "}"
    p.set_defaults(func=run_store_command)


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds")


def configured_tenants(config: KvwarmConfig) -> dict[str, Any]:
    """Credentials of every configured tenant whose secrets are available (for verify, gc and audit:
    their encryption keys open sealed snapshots)."""
    out = {}
    for name in config.tenants:
        try:
            out[name] = config.tenant(name)
        except StoreError:
            continue
    return out


def run_store_command(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    store = Store.open(args.store, config)
    try:
        return _dispatch(args, config, store)
    finally:
        store.close()


def _dispatch(args: argparse.Namespace, config: KvwarmConfig, store: Store) -> int:
    out = sys.stdout
    if args.store_cmd == "ls":
        tenant = config.tenant(args.tenant)
        rows = store.list(tenant, args.namespace)
        for row in rows:
            line = f"{row.key}  {row.size:>12}  {','.join(row.tiers)}"
            if args.long:
                found = store.stat(tenant, row.key, args.namespace)
                if found:
                    h = found[0]
                    line += f"  tokens={len(h.token_ids)} model={h.model_fingerprint} expires={_iso(h.expires_at)}"
            print(line, file=out)
        print(f"{len(rows)} snapshot(s), {sum(r.size for r in rows)} bytes", file=out)
        return 0
    if args.store_cmd == "stat":
        found = store.stat(config.tenant(args.tenant), args.key, args.namespace)
        if found is None:
            print(f"no snapshot {args.key} for tenant {args.tenant}", file=sys.stderr)
            return 1
        h, tiers = found
        info = {
            "key": h.key, "parent_key": h.parent_key, "tenant": h.tenant, "tiers": tiers,
            "tokens": len(h.token_ids), "model": h.model_fingerprint, "tokenizer": h.tokenizer_fingerprint,
            "layout": h.layout.__dict__, "kv_dtype": h.kv_dtype, "quant_scheme": h.quant_scheme,
            "created": _iso(h.created_at), "expires": _iso(h.expires_at),
            "expired": h.expired(store.clock()), "payload_bytes": h.payload_nbytes,
            "quant_error_max": {k: max(v) if v else 0.0 for k, v in h.quant_error.items()},
            "format_version": h.format_version,
        }
        print(json.dumps(info, indent=2), file=out)
        return 0
    if args.store_cmd == "verify":
        owners = check_owner_records(store, namespace=args.namespace)
        for location, reason in owners:
            print(f"BAD OWNER RECORD {location}: {reason}", file=out)
        records = bad_metadata(store, config, namespace=args.namespace)
        for location, reason in records:
            print(f"BAD RECORD {location}: {reason}", file=out)
        report = verify(store, namespace=args.namespace, tenants=configured_tenants(config), quarantine=not args.no_quarantine)
        for location, reason in report.bad:
            print(f"CORRUPT {location}: {reason}", file=out)
        for where in report.quarantined:
            print(f"quarantined -> {where}", file=out)
        for location, reason in report.mixed:
            print(f"MIXED {location}: {reason}", file=out)
        print(
            f"checked {report.checked}: {report.ok} ok, {len(report.bad)} bad, "
            f"{report.skipped_encrypted} encrypted without a key (skipped)"
            + (f", {len(report.mixed)} after a parent of another layout" if report.mixed else ""),
            file=out,
        )
        if owners:
            print(f"{len(owners)} damaged owner record(s): lookups in their namespaces miss and writes there are "
                  "refused until each is restored from a good tier or removed", file=out)
        if records:
            print(f"{len(records)} fleet record(s) or published plan(s) their readers skip: remove or republish them",
                  file=out)
        return 0 if report.clean and not report.mixed and not owners and not records else 1
    if args.store_cmd == "gc":
        report = gc(store, ttl_max_s=config.kv_cache.ttl_max_s, verify_all=args.verify,
                    tenants=configured_tenants(config))
        print(json.dumps(report.as_dict(), indent=2), file=out)
        return 1 if report.verify is not None and not report.verify.clean else 0
    if args.store_cmd == "rm":
        n = store.delete(config.tenant(args.tenant), args.key, args.namespace)
        print(f"removed from {n} tier(s)", file=out)
        return 0 if n else 1
    raise AssertionError(args.store_cmd)
