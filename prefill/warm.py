"""``prefill warm``: load a model, read the prefixes, prefill what is missing, report.

:func:`warm` is the function the flows call; the CLI is a thin shell over it.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from typing import Any, Sequence

from prefill.inputs import InputError, entries_from_file, entries_from_texts, parse_deadline, requests_from_plan
from prefill.models import DEFAULT_MODEL, LoadedModel, load_model, pick_device, pick_dtype
from prefill.numa import pin_to_device
from prefill.progress import Progress
from prefill.runner import DeadlinePassed, Prefiller, PrefillOptions, PrefillReport, check_deadline
from store.cli import add_location_options
from store.config import KvwarmConfig, load_config, with_values
from store.errors import StoreFull
from store.format.precision import Precision
from store.plan import PlanEntry, read_plan
from store.plan_seal import config_keys, open_plan
from store.tiers.store import Store

log = logging.getLogger(__name__)


def precision_for(config: KvwarmConfig, compression: str | None) -> Precision:
    """The configured precision, with ``compression`` overridden when given."""
    p = config.kv_cache.precision()
    return p if compression is None else replace(p, compression=compression)


def warm(entries: Sequence[PlanEntry], *, loaded: LoadedModel, store: Store, config: KvwarmConfig,
         deadline: float | None = None, compression: str | None = None, default_tenant: str = "public",
         max_batch_tokens: int = 8192, progress: Progress | None = None) -> PrefillReport:
    """Prefill ``entries`` (in order) into ``store`` before ``deadline``; returns the report.

    Raises :class:`prefill.runner.DeadlinePassed` (nothing written) when the deadline is
    past or too near for even one batch, :class:`prefill.inputs.InputError` for bad input.
    """
    options = PrefillOptions(precision=precision_for(config, compression), block_size=config.kv_cache.block_size,
                             deadline=deadline, max_batch_tokens=max_batch_tokens)
    check_deadline(deadline, time.time())  # before tokenising anything: the operator learns at once
    requests = requests_from_plan(entries, loaded, config, default_tenant=default_tenant)
    pin_to_device(loaded.device)
    return Prefiller(loaded, store, options, progress=progress).run(requests)


def _entries(args: argparse.Namespace, config: KvwarmConfig) -> list[PlanEntry]:
    sources = [bool(args.text), bool(args.file), bool(args.plan), bool(args.token_ids)]
    if sum(sources) == 0:
        raise InputError("no prefixes given: pass --text, --file, --plan or --token-ids")
    if sum(sources) > 1:
        raise InputError("give prefixes one way: --text, --file, --plan or --token-ids")
    if args.text:
        return entries_from_texts(args.text, args.tenant, chat=args.chat)
    if args.file:
        return entries_from_file(args.file, args.tenant, chat=args.chat)
    if args.plan:
        # a run directory's plan holds the entries of tenants with an encryption key sealed
        plan = open_plan(read_plan(args.plan), config_keys(config))
        entries = plan.prefill_entries()
        if not entries:
            raise InputError(f"plan {args.plan!r} has nothing to prefill: {len(plan.entries)} entries, none with "
                             "action 'prefill' and token ids or text")
        return entries
    out = []
    for i, spec in enumerate(args.token_ids):
        try:
            ids = tuple(int(t) for t in spec.replace(",", " ").split())
        except ValueError:
            raise InputError(f"--token-ids {i}: expected integers separated by commas or spaces, got {spec!r}") from None
        out.append(PlanEntry(tenant=args.tenant, token_ids=ids))
    return out


def _cmd_warm(args: argparse.Namespace) -> int:
    # Everything that can be checked without the model is checked before it loads (seconds
    # for the default model, minutes for a real one): the config, the prefixes and their
    # tenants, the deadline, the dtype and device, and the store URL.
    config = load_config(args.config)
    if args.block_size is not None:
        config = with_values(config, "kv_cache", {"block_size": args.block_size}, source="--block-size")
    entries = _entries(args, config)
    for name in sorted({e.tenant for e in entries}):
        config.tenant(name)
    deadline = parse_deadline(args.until, time.time()) if args.until else None
    if deadline is not None and deadline <= time.time():
        print(f"prefill: nothing done: the deadline {args.until!r} is already past", file=sys.stderr)
        return 1
    pick_dtype(args.dtype)
    pick_device(args.device)
    store = Store.open(args.store or config.store.url, config)
    try:
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
        report = warm(entries, loaded=loaded, store=store, config=config, deadline=deadline,
                      compression=args.compression, default_tenant=args.tenant, max_batch_tokens=args.max_batch_tokens,
                      progress=Progress())
    except DeadlinePassed as exc:
        print(f"prefill: nothing done: {exc}", file=sys.stderr)
        return 1
    except StoreFull as exc:  # an ordinary condition: one line, no traceback (nothing partial is left)
        print(f"prefill: StoreFull: {exc}. The blocks written before it are kept: rerun once there is room, and "
              "only the rest is computed", file=sys.stderr)
        return 1
    finally:
        store.close()
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        _print_report(report, loaded)
    if report.stopped:
        print(f"prefill: stopped at the deadline with {report.blocks_left} block(s) left; rerun in the next window "
              f"to continue (finished blocks are kept)", file=sys.stderr)
        return 1
    return 0


def _print_report(r: PrefillReport, loaded: LoadedModel) -> None:
    print(f"model {loaded.name} ({loaded.dtype}, {loaded.device}); {r.prefixes} prefix(es), {r.blocks_total} block(s): "
          f"{r.blocks_stored_before} already stored, {r.blocks_written} written, {r.blocks_skipped} skipped")
    print(f"computed {r.tokens_computed:,} tokens ({r.forward_tokens:,} with padding) in {r.batches} batch(es), "
          f"{r.seconds:.2f} s, {r.tokens_per_s:,.0f} tokens/s; max FP8 relative error {r.quant_error_max:.4f}")


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (``prefill warm``'s and ``prefill store audit``'s)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def add_warm_command(sub: Any) -> None:
    """Register ``prefill warm``."""
    p = sub.add_parser("warm", help="prefill prefixes into KV snapshots in the store",
                       description="Compute the KV of the given prefixes (only the blocks the store lacks) and write "
                                   "one snapshot per full block. The final partial block of a prefix is not stored. "
                                   "Give prefixes one way: --text, --file, --plan or --token-ids. Exit 1 when the "
                                   "deadline stops the run early, or the store's disk is full (rerun to continue).")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                   help=f"built-in name (kvwarm-tiny, kvwarm-ref), local directory or Hugging Face id "
                        f"(default: {DEFAULT_MODEL})")
    add_location_options(p)
    p.add_argument("--tenant", default="public", metavar="NAME",
                   help="tenant for --text, --file and --token-ids; its secret comes from the config (default: public)")
    p.add_argument("--text", action="append", help="a prefix as text (repeatable)")
    p.add_argument("--file", metavar="FILE", help="prefixes: .jsonl/.json/.parquet plan entries, or plain text one per line")
    p.add_argument("--plan", metavar="FILE", help="a plan file made by forecasting; its entries name their tenants (docs/reference/plan.md)")
    p.add_argument("--token-ids", action="append", metavar="IDS", help="a prefix as token ids, e.g. '1,2,3' (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template (as a system message)")
    p.add_argument("--until", metavar="TIME", help="deadline: ISO time (2026-11-30T06:00Z), +90m / +2h, HH:MM (UTC) or Unix seconds "
                                   "(default: none)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="model compute dtype (default: fp32)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present, else cpu)")
    p.add_argument("--compression", choices=["fp8", "bf16", "fp16", "fp32"],
                   help="storage precision (default: the config's kv_cache.compression, built in fp8)")
    p.add_argument("--block-size", type=int, metavar="TOKENS",
                   help="tokens per block (default: the config's kv_cache.block_size, built in 256)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=8192, metavar="TOKENS",
                   help="padded tokens per forward batch; bounds activation memory (default: 8192)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=_cmd_warm)
