"""``prefill simulate``: replay a request trace through vLLM's cache, kvwarm's tiers and its plans.

What it prints, with examples, is :data:`DESCRIPTION` (``prefill simulate -h``); see docs/guides/simulate.md.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from forecasting.ingest.log_trace import read_log_requests, requests_from_trace, trace_from_requests
from forecasting.ingest.traces import FORMATS, Trace, read_trace, simulation_root
from forecasting.mining.prefix_tree import Tokenizer
from forecasting.planning.cadence import CADENCE_MINUTES
from forecasting.simulate.kvwarm_policy import planner_for, retain_spec
from forecasting.simulate.policies import POLICIES
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.simulation import GPU_KV_BYTES, NODE_BYTES, SCENARIOS, Deployment, Scenario, plot, simulate
from forecasting.simulate.tiers import HOST_S3_LINK_BYTES_PER_S, HOST_S3_STREAM, S3_LINK_BYTES_PER_S, S3_STREAM
from store.config import KvCacheConfig, LoaderConfig
from store.cost import PrefillCost
from store.errors import BadInputError
from store.plan import read_plan

DESCRIPTION = """\
Replay a request trace through vLLM's prefix cache over kvwarm's node tier over S3, under
each policy side by side: vllm (the engine alone), reactive-store (LMCache's: write-back,
S3 hits waited for when that beats recomputing, LRU), kvwarm (the pipeline's plans at its
cadence, each from the trace before it), restore (the last hour's access log prefetched
at the event), and the ceilings oracle (a per-request bound no policy beats) and belady:

    prefill simulate --trace conversation_trace.jsonl --scenario replacement --at 50% [--json]
    prefill simulate --trace logs/ --format logs --model kvwarm-tiny --block-size 16 \\
        --scenario restart --at 86400 --plan plan.json     # the pipeline's logs, and its off-peak plan

Prints per policy the token hit rate (all levels, and vLLM / node tier / S3 without each
request's first block), the first minute after the event against the same policy
without it, the time to first token (mean, P99, first minute), the prefill GPU-seconds
kvwarm's plans spent, and warm-up precision/recall. See docs/guides/simulate.md."""

DEFAULTS = KvCacheConfig()


def add_simulate_command(sub: Any, load_tokenizer: Callable[[str], Tokenizer] | None = None) -> None:
    """Register ``simulate`` on an argparse subparsers object (``func(args) -> exit code``).

    ``load_tokenizer(model)`` gives the tokenizer for ``--format logs`` rows with prompt
    text (the ``prefill`` command passes the one of :mod:`prefill.models`; forecasting
    does not load models itself).
    """
    loader = LoaderConfig()
    p = sub.add_parser("simulate", help="what-if replay of a trace through vLLM's cache, kvwarm's tiers and plans",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, metavar="PATH",
                   help="the trace: a Mooncake JSONL file, a kvwarm JSONL/Parquet file, or for --format logs a log "
                        "file, directory or URL")
    p.add_argument("--format", choices=(*FORMATS, "logs"), default="mooncake",
                   help="mooncake; kvwarm (timestamp s, tenant, block_keys or token_ids); or logs: the request "
                        "logs the pipeline mines (docs/reference/logs.md) (default: mooncake)")
    p.add_argument("--block-size", type=int, metavar="TOKENS",
                   help=f"tokens per block for kvwarm traces and logs (default: {DEFAULTS.block_size}, the config's "
                        "default)")
    p.add_argument("--block-tokens", type=int, metavar="TOKENS",
                   help="tokens per hash id of a Mooncake trace, checked against every row (default: inferred from "
                        "the rows' input_length and hash_ids; Mooncake's own is 512)")
    p.add_argument("--model", metavar="NAME", help="--format logs: the model whose rows to replay and whose tokenizer "
                                                   "reads prompt text (default: the logs' only model)")
    p.add_argument("--tenant", default="mooncake", metavar="NAME",
                   help="tenant name given to Mooncake requests (default: %(default)s)")
    p.add_argument("--scenario", choices=SCENARIOS, default="replacement",
                   help="steady (one node throughout), restart (the engine's cache emptied at --at, the node tier "
                        "kept), replacement (a new node with an empty node tier takes the traffic) or scale-out "
                        "(a new node takes --share of it) (default: %(default)s)")
    p.add_argument("--at", default="50%", metavar="TIME",
                   help="event time: seconds from the trace start (900), or a percentage of it (default: 50%%)")
    p.add_argument("--window", type=float, default=600.0, metavar="S",
                   help="evaluation window after the event, seconds (default: %(default)s)")
    p.add_argument("--share", type=float, default=0.25, help="traffic share of the new node, scale-out "
                                                              "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="routing seed, scale-out (default: %(default)s)")
    p.add_argument("--policy", action="append",
                   help=f"repeatable or comma-separated, of {', '.join(POLICIES)} (default: all)")
    p.add_argument("--gpu-kv-bytes", type=float, default=GPU_KV_BYTES, metavar="BYTES",
                   help="vLLM's KV cache, bytes of bf16 KV of an 8B model (32 layers, 8 KV heads of 128) "
                        "(default: %(default)g, an H200's)")
    p.add_argument("--node-bytes", type=float, default=NODE_BYTES, metavar="BYTES",
                   help="kvwarm's node tier, bytes of stored KV (FP8, layer 0 bf16) (default: %(default)g)")
    p.add_argument("--fetch-workers", type=int, default=loader.fetch_workers, metavar="N",
                   help="the loader's S3 fetch workers, for background fetches after a lookup (default: "
                        "%(default)s, the config's)")
    p.add_argument("--prefetch-streams", type=int, default=loader.prefetch_streams, metavar="N",
                   help="S3 copies a plan's prefetch runs at once (default: %(default)s, the config's)")
    p.add_argument("--s3-gbps", type=float, default=None, metavar="GBPS",
                   help="the node's S3 bandwidth in gigabits a second, shared by every stream and the write-back "
                        f"uploads (default: the --s3-profile's; aws: {S3_LINK_BYTES_PER_S * 8 / 1e9:.2f}, 8 requests "
                        "at AWS's 87.5 MB/s each; docs/guides/simulate.md, 'Costs')")
    p.add_argument("--s3-profile", choices=("aws", "host"), default="aws",
                   help="one S3 stream's cost and the default link: aws (87.5 MB/s a request, AWS's guidance) or host "
                        f"(SeaweedFS on the 2-core host the benches ran on: 273 MB/s a stream, "
                        f"{HOST_S3_LINK_BYTES_PER_S * 8 / 1e9:.2f} Gb/s link) (default: %(default)s)")
    p.add_argument("--write-back-queue-bytes", type=float, default=None, metavar="BYTES",
                   help="the most write-back copies (the engine's bf16 KV) that wait to be encoded, and the most "
                        "stored bytes that wait for upload; a save keeps its leading blocks that fit, the tail is "
                        f"dropped (default: the config's {int(loader.write_back_queue_bytes)})")
    p.add_argument("--write-back-streams", type=int, default=loader.write_back_streams, metavar="N",
                   help="write-back uploads to S3 at once (default: %(default)s, the config's)")
    p.add_argument("--fetch-mode", choices=("background", "sync"), default=loader.fetch_mode,
                   help="kvwarm's loader on an S3-only hit: miss now and copy for next time, or wait when that beats "
                        "recomputing (default: %(default)s, the config's); reactive-store, restore and belady "
                        "always wait when it beats recomputing, as LMCache does")
    p.add_argument("--no-write-back", action="store_true", help="engines do not write their KV to the tiers")
    p.add_argument("--cadence", type=float, default=60.0 * CADENCE_MINUTES, metavar="S",
                   help="seconds between kvwarm's plans (default: %(default)s)")
    p.add_argument("--retain-fraction", type=float, default=None, metavar="F",
                   help="share of the node tier a plan may retain (default: the tuned setting, docs/guides/simulate.md)")
    p.add_argument("--plan", metavar="FILE",
                   help="the latest off-peak plan (docs/reference/plan.md): its prefill entries join every kvwarm plan and are "
                        "stored at its window's end (default: none)")
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


def _policies(args: argparse.Namespace) -> list[str]:
    if not args.policy:
        return [p for p in POLICIES if not (p == "restore" and args.scenario == "steady")]
    names = [p.strip() for group in args.policy for p in group.split(",") if p.strip()]
    for name in names:
        if name not in POLICIES:
            raise BadInputError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return names


def _read(args: argparse.Namespace) -> tuple[Trace, pd.DataFrame, dict[str, Any] | None, str]:
    """The trace, the log rows the planner mines (with their key roots), and for logs the read's summary."""
    if args.format != "logs":
        size = args.block_tokens if args.format == "mooncake" else args.block_size
        trace = read_trace(args.trace, args.format, block_size=size, tenant=args.tenant)
        return trace, requests_from_trace(trace), None, ""
    requests, report = read_log_requests(args.trace, load_tokenizer=args.load_tokenizer, model=args.model)
    size = args.block_size or DEFAULTS.block_size
    trace = trace_from_requests(requests, block_size=size, source=str(args.trace))
    roots = {str(t): simulation_root(str(t), size) for t in set(requests["tenant"])}
    return trace, requests, roots, f"; logs: {report.summary()}"


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
    """The prefill cost model: fitted to a prefill benchmark (--cost-from), or the given or default terms."""
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
    cost = _cost(args)
    policies = _policies(args)
    if args.fetch_workers < 1 or args.prefetch_streams < 1 or args.write_back_streams < 1:
        raise BadInputError(f"--fetch-workers, --prefetch-streams and --write-back-streams must each be at least 1, "
                            f"got {args.fetch_workers}, {args.prefetch_streams} and {args.write_back_streams}")
    if args.s3_gbps is not None and not (args.s3_gbps > 0 and math.isfinite(args.s3_gbps)):
        raise BadInputError(f"--s3-gbps must be a positive number of gigabits a second, got {args.s3_gbps}")
    host = args.s3_profile == "host"
    link = (HOST_S3_LINK_BYTES_PER_S if host else S3_LINK_BYTES_PER_S) if args.s3_gbps is None else args.s3_gbps * 1e9 / 8
    queue = args.write_back_queue_bytes
    if queue is not None and not (queue >= 0 and math.isfinite(queue)):
        raise BadInputError(f"--write-back-queue-bytes must be a number of bytes >= 0, got {queue}")
    loader = LoaderConfig().with_overrides(fetch_workers=args.fetch_workers, fetch_mode=args.fetch_mode,
                                           prefetch_streams=args.prefetch_streams,
                                           write_back_streams=args.write_back_streams,
                                           write_back_queue_bytes=None if queue is None else int(queue))
    base = read_plan(args.plan) if args.plan else None
    trace, requests, roots, read_note = _read(args)
    deployment = Deployment.default(trace.block_tokens, gpu_kv_bytes=args.gpu_kv_bytes, node_bytes=args.node_bytes,
                                    write_back=not args.no_write_back, loader=loader, prefill=cost,
                                    s3_bytes_per_s=link, s3_stream=HOST_S3_STREAM if host else S3_STREAM)
    spec = retain_spec(deployment, fraction=args.retain_fraction)
    planner = planner_for(trace, requests, spec, deployment, cadence_s=args.cadence, roots=roots, base=base)
    scenario = Scenario(args.scenario, _event_time(args.at, trace.duration_s), args.window, args.share, args.seed)
    index = BlockIndex.build(trace)
    result = simulate(index, deployment, [scenario], policies, planner=planner if "kvwarm" in policies else None)[0]
    plot_path = None
    if args.plots:
        plot_path = plot(result, Path(args.plots) / f"simulate-{args.scenario}.png")
    shape = deployment.shape
    out = result.to_json()
    out["trace"] = {"path": str(args.trace), "format": args.format, "requests": len(trace),
                    "blocks": trace.n_blocks, "duration_s": trace.duration_s}
    out["deployment"] = {"gpu_blocks": shape.gpu_blocks, "node_blocks": shape.node_blocks,
                         "block_bytes": deployment.costs.block_bytes, "fetch_mode": shape.fetch_mode,
                         "write_back": shape.write_back, "cadence_s": args.cadence,
                         "prefetch_streams": deployment.costs.prefetch_streams,
                         "fetch_streams": deployment.costs.fetch_streams, "s3_bytes_per_s": link,
                         "s3_profile": args.s3_profile, "write_back_queue_bytes": shape.write_back_queue_bytes,
                         "write_back_streams": deployment.costs.upload_streams}
    if plot_path is not None:
        out["plot"] = str(plot_path)
    if args.json:
        print(json.dumps(out))
        return 0
    sc = result.scenario
    event = "" if sc.kind == "steady" else f" at {sc.at_s:g} s, window {sc.window_s:g} s"
    print(f"{args.trace}: {len(trace)} requests, {trace.n_blocks} blocks over {trace.duration_s:.0f} s; vLLM cache "
          f"{shape.gpu_blocks} blocks, node tier {shape.node_blocks} blocks of {trace.block_tokens} tokens; "
          f"{sc.kind}{event}{read_note}")
    print(result.table())
    if plot_path is not None:
        print(f"plot: {plot_path}")
    return 0
