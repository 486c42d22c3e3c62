"""``prefill simulate``: replay a request trace against prefix caches and report what kvwarm saves.

What it prints, with examples, is :data:`DESCRIPTION` (``prefill simulate -h``); see docs/simulate.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from forecasting.ingest.log_trace import read_log_trace
from forecasting.ingest.traces import FORMATS, Trace, read_trace
from forecasting.mining.prefix_tree import Tokenizer
from forecasting.simulate.prewarm import plan_blocks
from forecasting.simulate.replay import BlockIndex, PredictorConfig
from forecasting.simulate.simulation import (
    SCENARIOS,
    STEADY_POLICIES,
    WARMUP_POLICIES,
    Policy,
    Scenario,
    plot,
    simulate,
)
from store.config import KvCacheConfig
from store.cost import PrefillCost
from store.errors import BadInputError
from store.format.header import Layout
from store.format.payload import kv_bytes_per_token
from store.plan import read_plan

DESCRIPTION = """\
Replay a request trace against prefix caches and report what kvwarm saves:

    prefill simulate --trace conversation_trace.jsonl --capacity-blocks 16384 \\
        --scenario restart --at 50% [--policy lru,lru+kvwarm,...] [--plots DIR] [--json]
    prefill simulate --trace logs/ --format logs --model kvwarm-tiny --block-size 16 --capacity-blocks 2048 \\
        --scenario restart --at 86400 --plan plan.json      # the pipeline's logs, and its plan (lru+plan)

Prints a table (or, with --json, one JSON object) with each policy's token hit rate, hit rate
excluding the shared root block, first-minute hit rate, minutes to recover, prefill tokens and
TTFT saved, and warm-up precision/recall. See docs/simulate.md."""

#: the geometry ``--capacity-bytes`` assumes when no --kv-bytes-per-token is given: an 8B
#: GQA model (Llama 3 8B: 32 layers, 8 KV heads of 128)
EIGHT_B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
#: kvwarm's configured defaults: the block size of kvwarm traces and logs when --block-size
#: is not given, and the storage precision (FP8, layer 0 in bf16, fp32 scales)
DEFAULTS = KvCacheConfig()


def default_kv_bytes_per_token(block_tokens: int) -> float:
    """What a token of the 8B geometry takes in the store, in kvwarm's default precision, in blocks
    of ``block_tokens`` (the per-block scales make it depend on the block size)."""
    return kv_bytes_per_token(Layout(**EIGHT_B, block_size=block_tokens), DEFAULTS.precision())


def add_simulate_command(sub: Any, load_tokenizer: Callable[[str], Tokenizer] | None = None) -> None:
    """Register ``simulate`` on an argparse subparsers object (``func(args) -> exit code``).

    ``load_tokenizer(model)`` gives the tokenizer for ``--format logs`` rows with prompt
    text (the ``prefill`` command passes the one of :mod:`prefill.models`; forecasting
    does not load models itself).
    """
    p = sub.add_parser("simulate", help="what-if replay of a trace: prewarming and retention vs reactive caches",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, metavar="PATH",
                   help="the trace: a Mooncake JSONL file, a kvwarm JSONL/Parquet file, or for --format logs a log "
                        "file, directory or URL")
    p.add_argument("--format", choices=(*FORMATS, "logs"), default="mooncake",
                   help="mooncake; kvwarm (timestamp s, tenant, block_keys or token_ids); or logs: the request "
                        "logs the pipeline mines (docs/logs.md) (default: mooncake)")
    p.add_argument("--block-size", type=int, metavar="TOKENS",
                   help=f"tokens per block for kvwarm traces and logs; Mooncake traces fix their own (default: "
                        f"{DEFAULTS.block_size}, the config's default)")
    p.add_argument("--model", metavar="NAME", help="--format logs: the model whose rows to replay and whose tokenizer "
                                                   "reads prompt text (default: the logs' only model)")
    p.add_argument("--tenant", default="mooncake", metavar="NAME",
                   help="tenant name given to Mooncake requests (default: %(default)s)")
    cap = p.add_mutually_exclusive_group(required=True)
    cap.add_argument("--capacity-blocks", type=int, metavar="N", help="cache capacity in blocks (this or --capacity-bytes)")
    cap.add_argument("--capacity-bytes", type=float, metavar="BYTES",
                     help="cache capacity in bytes: blocks = bytes / (block tokens * --kv-bytes-per-token)")
    p.add_argument("--kv-bytes-per-token", type=float, metavar="BYTES",
                   help=f"KV bytes per token for --capacity-bytes (default: an 8B model, 32 layers of 8 KV heads of "
                        f"128, in kvwarm's default precision, FP8 with layer 0 in bf16 and fp32 scales, at the "
                        f"trace's block size: {default_kv_bytes_per_token(256):,.2f} at 256 tokens, "
                        f"{default_kv_bytes_per_token(512):,.2f} at Mooncake's 512)")
    p.add_argument("--scenario", choices=SCENARIOS, default="steady",
                   help="steady (one cache throughout), restart (emptied at --at) or scale-out (a new replica "
                        "from --at) (default: %(default)s)")
    p.add_argument("--at", default="50%", metavar="TIME",
                   help="event time: seconds from the trace start (900), or a percentage of it (default: 50%%)")
    p.add_argument("--window", type=float, default=600.0, metavar="S",
                   help="evaluation window after the event, seconds (default: %(default)s)")
    p.add_argument("--share", type=float, default=0.25,
                   help="traffic share of the new replica, scale-out (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="routing seed, scale-out (default: %(default)s)")
    p.add_argument("--lookback", type=float, default=1800.0, metavar="S",
                   help="history the naive prewarm counts, seconds (default: %(default)s)")
    p.add_argument("--recovery", type=float, default=0.9, metavar="FRACTION",
                   help="recovered once a minute reaches this fraction of the no-event hit rate (default: %(default)s)")
    p.add_argument("--policy", action="append",
                   help="eviction[+prewarm], repeatable or comma-separated: evictions lru, retention, belady; "
                        "prewarms naive, kvwarm, oracle, plan (default: all that apply to the scenario, and "
                        "lru+plan with --plan)")
    p.add_argument("--plan", metavar="FILE",
                   help="a kvwarm plan file (docs/plan.md) for the 'plan' prewarm: its prefixes' token ids are keyed "
                        "like the trace's (kvwarm format, token_ids rows) (default: none)")
    p.add_argument("--horizon", type=float, default=PredictorConfig.horizon_s, metavar="S",
                   help="reuse horizon of the predictor, seconds (default: %(default)s)")
    p.add_argument("--tau", type=float, default=PredictorConfig.tau_s, metavar="S",
                   help="recency scale of retention priorities, seconds (default: %(default)s)")
    p.add_argument("--s-per-token", type=float, metavar="S",
                   help=f"prefill seconds per token, the cost model's linear term (default: {PrefillCost.s_per_token}, "
                        "an 8B model on an H200)")
    p.add_argument("--s-per-token-pair", type=float, metavar="S",
                   help=f"prefill seconds per attention token pair, the quadratic term (default: "
                        f"{PrefillCost.s_per_token_pair})")
    p.add_argument("--cost-from", metavar="FILE",
                   help="fit both prefill terms to a bench/prefill_bench.py --shape run's output (its last line, "
                        "JSON), e.g. bench/calibration/prefill-h200-8b.json; not with --s-per-token*")
    p.add_argument("--plots", metavar="DIR", help="write a PNG of per-minute hit rates to this directory (needs "
                                                  "matplotlib) (default: none)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run_simulate, load_tokenizer=load_tokenizer)


def _event_time(text: str, duration_s: float) -> float:
    text = str(text).strip()
    try:
        if text.endswith("%"):
            return float(text[:-1]) / 100.0 * duration_s
        return float(text)
    except ValueError:
        raise BadInputError(f"--at must be seconds (900) or a percentage of the trace (50%), got {text!r}") from None


def _policies(args: argparse.Namespace) -> list[Policy]:
    if not args.policy:
        names = STEADY_POLICIES if args.scenario == "steady" else WARMUP_POLICIES
        if args.plan and args.scenario != "steady":
            names = (*names[:3], "lru+plan", *names[3:])
        return [Policy.parse(p) for p in names]
    return [Policy.parse(p) for group in args.policy for p in group.split(",") if p.strip()]


def _read(args: argparse.Namespace) -> tuple[Trace, str]:
    """The trace, and for ``--format logs`` the read's summary (rows used, quarantined)."""
    if args.format != "logs":
        return read_trace(args.trace, args.format, block_size=args.block_size, tenant=args.tenant), ""
    trace, report = read_log_trace(args.trace, block_size=args.block_size or DEFAULTS.block_size,
                                   load_tokenizer=args.load_tokenizer, model=args.model)
    return trace, f"; logs: {report.summary()}"


def _bench_result(text: str) -> dict[str, Any]:
    """A bench's JSON result: the whole text, or (a bench's captured output) its last line."""
    try:
        doc = json.loads(text)
    except ValueError:
        lines = [line for line in text.splitlines() if line.strip()]
        doc = json.loads(lines[-1]) if lines else None
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object")
    return doc


def _cost(args: argparse.Namespace) -> PrefillCost:
    """The TTFT cost model: fitted to a prefill benchmark (--cost-from), or the given or default terms."""
    if args.cost_from:
        if args.s_per_token is not None or args.s_per_token_pair is not None:
            raise BadInputError("give --cost-from or --s-per-token/--s-per-token-pair, not both")
        try:
            doc = _bench_result(Path(args.cost_from).read_text())
        except (OSError, ValueError) as exc:
            raise BadInputError(f"--cost-from {args.cost_from}: cannot read a JSON result from it ({exc})") from None
        try:
            return PrefillCost.from_prefill_bench(doc)
        except ValueError as exc:  # the fit's documented answer to a result it cannot use
            raise BadInputError(f"--cost-from {args.cost_from}: {exc}") from None
    for flag, value in (("--s-per-token", args.s_per_token), ("--s-per-token-pair", args.s_per_token_pair)):
        if value is not None and not value >= 0:
            raise BadInputError(f"{flag} must be a number of seconds >= 0, got {value}")
    default = PrefillCost()
    return PrefillCost(default.s_per_token if args.s_per_token is None else args.s_per_token,
                       default.s_per_token_pair if args.s_per_token_pair is None else args.s_per_token_pair)


def _capacity_blocks(args: argparse.Namespace, trace: Trace) -> int:
    """--capacity-bytes in blocks of the trace's size, at --kv-bytes-per-token (default: the 8B geometry's)."""
    bpt = args.kv_bytes_per_token
    if bpt is None:
        bpt = default_kv_bytes_per_token(trace.block_tokens)
    if not bpt >= 1:
        raise BadInputError("--kv-bytes-per-token must be at least 1")
    capacity = int(args.capacity_bytes // (trace.block_tokens * bpt))
    if capacity < 1:
        raise BadInputError(f"the capacity holds no block ({trace.block_tokens} tokens x {bpt:g} bytes each); "
                         f"give a larger capacity")
    return capacity


def _check_plotting() -> None:
    """Fail before the replay, not after it, when --plots cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BadInputError("--plots needs matplotlib: pip install 'kvwarm[pipeline]' (or matplotlib)") from None


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``prefill simulate``; returns 0.

    Raises:
        BadInputError: a bad trace, plan, cost file or argument (the ``prefill`` command
            prints it and exits 2). The cheap arguments are checked before the trace is read.
    """
    if args.plots:
        _check_plotting()
    if args.kv_bytes_per_token is not None and not args.kv_bytes_per_token >= 1:
        raise BadInputError(f"--kv-bytes-per-token must be at least 1, got {args.kv_bytes_per_token}")
    cost = _cost(args)
    policies = _policies(args)
    predictor = PredictorConfig(horizon_s=args.horizon, tau_s=args.tau)
    plan = read_plan(args.plan) if args.plan else None
    trace, read_note = _read(args)
    capacity = args.capacity_blocks if args.capacity_blocks is not None else _capacity_blocks(args, trace)
    scenario = Scenario(args.scenario, _event_time(args.at, trace.duration_s), args.window, args.share,
                        args.seed, args.lookback, recovery_fraction=args.recovery)
    index = BlockIndex.build(trace)
    planned = plan_blocks(index, plan) if plan is not None else None
    result = simulate(index, capacity, scenario, policies, predictor=predictor, cost=cost, plan_blocks=planned)
    plot_path = None
    if args.plots:
        plot_path = plot(result, Path(args.plots) / f"simulate-{args.scenario}-{capacity}.png")
    out = result.to_json()
    out["trace"] = {"path": str(args.trace), "format": args.format, "requests": len(trace),
                    "blocks": trace.n_blocks, "duration_s": trace.duration_s}
    if planned is not None:
        out["plan"] = {"path": str(args.plan), "blocks": len(planned),
                       "blocks_in_trace": int((planned < index.n_unique).sum())}
    if plot_path is not None:
        out["plot"] = str(plot_path)
    if args.json:
        print(json.dumps(out))
        return 0
    sc = result.scenario
    event = "" if sc.kind == "steady" else f" at {sc.at_s:g} s, window {sc.window_s:g} s"
    print(f"{args.trace}: {len(trace)} requests, {trace.n_blocks} blocks over {trace.duration_s:.0f} s; "
          f"{capacity} blocks of {trace.block_tokens} tokens; {sc.kind}{event}{read_note}")
    if planned is not None:
        print(f"plan {args.plan}: {len(planned)} blocks, {int((planned < index.n_unique).sum())} of them in the trace")
    print(result.table())
    if plot_path is not None:
        print(f"plot: {plot_path}")
    return 0
