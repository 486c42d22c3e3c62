"""The ``prefill`` command line: the operator's entry point to kvwarm.

    prefill warm ...    prefill prefixes into FP8 KV snapshots (see ``prefill warm -h``)
    prefill simulate .. replay a trace against reactive, prewarmed and optimal caches
    prefill store ...   inspect, maintain and audit a snapshot store (see ``prefill store -h``)
    prefill node        run the machine's kvwarm node process (see ``prefill node -h``)
    prefill demo        write a snapshot from a tiny model and read it back
    prefill report ...  monitoring families of a pipeline run (see ``prefill report -h``)
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from store.cli import add_location_options, add_store_commands, location_options
from store.errors import BadInputError, KvwarmError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefill", description="kvwarm: ahead-of-time KV-cache prewarming.",
        epilog="--config and --store may also be given after the command (prefill store ls --store URL ...), "
               "where they win. Exit status: 0 done, 1 an operational failure or a failed check, 2 bad input. "
               "Run 'prefill COMMAND -h' for a command's options.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (default: warnings only)")
    add_location_options(parser, command=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from forecasting.simulate.cli import add_simulate_command
    from prefill.audit_cli import add_audit_command
    from prefill.demo import add_demo_command
    from prefill.models import load_tokenizer
    from prefill.report_cli import add_report_command
    from prefill.warm import add_warm_command
    from store.node.cli import add_node_command

    add_warm_command(sub)
    add_simulate_command(sub, load_tokenizer=load_tokenizer)
    add_store_commands(sub, extra=(add_audit_command,))
    add_node_command(sub)
    add_report_command(sub)
    add_demo_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status.

    0: done. 2: bad input (an argument, the config, an input file), printed as one
    ``prefill: error: ...`` line. 1: an operational failure or a failed check (a store
    unreachable, a corrupt snapshot, a passed deadline), printed with its kind. Only
    kvwarm's own errors are caught: anything else is a bug and keeps its traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    given, takes = location_options(args)
    if given and not takes:
        parser.error(f"prefill {args.command} takes no --config or --store")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except BadInputError as exc:
        print(f"prefill: error: {exc}", file=sys.stderr)
        return 2
    except KvwarmError as exc:
        print(f"prefill: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
